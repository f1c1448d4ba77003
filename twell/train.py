"""Training sparse models: the L1 activation penalty and relufication.

    twell.train.relufy(model)                 # SiLU/GELU FFN activations -> ReLU, for sparsity fine-tuning
    with twell.train.track_l1(model):         # hooks every FFN; each forward records its mean |h|
        out = model(ids, labels=ids)
        loss = out.loss + lam * twell.train.l1_penalty(model)
        loss.backward()

h is an FFN's hidden activation, the input of its down projection: act(x W_gate^T) * (x W_up^T) for a
gated FFN, act(x W_up^T) for a plain one. The penalty is the mean over FFN layers of
(1/(M*N)) * sum |h| for the layer's [M, N] hidden activation in the model's last forward; with ReLU
gates it drives most of h to exactly zero.

FFNs are found by twell's FFN matcher (twell.passes). Where an FFN runs as written, a forward pre-hook
on its down projection reads h as it is computed, at no extra cost. Where twell.sparsify rewrote a
whole FFN module (SparseFFN), the op never materialises h: a hook on the SparseFFN recomputes it from
the module's input and weights, two extra [M, K] x [K, N] products (one for a plain FFN) forward and
their backward (a SparseFFN's hooks are its original module's, so after restore the original keeps
recomputing). An FFN written inline in a bigger forward (OPT) and rewritten runs as written while its
stand-ins carry a hook, so h is read from the down projection's stand-in at no extra cost, on the
dense path. sparsify leaves an FFN whose down projection carries a hook dense: sparsify first, or
remove the tracker before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Attribute on the model instance holding its L1Tracker (one per model).
_TRACKER = "_twell_l1_tracker"

# Activation names (as twell's matcher reports them, lower-cased) that relufy switches to ReLU.
SWITCHABLE = ("silu", "swish", "gelu")


# ---------------------------------------------------------------------------------------------------
# L1 activation penalty


class _Probe:
    """Records one FFN's mean |h| (differentiable) and density (detached) into its tracker.

    spec: None when hooked on the down projection or its inline stand-in (h is its input); else the
    FFNSpec of the SparseFFN whose input x it receives. A SparseFFN (reports_l1) takes the probe for
    its call and records what its op computed (from the sparse training forward's record, at no extra
    cost), or has it recompute h; after restore, the original module's call recomputes h here."""

    def __init__(self, tracker: L1Tracker, path: str, spec=None):
        self.tracker = tracker
        self.path = path
        self.spec = spec

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.spec is None:
            self.tracker._record(self.path, args[0] if args else kwargs["input"])
        elif getattr(type(module), "reports_l1", False):
            module.l1_probe = self
        else:
            self.recompute(module, args, kwargs)

    def recompute(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs[self.spec.input_name]
        self.tracker._record(self.path, _recompute_hidden(self.spec, module, x))

    def record(self, l1: torch.Tensor, density: torch.Tensor) -> None:
        """The FFN's mean |h| (differentiable) and nonzero fraction (a tensor), as its op computed them."""
        self.tracker.l1[self.path] = l1
        self.tracker._density[self.path] = density.detach()


def _recompute_hidden(spec, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """h [..., N] of a SparseFFN from its input x [..., K]: what twell.ops computes before the down
    projection."""
    from twell.passes.modules import ffn_weights, hidden_activation

    # SparseFFN, or the original module after restore (SparseFFN shares its hooks): children by name
    gate, down = module.get_submodule(spec.gate), module.get_submodule(spec.down)
    up = module.get_submodule(spec.up) if spec.up is not None else None
    return hidden_activation(spec, ffn_weights(spec, gate, up, down), x)


class L1Tracker:
    """Forward hooks on every FFN of a model, recording each layer's mean |h| of the last forward.

    Made by track_l1(model); remove() (or leaving its `with` block) detaches the hooks. `l1` maps FFN
    path -> mean |h| (a scalar tensor in the autograd graph) of that FFN's last call."""

    def __init__(self, model: nn.Module):
        from twell.passes import scan
        from twell.passes.modules import InlineFFN, SparseFFN

        self.model = model
        self.l1: dict[str, torch.Tensor] = {}
        self._density: dict[str, torch.Tensor] = {}
        self._handles = []
        candidates, _ = scan(model)
        untrackable = [c for c in candidates if c.spec is None]
        if untrackable:
            lines = "\n".join(f"  {c.path}: {c.reason}" for c in untrackable)
            raise ValueError(
                "twell.train.track_l1 tracks FFNs twell can rewrite (a ReLU-family activation, plain "
                f"nn.Linear projections); these are not:\n{lines}\n"
                "twell.train.relufy(model) switches SiLU/GELU activations to ReLU."
            )
        hooks: list[tuple[nn.Module, _Probe]] = []
        for c in candidates:
            hooks.append((c.owner.get_submodule(c.spec.down), _Probe(self, c.path)))
        for path, module in model.named_modules():
            if isinstance(module, SparseFFN):
                hooks.append((module, _Probe(self, path, module.spec)))
            elif isinstance(module, InlineFFN):
                # A hooked inline stand-in computes what the original down projection does: h comes in.
                # named as the candidate was: owner[gate,up,down] or owner[up,down], the down
                # projection's name relative to the owner (BERT's: output.dense)
                spec = module.spec
                names = [n for n in (spec.gate, spec.up, spec.down) if n is not None]
                owner = path.removesuffix(spec.down).removesuffix(".")
                hooks.append((module, _Probe(self, f"{owner}[{','.join(names)}]")))
        if not hooks:
            raise ValueError(f"no FFN found in {type(model).__name__}: nothing to penalise")
        for module, probe in hooks:
            self._handles.append(module.register_forward_pre_hook(probe, with_kwargs=True))
        self.paths = [probe.path for _, probe in hooks]
        model.__dict__[_TRACKER] = self

    def _record(self, path: str, hidden: torch.Tensor) -> None:
        self.l1[path] = hidden.abs().mean()
        with torch.no_grad():  # kept on the device: density() synchronises, a training step need not
            self._density[path] = torch.count_nonzero(hidden) / max(hidden.numel(), 1)

    def penalty(self) -> torch.Tensor:
        """Mean over FFN layers of the layer's mean |h| in the last forward (differentiable)."""
        if not self.l1:
            raise RuntimeError("no forward recorded yet: run the model, then take the penalty")
        values = list(self.l1.values())
        return torch.stack([v.to(values[0].device) for v in values]).mean()

    def density(self) -> dict[str, float]:
        """FFN path -> fraction of h that was nonzero in its last call (synchronises with the device)."""
        return {path: density.item() for path, density in self._density.items()}

    def remove(self) -> None:
        """Detach the hooks and forget the records; l1_penalty(model) then raises."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.l1.clear()
        self._density.clear()
        if self.model.__dict__.get(_TRACKER) is self:
            del self.model.__dict__[_TRACKER]

    def __enter__(self) -> L1Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"L1Tracker({len(self.paths)} FFNs)"


def track_l1(model: nn.Module) -> L1Tracker:
    """Hook every FFN of `model` so that each forward records its L1 term; returns the L1Tracker
    (also a context manager that removes the hooks). Raises ValueError if the model is tracked already,
    has no FFN, or has FFNs twell cannot rewrite (relufy SiLU/GELU models first)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if model.__dict__.get(_TRACKER) is not None:
        raise ValueError("model is tracked already: use its tracker, or remove() it first")
    return L1Tracker(model)


def l1_penalty(model: nn.Module) -> torch.Tensor:
    """The L1 activation penalty of the model's last forward: mean over FFN layers of
    (1/(M*N)) * sum |h|, a scalar in the autograd graph. Needs track_l1(model) before that forward:

        loss = lm_loss + lam * twell.train.l1_penalty(model)
    """
    tracker = model.__dict__.get(_TRACKER) if isinstance(model, nn.Module) else None
    if tracker is None:
        raise RuntimeError("model is not tracked: call twell.train.track_l1(model) before its forward")
    return tracker.penalty()


# ---------------------------------------------------------------------------------------------------
# Relufication


@dataclass
class Change:
    """One FFN's activation: `module` (path of the activation module) went from `before` to `after`;
    `reason` says why it was not switched ("" when it was)."""

    ffn: str
    module: str
    before: str
    after: str
    reason: str = ""

    @property
    def switched(self) -> bool:
        return not self.reason


class RelufyReport:
    """What relufy did, one Change per FFN; print() shows a table. `config` says how the model's
    config was updated (so save_pretrained writes a ReLU model), or why it was not."""

    def __init__(self, changes: list[Change], config: str):
        self.changes = changes
        self.config = config

    def __iter__(self):
        return iter(self.changes)

    def __len__(self) -> int:
        return len(self.changes)

    def __rich_console__(self, console, options):
        from rich import box
        from rich.table import Table

        switched = sum(c.switched for c in self.changes)
        table = Table(
            title=f"relufy: {switched} of {len(self.changes)} FFN activations switched to ReLU",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
        )
        for column in ("activation module", "before", "after"):
            table.add_column(column)
        for c in self.changes:
            table.add_row(c.module or c.ffn, c.before, c.after if c.switched else f"unchanged: {c.reason}")
        yield table
        yield f"config: {self.config}"

    def __str__(self) -> str:
        from twell.report import plain_text

        return plain_text(self, width=100)

    def __repr__(self) -> str:
        return f"RelufyReport({sum(c.switched for c in self.changes)} of {len(self.changes)} switched)"


def _activation_child(candidate) -> tuple[nn.Module | None, str, str]:
    """(the module holding the activation module the candidate's FFN calls, that module's path below
    the candidate's owner, "") or (None, "", reason) if there is none to switch."""
    from twell.passes import experts
    from twell.passes.candidates import TraceFailure, stack_root, trace_module
    from twell.passes.match import Dialect, find_matches

    if experts.is_experts(candidate.gate_module):  # experts stored as 3-D parameters: one act_fn for all
        layer = candidate.gate_module
        if not isinstance(getattr(layer, "act_fn", None), nn.Module):
            return None, "", f"{type(layer).__name__} has no activation module act_fn to switch"
        return layer, "act_fn", ""
    owner = candidate.owner
    if candidate.inline and "." in (candidate.activation_children or ("",))[0]:
        return owner, candidate.activation_children[0], ""  # an FFN split across two modules (BERT)
    try:
        graph = trace_module(owner)
    except TraceFailure as failure:
        return None, "", f"could not trace {type(owner).__name__}: {failure}"
    dialect = Dialect(owner)
    gate = candidate.gate_module
    for match in find_matches(graph, dialect):
        if match.activation is None or dialect.module(match.gate.linear.node) is not gate:
            continue
        if match.gate.rows != candidate.gate_slice:
            continue
        owners = {stack_root(node) for node in match.activation.nodes}
        if len(owners) != 1 or None in owners:
            return None, "", "the activation is written in the forward, not held by an activation module"
        (name,) = owners
        if "." in name:
            return None, "", f"the activation is computed inside {name.split('.')[0]}, not by a module of its own"
        calls = [n for n in graph.nodes if stack_root(n) == name and n not in match.activation.nodes]
        if calls:
            return None, "", f"activation module {name} is used for more than this activation"
        return owner, name, ""
    reason = (
        f"twell could not tell which module of {type(owner).__name__} computes the activation: replace it "
        "by an nn.ReLU by hand and set the config's activation to 'relu'"
    )
    return None, "", reason


# Config fields naming the FFN activation: most families' hidden_act, GPT-2's and OPT's activation_function.
_ACTIVATION_KEYS = ("hidden_act", "activation_function")


def relufy(model: nn.Module) -> RelufyReport:
    """Switch the SiLU/GELU activations of the model's FFNs to ReLU, for sparsity fine-tuning (with
    track_l1 / l1_penalty); returns a RelufyReport (print it for a table).

    The activation module each FFN calls (e.g. LlamaMLP's `act_fn`) is replaced on that module
    instance by an nn.ReLU; no class is changed. When every FFN was switched and the model has a
    `config` with a `hidden_act` (GPT-2, OPT: `activation_function`), it is set to "relu", so
    save_pretrained writes a ReLU model. Raises
    ValueError naming what it expected when no FFN activation can be switched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    from twell.passes import scan

    candidates, unmatched = scan(model)
    changes: list[Change] = []
    holders = []
    for c in candidates:
        name = c.activation
        if not any(s in name.lower() for s in SWITCHABLE):
            reason = "already sparse" if c.activation in ("relu", "fatrelu", "relu2", "drelu") else "not SiLU or GELU"
            changes.append(Change(c.path, "", name, name, reason))
            holders.append(None)
            continue
        holder, child, reason = _activation_child(c)
        holder_path = c.path.split("[")[0]
        module_path = f"{holder_path}.{child}" if holder_path and child else child
        changes.append(Change(c.path, module_path, name, "relu", reason))
        holders.append((holder, child))
    to_switch = [(h, ch) for h, ch in zip(holders, changes, strict=True) if ch.switched]
    if not to_switch:
        found = "; ".join(f"{ch.ffn}: {ch.before} ({ch.reason})" for ch in changes) or "no FFN found"
        if unmatched:
            found += "; not analysed: " + ", ".join(f"{u.path} ({u.reason})" for u in unmatched)
        raise ValueError(
            "relufy expected FFNs whose activation is SiLU or GELU, held by an activation module (like "
            f"LlamaMLP.act_fn), found none it can switch: {found}"
        )
    replaced = set()
    for (holder, child), change in to_switch:
        parent_path, _, name = child.rpartition(".")
        parent = holder.get_submodule(parent_path)
        old = getattr(parent, name)
        replaced.add(type(old))
        change.before = f"{change.before} ({type(old).__name__})"
        setattr(parent, name, nn.ReLU().train(old.training))
    config = getattr(model, "config", None)
    keys = [k for k in _ACTIVATION_KEYS if isinstance(getattr(config, k, None), str)]
    # modules outside the FFNs built from the same config entry (BERT's prediction head): a reloaded
    # model would have ReLU there too
    others = [path for path, m in model.named_modules() if type(m) in replaced]
    if len(to_switch) < len(changes):
        status = "unchanged: not every FFN was switched"
    elif others and keys:
        status = (
            f"unchanged: {others[0]} (not an FFN) has the same activation, and would be ReLU in a model loaded "
            "from a ReLU config; save with this config and call relufy again after loading"
        )
    elif not keys:
        status = f"unchanged: the model has no config.{' or config.'.join(_ACTIVATION_KEYS)}"
    else:
        status = ", ".join(f"{k} {getattr(config, k)!r} -> 'relu'" for k in keys)
        for k in keys:
            setattr(config, k, "relu")
    return RelufyReport(changes, status)


__all__ = ["Change", "L1Tracker", "RelufyReport", "l1_penalty", "relufy", "track_l1"]
