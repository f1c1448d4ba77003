"""What a feed-forward block looks like in an FX graph.

One matcher serves three kinds of graph: per-module symbolic traces (linears are `call_module` nodes of
nn.Linear, activations may be modules), dynamo graphs (torch-level functions, weights are placeholders
whose example inputs are the model's Parameters) and Inductor's post-grad aten graphs (linears are
`mm`/`addmm` of a transposed weight between views). Operations are recognised by name (`relu` is
torch.relu, F.relu, Tensor.relu and aten.relu alike), restricted to torch and `operator` callables.

Patterns, with x the shared input, P a projection (a linear, or a last-dim slice of a fused linear):

    gated:  down(act(P_gate(x)) * P_up(x))      either operand order; dReLU: relu on P_up(x) too
    plain:  down(act(P_up(x)))

with eval-mode dropout or identities allowed between the steps. Sparse activations, which twell can
rewrite: relu, fatrelu (v * (v > t), where(v > t, v, 0), threshold(v, t, 0)), and relu² / fatrelu²
on plain FFNs. Any other unary function of the projection is matched (and reported) but not rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx, nn

from twell.distributed import tensor_parallel_linear
from twell.passes.projections import features, is_conv1d, is_projection, native_forward

SPARSE_ACTIVATIONS = ("relu", "fatrelu", "relu2")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REMEDY = "fine-tune with ReLU + L1 to make it sparse"

_RELU = {"relu", "relu_"}
_MUL = {"mul", "mul_", "imul"}
_SQUARE = {"square", "square_"}
_POW = {"pow", "pow_", "ipow"}
_WHERE = {"where"}
_CONVERT = {"to", "type_as", "float", "half", "bfloat16", "_to_copy", "convert_element_type", "_convert_element_type"}
_VIEW = {"view", "_unsafe_view", "reshape"}
# The size argument of chunk, torch.split, Tensor.split, aten split / split_with_sizes.
_SPLIT_KEYS = ("chunks", "split_size_or_sections", "split_size", "split_sizes")
_DROPOUT = {"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"}
_IDENTITY = {"alias"}
# Upper bound on the nodes of one unrecognised activation (e.g. gelu_new is ~8 nodes): keeps the
# backwards search local when the projection is far away or absent.
_MAX_ACTIVATION_NODES = 32


def op_name(node: fx.Node) -> str | None:
    """The operation's name for torch, aten and `operator` callables and tensor methods, else None."""
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None)
    if name and (module in ("_operator", "operator") or module.startswith("torch")):
        return name.lstrip("_")  # F.threshold is spelled _threshold
    return None


def arg(node: fx.Node, index: int, name: str, default=None):
    """Argument `index` (positional) or `name` (keyword) of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


@dataclass
class Linear:
    """A recognised y = x W^T + b. `weight`/`bias` are nodes (function forms) or None with `module` set.
    transposed: the weight is stored [in, out] (Conv1D, or mm/addmm of a weight without a transpose)."""

    node: fx.Node  # the node holding y
    input: fx.Node  # x (views into 2-D peeled off)
    out_features: int
    in_features: int
    module: nn.Module | None = None  # nn.Linear or Conv1D
    weight: fx.Node | None = None
    bias: fx.Node | None = None
    nodes: tuple[fx.Node, ...] = ()  # value-side nodes of this linear, y included (not the weight's transpose)
    transposed: bool = False


@dataclass
class Projection:
    """A linear's output, or a slice `rows` of the output features of a fused linear (Phi-3 gate_up)."""

    linear: Linear
    rows: slice | None
    nodes: tuple[fx.Node, ...]  # slicing nodes (chunk / getitem / slice)

    @property
    def size(self) -> int:
        if self.rows is None:
            return self.linear.out_features
        return self.rows.stop - self.rows.start


@dataclass
class Activation:
    name: str  # relu, fatrelu, relu2, or the name of a non-sparse function (silu, gelu, ...)
    projection: Projection  # what it is applied to
    nodes: tuple[fx.Node, ...]
    threshold: float = 0.0
    squared: bool = False

    @property
    def sparse(self) -> bool:
        return self.name in SPARSE_ACTIVATIONS


