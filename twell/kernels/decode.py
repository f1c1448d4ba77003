"""Decode path: few tokens, memory-bound. Read all of W_g, but only the active rows of W_u and W_d.

The gate runs dense (a GEMV-shaped cuBLAS call; it must read all of W_g anyway). Then two kernels,
each over a grid of (neuron block, K block, token block) so that even one token spreads over every
multiprocessor; a program whose tokens activate none of its neurons exits at once, and the others
load only the active neurons' weight rows (masked loads of inactive rows move no bytes):
    up:   u += x[:, kblk] W_u[nblk, kblk]^T            (fp32 atomics into u [M, N])
    down: y += (g * u)[:, nblk] W_d^T[nblk, kblk]       (fp32 atomics into y [M, K])
No host synchronisation: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.kernels.common import dot_precision

UP_BLOCK_N, UP_BLOCK_K = 64, 512
DOWN_BLOCK_N, DOWN_BLOCK_K = 128, 128
INNER_K = 128


@triton.jit
def _active(h_ptr, offs_m, offs_n, M, N, stride_hm, stride_hn):
    m_ok = offs_m < M
    g = tl.load(
        h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :] * stride_hn,
        mask=m_ok[:, None] & (offs_n < N)[None, :],
        other=0.0,
    )
    active = tl.max((g != 0).to(tl.int32), axis=0) > 0  # [BLOCK_N]: neuron used by some token of the block
    return g, active, m_ok


@triton.jit
def _decode_up_kernel(
    x_ptr,
    h_ptr,
    wu_ptr,
    u_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_hm,
    stride_hn,
    stride_un,
    stride_uk,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INNER_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * BLOCK_K
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    g, active, m_ok = _active(h_ptr, offs_m, offs_n, M, N, stride_hm, stride_hn)
    if tl.max(active.to(tl.int32), axis=0) == 0:
        return
    u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_start + BLOCK_K, INNER_K):
        offs_k = k0 + tl.arange(0, INNER_K)
        k_ok = offs_k < K
        xt = tl.load(
            x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        wt = tl.load(
            wu_ptr + offs_n.to(tl.int64)[None, :] * stride_un + offs_k[:, None] * stride_uk,
            mask=active[None, :] & k_ok[:, None],
            other=0.0,
        )
        u = tl.dot(xt, wt, u, input_precision=DOT_PRECISION)
    tl.atomic_add(u_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], u, mask=m_ok[:, None] & active[None, :])


@triton.jit
def _decode_down_kernel(
    h_ptr,
    u_ptr,
    bu_ptr,
    wd_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_hm,
    stride_hn,
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
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    g, active, m_ok = _active(h_ptr, offs_m, offs_n, M, N, stride_hm, stride_hn)
    if tl.max(active.to(tl.int32), axis=0) == 0:
        return
    h = g.to(tl.float32)
    if HAS_UP:
        u = tl.load(
            u_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], mask=m_ok[:, None] & active[None, :], other=0.0
        )
        if HAS_UP_BIAS:
            u += tl.load(bu_ptr + offs_n, mask=active, other=0.0).to(tl.float32)[None, :]
        if DRELU:
            u = tl.where(u <= 0.0, 0.0, u)
        h = h * u
    # inactive neurons hold exact zeros in g, so they add nothing; round h like the dense FFN does
    h = h.to(g.dtype)
    k_ok = offs_k < K
    wd = tl.load(
        wd_ptr + offs_n.to(tl.int64)[:, None] * stride_dn + offs_k[None, :] * stride_dk,
        mask=active[:, None] & k_ok[None, :],
        other=0.0,
    )
    part = tl.dot(h, wd, input_precision=DOT_PRECISION)
    tl.atomic_add(y_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], part, mask=m_ok[:, None] & k_ok[None, :])


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
    m_blocks = triton.cdiv(m, block_m)
    precision = dot_precision(x.dtype)
    u = None
    if up_weight is not None:
        u = torch.zeros(m, n, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(n, UP_BLOCK_N), triton.cdiv(k, UP_BLOCK_K), m_blocks)
        _decode_up_kernel[grid](
            x,
            hidden,
            up_weight,
            u,
            m,
            n,
            k,
            x.stride(0),
            x.stride(1),
            hidden.stride(0),
            hidden.stride(1),
            up_weight.stride(0),
            up_weight.stride(1),
            DOT_PRECISION=precision,
            BLOCK_M=block_m,
            BLOCK_N=UP_BLOCK_N,
            BLOCK_K=UP_BLOCK_K,
            INNER_K=INNER_K,
            num_warps=4,
            num_stages=2,
        )
    y = torch.zeros(m, k, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, DOWN_BLOCK_N), triton.cdiv(k, DOWN_BLOCK_K), m_blocks)
    _decode_down_kernel[grid](
        hidden,
        u if u is not None else y,
        up_bias if up_bias is not None else y,
        down_weight_t,
        y,
        m,
        n,
        k,
        hidden.stride(0),
        hidden.stride(1),
        down_weight_t.stride(0),
        down_weight_t.stride(1),
        HAS_UP=up_weight is not None,
        HAS_UP_BIAS=up_bias is not None,
        DRELU=drelu,
        DOT_PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=DOWN_BLOCK_N,
        BLOCK_K=DOWN_BLOCK_K,
        num_warps=4,
        num_stages=1,
    )
    return y
