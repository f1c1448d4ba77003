"""Plain PyTorch forms of the FFNs twell serves: the CPU implementation of the ops, the dense fallback
of the CUDA path and, upcast to float64, the reference every kernel is tested against.

Activation with threshold t (FATReLU; t = 0 is ReLU): keep v where not (v <= t), else 0. NaN is kept,
as torch.relu keeps it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def thresholded_relu(v: torch.Tensor, threshold: float) -> torch.Tensor:
    if threshold == 0.0:
        return torch.relu(v)
    return torch.where(v <= threshold, torch.zeros((), dtype=v.dtype, device=v.device), v)


def _records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records these ops (in-place updates would then break saved tensors)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _thresholded_relu_(v: torch.Tensor, threshold: float) -> torch.Tensor:
    """In-place thresholded_relu of a fresh buffer (same values, no second [M, N] buffer)."""
    if threshold == 0.0:
        return v.relu_()
    return v.masked_fill_(v <= threshold, 0.0)


def hidden(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor | None,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    threshold: float = 0.0,
    drelu: bool = False,
    squared: bool = False,
) -> torch.Tensor:
    """h [..., N], the down projection's input: act(gate(x)) * up(x) (drelu: ReLU on up(x) too) with
    up_weight; without, act(gate(x)), squared for relu² (gate_weight is then the FFN's up projection)."""
    h = thresholded_relu(F.linear(x, gate_weight, gate_bias), threshold)
    if up_weight is None:
        return h * h if squared else h
    up = F.linear(x, up_weight, up_bias)
    return h * (torch.relu(up) if drelu else up)


def gated_ffn_reference(
    x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None, threshold=0.0, drelu=False
) -> torch.Tensor:
    """y [..., K] = down(act(gate(x)) * up(x)) of x [..., K]; with drelu, ReLU on up(x) too. nn.Linear
    weight layouts (gate_weight, up_weight [N, K], down_weight [K, N]); biases optional. The argument
    order of every gated FFN function in twell (dense.gated_ffn_dense, the op, twell.ops.gated_ffn)."""
    if _records_grad(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias):
        h = hidden(x, gate_weight, up_weight, gate_bias, up_bias, threshold, drelu)
        return F.linear(h, down_weight, down_bias)
    # no autograd graph: in place, so at most two [M, N] buffers live at once (eager dense holds three)
    h = _thresholded_relu_(F.linear(x, gate_weight, gate_bias), threshold)
    up = F.linear(x, up_weight, up_bias)
    if drelu:
        up.relu_()
    h.mul_(up)
    del up
    return F.linear(h, down_weight, down_bias)


def ffn_reference(
    x, up_weight, down_weight, up_bias=None, down_bias=None, threshold=0.0, squared=False
) -> torch.Tensor:
    """y [..., K] = down(act(up(x))) of x [..., K] (up_weight [N, K], down_weight [K, N]); with squared,
    act is relu² (Primer / Nemotron)."""
    if _records_grad(x, up_weight, down_weight, up_bias, down_bias):
        h = hidden(x, up_weight, None, up_bias, None, threshold, squared=squared)
        return F.linear(h, down_weight, down_bias)
    h = _thresholded_relu_(F.linear(x, up_weight, up_bias), threshold)
    if squared:
        h.mul_(h)
    return F.linear(h, down_weight, down_bias)
