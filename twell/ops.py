"""Functional entry points: sparse-aware FFNs with nn.Linear weight layouts.

Both are exact at any sparsity (overflowing rows take a dense path, and shapes where sparse would not
pay run dense) and run on any device: Triton kernels on CUDA, plain PyTorch elsewhere.
"""

from __future__ import annotations

import torch

from twell.kernels import ops as _ops


def gated_ffn(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    threshold: float = 0.0,
    drelu: bool = False,
) -> torch.Tensor:
    """y = down(relu_t(gate(x)) * up(x)) for x [..., K].

    gate_weight, up_weight: [N, K]; down_weight: [K, N] (nn.Linear layouts; down_weight is read
    fastest when down_weight.t() is contiguous). relu_t keeps values > threshold (0: ReLU).
    drelu: ReLU on up(x) too (dReLU). Returns [..., K] in the dtype of x.
    """
    return torch.ops.twell.gated_ffn(
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, float(threshold), bool(drelu)
    )


def ffn(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    threshold: float = 0.0,
    squared: bool = False,
) -> torch.Tensor:
    """y = down(relu_t(up(x))) for x [..., K] (OPT, ReLU-Falcon); squared: relu² (Nemotron).

    up_weight: [N, K]; down_weight: [K, N]. Returns [..., K] in the dtype of x.
    """
    return torch.ops.twell.ffn(x, up_weight, down_weight, up_bias, down_bias, float(threshold), bool(squared))


__all__ = ["gated_ffn", "ffn", "_ops"]
