"""torch.ops.twell.*: the operator surface of the kernels, registered with torch.library (twell.ops is
the public Python API over them).

Each op has a fake implementation (torch.compile traces it with no graph break), a default
implementation in plain PyTorch (CPU and any device without Triton kernels) and a CUDA implementation
that dispatches to Triton (twell.kernels.dispatch, imported on first CUDA call, so importing twell
compiles nothing). twell.ops calls that CUDA implementation itself (same checks, same dispatcher) for
an eager call without autograd on plain tensors, saving the custom op's layers; everything else
(autograd, torch.compile, tensor subclasses, dispatch modes) goes through the op.

Route arguments: gated_ffn and ffn take the fields of the layer's twell.kernels.policy.LayerConfig
(tile_n ... neuron_groups, in LayerConfig.op_args' order, defaulting to its defaults): the CUDA dispatcher
routes by them; every implementation checks them, so a bad value fails the same on any device.

Training: twell::ffn_train (a forward that also returns the compact record of the hidden layer) and
twell::ffn_train_backward (every gradient from that record) are the sparse training path
(twell.kernels.backward); ffn_train's autograd calls ffn_train_backward, so torch.compile traces both
and activation checkpointing recomputes the forward. twell.ops routes a call there when
`sparse_training` says so (CUDA, gradients needed, the kernels' layout); otherwise autograd of
gated_ffn / ffn recomputes through the dense reference: exact, but no faster than dense.
"""

from __future__ import annotations

from typing import Optional

import torch

from twell.kernels import policy, reference
from twell.kernels.checks import FLOAT_DTYPES, check_gated, check_plain


def route_config(*route) -> policy.LayerConfig:
    """The LayerConfig of an op call's route arguments; ValueError naming the bad one. Concrete values
    are cached (the dispatcher asks on every call); symbolic ones (a compiled graph's) are checked
    uncached: they do not hash."""
    if all(isinstance(v, (int, float, bool, type(None))) for v in route):
        return policy.from_op_args(*route)
    return policy.op_config(*route)


_D = policy.DEFAULT


@torch.library.custom_op("twell::gated_ffn", mutates_args=())
def gated_ffn(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_bias: Optional[torch.Tensor],
    up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    threshold: float,
    drelu: bool,
    tile_n: int = _D.tile_n,
    slots: int = _D.slots,
    decode_max_m: int = _D.decode_max_m,
    decode_sparse_max_m: int = _D.decode_sparse_max_m,
    prefill_min_m: Optional[int] = _D.prefill_min_m,
    dense_above: Optional[float] = _D.dense_above,
    fused_gate: bool = _D.fused_gate,
    hot_rate: Optional[float] = _D.hot_rate,
    prefill_min_m_captured: Optional[int] = _D.prefill_min_m_captured,
    neuron_groups: int = _D.neuron_groups,
) -> torch.Tensor:
    check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold)
    route_config(
        tile_n,
        slots,
        decode_max_m,
        decode_sparse_max_m,
        prefill_min_m,
        dense_above,
        fused_gate,
        hot_rate,
        prefill_min_m_captured,
        neuron_groups,
    )
    return reference.gated_ffn_reference(
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu
    )


@gated_ffn.register_fake
def _(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu, *route):
    check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold)
    route_config(*route)
    return x.new_empty(x.shape)


@gated_ffn.register_kernel("cuda")
def _(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu, *route):
    from twell.kernels import dispatch

    check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold)
    config = route_config(*route)
    return dispatch.gated_ffn_cuda(
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu, config
    )


@torch.library.custom_op("twell::ffn", mutates_args=())
def ffn(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    threshold: float,
    squared: bool,
    tile_n: int = _D.tile_n,
    slots: int = _D.slots,
    decode_max_m: int = _D.decode_max_m,
    decode_sparse_max_m: int = _D.decode_sparse_max_m,
    prefill_min_m: Optional[int] = _D.prefill_min_m,
    dense_above: Optional[float] = _D.dense_above,
    fused_gate: bool = _D.fused_gate,
    hot_rate: Optional[float] = _D.hot_rate,
    prefill_min_m_captured: Optional[int] = _D.prefill_min_m_captured,
    neuron_groups: int = _D.neuron_groups,
) -> torch.Tensor:
    check_plain(x, up_weight, down_weight, up_bias, down_bias, threshold)
    route_config(
        tile_n,
        slots,
        decode_max_m,
        decode_sparse_max_m,
        prefill_min_m,
        dense_above,
        fused_gate,
        hot_rate,
        prefill_min_m_captured,
        neuron_groups,
    )
    return reference.ffn_reference(x, up_weight, down_weight, up_bias, down_bias, threshold, squared)


@ffn.register_fake
def _(x, up_weight, down_weight, up_bias, down_bias, threshold, squared, *route):
    check_plain(x, up_weight, down_weight, up_bias, down_bias, threshold)
    route_config(*route)
    return x.new_empty(x.shape)


