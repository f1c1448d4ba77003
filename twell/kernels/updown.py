"""Fused sparse up + down projection from TwELL (Algorithm 2 of the paper), exact at any sparsity.

One program per token row m, with the whole x_m and y_m rows in registers. The row's per-tile counts
give a flat numbering of its R packed (gate value g, neuron n) entries (prefix sum over tiles in
registers); the program walks them E at a time:
    u_e = x_m . W_u[n_e]  (skipped for non-gated FFNs);  y_m += sum_e (g_e * u_e) W_d[n_e]
with fp32 accumulation, the E entries' weight rows loaded together (more loads in flight per
program: a long row's serial chain is R / E steps, not R). The hidden state never reaches global
memory and rows of any length need no scratch.

Tiles whose count exceeds their slots (the hybrid format's overflow: the packed entries are
incomplete) are recomputed from W_g in the same program, E neurons at a time, every kept neuron
going through the same entry step: exact at any density, no dense backup buffer, no host.

Rows are taken heaviest first (an argsort of the row totals on the device, `order=True`): a long row
then runs beside the bulk of short ones instead of after them, at the end of the grid.
W_d is read as rows of down_weight^T ([N, K]): pass down_weight.t() with unit stride on K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.kernels import policy
from twell.kernels.common import interpreting, threshold_in


@triton.jit
def _row_entries(
    cnt,
    incl,
    e,
    live,
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
    g = tl.load(vals_ptr + slot_off, mask=live, other=0.0).to(tl.float32)
    neuron = tile * TILE_N + tl.load(idx_ptr + slot_off, mask=live, other=0).to(tl.int32)
    return g, neuron


@triton.jit
def _entries(
    y,
    xv,
    g,
    neuron,
    live,
    offs_k,
    k_ok,
    wu_ptr,
    bu_ptr,
    wd_ptr,
    stride_un,
    stride_uk,
    stride_dn,
    stride_dk,
    HAS_UP: tl.constexpr,
    HAS_UP_BIAS: tl.constexpr,
    DRELU: tl.constexpr,
):
    """y + sum over the live entries e of (g_e * u_e) W_d[neuron_e], u_e = x . W_u[neuron_e] (+ bias,
    dReLU); y + sum g_e W_d[neuron_e] for non-gated FFNs. Dead entries load nothing."""
    rows = neuron.to(tl.int64)[:, None]
    mask = live[:, None] & k_ok[None, :]
    wd = tl.load(wd_ptr + rows * stride_dn + offs_k[None, :] * stride_dk, mask=mask, other=0.0).to(tl.float32)
    if HAS_UP:
        wu = tl.load(wu_ptr + rows * stride_un + offs_k[None, :] * stride_uk, mask=mask, other=0.0).to(tl.float32)
        u = tl.sum(wu * xv[None, :], axis=1)
        if HAS_UP_BIAS:
            u += tl.load(bu_ptr + neuron, mask=live, other=0.0).to(tl.float32)
        if DRELU:
            u = tl.where(u <= 0.0, 0.0, u)
        h = g * u
    else:
        h = g
    h = tl.where(live, h, 0.0)
    return y + tl.sum(h[:, None] * wd, axis=0)


# (E, num_warps, num_stages): E entries per step of a row's loop, their weight rows loaded together
UPDOWN_CONFIGS = [
    (2, 4, 3),
    (1, 4, 3),
    (4, 4, 3),
    (2, 8, 3),
    (4, 8, 3),
    (1, 8, 3),
]


def _configs() -> list[triton.Config]:
    rows = UPDOWN_CONFIGS[:1] if interpreting() else UPDOWN_CONFIGS
    return [triton.Config({"E": e}, num_warps=w, num_stages=s) for e, w, s in rows]


@triton.autotune(configs=_configs(), key=["K", "TILE_N", "SLOTS", "HAS_UP"], cache_results=True)
@triton.jit
def _twell_up_down_kernel(
    x_ptr,
    vals_ptr,
    idx_ptr,
    cnt_ptr,
    order_ptr,
    wg_ptr,
    bg_ptr,
    wu_ptr,
    bu_ptr,
    wd_ptr,
    bd_ptr,
    y_ptr,
    N,
    K,
    n_tiles,
    threshold,
    stride_xm,
    stride_xk,
    stride_gn,
    stride_gk,
    stride_un,
    stride_uk,
    stride_dn,
    stride_dk,
    stride_ym,
    stride_yk,
    HAS_ORDER: tl.constexpr,
    HAS_UP: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr,
    HAS_UP_BIAS: tl.constexpr,
    HAS_DOWN_BIAS: tl.constexpr,
    DRELU: tl.constexpr,
    SQUARE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    TILES_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E: tl.constexpr,
):
    if HAS_ORDER:
        m = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
    else:
        m = tl.program_id(0).to(tl.int64)
    offs_t = tl.arange(0, TILES_PAD)
    true_cnt = tl.load(cnt_ptr + m * n_tiles + offs_t, mask=offs_t < n_tiles, other=0)
    cnt = tl.where(true_cnt > SLOTS, 0, true_cnt)  # an overflowing tile's packed entries are incomplete
    incl = tl.cumsum(cnt, axis=0)
    total = tl.sum(cnt, axis=0)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    xv = tl.load(x_ptr + m * stride_xm + offs_k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
    y = tl.zeros([BLOCK_K], dtype=tl.float32)
    offs_e = tl.arange(0, E)
    for e0 in range(0, total, E):
        e = e0 + offs_e
        live = e < total
        g, neuron = _row_entries(cnt, incl, e, live, m, n_tiles, vals_ptr, idx_ptr, TILE_N, SLOTS, TILES_PAD)
        y = _entries(
            y, xv, g, neuron, live, offs_k, k_ok, wu_ptr, bu_ptr, wd_ptr, stride_un, stride_uk, stride_dn,
            stride_dk, HAS_UP, HAS_UP_BIAS, DRELU,
        )  # fmt: skip
    if tl.max(true_cnt, axis=0) > SLOTS:
        for t in range(0, n_tiles):
            if tl.load(cnt_ptr + m * n_tiles + t) > SLOTS:
                for c0 in range(0, TILE_N, E):
                    cols = t * TILE_N + c0 + offs_e
                    ok = (c0 + offs_e < TILE_N) & (cols < N)
                    wg = tl.load(
                        wg_ptr + cols.to(tl.int64)[:, None] * stride_gn + offs_k[None, :] * stride_gk,
                        mask=ok[:, None] & k_ok[None, :],
                        other=0.0,
                    )
                    g = tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
                    if HAS_GATE_BIAS:
                        g += tl.load(bg_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                    g = g.to(y_ptr.dtype.element_ty).to(tl.float32)  # the dense gate's rounding
                    kept = ((g > threshold) | (g != g)) & ok  # not (g <= t): NaN kept, as by relu
                    if SQUARE:
                        g = (g * g).to(y_ptr.dtype.element_ty).to(tl.float32)
                    y = _entries(
                        y, xv, g, cols, kept, offs_k, k_ok, wu_ptr, bu_ptr, wd_ptr, stride_un, stride_uk,
                        stride_dn, stride_dk, HAS_UP, HAS_UP_BIAS, DRELU,
                    )  # fmt: skip
    if HAS_DOWN_BIAS:
        y += tl.load(bd_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_k * stride_yk, y.to(y_ptr.dtype.element_ty), mask=k_ok)


def twell_up_down(
    x: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight_t: torch.Tensor,
    down_bias: torch.Tensor | None,
    *,
    tile_n: int,
    threshold: float,
    drelu: bool = False,
    square: bool = False,
    out: torch.Tensor | None = None,
    order: bool = True,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """y [M, K] from x [M, K] and the TwELL arrays of act(x gate_weight^T + gate_bias).

    up_weight: [N, K] or None (non-gated: h = gate values, squared with `square`); gate_weight: [N, K],
    read only for overflowing tiles (count > slots), whose entries are recomputed; down_weight_t:
    [N, K] (= down_weight.t()). threshold: the activation's (as given to the gate). K <= policy.MAX_K:
    whole rows are held in registers. order: take rows heaviest first. config: one row of
    UPDOWN_CONFIGS instead of autotuning (tests, benchmarks).
    """
    m, k = x.shape
    if k > policy.MAX_K:
        raise ValueError(f"twell_up_down needs K <= {policy.MAX_K} (rows live in registers), got K={k}")
    n = gate_weight.shape[0]
    n_tiles = values.shape[1]
    if counts.shape != (m, n_tiles) or indices.shape != values.shape or values.shape[0] != m:
        raise ValueError(
            f"twell_up_down expects values/indices [{m}, T, S] and counts [{m}, T], got {list(values.shape)}, "
            f"{list(indices.shape)} and {list(counts.shape)}"
        )
    if n_tiles != triton.cdiv(n, tile_n):
        raise ValueError(f"{n_tiles} tiles do not cover N={n} at tile_n={tile_n}")
    for name, t in (("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight_t", down_weight_t)):
        if t is not None and (tuple(t.shape) != (n, k) or t.dtype != x.dtype or t.device != x.device):
            raise ValueError(
                f"{name} must be [{n}, {k}] {x.dtype} on {x.device}, got {list(t.shape)} {t.dtype} on {t.device}"
            )
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"out must be {list(x.shape)} {x.dtype}, got {list(out.shape)} {out.dtype}")
    y = torch.empty_like(x) if out is None else out
    if m == 0:
        return y
    # rows heaviest first; the order changes which program takes a row, never its result
    row_order = torch.argsort(counts.sum(1), descending=True).to(torch.int32) if order else counts
    dummy = x
    kernel, meta = _twell_up_down_kernel, {}
    if config is not None:
        e, warps, stages = config
        kernel, meta = _twell_up_down_kernel.fn, {"E": e, "num_warps": warps, "num_stages": stages}
    kernel[(m,)](
        x, values, indices, counts, row_order, gate_weight, gate_bias if gate_bias is not None else dummy,
        *((up_weight, up_bias if up_bias is not None else dummy) if up_weight is not None else (dummy, dummy)),
        down_weight_t, down_bias if down_bias is not None else dummy, y, n, k, n_tiles,
        threshold_in(threshold, x.dtype), x.stride(0), x.stride(1), gate_weight.stride(0), gate_weight.stride(1),
        *(up_weight.stride() if up_weight is not None else (0, 0)), down_weight_t.stride(0), down_weight_t.stride(1),
        y.stride(0), y.stride(1), HAS_ORDER=order, HAS_UP=up_weight is not None, HAS_GATE_BIAS=gate_bias is not None,
        HAS_UP_BIAS=up_bias is not None, HAS_DOWN_BIAS=down_bias is not None, DRELU=drelu, SQUARE=square,
        TILE_N=tile_n, SLOTS=values.shape[2], TILES_PAD=max(triton.next_power_of_2(n_tiles), 2),
        BLOCK_K=triton.next_power_of_2(k), **meta,
    )  # fmt: skip
    return y
