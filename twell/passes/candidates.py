"""Finding FFNs in an eager model: trace candidate modules one by one with torch.fx and match.

Whole-model FX tracing of transformers v5 models is not supported, so each module that holds an
FFN-shaped pair of nn.Linear children (one maps K -> N or K -> 2N, another N -> K) is traced on its own,
with its forward's first argument as the only input (the others keep their defaults). Children with
parameters or buffers, and torch.nn modules, stay opaque (`call_module`); parameter-free custom
modules (transformers' activation classes) are traced through, so every spelling of an activation
reaches the matcher as the same graph.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from twell.distributed import tensor_parallel_linear
from twell.passes import experts
from twell.passes.match import (
    Dialect,
    FFNMatch,
    activation,
    activation_problems,
    call_problems,
    find_matches,
    skip_identities,
)
from twell.passes.modules import TWELL_MODULES, FFNSpec
from twell.passes.projections import features, is_projection


@dataclass
class Candidate:
    """One FFN found in a model (whether or not it can be rewritten).

    path: module path of the FFN module; for an FFN written inline in a bigger module's forward (OPT's
    decoder layer), that module's path followed by the linears' names in brackets, e.g.
    "model.decoder.layers.0[fc1,fc2]" (plain) or "layers.0[w1,w3,w2]" (gated: gate, up, down).
    gate_module: the nn.Linear whose output (pre-activation, [..., N]) is thresholded; for plain FFNs
    the up linear. gate_slice: for a fused gate_up linear, the slice of its last dim that is the gate.
    hidden_size: N; model_size: K. For one expert of a mixture-of-experts layer (path
    "<experts module>.<e>"), gate_module is the experts module, `expert` its index, and `measure` gives
    that expert's gate pre-activation from a call of the experts module.
    """

    path: str
    kind: str  # "gated" or "plain"
    activation: str  # relu, fatrelu, drelu, relu2, or a non-sparse function's name (silu, gelu, ...)
    rewritable: bool
    reason: str  # why not rewritable, or ""
    gate_module: nn.Module | None
    gate_slice: slice | None
    threshold: float
    hidden_size: int
    model_size: int
    # How to rewrite it (None when not rewritable): the module that owns the FFN and the op's spec.
    owner: nn.Module | None = field(default=None, repr=False, compare=False)
    spec: FFNSpec | experts.ExpertsSpec | None = field(default=None, repr=False, compare=False)
    inline: bool = field(default=False, repr=False, compare=False)
    activation_children: tuple[str, ...] = field(default=(), repr=False, compare=False)
    expert: int | None = field(default=None, repr=False, compare=False)
    # (args, kwargs, output) of a gate_module call -> the pre-activation [..., N] to measure, None if
    # nothing of this FFN ran in that call; None: gate_module's output (sliced by gate_slice)
    measure: Callable | None = field(default=None, repr=False, compare=False)


@dataclass
class Unmatched:
    """A module that may hold an FFN but could not be analysed (e.g. its forward does not trace)."""

    path: str
    reason: str


class _Tracer(fx.Tracer):
    """Leaf modules: projections, torch.nn's modules and any module with tensors of its own. Control
    flow on two facts is resolved as a real call would: a tensor's dtype is the traced module's
    (`dtype`), and activations are finite (the fp16 overflow clamp of BART-style layers:
    `if x.dtype == torch.float16 and not torch.isfinite(x).all()`)."""

    dtype = torch.float32

    def to_bool(self, obj: fx.Proxy) -> bool:
        node = obj.node
        if node.op == "call_method" and node.target == "all" and _calls(node.args[0], torch.isfinite):
            return True
        if node.op == "call_function" and node.target in (operator.eq, operator.ne):
            a, b = node.args
            attr, dtype = (a, b) if isinstance(b, torch.dtype) else (b, a)
            if isinstance(dtype, torch.dtype) and _calls(attr, getattr) and attr.args[1] == "dtype":
                return (self.dtype == dtype) == (node.target is operator.eq)
        return super().to_bool(obj)

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if isinstance(module, TWELL_MODULES) or is_projection(module):
            return True
        if module.__module__.startswith("torch.nn") and not isinstance(module, nn.Sequential):
            return True
        return any(True for _ in itertools.chain(module.parameters(), module.buffers()))


class TraceFailure(Exception):
    pass


def _calls(node, function) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is function


def _input_name(module: nn.Module) -> tuple[str, tuple[str, ...]]:
    """(the name of forward's input, the other arguments it requires: BART's encoder layer, an
    attention_mask)."""
    forward = inspect.unwrap(type(module).forward)
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    if not parameters or parameters[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        raise TraceFailure("forward has no positional input")
    required = tuple(
        p.name
        for p in parameters[1:]
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )
    return parameters[0].name, required


def trace_module(module: nn.Module, inputs: int = 1, required: tuple[str, ...] = ()) -> fx.Graph:
    """FX graph of module.forward(x) (inputs=2: forward(x, other)) with every other argument at its
    default, and the `required` ones (without a default) None: a layer whose FFN is written inline
    computes it alike whatever its attention mask.

    Traced on a throwaway subclass instance sharing the module's state, through a method that calls
    the undecorated forward with x alone: transformers wraps layer forwards in (*args, **kwargs)
    decorators that FX cannot trace. Neither the module nor its class is modified.
    """
    forward = inspect.unwrap(type(module).forward)

    nones = dict.fromkeys(required)

    def _twell_traced(self, x):
        return forward(self, x, **nones)

    def _twell_traced_with_other(self, x, other):
        return forward(self, x, other, **nones)

    tracer = _Tracer()
    tracer.traced_func_name = "_twell_traced"
    tracer.dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    traced = _twell_traced if inputs == 1 else _twell_traced_with_other
    try:
        cls = type(type(module).__name__, (type(module),), {"_twell_traced": traced})
        shim = object.__new__(cls)
        shim.__dict__.update(module.__dict__)
        for key in ("_modules", "_parameters", "_buffers"):
            shim.__dict__[key] = dict(module.__dict__[key])
        graph = tracer.trace(shim)
    except Exception as error:  # any failure of user code under tracing means: cannot analyse
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        raise TraceFailure(f"{type(error).__name__}: {first_line}") from error
    # A parameter read only for its dtype (T5's `self.wo.weight.dtype`) is not part of the computation.
    for node in reversed(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    return graph


def _ffn_shaped(module: nn.Module) -> tuple[bool, bool]:
    """(has an up/down pair of direct projection children, and one that expands: N > K)."""
    shapes = [features(m) for m in module.children() if is_projection(m)]
    pair = expanding = False
    for (up_in, up_out), (n, down_out) in itertools.permutations(shapes, 2):
        if down_out == up_in and up_out in (n, 2 * n):
            pair = True
            expanding = expanding or n > up_in
    return pair, expanding


def _child_name(node: fx.Node) -> str | None:
    """The direct child a call_module node calls (None for deeper targets)."""
    return node.target if node.op == "call_module" and "." not in node.target else None


def _whole_module(graph: fx.Graph, match: FFNMatch, dialect: Dialect) -> tuple[bool, bool]:
    """(the graph is x -> this FFN -> output with only identities after down, there are dropouts after down)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in graph.nodes if n.op == "output"]
    source, trailing, dropouts = skip_identities(output.args[0], dialect)
    if source is not match.down.node or placeholders != [match.x]:
        return False, False
    body = set(graph.nodes) - {match.x, output}
    return body == match.nodes | {match.down.node} | set(trailing), bool(dropouts)


