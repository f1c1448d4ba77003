"""Gate GEMM with TwELL epilogue, and the same packing applied to a dense matrix.

Algorithm 1 of the paper: each program computes an output tile S = x[m0:m0+BLOCK_M] @ W_g[n0:n0+TILE_N]^T
in fp32, adds the bias, and packs each row's kept entries (not <= threshold) to the front of the
tile's SLOTS slots with a row-wise prefix sum; the true count goes to counts[m, tile]. The dense gate
never reaches global memory. A count above SLOTS marks the row for the hybrid dense path (the
launchers never drop it: see twell.kernels.dispatch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.kernels.common import autotune_configs, check_tile, dot_precision, m_bucket, threshold_in

# BLOCK_N is the TwELL tile width: one GEMM tile packs exactly one TwELL tile.
GATE_CONFIGS = [
    # (BLOCK_M, BLOCK_K, num_warps, num_stages)
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (64, 64, 4, 4),
    (128, 32, 8, 4),
    (256, 64, 8, 3),
    (64, 128, 4, 3),
]


@triton.jit
def _pack_tile(
    acc,
    offs_m,
    tile,
    M,
    N,
    threshold,
    vals_ptr,
    idx_ptr,
    cnt_ptr,
    n_tiles,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    SQUARE: tl.constexpr,
):
    """Pack one [BLOCK_M, TILE_N] fp32 tile into TwELL slots (the shared epilogue)."""
    offs_c = tl.arange(0, TILE_N)
    row_ok = offs_m < M
    in_bounds = row_ok[:, None] & ((tile * TILE_N + offs_c)[None, :] < N)
    keep = ((acc > threshold) | (acc != acc)) & in_bounds  # not (acc <= t): NaN is kept, as by relu
    keep_i = keep.to(tl.int32)
    pos = tl.cumsum(keep_i, axis=1) - 1
    cnt = tl.sum(keep_i, axis=1)
    if SQUARE:
        acc = acc * acc
    base = (offs_m.to(tl.int64) * n_tiles + tile) * SLOTS
    slot_ptr = base[:, None] + pos
    stored = keep & (pos < SLOTS)
    tl.store(vals_ptr + slot_ptr, acc.to(vals_ptr.dtype.element_ty), mask=stored)
    local = tl.broadcast_to(offs_c[None, :], acc.shape).to(tl.int16)
    tl.store(idx_ptr + slot_ptr, local, mask=stored)
    # slots past the count are zeroed (disjoint from the stores above: no ordering needed)
    offs_s = tl.arange(0, SLOTS)
    pad = row_ok[:, None] & (offs_s[None, :] >= cnt[:, None])
    pad_ptr = base[:, None] + offs_s[None, :]
    tl.store(vals_ptr + pad_ptr, tl.zeros([offs_m.shape[0], SLOTS], vals_ptr.dtype.element_ty), mask=pad)
    tl.store(idx_ptr + pad_ptr, tl.zeros([offs_m.shape[0], SLOTS], tl.int16), mask=pad)
    tl.store(cnt_ptr + offs_m.to(tl.int64) * n_tiles + tile, cnt, mask=row_ok)


@triton.autotune(
    configs=autotune_configs(GATE_CONFIGS, lambda bm, bk, w, s: {"BLOCK_M": bm, "BLOCK_K": bk}),
    key=["M_BUCKET", "N", "K", "TILE_N"],
)
@triton.jit
def _gate_twell_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    vals_ptr,
    idx_ptr,
    cnt_ptr,
    M,
    N,
    K,
    M_BUCKET,
    n_tiles,
    threshold,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    HAS_BIAS: tl.constexpr,
    SQUARE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr = 8,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    # grouped ordering: programs that run together share W_g tiles in L2
    group = pid // (GROUP_M * n_tiles)
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_tiles)) % group_size
    tile = (pid % (GROUP_M * n_tiles)) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile * TILE_N + tl.arange(0, TILE_N)
    offs_k = tl.arange(0, BLOCK_K)
    # clamp rows/cols instead of masking them: out-of-range results are never stored
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    a_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    b_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_xk
        b_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    # decide on the value the dense FFN sees: the gate rounded to the output dtype
    acc = acc.to(vals_ptr.dtype.element_ty).to(tl.float32)
    _pack_tile(acc, offs_m, tile, M, N, threshold, vals_ptr, idx_ptr, cnt_ptr, n_tiles, TILE_N, SLOTS, SQUARE)


PACK_CONFIGS = [
    # (BLOCK_M, num_warps, num_stages): a memory-bound pass, so small tiles and many programs
    (8, 4, 1),
    (4, 2, 1),
    (16, 4, 1),
    (32, 4, 1),
    (16, 8, 1),
]


@triton.autotune(
    configs=autotune_configs(PACK_CONFIGS, lambda bm, w, s: {"BLOCK_M": bm}),
    key=["M_BUCKET", "N", "TILE_N", "SLOTS"],
)
@triton.jit
def _pack_dense_kernel(
    h_ptr,
    vals_ptr,
    idx_ptr,
    cnt_ptr,
    M,
    N,
    M_BUCKET,
    n_tiles,
    threshold,
    stride_hm,
    stride_hn,
    SQUARE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    tile = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile * TILE_N + tl.arange(0, TILE_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :] * stride_hn
    acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    _pack_tile(acc, offs_m, tile, M, N, threshold, vals_ptr, idx_ptr, cnt_ptr, n_tiles, TILE_N, SLOTS, SQUARE)


def _alloc(m: int, n: int, tile_n: int, slots: int, dtype, device):
    n_tiles = triton.cdiv(n, tile_n)
    values = torch.empty(m, n_tiles, slots, dtype=dtype, device=device)
    indices = torch.empty(m, n_tiles, slots, dtype=torch.int16, device=device)
    counts = torch.empty(m, n_tiles, dtype=torch.int32, device=device)
    return values, indices, counts


def gate_twell(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: float,
    tile_n: int,
    slots: int,
    square: bool = False,
):
    """TwELL arrays (values, indices, counts) of act_t(x @ weight^T + bias), x: [M, K], weight: [N, K].

    square: store act² (relu², non-gated FFNs). Counts are true counts: > slots means the row overflows.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gate_twell expects x [M, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}")
    check_tile(tile_n, slots)
    m, k = x.shape
    n = weight.shape[0]
    values, indices, counts = _alloc(m, n, tile_n, slots, x.dtype, x.device)
    n_tiles = counts.shape[1]

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * n_tiles,)

    _gate_twell_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,
        values,
        indices,
        counts,
        m,
        n,
        k,
        m_bucket(m),
        n_tiles,
        threshold_in(threshold, x.dtype),
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        HAS_BIAS=bias is not None,
        SQUARE=square,
        DOT_PRECISION=dot_precision(x.dtype),
        TILE_N=tile_n,
        SLOTS=slots,
    )
    return values, indices, counts


def pack_dense(h: torch.Tensor, threshold: float, tile_n: int, slots: int, square: bool = False):
    """TwELL arrays of a dense pre-activation h [M, N]: the pack pass for a cuBLAS gate."""
    if h.dim() != 2:
        raise ValueError(f"pack_dense expects h [M, N], got {list(h.shape)}")
    check_tile(tile_n, slots)
    m, n = h.shape
    values, indices, counts = _alloc(m, n, tile_n, slots, h.dtype, h.device)
    n_tiles = counts.shape[1]
    _pack_dense_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), n_tiles)](
        h,
        values,
        indices,
        counts,
        m,
        n,
        m_bucket(m),
        n_tiles,
        threshold_in(threshold, h.dtype),
        h.stride(0),
        h.stride(1),
        SQUARE=square,
        TILE_N=tile_n,
        SLOTS=slots,
    )
    return values, indices, counts
