"""Functional entry points: sparse-aware FFNs with nn.Linear weight layouts.

Both are exact at any sparsity (overflowing rows take a dense path, and shapes where sparse would not
pay run dense) and run on any device: Triton kernels on CUDA, plain PyTorch elsewhere.
"""

from __future__ import annotations

import torch

from twell.kernels import ops as _ops
from twell.kernels import policy


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
    drelu: ReLU on up(x) too (dReLU). Returns [..., K] in the dtype of x. Under autograd on CUDA with
    that layout, forward keeps a compact record of the hidden layer and backward is sparse too.
    """
    biases = (gate_bias, up_bias, down_bias)
    if _ops.sparse_training(x, gate_weight, up_weight, down_weight, biases):
        return torch.ops.twell.ffn_train(
            x, gate_weight, up_weight, down_weight, *biases, float(threshold), bool(drelu), False,
            policy.train_width(gate_weight.shape[0]),
        )[0]  # fmt: skip
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

    up_weight: [N, K]; down_weight: [K, N]. Returns [..., K] in the dtype of x. Training as gated_ffn.
    """
    if _ops.sparse_training(x, up_weight, None, down_weight, (up_bias, down_bias)):
        return torch.ops.twell.ffn_train(
            x, up_weight, None, down_weight, up_bias, None, down_bias, float(threshold), False, bool(squared),
            policy.train_width(up_weight.shape[0]),
        )[0]  # fmt: skip
    return torch.ops.twell.ffn(x, up_weight, down_weight, up_bias, down_bias, float(threshold), bool(squared))


__all__ = ["gated_ffn", "ffn", "_ops"]
