"""The dense route on the GPU: what a rewritten FFN runs when its sparse kernels would not pay.

cuBLAS GEMMs as dense PyTorch runs them, with the activation and the product of the gated FFN in one
pass over the [M, N] hidden state (_act_mul_kernel, in place in the gate GEMM's output): eager PyTorch
spends two passes there (relu_, then mul_: five [M, N] reads and writes against three) and an extra
launch, which kept the dense route at 0.96x of compiled dense, where Inductor fuses the two. Values
are the same bits as reference.gated_ffn_reference / reference.ffn_reference: every op rounds once, as torch's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from twell.kernels.common import cdiv, threshold_in

BLOCK = 2048  # elements a program: 16 a thread at 4 warps, 16-byte loads of bf16


@triton.jit
def _act_mul_kernel(
    g_ptr, u_ptr, n_elements, threshold,
    HAS_UP: tl.constexpr, DRELU: tl.constexpr, SQUARE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """g <- act(g) * u (HAS_UP; DRELU: relu(u)), act(g)^2 (SQUARE) or act(g), in place; act keeps g
    where not (g <= threshold): NaN kept, as torch.relu keeps it."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_elements
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    h = tl.where(g <= threshold, 0.0, g)
    if HAS_UP:
        u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if DRELU:
            u = tl.where(u <= 0.0, 0.0, u)
        h = h * u
    elif SQUARE:
        h = h * h
    tl.store(g_ptr + offs, h.to(g_ptr.dtype.element_ty), mask=ok)


def act_mul_(g: torch.Tensor, u: torch.Tensor | None, threshold: float, *, drelu: bool, square: bool) -> torch.Tensor:
    """In place on g (contiguous, float): act(g) * (relu(u) if drelu else u) with u, else act(g) (act(g)²
    with square). Returns g."""
    if not g.is_contiguous() or (u is not None and (u.shape != g.shape or u.dtype != g.dtype or not u.is_contiguous())):
        raise ValueError(
            f"act_mul_ expects contiguous g and u of one shape and dtype, got {list(g.shape)} {g.dtype}"
            + ("" if u is None else f" and {list(u.shape)} {u.dtype}")
        )
    n = g.numel()
    if n:
        _act_mul_kernel[(cdiv(n, BLOCK),)](
            g, u if u is not None else g, n, threshold_in(threshold, g.dtype),
            HAS_UP=u is not None, DRELU=drelu, SQUARE=square, BLOCK=BLOCK, num_warps=4,
        )  # fmt: skip
    return g


def gated_ffn_dense(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu):
    """down(act(gate(x)) * up(x)) of x [M, K], nn.Linear weight layouts (down_weight may be a view of
    the rows sparsify stores); no autograd."""
    g = F.linear(x, gate_weight, gate_bias)
    act_mul_(g, F.linear(x, up_weight, up_bias), threshold, drelu=drelu, square=False)
    return F.linear(g, down_weight, down_bias)


def ffn_dense(x, up_weight, down_weight, up_bias, down_bias, threshold, squared):
    """down(act(up(x))) (act² with squared) of x [M, K]; no autograd."""
    h = act_mul_(F.linear(x, up_weight, up_bias), None, threshold, drelu=False, square=squared)
    return F.linear(h, down_weight, down_bias)
