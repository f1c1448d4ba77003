"""The modules sparsify() swaps in. They call twell.ops (never kernels) and own no new tensors: each
registers the very Parameter and buffer objects of what it replaces under the same names, so the model's
state_dict keeps its keys, shapes and storage, and restore() puts the originals back.

Two ways to stand in for an FFN:
- SparseFFN replaces a module whose forward is exactly the FFN (LlamaMLP, Phi3MLP, GPTNeoXMLP, a
  hand-written nn.Sequential ...).
- For an FFN written inline in a bigger forward (OPT's decoder layer: fc1 -> activation_fn -> fc2),
  the layer keeps its own forward and its children are swapped: the gate linear by GatePassthrough
  (returns x), the activation module(s) by ActivationPassthrough (returns its input), a gated FFN's up
  linear by UpUnit (returns 1, so act(gate) * up is x again) and the down linear by InlineFFN, which
  computes the whole FFN from x. While forward hooks are registered on any of them (or on the modules
  they replace), each computes what its original does instead. An FFN split across two modules (BERT's
  intermediate and output) is rewritten the same way, across both.

SparseFFN and InlineFFN own their layer's twell.kernels.policy.LayerConfig (`layer_config`: the route
limits and TwELL layout the op is called with; sparsify sets it from the layer's calibration decision).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twell import distributed, ops
from twell.kernels import reference
from twell.kernels.policy import DEFAULT, LayerConfig
from twell.passes.projections import features, is_conv1d, linear_weight, native_forward


@dataclass(frozen=True)
class FFNSpec:
    """How to call the op: which children hold the projections, and the activation's parameters.

    gate / up / down: child names of the linears (gate of a plain FFN: its up linear);
    gate_rows / up_rows: output-feature rows of a fused gate_up linear; dropout: eval-only steps
    inside the FFN (in training mode SparseFFN runs the original forward); input_name: name of the
    original forward's input (for callers passing it by keyword).
    """

    kind: str
    gate: str
    up: str | None
    down: str
    gate_rows: slice | None = None
    up_rows: slice | None = None
    threshold: float = 0.0
    drelu: bool = False
    squared: bool = False
    dropout: bool = False
    input_name: str = "x"


def store_down_rows(weight: torch.Tensor) -> bool:
    """Re-lay a down projection's weight [K, N] (or a stack of them, [E, K, N]: one per expert) in place
    so that weight.t() ([N, K], one row per hidden neuron) is contiguous: the kernels gather whole rows
    of it for the active neurons, and a copy per call would cost more than the whole sparse FFN at
    decode sizes. Same tensor object, shape and values; only the strides change (.to()/.half() keep
    them). Returns whether it re-laid the weight. A row-wise tensor-parallel shard is re-laid in place
    (twell.distributed.store_local_rows); in a program whose process group is initialised, a plain
    [K, N] weight is not, so that fully_shard (which takes contiguous parameters only) can follow
    sparsify: sharded, its calls get twell.distributed.rows_for_call's copy."""
    if distributed.is_dtensor(weight):
        return distributed.store_local_rows(weight)
    if weight.dim() == 2 and distributed.process_group_initialised():
        return False
    if type(weight.data) is not torch.Tensor or weight.dim() < 2 or weight.transpose(-2, -1).is_contiguous():
        return False
    with torch.no_grad():
        weight.data = weight.data.transpose(-2, -1).contiguous().transpose(-2, -1)
    return True


def store_contiguous(weight: torch.Tensor) -> None:
    """Undo store_down_rows: the nn.Linear layout again (restore leaves the model as it was)."""
    if distributed.is_dtensor(weight):
        distributed.store_local_contiguous(weight)
    elif not weight.is_contiguous():
        with torch.no_grad():
            weight.data = weight.data.contiguous()


