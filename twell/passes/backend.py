"""torch.compile integration: the "twell" dynamo backend and an Inductor custom graph pass.

    torch.compile(model, backend="twell")       # registered through the torch_dynamo_backends entry point
    torch.compile(model, options={"post_grad_custom_pre_pass": twell.passes.backend.TwellInductorPass()})

The backend rewrites every sparse-gated FFN of dynamo's (torch-level) graph to a torch.ops.twell.* call
and hands the graph to Inductor; the Inductor pass does the same on the post-grad aten graph, for users
of the default backend. Both rewrite every rewritable FFN they find (the ops are exact at any sparsity
and run dense where sparse does not pay); to follow calibration decisions, sparsify the model first
and compile it with any backend. Inductor options given to torch.compile go to compile_fx as config
patches, scoped to this compilation.
"""

from __future__ import annotations

import contextlib
import operator
from pathlib import Path

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

import twell.ops  # noqa: F401  (registers torch.ops.twell.*)
from twell.passes.match import Dialect, FFNMatch, Projection, find_matches, op_name


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


def _rewrite(graph: fx.Graph, match: FFNMatch, aten: bool) -> fx.Node:
    down = match.down
    with graph.inserting_before(down.node):
        gate_weight, gate_bias = _weights(graph, match.gate, aten)
        if match.kind == "plain":
            target = torch.ops.twell.ffn.default
            down_weight = _linear_layout(graph, down, aten)
            args = (match.x, gate_weight, down_weight, gate_bias, down.bias, match.threshold, match.squared)
        else:
            up_weight, up_bias = _weights(graph, match.up, aten)
            target = torch.ops.twell.gated_ffn.default
            down_weight = _linear_layout(graph, down, aten)
            args = (match.x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down.bias)
            args += (match.threshold, match.drelu)
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


def rewrite_graph(graph: fx.Graph, dialect: Dialect) -> list[FFNMatch]:
    """Replace every rewritable FFN of `graph` by a torch.ops.twell call; returns the matches (all of
    them: the rewritten ones have no problems). Dead nodes are removed."""
    aten = any(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes if n.op == "call_function")
    matches = find_matches(graph, dialect)
    rewritten = 0
    for match in matches:
        if not match.rewritable:
            continue
        if not _same_shape(match.x, match.down.node):
            match.problems.append("the FFN's input and output differ in shape or dtype")
            continue
        _rewrite(graph, match, aten)
        rewritten += 1
    if rewritten:
        graph.eliminate_dead_code()
    return matches


def rewrite_dynamo_graph(gm: fx.GraphModule, example_inputs) -> list[FFNMatch]:
    """rewrite_graph on a dynamo graph, whose placeholders' example inputs tell parameters apart."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = {n: t for n, t in zip(placeholders, example_inputs, strict=False) if isinstance(t, torch.Tensor)}
    matches = rewrite_graph(gm.graph, Dialect(gm, values))
    gm.recompile()
    return matches


def twell_backend(gm: fx.GraphModule, example_inputs, **kwargs):
    """Dynamo backend "twell": rewrite FFNs to torch.ops.twell.*, then compile with Inductor.

    kwargs: torch.compile's `options` (Inductor config patches for this compilation) and `mode`.
    """
    from torch._inductor.compile_fx import compile_fx

    options = dict(kwargs.get("options") or {})
    mode = kwargs.get("mode")
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode), **options}
    rewrite_dynamo_graph(gm, example_inputs)
    return compile_fx(gm, example_inputs, config_patches=options or None)


# What the rewritten graph depends on: the pass, and the op schemas it emits.
_SOURCES = (
    *(str(Path(__file__).with_name(name)) for name in ("backend.py", "match.py")),
    str(Path(__file__).parent.parent / "kernels" / "ops.py"),
)


class TwellInductorPass(CustomGraphPass):
    """Inductor post-grad pass (post_grad_custom_pre_pass / post_grad_custom_post_pass) rewriting FFNs
    of the aten graph. Weights there are graph inputs: AOTAutograd lifts parameters to placeholders."""

    def __call__(self, graph: fx.Graph) -> None:
        rewrite_graph(graph, Dialect(graph.owning_module))

    def uuid(self) -> bytes:
        # Stable across processes (FX graph caching stays on), new whenever the matcher changes.
        return get_hash_for_files(_SOURCES)


__all__ = ["TwellInductorPass", "op_name", "rewrite_dynamo_graph", "rewrite_graph", "twell_backend"]