def _inline_children(graph: fx.Graph, match: FFNMatch) -> tuple[tuple[str, ...], str]:
    """Names of the activation children to swap for an inline FFN, or ((), reason it cannot be)."""
    linears = [match.gate.linear, match.down] + ([match.up.linear] if match.up is not None else [])
    if any(p.rows is not None for p in (match.gate, match.up) if p is not None):
        return (), "fused gate_up projection inside a bigger forward cannot be swapped module by module"
    if match.dropout:
        return (), "dropout inside an inline FFN would act on the layer's input in training mode"
    names = [_child_name(linear.node) for linear in linears]
    if None in names:
        return (), "inline FFN projections are not direct children of the module"
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    activation_children = []
    for act in (match.activation, match.up_activation):
        if act is None:
            continue
        owners = {stack_root(node) for node in act.nodes}
        if len(owners) != 1 or None in owners or "." in next(iter(owners)):
            return (), "the activation is written inline in the forward, not an activation module that can be swapped"
        (owner,) = owners
        others = [n for n in graph.nodes if n not in act.nodes and stack_root(n) == owner]
        if others or calls.get(owner, 0) > 1:
            return (), f"activation module {owner} is used more than once"
        activation_children.append(owner)
    for name in names:
        if calls.get(name, 0) != 1:
            return (), f"linear {name} is called more than once"
    return tuple(activation_children), ""


