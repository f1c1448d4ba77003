"""The projection modules an FFN is built from: nn.Linear (weight [out, in], y = x W^T + b) and
transformers' Conv1D (GPT-2 and its descendants: weight [in, out], y = addmm(b, x, W)).

The ops take nn.Linear layouts; a Conv1D's weight goes to them as the view `weight.t()`, never a copy.
For a down projection that view is what the kernels want: they gather rows of down_weight.t() ([N, K]),
and a Conv1D down weight is stored [N, K] row-major already.
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def conv1d_class() -> type | None:
    """transformers' Conv1D, if transformers has loaded it (else no module can be one)."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def is_conv1d(module: nn.Module) -> bool:
    cls = conv1d_class()
    return cls is not None and isinstance(module, cls)


def is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a projection."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The projection's weight in the nn.Linear layout [out, in]: a Conv1D's as a transposed view (also
    for the stand-ins that hold a Conv1D's weight, marked by `weight_transposed`)."""
    # nn.Linear first: a getattr that misses costs an AttributeError (~3 us) on every eager call.
    transposed = is_conv1d(module) or (
        not isinstance(module, nn.Linear) and getattr(module, "weight_transposed", False)
    )
    return module.weight.t() if transposed else module.weight


def native_forward(module: nn.Module) -> bool:
    """The module's class computes exactly its projection: nn.Linear's or Conv1D's own forward."""
    forward = type(module).forward
    if isinstance(module, nn.Linear):
        return forward is nn.Linear.forward
    return is_conv1d(module) and forward is conv1d_class().forward


__all__ = ["conv1d_class", "features", "is_conv1d", "is_projection", "linear_weight", "native_forward"]
