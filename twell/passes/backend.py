"""torch.compile integration: the "twell" dynamo backend and an Inductor custom graph pass.

    torch.compile(model, backend="twell")       # registered through the torch_dynamo_backends entry point
    torch.compile(model, options={"pre_grad_custom_pass": twell.passes.backend.TwellInductorPass(plan=...)})

The backend rewrites every sparse-gated FFN of dynamo's (torch-level) graph to a torch.ops.twell.* call
and hands the graph to Inductor; the Inductor pass does the same for users of the default backend, on
dynamo's graph as pre_grad_custom_pass or on the post-grad aten graph. Without decisions they rewrite
every rewritable FFN they find (the ops are exact at any sparsity and run dense where sparse does not
pay), with the default LayerConfig (twell.kernels.policy) as their route arguments. On dynamo's graph
they follow calibration decisions, each rewritten FFN with its decision's layout: those of a model
sparsified with calibration data or a plan (looked up by gate weight, twell.passes.decided), and a plan
file (options={"plan": path} for the backend, TwellInductorPass(plan=path)), looked up by the module
paths dynamo records for each parameter. What they did is kept as report records
(twell.compile_report, TwellInductorPass.records) and counted in torch._dynamo.utils.counters["twell"].
Inductor options given to torch.compile go to compile_fx as config patches, scoped to this compilation.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import re
from pathlib import Path

import torch
from torch import fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

import twell.ops  # noqa: F401  (registers torch.ops.twell.*)
from twell.kernels.policy import LayerConfig, default_config
from twell.passes.decided import decision_for, decisions_digest, record_compiled
from twell.passes.match import Dialect, FFNMatch, Projection, find_matches, op_name
from twell.report import Record, Report


def _tensor_meta(node: fx.Node):
    return node.meta.get("val", node.meta.get("example_value"))


def _rows(graph: fx.Graph, ref: fx.Node | None, rows: slice | None, aten: bool) -> fx.Node | None:
    if ref is None or rows is None:
        return ref
    if aten:
        return graph.call_function(torch.ops.aten.slice.Tensor, (ref, 0, rows.start, rows.stop))
    return graph.call_function(operator.getitem, (ref, slice(rows.start, rows.stop)))


def _linear_layout(graph: fx.Graph, linear, aten: bool) -> fx.Node:
    """The weight as the ops take it, [out, in]: a transposed view of one stored [in, out] (Conv1D)."""
    if not linear.transposed:
        return linear.weight
    if aten:  # permute, not aten.t: Inductor lowers t only through its decomposition
        return graph.call_function(torch.ops.aten.permute.default, (linear.weight, [1, 0]))
    return graph.call_function(torch.t, (linear.weight,))


def _weights(graph: fx.Graph, projection: Projection, aten: bool) -> tuple[fx.Node, fx.Node | None]:
    linear = projection.linear
    weight = _linear_layout(graph, linear, aten)
    return _rows(graph, weight, projection.rows, aten), _rows(graph, linear.bias, projection.rows, aten)


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    va, vb = _tensor_meta(a), _tensor_meta(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return True  # unknown shapes: the op's own checks run at trace time
    return va.shape == vb.shape and va.dtype == vb.dtype


def _rewrite(graph: fx.Graph, match: FFNMatch, aten: bool, config: LayerConfig) -> fx.Node:
    down = match.down
    with graph.inserting_before(down.node):
        gate_weight, gate_bias = _weights(graph, match.gate, aten)
        if match.kind == "plain":
            target = torch.ops.twell.ffn.default
            down_weight = _linear_layout(graph, down, aten)
            args = (match.x, gate_weight, down_weight, gate_bias, down.bias, match.threshold, match.squared)
            args += config.op_args()
        else:
            up_weight, up_bias = _weights(graph, match.up, aten)
            target = torch.ops.twell.gated_ffn.default
            down_weight = _linear_layout(graph, down, aten)
            args = (match.x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down.bias)
            args += (match.threshold, match.drelu, *config.op_args())
        new = graph.call_function(target, args)
    _propagate_meta(new, down.node)
    down.node.replace_all_uses_with(new)
    return new


def _propagate_meta(new: fx.Node, old: fx.Node) -> None:
    """Inductor reads node.meta["val"]: compute fake values for the new nodes under the graph's fake mode."""
    if "val" not in old.meta:
        return
    fake_mode = torch._guards.detect_fake_mode([old.meta["val"]])

    def fake(node: fx.Node):
        if "val" not in node.meta:
            node.meta["val"] = node.target(*fx.node.map_arg(node.args, fake), **node.kwargs)
        return node.meta["val"]

    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        fake(new)