def stack_root(node: fx.Node) -> str | None:
    """The direct child whose forward produced `node` (traced through, or called as a leaf), if any."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        return next(iter(stack.values()))[0]
    return _child_name(node)


def _candidate(
    path: str, module: nn.Module, graph: fx.Graph, match: FFNMatch, input_name: str, required: tuple[str, ...]
) -> Candidate:
    problems = list(match.problems)
    gate_name = match.gate.linear.node.target
    up_name = match.up.linear.node.target if match.up is not None else None
    down_name = match.down.node.target
    dialect = Dialect(module)
    whole, trailing_dropout = _whole_module(graph, match, dialect)
    activation_children: tuple[str, ...] = ()
    if whole and not path:
        problems.append("the model itself is the FFN; sparsify a module that contains it")
    if whole and required:  # SparseFFN computes the FFN from its input alone
        problems.append(f"forward needs arguments besides its input: {', '.join(required)}")
    if whole and "forward" in module.__dict__:
        problems.append("forward is replaced on the instance (e.g. by offloading hooks)")
    linears = [module.get_submodule(name) for name in (gate_name, up_name, down_name) if name is not None]
    if not whole and any(tensor_parallel_linear(m) for m in linears):
        problems.append("tensor-parallel linears of an FFN written inline in a bigger forward (twell runs FFN modules)")
    if not whole and not problems:
        activation_children, reason = _inline_children(graph, match)
        if reason:
            problems.append(reason)
    if whole:
        ffn_path = path
    else:
        names = [gate_name, up_name, down_name] if match.kind == "gated" else [gate_name, down_name]
        ffn_path = f"{path}[{','.join(names)}]"
    spec = None
    if not problems:
        spec = FFNSpec(
            kind=match.kind,
            gate=gate_name,
            up=up_name,
            down=down_name,
            gate_rows=match.gate.rows,
            up_rows=match.up.rows if match.up is not None else None,
            threshold=match.threshold,
            drelu=match.drelu,
            squared=match.squared,
            dropout=bool(match.dropout) or trailing_dropout,
            input_name=input_name,
        )
    return Candidate(
        path=ffn_path,
        kind=match.kind,
        activation=match.activation_name,
        rewritable=not problems,
        reason="; ".join(problems),
        gate_module=module.get_submodule(gate_name),
        gate_slice=match.gate.rows,
        threshold=match.threshold,
        hidden_size=match.hidden_size,
        model_size=match.model_size,
        owner=module,
        spec=spec,
        inline=not whole,
        activation_children=activation_children,
    )


class _ActivationProbe(nn.Module):
    """A two-neuron FFN around a given activation module: the matcher names and checks the activation of
    experts (whose own forward, over routed tokens, does not trace) as it does any other FFN's."""

    def __init__(self, act: nn.Module, gated: bool):
        super().__init__()
        self.gate = nn.Linear(1, 2, bias=False)
        self.up = nn.Linear(1, 2, bias=False) if gated else None
        self.down = nn.Linear(2, 1, bias=False)
        self.act = act

    def forward(self, x):
        hidden = self.act(self.gate(x))
        return self.down(hidden * self.up(x) if self.up is not None else hidden)


