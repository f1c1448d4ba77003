"""The ops' input checks, defined once: the float dtypes the ops and kernels take, the threshold rule
and the FFN operands' shapes. twell.kernels.library checks every op call with them at the op boundary;
the kernel launchers' public entry points (twell.kernels.common's checks) use the same rules. No Triton
here: the ops' CPU implementations import this too."""

from __future__ import annotations

import math

import torch

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


def check_threshold(threshold) -> None:
    """A threshold is a finite real number (int or float; not a bool)."""
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not math.isfinite(threshold):
        raise ValueError(f"threshold must be a finite float, got {threshold!r}")


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