@dataclass
class FFNMatch:
    """One feed-forward block found in a graph. `problems` lists why it cannot be rewritten."""

    kind: str  # "gated" or "plain"
    x: fx.Node
    gate: Projection  # the thresholded projection (for plain FFNs: the up projection)
    up: Projection | None  # gated only
    down: Linear
    activation: Activation | None  # None: a bilinear gated FFN (no activation)
    up_activation: Activation | None  # dReLU
    nodes: frozenset[fx.Node]  # every value node of the block but x and the output
    dropout: tuple[fx.Node, ...] = ()
    problems: list[str] = field(default_factory=list)

    @property
    def activation_name(self) -> str:
        if self.activation is None:
            return "none"
        if self.up_activation is not None and self.activation.sparse and self.up_activation.sparse:
            return "drelu"
        return self.activation.name

    @property
    def threshold(self) -> float:
        return self.activation.threshold if self.activation is not None else 0.0

    @property
    def drelu(self) -> bool:
        return self.up_activation is not None

    @property
    def squared(self) -> bool:
        return self.activation is not None and self.activation.squared

    @property
    def hidden_size(self) -> int:
        return self.gate.size

    @property
    def model_size(self) -> int:
        return self.down.out_features

    @property
    def rewritable(self) -> bool:
        return not self.problems