def _experts_candidates(path: str, module: nn.Module) -> list[Candidate]:
    """One candidate per expert when twell can serve the layer, else one for the layer with the reason."""
    spec, problems = experts.layout(module)
    kind = "gated" if module.has_gate else "plain"
    activation, threshold, squared = "", 0.0, False
    act = getattr(module, "act_fn", None)
    if not isinstance(act, nn.Module):
        problems.append("experts have no activation module (act_fn)")
    else:
        probe = _ActivationProbe(act, kind == "gated")
        try:
            (match,) = find_matches(trace_module(probe), Dialect(probe))
        except (TraceFailure, ValueError) as failure:
            problems.append(f"the experts' activation could not be analysed: {failure}")
        else:
            activation, threshold, squared = match.activation_name, match.threshold, match.squared
            problems.extend(match.problems)
    down = module._parameters["down_proj"]
    transposed = bool(module.is_transposed)
    n, k = (down.shape[-2], down.shape[-1]) if transposed else (down.shape[-1], down.shape[-2])
    common = dict(kind=kind, activation=activation, gate_slice=None, threshold=threshold, hidden_size=n, model_size=k)
    if problems:
        return [Candidate(path, rewritable=False, reason="; ".join(problems), gate_module=module, **common)]
    spec = dataclasses.replace(spec, threshold=threshold, squared=squared)
    return [
        Candidate(
            f"{path}.{e}" if path else str(e),
            rewritable=True,
            reason="",
            gate_module=module,
            owner=module,
            spec=spec,
            expert=e,
            measure=functools.partial(_expert_preactivation, module, spec, e),
            **common,
        )
        for e in range(experts.sizes(module, spec)[0])
    ]


def _expert_preactivation(module, spec, expert, args, kwargs, output):
    return experts.gate_preactivation(module, spec, expert, args, kwargs)


def _split_pairs(module: nn.Module) -> list[tuple[str, str, str, str]]:
    """(first, up, second, down) for children `first`, whose only projection `up` widens K -> N, and
    `second`, with a projection `down` N -> K: an FFN that may be split across the two (BERT's
    intermediate and output)."""
    children = [(name, child) for name, child in module.named_children() if not is_projection(child)]
    pairs = []
    for first, a in children:
        ups = [(name, features(m)) for name, m in a.named_children() if is_projection(m)]
        if len(ups) != 1 or ups[0][1][1] <= ups[0][1][0]:
            continue
        up, (k, n) = ups[0]
        for second, b in children:
            downs = [name for name, m in b.named_children() if is_projection(m) and features(m) == (n, k)]
            if second != first and len(downs) == 1:
                pairs.append((first, up, second, downs[0]))
    return pairs


def _called_once(graph: fx.Graph, target: str) -> fx.Node | None:
    nodes = [n for n in graph.nodes if n.op == "call_module" and n.target == target]
    return nodes[0] if len(nodes) == 1 else None


