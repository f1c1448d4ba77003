"""The one-liner: find FFNs, decide (calibration or a plan), rewrite; restore, report and save plans.

    model = twell.sparsify(model)                     # rewrite every sparse-gated FFN
    model = twell.sparsify(model, batches)            # calibrate first, rewrite where it pays
    twell.save_plan(model, "plan.json")               # keep the decisions ...
    model = twell.sparsify(other_copy, plan="plan.json")   # ... and re-apply them without calibrating
    model = twell.sparsify(model, layer_config={"prefill_min_m": 4096})  # route limits of every layer
    with twell.configure(model, route="prefill"): ...  # force a path for a while (benchmarks, tests)
    print(twell.report(model))                        # what was found, rewritten, and why
    twell.compile_report(model)                       # what torch.compile(model, backend="twell") did
    twell.restore(model)                              # the original modules, bit for bit

Importing this module is light: the passes (and networkx) load on first call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from twell.report import Report, build_records

# Attribute on the model instance holding what sparsify did (a _State): restore, report and save_plan
# read it, and it travels with copy.deepcopy of the model.
_STATE = "_twell_state"


@dataclass
class _State:
    candidates: list  # twell.passes.Candidate
    unmatched: list  # twell.passes.Unmatched
    decisions: dict | None  # {path: twell.calibrate.Decision}, None without calibration or plan
    swaps: list  # twell.passes.rewrite.Swap
    rewritten: set[str] = field(default_factory=set)
    # path -> (module holding the layer's LayerConfig, expert index or None), for every rewritten FFN
    configs: dict = field(default_factory=dict)


def _check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def sparsify(
    model: torch.nn.Module, calibration_data=None, *, config=None, plan=None, layer_config=None
) -> torch.nn.Module:
    """Rewrite the model's sparse-gated FFNs to torch.ops.twell.* in place; returns the same model.

    Without calibration_data or plan every rewritable FFN is rewritten (the ops are exact at any
    sparsity and run dense where sparse does not pay). calibration_data: an iterable of model inputs
    (token-id tensors or dicts of forward kwargs), measured by twell.calibrate with `config`; plan: a
    path written by save_plan. Either way only FFNs whose decision says rewrite are rewritten, each
    with the TwELL layout its decision chose.
    layer_config: changes to the LayerConfig of every rewritten FFN (twell.kernels.policy.LayerConfig
    fields, e.g. {"prefill_min_m": 4096}, or {"route": "prefill"} to force a path; see
    LayerConfig.replace); with calibration data or a plan, not tile_n or slots.
    Idempotent: sparsifying again without data, plan or layer_config changes nothing; with data or a
    plan, the model is restored first and decided anew; with layer_config alone, the rewritten FFNs
    take its changes. state_dict keys, shapes and tensors stay the model's own.
    """
    _check_model(model)
    if calibration_data is not None and plan is not None:
        raise ValueError("give calibration_data or plan, not both")
    if config is not None and calibration_data is None:
        raise ValueError("config configures calibration: give calibration_data with it")
    if plan is not None and not isinstance(plan, (str, os.PathLike)):
        raise TypeError(f"plan must be a path (str or os.PathLike), got {type(plan).__name__}")
    from twell.calibrate import layer_changes

    changes = layer_changes(layer_config, calibrated=calibration_data is not None or plan is not None)
    if getattr(model, _STATE, None) is not None:
        if calibration_data is None and plan is None:
            configure(model, **changes)
            return model
        restore(model)

    from twell.passes import scan
    from twell.passes.rewrite import apply

    candidates, unmatched = scan(model)
    if not candidates and not unmatched:
        raise ValueError(
            f"no FFN found in {type(model).__name__}: sparsify rewrites feed-forward blocks, two projections "
            "K -> N -> K around an activation (down(act(up(x))) or down(act(gate(x)) * up(x)))"
        )
    decisions = None
    if calibration_data is not None:
        from twell.calibrate import calibrate
        from twell.inputs import calibration_config, check_batches

        data, config = check_batches(model, calibration_data), calibration_config(model, config)
        decisions = calibrate(model, candidates, data, config=config, layer_config=changes)
    elif plan is not None:
        from twell.calibrate import load_plan

        decisions = load_plan(plan, candidates)

    if decisions is not None:
        from twell.passes import decided

        decided.remember(candidates, decisions)  # the compile backend follows them too
    state = _State(candidates, unmatched, decisions, swaps=[])
    from twell.kernels.policy import default_config

    for candidate in candidates:
        if not candidate.rewritable:
            continue
        layer = default_config(candidate.model_size).replace(**changes)
        if decisions is not None:
            decision = decisions.get(candidate.path)
            if decision is None or not decision.rewrite:
                continue
            layer = decision.layer_config(changes)  # the layout (and limits) its prediction assumed
        swaps = apply(model, candidate, layer)
        state.swaps.extend(swaps)
        state.rewritten.add(candidate.path)
        state.configs[candidate.path] = _config_holder(model, candidate, swaps)
    model.__dict__[_STATE] = state
    return model


def _config_holder(model, candidate, swaps) -> tuple:
    """(module holding the rewritten candidate's LayerConfig, expert index or None)."""
    from twell.passes.modules import InlineFFN, SparseFFN

    if candidate.expert is not None:  # the experts module's SparseExperts holds one per expert
        return model.get_submodule(candidate.path.rpartition(".")[0]), candidate.expert
    (holder,) = [s.replacement for s in swaps if isinstance(s.replacement, (SparseFFN, InlineFFN))]
    return holder, None


def layer_configs(model: torch.nn.Module) -> dict:
    """{path: twell.kernels.policy.LayerConfig} of every FFN sparsify rewrote in `model`: the layout
    and route limits its op is called with."""
    _check_model(model)
    state = getattr(model, _STATE, None)
    if state is None:
        return {}
    return {
        path: module.layer_configs[expert] if expert is not None else module.layer_config
        for path, (module, expert) in state.configs.items()
    }


def _set_layer_configs(model: torch.nn.Module, configs: dict) -> None:
    state = getattr(model, _STATE)
    for path, config in configs.items():
        module, expert = state.configs[path]
        if expert is not None:
            module.layer_configs[expert] = config
        else:
            module.layer_config = config


def configure(model: torch.nn.Module, **changes) -> Configured:
    """Change the LayerConfig of every FFN sparsify rewrote in `model`: `changes` are LayerConfig fields
    (and route="decode" / "prefill" / "dense": every call takes that path, see LayerConfig.replace).

        twell.configure(model, prefill_min_m=4096)          # from now on
        with twell.configure(model, route="prefill"):       # inside the block only: on leaving it
            model(x)                                        # the previous configs are back

    A model that is not sparsified raises ValueError. Compiled graphs of the model recompile on their
    next call (torch.compile guards on the configs).
    """
    _check_model(model)
    if getattr(model, _STATE, None) is None:
        raise ValueError("configure needs a model sparsified by twell.sparsify")
    previous = layer_configs(model)
    _set_layer_configs(model, {path: config.replace(**changes) for path, config in previous.items()})
    return Configured(model, previous)


class Configured:
    """What configure() returns: as a context manager, puts the configs it replaced back on exit."""

    def __init__(self, model: torch.nn.Module, previous: dict):
        self.model = model
        self.previous = previous

    def __enter__(self) -> Configured:
        return self

    def __exit__(self, *exc) -> None:
        _set_layer_configs(self.model, self.previous)


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Put back every module sparsify replaced (state_dict bit-identical); returns the same model.
    A model that is not sparsified is returned unchanged."""
    _check_model(model)
    state = model.__dict__.pop(_STATE, None)
    if state is not None:
        from twell.passes import decided
        from twell.passes.rewrite import undo

        undo(state.swaps)
        decided.forget(state.candidates)
    return model


def warmup(model: torch.nn.Module, token_counts=(1, 16, 4096)) -> dict[int, float]:
    """Run every rewritten FFN once for each token count, so that kernels are compiled and autotuned
    before serving rather than on a user's first request. Returns the seconds spent per token count.

    The first call of a new shape compiles the Triton kernels (seconds) and, for prefill-sized calls,
    autotunes them; compiled kernels and tuned configurations are cached on disk, so a later process
    pays only a fraction of that. Inputs are random: tuning on your own data is as good or better
    (run the model on a representative batch instead). Raises ValueError for a model with no
    rewritten FFN.
    """
    _check_model(model)
    bad = [m for m in token_counts if not isinstance(m, int) or isinstance(m, bool) or m < 1]
    if bad:
        raise ValueError(f"token_counts must hold positive ints, got {bad[0]!r}")
    import time

    state = getattr(model, _STATE, None)
    calls = _warmup_calls([s.replacement for s in state.swaps] if state else [])
    if not calls:
        why = "sparsify rewrote none of its FFNs" if state else "it is not sparsified"
        raise ValueError(f"nothing to warm up in {type(model).__name__}: {why} (call twell.sparsify(model) first)")
    seconds = {}
    for m in token_counts:
        start = time.perf_counter()
        for k, weight, ffn in calls:
            x = torch.randn(m, k, dtype=weight.dtype, device=weight.device)
            with torch.no_grad():
                ffn(x)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds[m] = time.perf_counter() - start
    return seconds


def _warmup_calls(replacements) -> list:
    """(K, a weight of the FFN, function of x [M, K]) for every rewritten FFN: each module's own path,
    without the forward hooks of the user's model."""
    import functools

    from twell.passes.experts import SparseExperts, sizes
    from twell.passes.modules import InlineFFN, SparseFFN
    from twell.passes.projections import features

    calls = []
    for r in replacements:
        if isinstance(r, SparseFFN):
            down = getattr(r, r.spec.down)
            calls.append((features(down)[1], down.weight, r.forward))
        elif isinstance(r, InlineFFN):
            calls.append((r.out_features, r.weight, r.whole_ffn))
        elif isinstance(r, SparseExperts):
            k = sizes(r, r.spec)[2]
            calls += [(k, r.down_proj, functools.partial(r.expert_ffn, e)) for e in sorted(r.rewritten)]
    return calls


def report(model: torch.nn.Module) -> Report:
    """The FFNs of `model`: what sparsify did to it, or (not sparsified) what it would find."""
    _check_model(model)
    state = getattr(model, _STATE, None)
    if state is None:
        from twell.passes import scan

        state = _State(*scan(model), decisions=None, swaps=[])
    return Report(build_records(state.candidates, state.unmatched, state.decisions, state.rewritten))


def compile_report(model: torch.nn.Module) -> Report:
    """What torch.compile's "twell" backend did to the FFNs of `model` (or of the module a
    torch.compile'd `model` wraps): one record per FFN it found in the compiled graphs, the latest
    compilation's, rewritten or not and why. FFNs that sparsify rewrote before compiling reach the
    compiler as twell ops already: twell.report(model) lists those."""
    model = getattr(model, "_orig_mod", model)
    _check_model(model)
    from twell.passes.decided import compiled_records

    return Report(compiled_records(model))


def save_plan(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Write the decisions sparsify made from calibration data (or a plan) to a JSON plan at `path`."""
    _check_model(model)
    state: Any = getattr(model, _STATE, None)
    if state is None or state.decisions is None:
        raise ValueError("no decisions to save: call twell.sparsify(model, calibration_data) first")
    from twell.calibrate import save_plan as _save

    _save(state.decisions, state.candidates, path)


__all__ = [
    "compile_report",
    "configure",
    "Configured",
    "layer_configs",
    "restore",
    "report",
    "save_plan",
    "sparsify",
    "warmup",
]