class Dialect:
    """How to read linears and weights in one kind of graph.

    modules: the root module for `call_module` / `get_attr` targets (symbolic traces, GraphModules).
    values: node -> tensor for placeholders whose real tensors are known (dynamo's example inputs).
    """

    def __init__(self, root: nn.Module | None = None, values: dict[fx.Node, torch.Tensor] | None = None):
        self.root = root
        self.values = values or {}

    def module(self, node: fx.Node) -> nn.Module | None:
        if node.op != "call_module" or self.root is None:
            return None
        return self.root.get_submodule(node.target)

    def tensor(self, node) -> torch.Tensor | None:
        """The real tensor, or its fake/meta value, behind a weight node."""
        if not isinstance(node, fx.Node):
            return None
        if node in self.values:
            return self.values[node]
        if node.op == "get_attr" and self.root is not None:
            *path, name = node.target.split(".")
            owner = self.root.get_submodule(".".join(path)) if path else self.root
            return getattr(owner, name, None)
        value = node.meta.get("val", node.meta.get("example_value"))
        return value if isinstance(value, torch.Tensor) else None

    def rank(self, node: fx.Node) -> int | None:
        value = node.meta.get("val", node.meta.get("example_value"))
        return value.dim() if isinstance(value, torch.Tensor) else None

    def linear(self, node: fx.Node) -> Linear | None:
        module = self.module(node)
        if module is not None:
            if not is_projection(module) or not node.args:
                return None
            in_features, out_features = features(module)
            return Linear(
                node,
                node.args[0],
                out_features,
                in_features,
                module=module,
                nodes=(node,),
                transposed=is_conv1d(module),
            )
        name = op_name(node)
        if name == "linear":
            x, weight, bias = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
            w = self.tensor(weight)
            if not isinstance(x, fx.Node) or w is None or w.dim() != 2:
                return None
            return Linear(node, x, w.shape[0], w.shape[1], weight=weight, bias=bias, nodes=(node,))
        return self._aten_linear(node)

    def _aten_linear(self, node: fx.Node) -> Linear | None:
        # Post-grad form: view(mm(view(x, [M, K]), permute(W, [1, 0])), [..., N]), addmm with a bias; a
        # weight stored [in, out] (Conv1D) enters mm / addmm as it is, in dynamo's graphs and aten's alike.
        outer = node
        inner = node.args[0] if op_name(node) in _VIEW and isinstance(node.args[0], fx.Node) else node
        name = op_name(inner)
        if name == "mm":
            bias, a, bt = None, inner.args[0], inner.args[1]
        elif name == "addmm" and inner.kwargs.get("beta", 1) == 1 and inner.kwargs.get("alpha", 1) == 1:
            bias, a, bt = inner.args[:3]
        else:
            return None
        if not isinstance(bt, fx.Node) or not isinstance(a, fx.Node):
            return None
        if outer is inner and len(inner.users) == 1 and op_name(next(iter(inner.users))) in _VIEW:
            return None  # the view of this mm back to [..., N] is the linear's output
        transposed = not (op_name(bt) == "t" or (op_name(bt) == "permute" and list(bt.args[1]) == [1, 0]))
        weight = bt if transposed else bt.args[0]
        w = self.tensor(weight)
        if w is None or w.dim() != 2 or weight.op not in ("placeholder", "get_attr"):
            return None
        x, nodes = a, [inner]
        if op_name(a) in _VIEW:
            x = a.args[0]
            if len(a.users) == 1:  # a view shared by gate and up is x's, not this linear's
                nodes.append(a)
        if outer is not inner:
            nodes.append(outer)
        out_features, in_features = w.shape[::-1] if transposed else w.shape
        return Linear(
            outer, x, out_features, in_features, weight=weight, bias=bias, nodes=tuple(nodes), transposed=transposed
        )

    def weight_problems(self, linear: Linear, role: str) -> list[str]:
        """Weights must be parameters (or graph inputs) of a supported dtype, the linear exact."""
        if linear.module is not None:
            module = linear.module
            if not native_forward(module):
                return [f"{role} linear is a {type(module).__name__} with its own forward, not a plain nn.Linear"]
            problems = call_problems(module, f"{role} linear")
            if problems:
                return problems
            for kind in ("weight", "bias"):
                if kind in module.__dict__ or not isinstance(getattr(module, kind), (nn.Parameter, type(None))):
                    return [f"{role} {kind} is a plain tensor attribute, not a parameter"]
            tensors = [("weight", module.weight), ("bias", module.bias)]
        else:
            tensors = [("weight", linear.weight), ("bias", linear.bias)]
            resolved = []
            for kind, ref in tensors:
                if ref is None:
                    continue
                if not isinstance(ref, fx.Node) or ref.op not in ("placeholder", "get_attr"):
                    return [f"{role} {kind} is computed in the graph, not a parameter"]
                value = self.tensor(ref)
                if ref in self.values and not isinstance(value, nn.Parameter):
                    return [f"{role} {kind} is an input tensor, not a parameter"]
                resolved.append((kind, value))
            tensors = resolved
        for kind, tensor in tensors:
            if tensor is None:
                continue
            if not isinstance(tensor, torch.Tensor):
                return [f"{role} {kind} is not a tensor"]
            if tensor.dtype not in SUPPORTED_DTYPES:
                return [f"{role} {kind} has dtype {tensor.dtype}; twell supports float32, float16 and bfloat16"]
        return []


def call_problems(module: nn.Module, what: str) -> list[str]:
    """A module whose call runs more than its class's forward, which the rewritten FFN would skip."""
    if "forward" in module.__dict__:
        return [f"{what}'s forward is replaced on the instance (e.g. by offloading hooks)"]
    # a tensor-parallel linear's hooks (its style's input and output layouts) run around the op
    if (module._forward_hooks or module._forward_pre_hooks) and not tensor_parallel_linear(module):
        return [f"{what} has forward hooks, which the rewritten FFN would not run"]
    return []


def _transparent(node: fx.Node, dialect: Dialect) -> tuple[bool, bool]:
    """(is an identity in this graph, is a dropout: an identity in eval mode only)."""
    module = dialect.module(node)
    if module is not None:
        if isinstance(module, nn.modules.dropout._DropoutNd):
            return True, module.p > 0
        return isinstance(module, nn.Identity), False
    name = op_name(node)
    if name in _DROPOUT:
        # Traced in eval mode (training=False was a constant then); the forward may pass training=True later.
        training = arg(node, 2, "training", True)
        p = arg(node, 1, "p", 0.5)
        return training is False or p == 0, p != 0
    return name in _IDENTITY or (name == "contiguous" and len(node.args) == 1), False