def rewrite_graph(graph: fx.Graph, dialect: Dialect, keep=None, config=None) -> list[tuple[FFNMatch, str]]:
    """Replace every rewritable FFN of `graph` by a torch.ops.twell call, except those for which
    keep(match) gives a reason to leave them as they are (a plan's decision); config(match): the
    LayerConfig the call gets (None: the defaults of its width, policy.default_config). Returns (match, reason)
    for every FFN found: reason "" for those rewritten. Dead nodes are removed. Counts go to
    torch._dynamo.utils.counters["twell"] (ffn_found, ffn_rewritten, ffn_not_rewritable, ffn_kept)."""
    aten = any(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes if n.op == "call_function")
    found = []
    for match in find_matches(graph, dialect):
        counters["twell"]["ffn_found"] += 1
        reason = "; ".join(match.problems)
        if not reason and not _same_shape(match.x, match.down.node):
            match.problems.append("the FFN's input and output differ in shape or dtype")
            reason = match.problems[0]
        if reason:
            counters["twell"]["ffn_not_rewritable"] += 1
        else:
            reason = keep(match) if keep is not None else ""
            if reason:
                counters["twell"]["ffn_kept"] += 1
            else:
                layer = config(match) if config is not None else default_config(match.model_size)
                _rewrite(graph, match, aten, layer)
                counters["twell"]["ffn_rewritten"] += 1
        found.append((match, reason))
    if any(not reason for _, reason in found):
        _remove_dead_nodes(graph)
    return found


def _mutates(node: fx.Node) -> bool:
    """Whether the node writes into a tensor: an in-place method or function (name ending in one
    underscore), an operator overload with a mutable schema, or an out= argument."""
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or "out" in node.kwargs


def _remove_dead_nodes(graph: fx.Graph) -> None:
    """Graph.eliminate_dead_code without removing writes: FX counts dynamo's in-place calls (a static KV
    cache's index_copy_ and position add_, whose results nobody uses) as pure, and would drop them."""
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure() and not _mutates(node):
            graph.erase_node(node)


# A parameter's dynamo source: L['self']._modules['model']._modules['layers']._modules['0']._parameters['weight']
_SOURCE_MODULE = re.compile(r"_modules\['([^']*)'\]")


def _module_path(weight: fx.Node | None) -> str | None:
    """The module path of a parameter input of a dynamo graph, from its source (None if unknown)."""
    source = getattr(weight.meta.get("grapharg"), "source", None) if isinstance(weight, fx.Node) else None
    name = getattr(source, "name", None)
    name = name() if callable(name) else name
    if not isinstance(name, str) or "_parameters[" not in name:
        return None
    return ".".join(_SOURCE_MODULE.findall(name))


def _linears(match: FFNMatch):
    linears = [match.gate.linear]
    if match.up is not None and match.up.linear is not match.gate.linear:
        linears.append(match.up.linear)
    return [*linears, match.down]


def _paths(match: FFNMatch) -> list[str]:
    """The paths twell.report would give this FFN: the module holding its projections, and that module
    followed by the projections' names (an FFN written inline, or split across modules). Empty when the
    graph does not tell where its weights come from."""
    paths = [_module_path(linear.weight) for linear in _linears(match)]
    if None in paths or not paths:
        return []
    parts = [p.split(".") for p in paths]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    owner = ".".join(parts[0][:common])
    names = ",".join(".".join(p[common:]) for p in parts)
    return [owner, f"{owner}[{names}]"]


class _Plan:
    """The decisions a compilation follows: a plan file's (by FFN path), and those sparsify made for
    FFNs it kept dense (by gate weight, twell.passes.decided)."""

    def __init__(self, path=None):
        self.path = path
        self.fingerprints, self.decisions = ({}, {}) if path is None else _read_plan(path)

    def lookup(self, match: FFNMatch, dialect: Dialect) -> tuple[str | None, object | None]:
        """(the FFN's path, its decision), either None where unknown."""
        paths = _paths(match)
        decided = decision_for(dialect.tensor(match.gate.linear.weight))
        if decided is not None:
            return decided
        for path in paths:
            if path in self.decisions:
                planned = self.fingerprints.get(path, {})
                shape = (planned.get("hidden_size"), planned.get("model_size"))
                if shape != (match.hidden_size, match.model_size):
                    raise ValueError(
                        f"plan {self.path} was made for a different model: {path} has N x K "
                        f"{match.hidden_size}x{match.model_size}, the plan {shape[0]}x{shape[1]}"
                    )
                return path, self.decisions[path]
        return (paths[-1] if paths else None), None

    def config(self, match: FFNMatch, dialect: Dialect) -> LayerConfig:
        """The LayerConfig of a rewritten FFN: its decision's layout, its width's defaults without one."""
        _, decision = self.lookup(match, dialect)
        return decision.layer_config() if decision is not None else default_config(match.model_size)

    def keep(self, match: FFNMatch, dialect: Dialect) -> str:
        """Why to leave a rewritable FFN as it is ("" to rewrite it)."""
        path, decision = self.lookup(match, dialect)
        if decision is not None:
            return "" if decision.rewrite else f"kept dense by the plan: {decision.reason}"
        if self.path is not None:
            return f"not in the plan {self.path}"
        return ""


def _read_plan(path):
    from twell.calibrate import read_plan

    return read_plan(path)


