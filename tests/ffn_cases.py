"""Random FFN problems with controlled per-row density, and their float64 references."""

from __future__ import annotations

import torch

from twell.kernels import reference


def make_ffn(m, k, n, densities, dtype, device="cpu", seed=0, biases=False, gated=True):
    """Inputs of an FFN whose gate fires on about densities[i % len] of the N neurons in row i.

    The last input feature carries a per-row offset (its gate weights are all one), chosen from the
    row's pre-activation quantile: density 0 gives an empty row, 1 a fully dense one.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w_gate = torch.randn(n, k, generator=g, dtype=torch.float64) / k**0.5
    w_gate[:, -1] = 1.0
    x[:, -1] = 0.0
    pre = x @ w_gate.T
    for i in range(m):
        d = densities[i % len(densities)]
        if d <= 0:
            x[i, -1] = -pre[i].max() - 1.0
        elif d >= 1:
            x[i, -1] = -pre[i].min() + 0.5
        else:
            x[i, -1] = -torch.quantile(pre[i], 1.0 - d) + 1e-3
    w_up = torch.randn(n, k, generator=g, dtype=torch.float64) / k**0.5
    w_down = torch.randn(k, n, generator=g, dtype=torch.float64) / n**0.5
    b = (lambda size: torch.randn(size, generator=g, dtype=torch.float64) * 0.1) if biases else (lambda size: None)
    case = {
        "x": x,
        "gate_weight": w_gate,
        "up_weight": w_up,
        "down_weight": w_down,
        "gate_bias": b(n),
        "up_bias": b(n),
        "down_bias": b(k),
    }
    if biases:  # keep the gate bias from shifting the controlled densities much
        case["gate_bias"] = case["gate_bias"] * 0.01
    if not gated:
        case["up_weight"], case["up_bias"] = case.pop("gate_weight"), case.pop("gate_bias")
    case = {name: (t.to(dtype=dtype, device=device) if t is not None else None) for name, t in case.items()}
    # down_weight [K, N] stored as its transpose, as sparsify stores it: the layout the kernels read
    case["down_weight"] = case["down_weight"].t().contiguous().t()
    return case


def gated_ref(case, threshold=0.0, drelu=False):
    c = {name: (t.double() if t is not None else None) for name, t in case.items()}
    return reference.gated_ffn_reference(
        c["x"],
        c["gate_weight"],
        c["up_weight"],
        c["down_weight"],
        c["gate_bias"],
        c["up_bias"],
        c["down_bias"],
        threshold,
        drelu,
    )


def plain_ref(case, threshold=0.0, squared=False):
    c = {name: (t.double() if t is not None else None) for name, t in case.items()}
    return reference.ffn_reference(
        c["x"], c["up_weight"], c["down_weight"], c["up_bias"], c["down_bias"], threshold, squared
    )


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def decode_args(case, gated: bool) -> tuple:
    """The positional arguments (x, gate weight and bias, up weight and bias, down_weight^T, down bias,
    threshold 0) of the decode launchers for a make_ffn case; a plain FFN's gate is its up projection."""
    gate_w, gate_b = ("gate_weight", "gate_bias") if gated else ("up_weight", "up_bias")
    up = (case["up_weight"], case["up_bias"]) if gated else (None, None)
    return (case["x"], case[gate_w], case[gate_b], *up, case["down_weight"].t(), case["down_bias"], 0.0)


class GatedMLP(torch.nn.Module):
    """A Llama-style ReLU-gated FFN (gate with a bias, up and down without) for module-level tests."""

    def __init__(self, k, n):
        super().__init__()
        self.gate_proj = torch.nn.Linear(k, n)
        self.up_proj = torch.nn.Linear(k, n, bias=False)
        self.down_proj = torch.nn.Linear(n, k, bias=False)

    def forward(self, x):
        return self.down_proj(torch.relu(self.gate_proj(x)) * self.up_proj(x))


class GatedBlock(torch.nn.Module):
    """GatedMLP as the `mlp` of a block, where twell.sparsify looks for FFNs."""

    def __init__(self, k, n):
        super().__init__()
        self.mlp = GatedMLP(k, n)

    def forward(self, x):
        return self.mlp(x)
