"""torch.ops.twell.*: the operator surface of the kernels.

Each op has a fake implementation (torch.compile traces it with no graph break), a default
implementation in plain PyTorch (CPU and any device without Triton kernels) and a CUDA implementation
that dispatches to Triton (twell.kernels.dispatch, imported on first CUDA call, so importing twell
compiles nothing). Autograd recomputes through the dense reference: exact gradients, not yet sparse.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from twell.kernels import reference

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_matrix(name: str, t: torch.Tensor, shape: tuple[int, int], x: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != x.dtype:
        raise TypeError(f"{name} must have the dtype of x ({x.dtype}), got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on the device of x ({x.device}), got {t.device}")


def check_ffn_inputs(x, weights: dict, biases: dict, hidden: int) -> None:
    """Clear errors for every malformed input; weights are (name -> (tensor, expected shape))."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have shape [..., K] (at least 1 dim), got a scalar")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    for name, (t, shape) in weights.items():
        _check_matrix(name, t, shape, x)
    for name, (b, size) in biases.items():
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or b.dim() != 1 or b.shape[0] != size:
            got = list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"{name} must have shape [{size}], got {got}")
        if b.dtype != x.dtype or b.device != x.device:
            raise TypeError(f"{name} must match x ({x.dtype}, {x.device}), got ({b.dtype}, {b.device})")


def check_threshold(threshold: float) -> None:
    if not math.isfinite(threshold):
        raise ValueError(f"threshold must be a finite float, got {threshold}")


def check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold) -> None:
    check_threshold(threshold)
    if not isinstance(gate_weight, torch.Tensor) or gate_weight.dim() != 2:
        raise ValueError("gate_weight must be a 2-dim tensor [N, K] (nn.Linear layout)")
    n, k = gate_weight.shape
    check_ffn_inputs(
        x,
        {"gate_weight": (gate_weight, (n, k)), "up_weight": (up_weight, (n, k)), "down_weight": (down_weight, (k, n))},
        {"gate_bias": (gate_bias, n), "up_bias": (up_bias, n), "down_bias": (down_bias, k)},
        n,
    )
    if x.shape[-1] != k:
        raise ValueError(f"x must have shape [..., {k}] (K of gate_weight), got {list(x.shape)}")


def check_plain(x, up_weight, down_weight, up_bias, down_bias, threshold) -> None:
    check_threshold(threshold)
    if not isinstance(up_weight, torch.Tensor) or up_weight.dim() != 2:
        raise ValueError("up_weight must be a 2-dim tensor [N, K] (nn.Linear layout)")
    n, k = up_weight.shape
    check_ffn_inputs(
        x,
        {"up_weight": (up_weight, (n, k)), "down_weight": (down_weight, (k, n))},
        {"up_bias": (up_bias, n), "down_bias": (down_bias, k)},
        n,
    )
    if x.shape[-1] != k:
        raise ValueError(f"x must have shape [..., {k}] (K of up_weight), got {list(x.shape)}")


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
) -> torch.Tensor:
    check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold)
    return reference.gated_ffn(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu)


@gated_ffn.register_fake
def _(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu):
    check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold)
    return x.new_empty(x.shape)


@gated_ffn.register_kernel("cuda")
def _(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu):
    from twell.kernels import dispatch

    check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold)
    return dispatch.gated_ffn(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu)


@torch.library.custom_op("twell::ffn", mutates_args=())
def ffn(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    threshold: float,
    squared: bool,
) -> torch.Tensor:
    check_plain(x, up_weight, down_weight, up_bias, down_bias, threshold)
    return reference.ffn(x, up_weight, down_weight, up_bias, down_bias, threshold, squared)


@ffn.register_fake
def _(x, up_weight, down_weight, up_bias, down_bias, threshold, squared):
    check_plain(x, up_weight, down_weight, up_bias, down_bias, threshold)
    return x.new_empty(x.shape)


@ffn.register_kernel("cuda")
def _(x, up_weight, down_weight, up_bias, down_bias, threshold, squared):
    from twell.kernels import dispatch

    check_plain(x, up_weight, down_weight, up_bias, down_bias, threshold)
    return dispatch.ffn(x, up_weight, down_weight, up_bias, down_bias, threshold, squared)


def _dense_backward(reference_fn, n_tensors: int):
    """Autograd through the dense reference: recompute forward under autograd, pull grads back."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(t if isinstance(t, torch.Tensor) else None for t in inputs[:n_tensors]))
        ctx.scalars = inputs[n_tensors:]

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
        return (*result, *([None] * len(ctx.scalars)))

    return setup_context, backward


_setup, _backward = _dense_backward(reference.gated_ffn, 7)
gated_ffn.register_autograd(_backward, setup_context=_setup)
_setup, _backward = _dense_backward(reference.ffn, 5)
ffn.register_autograd(_backward, setup_context=_setup)