def _rows(linear: nn.Module, rows: slice | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight, bias = linear_weight(linear), linear.bias
    if rows is None:
        return weight, bias
    # Row slices of a [2N, K] weight are contiguous views: no copy of the fused weight.
    return weight[rows], None if bias is None else bias[rows]


@dataclass(frozen=True)
class FFNWeights:
    """An FFN's tensors in nn.Linear layouts (gate/up [N, K], down [K, N]); a plain FFN's up is None
    and its gate is its up projection."""

    gate: torch.Tensor
    gate_bias: torch.Tensor | None
    up: torch.Tensor | None
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None

    def map(self, fn) -> FFNWeights:
        """fn applied to every tensor present (e.g. a DTensor's to_local)."""
        tensors = (getattr(self, f.name) for f in dataclasses.fields(self))  # astuple would copy them
        return FFNWeights(*(None if t is None else fn(t) for t in tensors))


def ffn_weights(spec: FFNSpec, gate: nn.Module, up: nn.Module | None, down: nn.Module) -> FFNWeights:
    """The FFN's weights through the projections' own accessors (linear_weight: a Conv1D's as a
    transposed view), the rows of a fused gate_up linear as views."""
    gate_weight, gate_bias = _rows(gate, spec.gate_rows)
    up_weight, up_bias = (None, None) if spec.kind == "plain" else _rows(up, spec.up_rows)
    return FFNWeights(gate_weight, gate_bias, up_weight, up_bias, linear_weight(down), down.bias)


def hidden_activation(spec: FFNSpec, weights: FFNWeights, x: torch.Tensor) -> torch.Tensor:
    """h [..., N], the down projection's input, from x [..., K]: the one computation of it (the ops'
    reference), in plain torch ops so F.linear follows autocast as the original projections do."""
    return reference.hidden(
        x, weights.gate, weights.up, weights.gate_bias, weights.up_bias, spec.threshold, spec.drelu, spec.squared
    )


def call_op(spec: FFNSpec, weights: FFNWeights, x: torch.Tensor, config: LayerConfig, return_l1=False):
    """twell.ops.(gated_)ffn of `spec` on x [..., K] with `weights` and the layer's `config`."""
    weights = distributed.rows_for_call(weights, x, config)
    shared = {"down_bias": weights.down_bias, "threshold": spec.threshold, "return_l1": return_l1, "config": config}
    if spec.kind == "plain":
        return ops.ffn(x, weights.gate, weights.down, up_bias=weights.gate_bias, squared=spec.squared, **shared)
    biases = {"gate_bias": weights.gate_bias, "up_bias": weights.up_bias}
    return ops.gated_ffn(x, weights.gate, weights.up, weights.down, **biases, drelu=spec.drelu, **shared)


def run_ffn(
    spec: FFNSpec,
    gate: nn.Module,
    up: nn.Module | None,
    down: nn.Module,
    x: torch.Tensor,
    config: LayerConfig,
    return_l1=False,
):
    """The FFN of `spec` on x [..., K] through twell.ops with the layer's `config`; gate/up/down are
    projections (nn.Linear or Conv1D) with bias. return_l1: (y, l1, density) as twell.ops returns."""
    return call_op(spec, ffn_weights(spec, gate, up, down), x, config, return_l1)


# nn.Module's attributes that hold forward hooks: a module with any runs more than its forward
FORWARD_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


def dense_ffn(spec: FFNSpec, gate: nn.Module, up: nn.Module | None, down: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """run_ffn's function in plain torch ops, for calls the op cannot take (autocast, mixed dtypes):
    F.linear follows autocast as the original linears did."""
    weights = ffn_weights(spec, gate, up, down)
    return F.linear(hidden_activation(spec, weights, x), weights.down, weights.down_bias)


def _plain_linear(m: nn.Module) -> bool:
    """A projection whose call is exactly its linear map: no subclass forward, instance forward or hooks."""
    return native_forward(m) and "forward" not in m.__dict__ and not any(getattr(m, hooks) for hooks in FORWARD_HOOKS)


def _op_dtype(x: torch.Tensor, linear: nn.Module) -> bool:
    """The op computes in x's dtype: only valid when the weights share it and autocast is off."""
    return x.dtype == linear.weight.dtype and not torch.is_autocast_enabled(x.device.type)


class StandIn(nn.Module):
    """Holds the original's parameters, buffers and children (same objects, same names)."""

    def __init__(self, original: nn.Module, *, children: bool):
        super().__init__()
        if children:
            for name, child in original.named_children():
                self.add_module(name, child)
        for name, param in original._parameters.items():
            self.register_parameter(name, param)
        for name, buffer in original._buffers.items():
            self.register_buffer(name, buffer, persistent=name not in original._non_persistent_buffers_set)
        self.training = original.training
        # Plain attribute, not a submodule: its tensors are registered here already.
        self.__dict__["original"] = original

    def sync_original(self) -> nn.Module:
        """The original module, with what was replaced here since (tensors by .to()/.half(), children
        by adapters) carried over."""
        original = self.__dict__["original"]
        original._parameters.update(self._parameters)
        original._buffers.update(self._buffers)
        original._modules.update(self._modules)
        original.training = self.training
        return original


class SparseFFN(StandIn):
    """Replaces a module whose forward is exactly an FFN; y = twell.ops.(gated_)ffn(x), x [..., K].

    The original's forward hooks stay attached (the hook dicts are shared): they see the same inputs
    and outputs as before. twell.train's L1 probe, a forward pre-hook, hands itself to the call
    (reports_l1): the op's run then gives it the L1 term from the sparse forward's record (recomputing
    h only where the op runs dense), and a call that runs the original forward has the probe recompute.
    """

    reports_l1 = True
    l1_probe = None  # twell.train's probe for the coming call (SparseFFN takes its L1 term from the op)

    def __init__(self, original: nn.Module, spec: FFNSpec, config: LayerConfig = DEFAULT):
        super().__init__(original, children=True)
        self.spec = spec
        self.layer_config = config
        for hooks in FORWARD_HOOKS:
            setattr(self, hooks, getattr(original, hooks))

    def forward(self, *args, **kwargs):
        spec = self.spec
        if len(args) == 1 and not kwargs:
            x = args[0]
        elif not args and list(kwargs) == [spec.input_name]:
            x = kwargs[spec.input_name]
        else:
            x = None
        # set by twell.train's pre-hook for this call; plain attribute reads and writes (torch 2.11's
        # dynamo cannot trace __dict__.pop)
        probe = self.l1_probe
        if probe is not None:
            self.l1_probe = None
        gate, down = getattr(self, spec.gate), getattr(self, spec.down)
        up = getattr(self, spec.up) if spec.up is not None else None
        # Calls the ops cannot express run the original forward: extra arguments (another code path
        # than the one matched), dropout in training mode, linears replaced, hooked or given an
        # instance forward since (LoRA adapters, offloading hooks), autocast or mixed dtypes. Its
        # forward, not its __call__: the hooks (shared) have run for this call already. Linears sharded
        # by tensor parallelism run the op on this rank's neurons, their hooks around it.
        parallel = distributed.tensor_parallel(spec, gate, up, down)
        exact = parallel or all(_plain_linear(m) for m in (gate, up, down) if m is not None)
        op = not (x is None or (spec.dropout and self.training) or not exact or not _op_dtype(x, gate))
        if probe is not None and (not op or parallel):
            probe.recompute(self, args, kwargs)
        if not op:
            return self.sync_original().forward(*args, **kwargs)
        if parallel:
            return distributed.run_tensor_parallel(spec, gate, up, down, x, self.layer_config)
        if probe is None:
            return run_ffn(spec, gate, up, down, x, self.layer_config)
        y, l1, density = run_ffn(spec, gate, up, down, x, self.layer_config, return_l1=True)
        probe.record(l1, density)
        return y

    def extra_repr(self) -> str:
        return f"twell {self.spec.kind}, threshold={self.spec.threshold}, drelu={self.spec.drelu}"


class _InlineMember(StandIn):
    """One of the modules standing in for an inline FFN's children. It shares its forward hooks with the
    module it replaces (hooks registered on either object land in the same dicts), and while any module
    of its group (the FFN's members, and the halves of a split FFN) has hooks, every member computes what
    its original computes, so each hook sees the inputs and outputs it would see without twell."""

    def __init__(self, original: nn.Module, group: list[_InlineMember], *, children: bool = False):
        super().__init__(original, children=children)
        for hooks in FORWARD_HOOKS:
            setattr(self, hooks, getattr(original, hooks))
        # Not submodules: the layer owns each member under its own name.
        self.__dict__["group"] = group
        group.append(self)

    def hooked(self) -> bool:
        return any(getattr(member, hooks) for member in self.__dict__["group"] for hooks in FORWARD_HOOKS)

    def as_original(self, x: torch.Tensor) -> torch.Tensor:
        # Its forward, not its __call__: this module's (shared) hooks run around this call already.
        return self.sync_original().forward(x)


class _ProjectionMember(_InlineMember):
    def __init__(self, linear: nn.Module, group: list[_InlineMember]):
        super().__init__(linear, group)
        self.in_features, self.out_features = features(linear)
        self.weight_transposed = is_conv1d(linear)


class GatePassthrough(_ProjectionMember):
    """Inline FFN: in place of the gate (plain: up) linear; returns its input x unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.as_original(x) if self.hooked() else x


class UpUnit(_ProjectionMember):
    """Inline gated FFN: in place of the up linear; returns 1, so the layer's act(gate) * up is x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.as_original(x) if self.hooked() else x.new_ones(())


class ActivationPassthrough(_InlineMember):
    """Inline FFN: in place of the activation module; returns its input unchanged."""

    def __init__(self, activation: nn.Module, group: list[_InlineMember]):
        super().__init__(activation, group, children=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.as_original(x) if self.hooked() else x


class InlineFFN(_ProjectionMember):
    """Inline FFN: in place of the down linear; receives x and returns the whole FFN's output."""

    def __init__(
        self, linear: nn.Module, spec: FFNSpec, gate: GatePassthrough, up: UpUnit | None, group, config=DEFAULT
    ):
        super().__init__(linear, group)
        self.spec = spec
        self.layer_config = config
        self.__dict__["gate"] = gate
        self.__dict__["up"] = up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.as_original(x) if self.hooked() else self.whole_ffn(x)

    def whole_ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN from its input x [..., K]."""
        gate, up = self.__dict__["gate"], self.__dict__["up"]
        if not _op_dtype(x, gate):
            return dense_ffn(self.spec, gate, up, self, x)
        return run_ffn(self.spec, gate, up, self, x, self.layer_config)

    def extra_repr(self) -> str:
        return f"twell inline {self.spec.kind}, threshold={self.spec.threshold}, drelu={self.spec.drelu}"


TWELL_MODULES = (SparseFFN, GatePassthrough, UpUnit, ActivationPassthrough, InlineFFN)