@ffn.register_kernel("cuda")
def _(x, up_weight, down_weight, up_bias, down_bias, threshold, squared, *route):
    from twell.kernels import dispatch

    check_plain(x, up_weight, down_weight, up_bias, down_bias, threshold)
    return dispatch.ffn_cuda(x, up_weight, down_weight, up_bias, down_bias, threshold, squared, route_config(*route))


def _dense_backward(reference_fn, n_tensors: int, n_scalars: int):
    """Autograd through the dense reference: recompute forward under autograd, pull grads back. The
    op's first n_scalars scalars are the reference's; the route arguments after them only route."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(t if isinstance(t, torch.Tensor) else None for t in inputs[:n_tensors]))
        ctx.scalars = inputs[n_tensors : n_tensors + n_scalars]
        ctx.route = len(inputs) - n_tensors - n_scalars

    def backward(ctx, grad):
        saved = ctx.saved_tensors
        leaves = [
            t.detach().requires_grad_(need) if t is not None else None
            for t, need in zip(saved, ctx.needs_input_grad[:n_tensors], strict=True)
        ]
        with torch.enable_grad():
            out = reference_fn(*leaves, *ctx.scalars)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        result = [next(grads) if t is not None and t.requires_grad else None for t in leaves]
        return (*result, *([None] * (len(ctx.scalars) + ctx.route)))

    return setup_context, backward


_setup, _backward = _dense_backward(reference.gated_ffn_reference, 7, 2)
gated_ffn.register_autograd(_backward, setup_context=_setup)
_setup, _backward = _dense_backward(reference.ffn_reference, 5, 2)
ffn.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("twell::ffn_train", mutates_args=())
def ffn_train(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: Optional[torch.Tensor],
    down_weight: torch.Tensor,
    gate_bias: Optional[torch.Tensor],
    up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    threshold: float,
    drelu: bool,
    squared: bool,
    width: int,
    entries: int = policy.TRAIN_ENTRIES_DEFAULT,
    dense_above: Optional[float] = policy.TRAIN_DENSE_ABOVE,
    hot: int = policy.TRAIN_HOT,
    forward_pack: bool = policy.TRAIN_FORWARD_PACK,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, torch.Tensor,
]:  # fmt: skip
    """(y, ids, gate, up, counts, hot_ids, hot_gate, hot_up, l1, nonzero): the FFN (gated with
    up_weight, else plain: gate_weight is its up projection, squared its relu²), the record backward
    reads (twell.kernels.backward; hot_*: the hot neurons' ids [hot] and their gate and up values
    [M, hot]), and sum |h| (fp32, differentiable: the L1 penalty's) and the count of nonzero h (int64)
    over its hidden activation h. entries: LayerConfig.train_entries (the row kernels' entries a step;
    the backward's too); dense_above: LayerConfig.train_dense_above (a layer measured denser trains
    dense); hot: LayerConfig.train_hot; forward_pack: LayerConfig.train_forward_pack. Triton kernels:
    CUDA, or CPU under TRITON_INTERPRET=1."""
    from twell.kernels import backward

    _check_train(
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, width, entries, dense_above,
        hot, forward_pack,
    )  # fmt: skip
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y, *record = backward.train_forward(
        x2, gate_weight, _unit(gate_bias), up_weight, _unit(up_bias), down_weight.t(), _unit(down_bias),
        threshold=threshold, drelu=drelu, square=squared, width=width, entries=entries, dense_above=dense_above,
        hot=hot, forward_pack=forward_pack,
    )  # fmt: skip
    return (y.reshape(x.shape), *record)


@ffn_train.register_fake
def _(
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu, squared, width, entries=1,
    dense_above=None, hot=0, forward_pack=False,
):  # fmt: skip
    _check_train(
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, width, entries, dense_above,
        hot, forward_pack,
    )  # fmt: skip
    m = x.numel() // x.shape[-1]
    ids = x.new_empty(m, width, dtype=torch.int32)
    up = x.new_empty(m, width if up_weight is not None else 0)
    counts = x.new_empty(m, dtype=torch.int32)
    hot_record = (
        x.new_empty(hot, dtype=torch.int64),
        x.new_empty(m, hot),
        x.new_empty(m, hot if up_weight is not None else 0),
    )
    l1, nonzero = x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.int64)
    return x.new_empty(x.shape), ids, x.new_empty(m, width), up, counts, *hot_record, l1, nonzero


@torch.library.custom_op("twell::ffn_train_backward", mutates_args=())
def ffn_train_backward(
    dy: torch.Tensor,
    l1_grad: torch.Tensor,
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: Optional[torch.Tensor],
    down_weight: torch.Tensor,
    gate_bias: Optional[torch.Tensor],
    up_bias: Optional[torch.Tensor],
    has_down_bias: bool,
    ids: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    counts: torch.Tensor,
    hot_ids: torch.Tensor,
    hot_gate: torch.Tensor,
    hot_up: torch.Tensor,
    threshold: float,
    drelu: bool,
    squared: bool,
    entries: int = policy.TRAIN_ENTRIES_DEFAULT,
    dense_above: Optional[float] = policy.TRAIN_DENSE_ABOVE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d gate_weight, d up_weight, d down_weight, d gate_bias, d up_bias, d down_bias) of ffn_train
    from its record (hot_*: its hot neurons'); l1_grad: the gradient of ffn_train's l1 (one-element
    fp32). Gradients of absent tensors are empty; d down_weight has down_weight's layout."""
    from twell.kernels import backward

    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    dy2 = dy.reshape(-1, k).contiguous()
    dx, dwg, dwu, dwd_t, dbg, dbu, dbd = backward.train_backward(
        dy2, l1_grad, x2, gate_weight, _unit(gate_bias), up_weight, _unit(up_bias), down_weight.t(), has_down_bias, ids,
        gate, up, counts, threshold=threshold, drelu=drelu, square=squared, entries=entries, dense_above=dense_above,
        hot=(hot_ids, hot_gate, hot_up),
    )  # fmt: skip
    return dx.reshape(x.shape), dwg, dwu, dwd_t.t(), dbg, dbu, dbd


@ffn_train_backward.register_fake
def _(dy, l1_grad, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, has_down_bias, *_):
    n, k = gate_weight.shape
    return (
        x.new_empty(x.shape),
        x.new_empty(n, k),
        x.new_empty((n, k) if up_weight is not None else (0,)),
        x.new_empty(n, k).t(),
        x.new_empty(n if gate_bias is not None else 0),
        x.new_empty(n if up_bias is not None else 0),
        x.new_empty(k if has_down_bias else 0),
    )


def _unit(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The kernels read biases with unit stride."""
    return bias.contiguous() if bias is not None else None


def _check_train(
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, width, entries, dense_above, hot,
    forward_pack,
) -> None:  # fmt: skip
    if up_weight is None:
        if up_bias is not None:
            raise ValueError("up_bias needs up_weight (a plain FFN has its bias as gate_bias)")
        check_plain(x, gate_weight, down_weight, gate_bias, down_bias, threshold)
    else:
        check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold)
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if entries not in policy.TRAIN_ENTRIES:
        raise ValueError(f"entries must be one of {policy.TRAIN_ENTRIES}, got {entries}")
    policy.check_train_dense_above(dense_above)
    # under torch.compile(dynamic=True) an int argument arrives as a symbol: its value is specialised
    # here (the hot outputs' shapes depend on it)
    policy.check_train_hot(int(hot) if isinstance(hot, torch.SymInt) else hot)
    if hot > gate_weight.shape[0]:
        raise ValueError(f"hot must be at most the {gate_weight.shape[0]} hidden neurons, got {hot}")


def _train_setup(ctx, inputs, output):
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu, squared, _, *tail = inputs
    _, ids, gate, up, counts, hot_ids, hot_gate, hot_up, _, nonzero = output
    ctx.mark_non_differentiable(ids, gate, up, counts, hot_ids, hot_gate, hot_up, nonzero)
    record = (ids, gate, up, counts, hot_ids, hot_gate, hot_up)
    ctx.save_for_backward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, *record)
    ctx.flags = (down_bias is not None, threshold, drelu, squared, *tail[:2])


def _train_backward(ctx, dy, _ids, _gate, _up, _counts, _hot_ids, _hot_gate, _hot_up, l1_grad, _nonzero):
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias, *record = ctx.saved_tensors
    has_down_bias, threshold, drelu, squared, entries, dense_above = ctx.flags
    dy = torch.zeros_like(x) if dy is None else dy
    l1_grad = x.new_zeros((), dtype=torch.float32) if l1_grad is None else l1_grad.float()
    grads = torch.ops.twell.ffn_train_backward(
        dy, l1_grad, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, has_down_bias, *record, threshold,
        drelu, squared, entries, dense_above,
    )  # fmt: skip
    present = (True, True, up_weight is not None, True, gate_bias is not None, up_bias is not None, has_down_bias)
    return (*(g if p else None for g, p in zip(grads, present, strict=True)), *[None] * 8)


ffn_train.register_autograd(_train_backward, setup_context=_train_setup)


def sparse_training(x, gate_weight, up_weight, down_weight, biases: tuple, train_min_m: int | None) -> bool:
    """Whether a call takes the sparse training path: autograd records it, on CUDA, in a dtype the
    kernels take, with weight rows contiguous along K and down_weight stored as sparsify stores it
    (down_weight.t() rows contiguous: a copy per call would cost more than the sparse backward saves),
    K <= policy.MAX_K, and at least train_min_m tokens (the layer's LayerConfig.train_min_m; None, the
    default: never). Malformed inputs go the checked way."""
    tensors = (x, gate_weight, up_weight, down_weight, *biases)
    if not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)):
        return False
    if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in FLOAT_DTYPES and x.dim() >= 1):
        return False
    if not (isinstance(down_weight, torch.Tensor) and down_weight.dim() == 2):
        return False
    rows = (gate_weight, down_weight.t()) if up_weight is None else (gate_weight, up_weight, down_weight.t())
    if not all(isinstance(w, torch.Tensor) and w.dim() == 2 and w.stride(1) == 1 for w in rows):
        return False
    k = x.shape[-1]
    return train_min_m is not None and 0 < k <= policy.MAX_K and x.numel() // k >= train_min_m