def _split_candidate(path: str, module: nn.Module, graph: fx.Graph, pair) -> Candidate | Unmatched | None:
    """The FFN split across children `first` (x -> act(up(x))) and `second` (whose forward starts with
    down(h) on first's output h), or None if the module does not pass first's output to second; where
    it does but either half is not that, the reason as an Unmatched. The rewrite is the
    inline one across both: up returns x, the activation is the identity (first now returns x), and down
    computes the whole FFN from x; the rest of second's forward (dropout, residual, norm) is unchanged."""
    first, up_name, second, down_name = pair
    a, b = module.get_submodule(first), module.get_submodule(second)
    ffn_path = f"{path}[{first}.{up_name},{second}.{down_name}]"
    node_a, node_b = _called_once(graph, first), _called_once(graph, second)
    if node_a is None or node_b is None or node_b.args[:1] != (node_a,):
        return None
    problems = []
    if list(node_a.users) != [node_b] or node_a in node_b.args[1:] or node_a in node_b.kwargs.values():
        problems.append(f"{first}'s output is also used outside {second}'s first argument")
    try:
        graph_a = trace_module(a)
        parameters = list(inspect.signature(inspect.unwrap(type(b).forward)).parameters.values())[1:]
        graph_b = trace_module(b, inputs=2 if len(parameters) > 1 else 1)
    except TraceFailure as failure:
        return Unmatched(ffn_path, f"could not trace {first} or {second}: {failure}")
    dialect_a, dialect_b = Dialect(a), Dialect(b)
    (x,) = [n for n in graph_a.nodes if n.op == "placeholder"]
    (output,) = [n for n in graph_a.nodes if n.op == "output"]
    source, trailing, dropouts = skip_identities(output.args[0], dialect_a)
    act = activation(source, dialect_a)
    if act is None or act.projection.rows is not None or act.projection.linear.node.target != up_name:
        return Unmatched(ffn_path, f"{first} passes its output to {second}, but does not return act({up_name}(x))")
    up = act.projection.linear
    if up.input is not x or set(graph_a.nodes) != {x, output, up.node, *act.nodes, *trailing}:
        problems.append(f"{first}'s forward computes more than act({up_name}(x))")
    h = next(n for n in graph_b.nodes if n.op == "placeholder")
    down_node = _called_once(graph_b, down_name)
    if down_node is None or list(h.users) != [down_node]:
        return Unmatched(ffn_path, f"{second} does not use {first}'s output only as the input of {down_name}")
    down = dialect_b.linear(down_node)
    match = FFNMatch("plain", x, act.projection, None, down, act, None, frozenset())
    problems += activation_problems(match)
    if dropouts:
        problems.append(f"dropout after the activation in {first} would act on the FFN's input in training mode")
    owners = {stack_root(node) for node in act.nodes}
    if len(owners) != 1 or None in owners or "." in next(iter(owners)):
        problems.append(
            f"the activation is written inline in {first}'s forward, not an activation module that can be swapped"
        )
    for node in act.nodes:
        if dialect_a.module(node) is not None:
            problems += call_problems(dialect_a.module(node), f"activation {first}.{node.target}")
    problems += dialect_a.weight_problems(up, "up") + dialect_b.weight_problems(down, "down")
    problems += call_problems(a, first) + call_problems(b, second)
    if any(tensor_parallel_linear(m) for m in (up.module, down.module)):
        problems.append("tensor-parallel linears of an FFN split across two modules (twell runs FFN modules)")
    weights = {(w.dtype, w.device) for w in (up.module.weight, down.module.weight)}
    if len(weights) > 1:
        problems.append("the two projections differ in dtype or device")
    names = [f"{first}.{up_name}", f"{second}.{down_name}"]
    return Candidate(
        path=ffn_path,
        kind="plain",
        activation=match.activation_name,
        rewritable=not problems,
        reason="; ".join(problems),
        gate_module=up.module,
        gate_slice=None,
        threshold=match.threshold,
        hidden_size=match.hidden_size,
        model_size=match.model_size,
        owner=module,
        spec=None
        if problems
        else FFNSpec(
            kind="plain",
            gate=names[0],
            up=None,
            down=names[1],
            threshold=match.threshold,
            squared=match.squared,
        ),
        inline=True,
        # the activation module, also where the FFN is not rewritable (relufy switches it)
        activation_children=(f"{first}.{next(iter(owners))}",) if len(owners) == 1 and None not in owners else (),
    )


_NO_PATTERN = (
    "holds projections K -> N and N -> K, but its forward computes neither down(act(up(x))) nor "
    "down(act(gate(x)) * up(x)) from its input"
)


def scan(model: nn.Module) -> tuple[list[Candidate], list[Unmatched]]:
    """Every FFN of `model` (module order), and the modules that could not be analysed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    candidates: list[Candidate] = []
    unmatched: list[Unmatched] = []
    for path, module in model.named_modules():
        if isinstance(module, (*TWELL_MODULES, experts.SparseExperts)) or is_projection(module):
            continue
        if experts.is_experts(module):
            candidates.extend(_experts_candidates(path, module))
            continue
        pairs = _split_pairs(module)
        if pairs:
            try:
                graph = trace_module(module, required=_input_name(module)[1])
            except TraceFailure as failure:
                unmatched.append(Unmatched(path, f"could not trace {type(module).__name__}: {failure}"))
            else:
                for pair in pairs:
                    found = _split_candidate(path, module, graph, pair)
                    if isinstance(found, Candidate):
                        candidates.append(found)
                    elif found is not None:
                        unmatched.append(found)
        pair, expanding = _ffn_shaped(module)
        if not pair:
            continue
        try:
            input_name, required = _input_name(module)
            graph = trace_module(module, required=required)
        except TraceFailure as failure:
            if expanding:
                unmatched.append(Unmatched(path, f"could not trace {type(module).__name__}: {failure}"))
            continue
        matches = find_matches(graph, Dialect(module))
        if not matches and expanding:
            unmatched.append(Unmatched(path, _NO_PATTERN))
        for match in matches:
            candidates.append(_candidate(path, module, graph, match, input_name, required))
    return candidates, unmatched


def find_ffns(model: torch.nn.Module) -> list[Candidate]:
    """Every FFN of `model`, rewritable or not (see Candidate), in module order."""
    return scan(model)[0]