def skip_identities(node, dialect: Dialect) -> tuple[fx.Node, list[fx.Node], list[fx.Node]]:
    """Walk back through identities and eval dropouts: (source, skipped nodes, train-mode dropouts)."""
    skipped, dropouts = [], []
    while isinstance(node, fx.Node) and node.op in ("call_module", "call_function", "call_method") and node.args:
        identity, is_dropout = _transparent(node, dialect)
        if not identity or not isinstance(node.args[0], fx.Node):
            break
        skipped.append(node)
        if is_dropout:
            dropouts.append(node)
        node = node.args[0]
    return node, skipped, dropouts


def _last_dim(node: fx.Node, dim, dialect: Dialect) -> bool:
    rank = dialect.rank(node)
    return dim == -1 or (rank is not None and dim == rank - 1)


def _split_rows(total: int, name: str, spec) -> list[slice] | None:
    """Row ranges of chunk(n) / split(size) / split([sizes]) over `total` output features."""
    if name == "chunk":
        if not isinstance(spec, int) or spec <= 0:
            return None
        size = -(-total // spec)
        sizes = [min(size, total - i) for i in range(0, total, size)]
    elif isinstance(spec, int):
        sizes = [min(spec, total - i) for i in range(0, total, spec)] if spec > 0 else None
    elif isinstance(spec, (list, tuple)) and all(isinstance(s, int) for s in spec) and sum(spec) == total:
        sizes = list(spec)
    else:
        return None
    if not sizes:
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [slice(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def projection(node, dialect: Dialect) -> Projection | None:
    """A linear output, or a last-dim slice of one (chunk, split, x[..., a:b], narrow, aten slice)."""
    if not isinstance(node, fx.Node):
        return None
    linear = dialect.linear(node)
    if linear is not None:
        return Projection(linear, None, ())
    name = op_name(node)
    if name == "getitem":
        source, index = node.args
        if not isinstance(source, fx.Node):
            return None
        split_name = op_name(source)
        if split_name in ("chunk", "split", "split_with_sizes") and isinstance(index, int):
            linear = dialect.linear(source.args[0]) if isinstance(source.args[0], fx.Node) else None
            spec = source.args[1] if len(source.args) > 1 else None
            spec = next((source.kwargs[k] for k in _SPLIT_KEYS if k in source.kwargs), spec)
            if linear is None or not _last_dim(source.args[0], arg(source, 2, "dim", 0), dialect):
                return None
            rows = _split_rows(linear.out_features, "chunk" if split_name == "chunk" else "split", spec)
            if rows is None or not -len(rows) <= index < len(rows):
                return None
            return Projection(linear, rows[index], (source, node))
        linear = dialect.linear(source)
        if linear is None:
            return None
        if isinstance(index, tuple) and index and isinstance(index[-1], slice):
            leading = index[:-1]
            if all(i is Ellipsis or i == slice(None) for i in leading) and (
                Ellipsis in leading or len(leading) + 1 == dialect.rank(source)
            ):
                return _sliced(linear, index[-1], (node,))
        return None
    if name == "slice" and isinstance(node.args[0], fx.Node):
        linear = dialect.linear(node.args[0])
        if linear is None or not _last_dim(node.args[0], arg(node, 1, "dim", 0), dialect):
            return None
        return _sliced(linear, slice(arg(node, 2, "start"), arg(node, 3, "end"), arg(node, 4, "step", 1)), (node,))
    if name == "narrow" and isinstance(node.args[0], fx.Node):
        linear = dialect.linear(node.args[0])
        dim, start, length = arg(node, 1, "dim"), arg(node, 2, "start"), arg(node, 3, "length")
        if linear is None or not _last_dim(node.args[0], dim, dialect) or not isinstance(start, int):
            return None
        if not isinstance(length, int):
            return None
        return _sliced(linear, slice(start, start + length), (node,))
    return None


def _sliced(linear: Linear, index: slice, nodes) -> Projection | None:
    if not all(isinstance(v, int) or v is None for v in (index.start, index.stop, index.step)):
        return None
    start, stop, step = index.indices(linear.out_features)
    if step != 1 or stop <= start:
        return None
    return Projection(linear, slice(start, stop), tuple(nodes))


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _strip_converts(node) -> tuple[object, list[fx.Node]]:
    nodes = []
    while isinstance(node, fx.Node) and op_name(node) in _CONVERT and node.args:
        nodes.append(node)
        node = node.args[0]
    return node, nodes


def _relu_like(node: fx.Node, dialect: Dialect) -> Activation | None:
    """relu(P) or a thresholded relu of P, for P a projection."""
    module = dialect.module(node)
    name = op_name(node)
    if module is not None:
        if isinstance(module, nn.ReLU) and type(module).forward is nn.ReLU.forward:
            p = projection(node.args[0], dialect)
            return Activation("relu", p, (node,)) if p else None
        if isinstance(module, nn.Threshold) and type(module).forward is nn.Threshold.forward and module.value == 0:
            p = projection(node.args[0], dialect)
            return Activation("fatrelu", p, (node,), threshold=float(module.threshold)) if p else None
        return None
    if name in _RELU or (name in ("clamp_min", "clamp") and _number(arg(node, 1, "min")) == 0.0):
        if name == "clamp" and arg(node, 2, "max") is not None:
            return None
        p = projection(node.args[0], dialect)
        return Activation("relu", p, (node,)) if p else None
    if name == "threshold" and _number(arg(node, 2, "value")) == 0.0 and _number(arg(node, 1, "threshold")) is not None:
        p = projection(node.args[0], dialect)
        return Activation("fatrelu", p, (node,), threshold=_number(arg(node, 1, "threshold"))) if p else None
    if name in _MUL and len(node.args) == 2:
        # v * (v > t)
        for v, mask in (node.args, node.args[::-1]):
            mask, converts = _strip_converts(mask)
            t = _comparison(mask, v)
            if t is not None:
                p = projection(v, dialect)
                return Activation("fatrelu", p, (node, mask, *converts), threshold=t) if p else None
        return None
    if name in _WHERE and len(node.args) == 3:
        cond, keep, other = node.args
        t = _comparison(cond, keep)
        if t is not None and _number(other) == 0.0:
            p = projection(keep, dialect)
            return Activation("fatrelu", p, (node, cond), threshold=t) if p else None
    return None


def _comparison(mask, v) -> float | None:
    """t if mask is (v > t) or (t < v)."""
    if not isinstance(mask, fx.Node) or len(mask.args) != 2:
        return None
    name = op_name(mask)
    if name == "gt" and mask.args[0] is v:
        return _number(mask.args[1])
    if name == "lt" and mask.args[1] is v:
        return _number(mask.args[0])
    return None


def activation(node, dialect: Dialect) -> Activation | None:
    """The activation whose output is `node`, applied to a projection; None if `node` is not one."""
    if not isinstance(node, fx.Node):
        return None
    name = op_name(node)
    inner = None
    if name in _SQUARE:
        inner = node.args[0]
    elif name in _POW and _number(arg(node, 1, "exponent")) == 2.0:
        inner = node.args[0]
    elif name in _MUL and len(node.args) == 2 and node.args[0] is node.args[1]:
        inner = node.args[0]
    if isinstance(inner, fx.Node):
        base = _relu_like(inner, dialect)
        if base is not None:
            base.nodes = (node, *base.nodes)
            base.squared = True
            base.name = "relu2" if base.name == "relu" else base.name
            return base
    found = _relu_like(node, dialect)
    if found is not None:
        return found
    return _other_function(node, dialect)


def _other_function(node: fx.Node, dialect: Dialect) -> Activation | None:
    """Any unary function of one projection (silu, gelu, a multi-node gelu_new, ...), named for the report."""
    if projection(node, dialect) is not None:
        return None  # a bare projection (or a slice of one) has no activation
    found: Projection | None = None
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        p = projection(current, dialect) if current is not node else None
        if p is not None:
            if found is not None and (found.linear.node is not p.linear.node or found.rows != p.rows):
                return None  # a function of two projections is not an activation
            found = p
            continue
        if current.op not in ("call_function", "call_method", "call_module") or len(seen) >= _MAX_ACTIVATION_NODES:
            return None
        module = dialect.module(current)
        if module is not None and (any(True for _ in module.parameters()) or is_projection(module)):
            return None
        seen.add(current)
        stack.extend(a for a in current.all_input_nodes)
    if found is None or not seen:
        return None
    return Activation(_function_name(node, seen, dialect), found, tuple(seen))


def _function_name(node: fx.Node, nodes: set[fx.Node], dialect: Dialect) -> str:
    if len(nodes) == 1:
        module = dialect.module(node)
        if module is not None:
            return type(module).__name__.lower()
        name = op_name(node) or getattr(node.target, "__name__", str(node.target))
        if name == "gelu" and arg(node, 1, "approximate") == "tanh":
            return "gelu_tanh"
        return name
    # Several nodes: the activation module they were traced from (e.g. NewGELUActivation), if recorded.
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "custom"
    owner = list(stack.values())[-1][1]  # (path, class) or, in some torch versions, (path, "module.Class")
    return owner.__name__ if isinstance(owner, type) else str(owner).rsplit(".", 1)[-1]


def _is_mul(node) -> bool:
    return isinstance(node, fx.Node) and op_name(node) in _MUL and len(node.args) == 2 and not node.kwargs


def match_at(down: Linear, dialect: Dialect) -> FFNMatch | None:
    """The FFN whose down projection is `down`, or None."""
    hidden, skipped, dropouts = skip_identities(down.input, dialect)
    if _is_mul(hidden):
        gated = _gated(down, hidden, skipped, dropouts, dialect)
        if gated is not None:
            return gated
    act = activation(hidden, dialect)  # a product may also be a plain FFN's activation (gelu_new)
    if act is None or act.projection.rows is not None:
        return None
    up = act.projection
    if up.linear.out_features != down.in_features or up.linear.in_features != down.out_features:
        return None
    nodes = {*up.linear.nodes, *act.nodes, *skipped, *down.nodes} - {down.node}
    return FFNMatch("plain", up.linear.input, up, None, down, act, None, frozenset(nodes), tuple(dropouts))


def _gated(down: Linear, mul: fx.Node, skipped, dropouts, dialect: Dialect) -> FFNMatch | None:
    options = []
    for left, right in (mul.args, mul.args[::-1]):
        g, g_skipped, g_drop = skip_identities(left, dialect)
        u, u_skipped, u_drop = skip_identities(right, dialect)
        gate_act = activation(g, dialect)
        if gate_act is None:
            continue
        up = projection(u, dialect)
        up_act = None
        if up is None:
            up_act = activation(u, dialect)
            if up_act is None:
                continue
            up = up_act.projection
        # Prefer: a bare up projection; then a sparse gate; then the thresholded side as the gate.
        rank = (up_act is not None, not gate_act.sparse, gate_act.threshold == 0.0)
        options.append((rank, gate_act, up_act, up, g_skipped + u_skipped, g_drop + u_drop))
    if options:
        _, gate_act, up_act, up, more_skipped, more_drop = min(options, key=lambda o: o[0])
        gate = gate_act.projection
    else:
        gate, up = projection(mul.args[0], dialect), projection(mul.args[1], dialect)
        if gate is None or up is None:
            return None
        gate_act = up_act = None
        more_skipped, more_drop = [], []
    if not _same_input(gate, up) or gate.size != up.size:
        return None
    if gate.size != down.in_features or gate.linear.in_features != down.out_features:
        return None
    nodes = {*gate.linear.nodes, *gate.nodes, *up.linear.nodes, *up.nodes, mul, *skipped, *more_skipped}
    for act in (gate_act, up_act):
        if act is not None:
            nodes.update(act.nodes)
    nodes.update(down.nodes)
    nodes.discard(down.node)
    return FFNMatch(
        "gated", gate.linear.input, gate, up, down, gate_act, up_act, frozenset(nodes), tuple(dropouts + more_drop)
    )


def _same_input(gate: Projection, up: Projection) -> bool:
    if gate.linear.node is up.linear.node:  # one fused linear: two disjoint slices
        if gate.rows is None or up.rows is None:
            return False
        return gate.rows.stop <= up.rows.start or up.rows.stop <= gate.rows.start
    return gate.linear.input is up.linear.input and gate.rows is None and up.rows is None


def activation_problems(match: FFNMatch) -> list[str]:
    act, up_act = match.activation, match.up_activation
    if act is None:
        return [f"gated FFN without an activation is not sparse; {REMEDY}"]
    if act.name == "relu6":
        return ["activation relu6 is sparse, but twell's ops do not clip the activation at 6"]
    if not act.sparse:
        return [f"activation {act.name} is not sparse; {REMEDY}"]
    if match.kind == "gated" and act.squared:
        return ["relu² on the gate of a gated FFN is not supported by twell.ops.gated_ffn"]
    if up_act is not None and not (up_act.name == "relu" and not up_act.squared):
        return [f"activation {up_act.name} on the up projection is not supported (dReLU needs relu there)"]
    return []


def check(matches: list[FFNMatch], graph: fx.Graph, dialect: Dialect) -> list[FFNMatch]:
    """Fill each match's `problems`: activation (its modules run nothing but their forward), weights,
    and that the hidden activation feeds only the down projection (no node of the block is used outside it)."""
    import networkx as nx

    uses = nx.DiGraph()
    uses.add_nodes_from(graph.nodes)
    uses.add_edges_from((node, user) for node in graph.nodes for user in node.users)
    claimed: dict[fx.Node, FFNMatch] = {}
    for match in matches:
        match.problems.extend(activation_problems(match))
        for act in (match.activation, match.up_activation):
            for node in act.nodes if act is not None else ():
                module = dialect.module(node)
                if module is not None:
                    match.problems.extend(call_problems(module, f"activation {node.target}"))
        roles = [("gate", match.gate.linear), ("down", match.down)]
        if match.up is not None and match.up.linear is not match.gate.linear:
            roles.insert(1, ("up", match.up.linear))
        for role, linear in roles:
            match.problems.extend(dialect.weight_problems(linear, role))
        weights = [_weight(linear, dialect) for _, linear in roles]
        dtypes = {w.dtype for w in weights if w is not None}
        devices = {w.device for w in weights if w is not None}
        if len(dtypes) > 1:
            match.problems.append(f"projections have different dtypes {sorted(map(str, dtypes))}")
        if len(devices) > 1:
            match.problems.append(f"projections are on different devices {sorted(map(str, devices))}")
        escaping = nx.node_boundary(uses, match.nodes) - {match.down.node}
        if escaping:
            names = ", ".join(sorted(n.name for n in escaping))
            match.problems.append(f"the hidden activation is also used outside the FFN (by {names})")
        for node in match.nodes | {match.down.node}:
            if node in claimed:
                match.problems.append(f"overlaps the FFN at {claimed[node].down.node.name}")
                break
            claimed[node] = match
    return matches


def _weight(linear: Linear, dialect: Dialect) -> torch.Tensor | None:
    if linear.module is not None:
        return linear.module.weight
    return dialect.tensor(linear.weight)


def find_matches(graph: fx.Graph, dialect: Dialect) -> list[FFNMatch]:
    """Every FFN of `graph`, checked (see `check`), in graph order."""
    matches = []
    for node in graph.nodes:
        down = dialect.linear(node)
        if down is None:
            continue
        match = match_at(down, dialect)
        if match is not None:
            matches.append(match)
    return check(matches, graph, dialect)


__all__ = [
    "Activation",
    "Dialect",
    "FFNMatch",
    "Linear",
    "Projection",
    "activation",
    "call_problems",
    "find_matches",
    "match_at",
    "op_name",
    "projection",
    "skip_identities",
]
