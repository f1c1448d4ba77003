"""Fused sparse up + down projection from TwELL (Algorithm 2 of the paper).

One program per token row m, shaped like the reference CUDA kernel. First the row's per-tile counts
become one flat list of its R (gate value g, neuron n) pairs in a per-row scratch (prefix sum over
tiles in registers, CHUNK entries at a time). Then, with the whole x_m and y_m rows in registers,
    for each entry j:  u_j = x_m . W_u[n_j]  (skipped for non-gated FFNs);  y_m += (g_j * u_j) W_d[n_j]
with fp32 accumulation: each entry loads both weight rows at once (many independent 16-byte loads per
thread) and the entry loop is software-pipelined. The hidden state never reaches global memory. Rows
flagged in `skip` (overflowing a tile, or chosen for dense) are left to the dispatcher's dense path.
W_d is read as rows of down_weight^T ([N, K]): pass down_weight.t() with unit stride on K for
coalesced loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.kernels import policy
from twell.kernels.common import autotune_configs

CHUNK = 16  # entries flattened at a time


@triton.jit
def _row_entries(
    cnt,
    incl,
    e,
    valid,
    m,
    n_tiles,
    vals_ptr,
    idx_ptr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    TILES_PAD: tl.constexpr,
):
    """Gate value and neuron id of the row's flat entries e (entry e lies in the first tile whose
    inclusive count exceeds e)."""
    offs_t = tl.arange(0, TILES_PAD)
    tile = tl.sum((incl[None, :] <= e[:, None]).to(tl.int32), axis=1)
    start = tl.sum(tl.where(offs_t[None, :] == tile[:, None], (incl - cnt)[None, :], 0), axis=1)
    slot_off = (m * n_tiles + tile) * SLOTS + (e - start)
    g = tl.load(vals_ptr + slot_off, mask=valid, other=0.0).to(tl.float32)
    neuron = tile * TILE_N + tl.load(idx_ptr + slot_off, mask=valid, other=0).to(tl.int32)
    return g, neuron


ROWVEC_CONFIGS = [
    # (num_warps, num_stages): the whole K row lives in registers, entries stream one at a time
    (4, 3),
    (8, 3),
    (4, 4),
    (2, 3),
]


@triton.autotune(
    configs=autotune_configs(ROWVEC_CONFIGS, lambda w, s: {}),
    key=["K", "TILE_N", "SLOTS", "HAS_UP"],
)
@triton.jit
def _twell_up_down_kernel(
    x_ptr,
    vals_ptr,
    idx_ptr,
    cnt_ptr,
    skip_ptr,
    wu_ptr,
    bu_ptr,
    wd_ptr,
    bd_ptr,
    y_ptr,
    g_ptr,
    n_ptr,
    K,
    n_tiles,
    scratch_stride,
    stride_xm,
    stride_xk,
    stride_un,
    stride_uk,
    stride_dn,
    stride_dk,
    stride_ym,
    stride_yk,
    HAS_UP: tl.constexpr,
    HAS_UP_BIAS: tl.constexpr,
    HAS_DOWN_BIAS: tl.constexpr,
    DRELU: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    TILES_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    if tl.load(skip_ptr + m) != 0:
        return
    offs_t = tl.arange(0, TILES_PAD)
    cnt = tl.load(cnt_ptr + m * n_tiles + offs_t, mask=offs_t < n_tiles, other=0)
    incl = tl.cumsum(cnt, axis=0)
    total = tl.sum(cnt, axis=0)
    g_row = g_ptr + m * scratch_stride
    n_row = n_ptr + m * scratch_stride
    # flat list of the row's (gate value, neuron) pairs, so the entry loop below has no tile bookkeeping
    for c0 in range(0, total, CHUNK):
        e = c0 + tl.arange(0, CHUNK)
        valid = e < total
        g, neuron = _row_entries(cnt, incl, e, valid, m, n_tiles, vals_ptr, idx_ptr, TILE_N, SLOTS, TILES_PAD)
        tl.store(g_row + e, g, mask=valid)
        tl.store(n_row + e, neuron, mask=valid)
    tl.debug_barrier()  # the loop below reads scratch entries that other threads of this program wrote

    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    if HAS_UP:
        xv = tl.load(x_ptr + m * stride_xm + offs_k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
    y = tl.zeros([BLOCK_K], dtype=tl.float32)
    for e in range(0, total):
        g = tl.load(g_row + e)
        neuron = tl.load(n_row + e).to(tl.int64)
        wd = tl.load(wd_ptr + neuron * stride_dn + offs_k * stride_dk, mask=k_ok, other=0.0).to(tl.float32)
        if HAS_UP:
            wu = tl.load(wu_ptr + neuron * stride_un + offs_k * stride_uk, mask=k_ok, other=0.0).to(tl.float32)
            u = tl.sum(wu * xv, axis=0)
            if HAS_UP_BIAS:
                u += tl.load(bu_ptr + neuron).to(tl.float32)
            if DRELU:
                u = tl.where(u <= 0.0, 0.0, u)
            h = g * u
        else:
            h = g
        y += h * wd
    if HAS_DOWN_BIAS:
        y += tl.load(bd_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_k * stride_yk, y.to(y_ptr.dtype.element_ty), mask=k_ok)


def twell_up_down(
    x: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    skip: torch.Tensor,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight_t: torch.Tensor,
    down_bias: torch.Tensor | None,
    *,
    tile_n: int,
    max_entries: int,
    drelu: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, K] from x [M, K] and TwELL arrays; rows with skip[m] != 0 are not written.

    up_weight: [N, K] or None (non-gated: h = gate values); down_weight_t: [N, K] (= down_weight.t()).
    max_entries: >= the largest entry count among rows not skipped (sizes the per-row scratch; the
    dispatcher skips every row past it). K <= policy.MAX_K: whole rows are held in registers.
    """
    m, k = x.shape
    if k > policy.MAX_K:
        raise ValueError(f"twell_up_down needs K <= {policy.MAX_K} (rows live in registers), got K={k}")
    n_tiles, slots = values.shape[1], values.shape[2]
    y = torch.empty_like(x) if out is None else out
    width = max(max_entries, 1)
    g_scratch = torch.empty(m, width, dtype=torch.float32, device=x.device)
    n_scratch = torch.empty(m, width, dtype=torch.int32, device=x.device)
    dummy = x
    _twell_up_down_kernel[(m,)](
        x,
        values,
        indices,
        counts,
        skip,
        up_weight if up_weight is not None else dummy,
        up_bias if up_bias is not None else dummy,
        down_weight_t,
        down_bias if down_bias is not None else dummy,
        y,
        g_scratch,
        n_scratch,
        k,
        n_tiles,
        width,
        x.stride(0),
        x.stride(1),
        *(up_weight.stride() if up_weight is not None else (0, 0)),
        down_weight_t.stride(0),
        down_weight_t.stride(1),
        y.stride(0),
        y.stride(1),
        HAS_UP=up_weight is not None,
        HAS_UP_BIAS=up_bias is not None,
        HAS_DOWN_BIAS=down_bias is not None,
        DRELU=drelu,
        TILE_N=tile_n,
        SLOTS=slots,
        TILES_PAD=max(triton.next_power_of_2(n_tiles), 2),
        CHUNK=CHUNK,
        BLOCK_K=triton.next_power_of_2(k),
    )
    return y