def compile_records(found, dialect: Dialect, plan: _Plan) -> list:
    """The report records (twell.report.Record) of what one graph rewrite did, one per FFN found;
    each is also kept by the FFN's gate weight for twell.compile_report(model)."""
    records = []
    for match, reason in found:
        path, decision = plan.lookup(match, dialect)
        record = Record(
            path=path or f"<graph>[{','.join(linear.node.name for linear in _linears(match))}]",
            kind=match.kind,
            matched=True,
            activation=match.activation_name,
            rewritable=match.rewritable,
            rewritten=not reason,
            reason=reason,
            hidden_size=match.hidden_size,
            model_size=match.model_size,
            threshold=match.threshold,
            decision=decision.to_dict() if decision is not None else None,
        )
        record_compiled(dialect.tensor(match.gate.linear.weight), record)
        records.append(record)
    return records


def rewrite_dynamo_graph(gm: fx.GraphModule, example_inputs, plan=None) -> list:
    """rewrite_graph on a dynamo graph, whose placeholders' example inputs tell parameters apart (and,
    through their sources, the paths of their modules). plan: a plan file to follow, besides the
    decisions of a model sparsified with calibration data or a plan. Returns the report records."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = {n: t for n, t in zip(placeholders, example_inputs, strict=False) if isinstance(t, torch.Tensor)}
    dialect = Dialect(gm, values)
    plan = _Plan(plan)
    found = rewrite_graph(
        gm.graph, dialect, keep=lambda match: plan.keep(match, dialect), config=lambda m: plan.config(m, dialect)
    )
    gm.recompile()
    return compile_records(found, dialect, plan)


def twell_backend(gm: fx.GraphModule, example_inputs, **kwargs):
    """Dynamo backend "twell": rewrite FFNs to torch.ops.twell.*, then compile with Inductor.

    kwargs: torch.compile's `options` (Inductor config patches for this compilation, and "plan": a
    plan file whose decisions to follow) and `mode`. A model sparsified with calibration data or a plan
    keeps its decisions here too: the FFNs it kept dense stay dense. What was done is in
    twell.compile_report(model) and torch._dynamo.utils.counters["twell"].
    """
    from torch._inductor.compile_fx import compile_fx

    options = dict(kwargs.get("options") or {})
    plan = options.pop("plan", None)
    mode = kwargs.get("mode")
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode), **options}
    rewrite_dynamo_graph(gm, example_inputs, plan=plan)
    return compile_fx(gm, example_inputs, config_patches=options or None)


# What the rewritten graph depends on: the pass, and the op schemas it emits.
_SOURCES = (
    *(str(Path(__file__).with_name(name)) for name in ("backend.py", "match.py", "projections.py")),
    str(Path(__file__).parent.parent / "kernels" / "library.py"),
)


class TwellInductorPass(CustomGraphPass):
    """Inductor custom graph pass rewriting FFNs, for users of the default backend.

    As `pre_grad_custom_pass` it runs on dynamo's graph, as the "twell" backend does, and follows the
    same decisions: a model's sparsified with calibration data or a plan, and `plan` (a plan file). As
    a post-grad pass (post_grad_custom_pre_pass / post_grad_custom_post_pass) it runs on the aten
    graph, whose parameter inputs no longer tell which weights they are: it rewrites every rewritable
    FFN, and refuses a plan. `records` lists what each run did (report records; a post-grad run's paths
    name graph nodes); a compilation served from Inductor's caches does not run the pass.
    """

    def __init__(self, plan=None):
        self.plan = plan
        self.records = []

    def __call__(self, graph: fx.Graph) -> None:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        # dynamo's graph (pre-grad) keeps each input's real tensor and source in its placeholders' meta
        values = {
            n: n.meta["grapharg"].example
            for n in placeholders
            if isinstance(getattr(n.meta.get("grapharg"), "example", None), torch.Tensor)
        }
        if not values and self.plan is not None:
            raise ValueError(
                "TwellInductorPass(plan=...) follows a plan only as pre_grad_custom_pass: the post-grad "
                "graph does not tell which weights its inputs are"
            )
        dialect = Dialect(graph.owning_module, values)
        plan = _Plan(self.plan)
        found = rewrite_graph(
            graph, dialect, keep=lambda match: plan.keep(match, dialect), config=lambda m: plan.config(m, dialect)
        )
        self.records.extend(compile_records(found, dialect, plan))

    def report(self):
        """The records as a twell.report.Report."""
        return Report(list(self.records))

    def uuid(self) -> bytes:
        # Stable across processes (Inductor's caches stay on), new whenever the matcher, the plan or the
        # decisions of sparsified models change.
        digest = hashlib.sha256(get_hash_for_files(_SOURCES))
        if self.plan is not None:
            digest.update(Path(self.plan).read_bytes())
        digest.update(decisions_digest())
        return digest.digest()


__all__ = ["TwellInductorPass", "compile_records", "op_name", "rewrite_dynamo_graph", "rewrite_graph", "twell_backend"]
