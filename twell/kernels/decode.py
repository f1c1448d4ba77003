"""Decode path: few tokens, memory-bound. Read all of W_g, but only the active rows of W_u and W_d.

The gate runs dense (a GEMV-shaped cuBLAS call; it must read all of W_g anyway). Then one program per
(block of BLOCK_N neurons, block of BLOCK_M tokens): if no token of the block activates any of its
neurons it exits at once; otherwise it loads only the active neurons' rows of W_u and W_d^T (masked
loads of inactive rows move no bytes), computes u = x W_u^T and h = g * u on tensor cores and adds
h W_d^T into an fp32 accumulator with atomics. No host synchronisation: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.kernels.common import dot_precision

BLOCK_N = 64  # neurons per program
BLOCK_K = 128


@triton.jit
def _decode_kernel(
    x_ptr,
    h_ptr,
    wu_ptr,
    bu_ptr,
    wd_ptr,
    yacc_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_hm,
    stride_hn,
    stride_un,
    stride_uk,
    stride_dn,
    stride_dk,
    HAS_UP: tl.constexpr,
    HAS_UP_BIAS: tl.constexpr,
    DRELU: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    g = tl.load(
        h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :] * stride_hn,
        mask=m_ok[:, None] & n_ok[None, :],
        other=0.0,
    )
    active = tl.max((g != 0).to(tl.int32), axis=0) > 0  # [BLOCK_N]: neuron used by any token
    if tl.max(active.to(tl.int32), axis=0) == 0:
        return
    rows = offs_n.to(tl.int64)
    if HAS_UP:
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xt = tl.load(
                x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            wt = tl.load(
                wu_ptr + rows[None, :] * stride_un + offs_k[:, None] * stride_uk,
                mask=active[None, :] & k_ok[:, None],
                other=0.0,
            )
            u = tl.dot(xt, wt, u, input_precision=DOT_PRECISION)
        if HAS_UP_BIAS:
            u += tl.load(bu_ptr + offs_n, mask=active, other=0.0).to(tl.float32)[None, :]
        if DRELU:
            u = tl.where(u <= 0.0, 0.0, u)
        h = g.to(tl.float32) * u
    else:
        h = g.to(tl.float32)
    # inactive neurons hold exact zeros in g, so they add nothing below; round h like the dense FFN does
    h = h.to(g.dtype)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        wd = tl.load(
            wd_ptr + rows[:, None] * stride_dn + offs_k[None, :] * stride_dk,
            mask=active[:, None] & k_ok[None, :],
            other=0.0,
        )
        part = tl.dot(h, wd, input_precision=DOT_PRECISION)
        tl.atomic_add(
            yacc_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], part, mask=m_ok[:, None] & k_ok[None, :]
        )


def decode_up_down(
    x: torch.Tensor,
    hidden: torch.Tensor,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight_t: torch.Tensor,
    *,
    drelu: bool = False,
) -> torch.Tensor:
    """fp32 [M, K]: (hidden * (x W_u^T + b_u)) W_d^T, or hidden W_d^T without up_weight.

    x: [M, K]; hidden: [M, N] activated gate (zeros mark inactive neurons); down_weight_t: [N, K].
    """
    m, k = x.shape
    n = hidden.shape[1]
    block_m = min(max(triton.next_power_of_2(m), 16), 64)
    yacc = torch.zeros(m, k, dtype=torch.float32, device=x.device)
    up = up_weight if up_weight is not None else down_weight_t
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, block_m))
    _decode_kernel[grid](
        x,
        hidden,
        up,
        up_bias if up_bias is not None else x,
        down_weight_t,
        yacc,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        hidden.stride(0),
        hidden.stride(1),
        up.stride(0),
        up.stride(1),
        down_weight_t.stride(0),
        down_weight_t.stride(1),
        HAS_UP=up_weight is not None,
        HAS_UP_BIAS=up_bias is not None,
        DRELU=drelu,
        DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
        num_stages=2,
    )
    return yacc
