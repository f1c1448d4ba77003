"""Fused sparse up + down projection from TwELL (Algorithm 2 of the paper), exact at any sparsity.

_twell_up_down_kernel, one program per token row m, shaped like the reference CUDA kernel: the row's
per-tile counts become one flat list of its R (gate value g, neuron n) pairs in a per-row scratch
(prefix sum over tiles in registers, CHUNK entries at a time); then, with the whole x_m and y_m rows in
registers,
    for each entry j:  u_j = x_m . W_u[n_j]  (skipped for non-gated FFNs);  y_m += (g_j * u_j) W_d[n_j]
with fp32 accumulation: each entry loads both weight rows at once and the entry loop is
software-pipelined. The hidden state never reaches global memory. Rows are taken heaviest first.

A program walks its row's entries one after another (~1.4 us each on an H200), so one long row would
bound the whole launch. The main kernel therefore leaves two kinds of rows, appended to a list on the
device, to _heavy_kernel: rows with more than WIDTH entries and rows with a tile whose count exceeds
its slots (an overflow row of the TwELL format: the packed entries are incomplete, so that tile's gate values
are recomputed from W_g, a GEMV over TILE_N rows). _heavy_kernel, persistent, splits each listed row
into SPLITS parts (entry ranges and overflowing tiles), each part an fp32 partial of y_m; the last
part to finish sums the partials in part order (deterministic). Rows past the partials' capacity are
taken whole by one part. Neither path needs a dense backup buffer or the host.
The row's entries are read from TwELL words (twell.kernels.words) inside each tile's count only.
W_d is read as rows of down_weight^T ([N, K]): pass down_weight.t() with unit stride on K.
hot_pos: the neurons the packer left out (twell.kernels.gate's hot map, -1: packed); recomputed
tiles leave them out too.

Neuron-group passes (groups > 1, LayerConfig.neuron_groups): the main kernel runs once per contiguous
range of tiles, each pass walking only its range's entries, so the W_u / W_d rows a pass gathers (1 / G
of them) can stay in L2 where the whole matrices do not (235 MB at K=4096, N=14336 against the H200's
~50 MB). y is carried between passes in an fp32 [M, K] buffer and the entries are walked in the one pass's
order, at the one pass's config (one autotune key for both: a config of other warps reduces u in another
order, and gave other bits on the H200, equally close to float64); each pass takes its rows heaviest
first by their entries in that pass. A row is heavy there when it has an overflowing tile or more than
WIDTH entries in some pass: a row past WIDTH whose passes each fit is walked in the passes, where gathers
stay in L2, not by _heavy_kernel over all its neurons (on the benchmark's uniform input at K=4096, 0.65%
dense, ~4.4% of the rows, 16% of the entries, are past the width of 256). Those rows get the main
kernel's walk, other bits than one pass's heavy-kernel parts (both within fp32 rounding of float64);
every other row gets one pass's bits. Heavy rows are listed by the first pass and skipped by all;
_heavy_kernel runs once after the last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from twell.format import word_dtype
from twell.kernels import policy
from twell.kernels.common import (
    TunedLaunch,
    autotune_configs,
    cdiv,
    check_bias,
    check_input,
    check_operand,
    check_pos,
    check_threshold,
    check_tile,
    m_bucket,
    next_power_of_2,
    persistent_programs,
    threshold_in,
)
from twell.kernels.words import decode

CHUNK = 16  # entries flattened at a time
MAX_WIDTH = 256  # scratch entries per row; rows with more take the heavy-row kernel
SPLITS = 8  # parts of a heavy row, each a program's work
PARTIAL_BYTES = 64 << 20  # fp32 partials of split rows; rows past this capacity are taken whole


@triton.jit
def _row_entries(
    cnt,
    incl,
    e,
    valid,
    m,
    n_tiles,
    words_ptr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    TILES_PAD: tl.constexpr,
    VALUE: tl.constexpr,
):
    """Gate value (fp32 of a VALUE) and neuron id of the row's flat entries e (entry e lies in the first tile whose
    inclusive count exceeds e)."""
    offs_t = tl.arange(0, TILES_PAD)
    tile = tl.sum((incl[None, :] <= e[:, None]).to(tl.int32), axis=1)
    start = tl.sum(tl.where(offs_t[None, :] == tile[:, None], (incl - cnt)[None, :], 0), axis=1)
    slot_off = (m * n_tiles + tile) * SLOTS + (e - start)
    g, column = decode(tl.load(words_ptr + slot_off, mask=valid, other=0), VALUE)
    return g, tile * TILE_N + column


@triton.jit
def _entry(
    y,
    xv,
    g,
    neuron,
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
    """(y + (g * u) W_d[neuron] with u = x . W_u[neuron] (+ bias, dReLU), or y + g W_d[neuron]; u
    before the activation, fp32: g for a plain FFN)."""
    wd = tl.load(wd_ptr + neuron * stride_dn + offs_k * stride_dk, mask=k_ok, other=0.0).to(tl.float32)
    if HAS_UP:
        wu = tl.load(wu_ptr + neuron * stride_un + offs_k * stride_uk, mask=k_ok, other=0.0).to(tl.float32)
        u = tl.sum(wu * xv, axis=0)
        if HAS_UP_BIAS:
            u += tl.load(bu_ptr + neuron).to(tl.float32)
        a = u
        if DRELU:
            a = tl.where(u <= 0.0, 0.0, u)
        h = g * a
    else:
        u = g
        h = g
    return y + h * wd, u


@triton.jit
def _flatten(
    cnt, incl, lo, count, m, n_tiles, words_ptr, g_row, n_row, TILE_N: tl.constexpr, SLOTS: tl.constexpr,
    TILES_PAD: tl.constexpr, CHUNK: tl.constexpr, VALUE: tl.constexpr,
):  # fmt: skip
    """The row's flat entries lo .. lo + count - 1 as (gate value, neuron) pairs in the scratch, CHUNK
    at a time, so the entry loop that follows has no tile bookkeeping."""
    for c0 in range(0, count, CHUNK):
        e = c0 + tl.arange(0, CHUNK)
        valid = e < count
        g, neuron = _row_entries(cnt, incl, lo + e, valid, m, n_tiles, words_ptr, TILE_N, SLOTS, TILES_PAD, VALUE)
        tl.store(g_row + e, g, mask=valid)
        tl.store(n_row + e, neuron, mask=valid)


@triton.jit
def _walk(
    y, xv, g_row, n_row, count, offs_k, k_ok, wu_ptr, bu_ptr, wd_ptr, stride_un, stride_uk, stride_dn, stride_dk,
    u_row, HAS_UP: tl.constexpr, HAS_UP_BIAS: tl.constexpr, DRELU: tl.constexpr, STORE_U: tl.constexpr,
    U_WIDTH: tl.constexpr,
):  # fmt: skip
    """y plus the first `count` scratch entries' contributions, one entry after another; with STORE_U
    entry e's u (before the activation) to u_row[e] for e < U_WIDTH."""
    for e in range(0, count):
        y, u = _entry(
            y, xv, tl.load(g_row + e), tl.load(n_row + e).to(tl.int64), offs_k, k_ok, wu_ptr, bu_ptr, wd_ptr,
            stride_un, stride_uk, stride_dn, stride_dk, HAS_UP, HAS_UP_BIAS, DRELU,
        )  # fmt: skip
        if STORE_U:
            tl.store(u_row + e, u.to(u_row.dtype.element_ty), mask=e < U_WIDTH)
    return y


@triton.jit
def _store_row(y, m, bd_ptr, y_ptr, offs_k, k_ok, stride_ym, stride_yk, HAS_DOWN_BIAS: tl.constexpr):
    if HAS_DOWN_BIAS:
        y += tl.load(bd_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_k * stride_yk, y.to(y_ptr.dtype.element_ty), mask=k_ok)


ROWVEC_CONFIGS = [
    # (num_warps, num_stages): the whole K row lives in registers, entries stream one at a time
    (4, 3),
    (8, 3),
    (4, 4),
    (2, 3),
]


@triton.autotune(
    configs=autotune_configs(ROWVEC_CONFIGS, lambda w, s: {}),
    # per token bucket: with one key for every M, whichever size ran first chose the config for all sizes
    # (the 8192-token variance it was suspected of came from host time instead: benchmarks/NOTES.md v9)
    # GROUPS, FIRST and LAST are not in the key: the neuron-group passes run at the one pass's config, so they
    # give its bits (the warps set u's reduction order). A key first launched grouped is benchmarked by a first
    # pass, which starts from zeros (a later pass run again would add its group to acc again)
    key=["M_BUCKET", "K", "TILE_N", "SLOTS", "HAS_UP", "WIDTH"],
    cache_results=True,
    reset_to_zero=["heavy_ptr"],  # the heavy list starts empty on every benchmarked run
)
@triton.jit(do_not_specialize=["tile_lo", "tile_hi"])  # one binary for every pass's bounds
def _twell_up_down_kernel(
    x_ptr,
    words_ptr,
    cnt_ptr,
    order_ptr,
    heavy_ptr,
    wu_ptr,
    bu_ptr,
    wd_ptr,
    bd_ptr,
    y_ptr,
    acc_ptr,
    g_ptr,
    n_ptr,
    u_ptr,
    K,
    n_tiles,
    tile_lo,
    tile_hi,
    M_BUCKET,
    stride_xm,
    stride_xk,
    stride_un,
    stride_uk,
    stride_dn,
    stride_dk,
    stride_ym,
    stride_yk,
    HAS_ORDER: tl.constexpr,
    HAS_UP: tl.constexpr,
    HAS_UP_BIAS: tl.constexpr,
    HAS_DOWN_BIAS: tl.constexpr,
    DRELU: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    TILES_PAD: tl.constexpr,
    WIDTH: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STORE_U: tl.constexpr,
    U_WIDTH: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
):
    """The common row: no overflowing tile and at most WIDTH entries; the others are appended to the
    heavy list (heavy[0]: their number, heavy[1 + i]: row ids) for _heavy_kernel. Program i takes
    row order[i] with HAS_ORDER (heaviest first), else row i. STORE_U (the training forward's record,
    twell.kernels.backward): the row's first U_WIDTH entries' u, in entry order, to u [M, U_WIDTH]
    (u_ptr None without: the inference kernel unchanged); heavy rows' are not stored.
    GROUPS > 1: one pass of GROUPS, over the entries in tiles [tile_lo, tile_hi) only (in the same order as
    the whole row's walk); y starts from zeros in the FIRST pass, else from the row's fp32 partial in acc
    [M, K] (contiguous), and goes to acc, or (LAST) to y. A row is heavy there when it has an overflowing
    tile or more than WIDTH entries in some pass (pass g: tiles [T g // GROUPS, T (g + 1) // GROUPS)),
    decided alike by every pass from all its tiles; only the FIRST pass lists it."""
    if HAS_ORDER:
        m = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
    else:
        m = tl.program_id(0).to(tl.int64)
    offs_t = tl.arange(0, TILES_PAD)
    cnt = tl.load(cnt_ptr + m * n_tiles + offs_t, mask=offs_t < n_tiles, other=0)
    total = tl.sum(cnt, axis=0)
    if GROUPS > 1:
        # tile t is in pass ((t + 1) G - 1) // T, the g with T g // G <= t < T (g + 1) // G
        offs_g = tl.arange(0, GROUPS_PAD)
        in_pass = (((offs_t + 1) * GROUPS - 1) // n_tiles)[:, None] == offs_g[None, :]
        widest = tl.max(tl.sum(tl.where(in_pass, cnt[:, None], 0), axis=0), axis=0)
    else:
        widest = total
    if (tl.max(cnt, axis=0) > SLOTS) | (widest > WIDTH):
        if FIRST:
            slot = tl.atomic_add(heavy_ptr, 1)
            tl.store(heavy_ptr + 1 + slot, m.to(tl.int32))
        return
    if GROUPS > 1:
        # the other groups' tiles as empty: the flat entries are this group's, walked in the whole row's order
        cnt = tl.where((offs_t >= tile_lo) & (offs_t < tile_hi), cnt, 0)
        total = tl.sum(cnt, axis=0)
    incl = tl.cumsum(cnt, axis=0)
    g_row = g_ptr + m * WIDTH
    n_row = n_ptr + m * WIDTH
    _flatten(
        cnt, incl, 0, total, m, n_tiles, words_ptr, g_row, n_row, TILE_N, SLOTS, TILES_PAD, CHUNK,
        x_ptr.dtype.element_ty,
    )  # fmt: skip
    tl.debug_barrier()  # the loop below reads scratch entries that other threads of this program wrote
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    xv = tl.load(x_ptr + m * stride_xm + offs_k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
    u_row = u_ptr
    if STORE_U:
        u_row = u_ptr + m * U_WIDTH
    if FIRST:
        y = tl.zeros([BLOCK_K], dtype=tl.float32)
    else:
        y = tl.load(acc_ptr + m * K + offs_k, mask=k_ok, other=0.0)
    y = _walk(
        y, xv, g_row, n_row, total, offs_k, k_ok, wu_ptr, bu_ptr, wd_ptr, stride_un, stride_uk, stride_dn, stride_dk,
        u_row, HAS_UP, HAS_UP_BIAS, DRELU, STORE_U, U_WIDTH,
    )  # fmt: skip
    if LAST:
        _store_row(y, m, bd_ptr, y_ptr, offs_k, k_ok, stride_ym, stride_yk, HAS_DOWN_BIAS)
    else:
        tl.store(acc_ptr + m * K + offs_k, y, mask=k_ok)


@triton.jit
def _heavy_part(
    xv,
    offs_k,
    k_ok,
    m,
    part,
    parts,
    words_ptr,
    cnt_ptr,
    wg_ptr,
    bg_ptr,
    wu_ptr,
    bu_ptr,
    wd_ptr,
    pos_ptr,
    g_row,
    n_row,
    N,
    n_tiles,
    threshold,
    stride_gn,
    stride_gk,
    stride_un,
    stride_uk,
    stride_dn,
    stride_dk,
    HAS_UP: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr,
    HAS_HOT: tl.constexpr,
    HAS_UP_BIAS: tl.constexpr,
    DRELU: tl.constexpr,
    SQUARE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    TILES_PAD: tl.constexpr,
    WIDTH: tl.constexpr,
    CHUNK: tl.constexpr,
    RECOMPUTE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 partial of y_m over part `part` of `parts` of row m: its share of the packed entries (one
    contiguous range, WIDTH at a time through the program's scratch) and the overflowing tiles t with
    t % parts == part, whose gate values are recomputed from W_g RECOMPUTE neurons at a time."""
    offs_t = tl.arange(0, TILES_PAD)
    true_cnt = tl.load(cnt_ptr + m * n_tiles + offs_t, mask=offs_t < n_tiles, other=0)
    cnt = tl.where(true_cnt > SLOTS, 0, true_cnt)
    incl = tl.cumsum(cnt, axis=0)
    total = tl.sum(cnt, axis=0)
    per = tl.cdiv(total, parts)
    lo = part * per
    hi = tl.minimum(total, lo + per)
    y = tl.zeros([BLOCK_K], dtype=tl.float32)
    for b0 in range(lo, hi, WIDTH):
        block = tl.minimum(hi - b0, WIDTH)
        _flatten(cnt, incl, b0, block, m, n_tiles, words_ptr, g_row, n_row, TILE_N, SLOTS, TILES_PAD, CHUNK, OUT_DTYPE)
        tl.debug_barrier()
        y = _walk(
            y, xv, g_row, n_row, block, offs_k, k_ok, wu_ptr, bu_ptr, wd_ptr, stride_un, stride_uk, stride_dn,
            stride_dk, g_row, HAS_UP, HAS_UP_BIAS, DRELU, False, 0,
        )  # fmt: skip
        tl.debug_barrier()  # the next block overwrites the scratch
    offs_r = tl.arange(0, RECOMPUTE)
    for t in range(part, n_tiles, parts):
        if tl.load(cnt_ptr + m * n_tiles + t) > SLOTS:
            for c0 in range(0, TILE_N, RECOMPUTE):
                cols = t * TILE_N + c0 + offs_r
                ok = (c0 + offs_r < TILE_N) & (cols < N)
                rows = cols.to(tl.int64)
                wg = tl.load(
                    wg_ptr + rows[:, None] * stride_gn + offs_k[None, :] * stride_gk, ok[:, None] & k_ok[None, :], 0.0
                )
                g = tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
                if HAS_GATE_BIAS:
                    g += tl.load(bg_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                g = g.to(OUT_DTYPE).to(tl.float32)  # the dense gate's rounding
                kept = ((g > threshold) | (g != g)) & ok  # not (g <= t): NaN kept, as by relu
                if HAS_HOT:
                    kept = kept & (tl.load(pos_ptr + cols, mask=ok, other=-1) < 0)
                if SQUARE:
                    g = (g * g).to(OUT_DTYPE).to(tl.float32)
                slot = tl.cumsum(kept.to(tl.int32), axis=0) - 1
                n_kept = tl.sum(kept.to(tl.int32), axis=0)
                tl.store(g_row + slot, g, mask=kept)
                tl.store(n_row + slot, cols, mask=kept)
                tl.debug_barrier()
                y = _walk(
                    y, xv, g_row, n_row, n_kept, offs_k, k_ok, wu_ptr, bu_ptr, wd_ptr, stride_un, stride_uk,
                    stride_dn, stride_dk, g_row, HAS_UP, HAS_UP_BIAS, DRELU, False, 0,
                )  # fmt: skip
                tl.debug_barrier()
    return y


@triton.jit
def _heavy_kernel(
    x_ptr,
    words_ptr,
    cnt_ptr,
    heavy_ptr,
    sem_ptr,
    part_ptr,
    wg_ptr,
    bg_ptr,
    wu_ptr,
    bu_ptr,
    wd_ptr,
    bd_ptr,
    pos_ptr,
    y_ptr,
    g_ptr,
    n_ptr,
    N,
    K,
    n_tiles,
    capacity,
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
    HAS_UP: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr,
    HAS_UP_BIAS: tl.constexpr,
    HAS_DOWN_BIAS: tl.constexpr,
    HAS_HOT: tl.constexpr,
    DRELU: tl.constexpr,
    SQUARE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    TILES_PAD: tl.constexpr,
    WIDTH: tl.constexpr,
    CHUNK: tl.constexpr,
    RECOMPUTE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Persistent over the heavy list's SPLITS parts per row: rows i < capacity in SPLITS partials
    (the last part to arrive sums them in order), later rows whole, one item each. Which rows are
    split depends on the order the main kernel listed them in; the result does not."""
    pid = tl.program_id(0)
    g_row = g_ptr + pid * WIDTH
    n_row = n_ptr + pid * WIDTH
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    n_heavy = tl.load(heavy_ptr)
    n_split = tl.minimum(n_heavy, capacity) * SPLITS  # items: the split rows' parts, then whole rows
    for item in range(pid, n_split + tl.maximum(n_heavy - capacity, 0), tl.num_programs(0)):
        split = item < n_split
        i = tl.where(split, item // SPLITS, capacity + item - n_split)
        part = item % SPLITS
        m = tl.load(heavy_ptr + 1 + i).to(tl.int64)
        xv = tl.load(x_ptr + m * stride_xm + offs_k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
        # a whole row goes through the same parts, summed in the same order: the same bits either way
        y = tl.zeros([BLOCK_K], dtype=tl.float32)
        for p in range(tl.where(split, part, 0), tl.where(split, part + 1, SPLITS)):
            y_p = _heavy_part(
                xv, offs_k, k_ok, m, p, SPLITS, words_ptr, cnt_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr,
                wd_ptr, pos_ptr, g_row, n_row, N, n_tiles, threshold, stride_gn, stride_gk, stride_un,
                stride_uk, stride_dn, stride_dk, HAS_UP, HAS_GATE_BIAS, HAS_HOT, HAS_UP_BIAS, DRELU, SQUARE,
                y_ptr.dtype.element_ty,
                TILE_N, SLOTS, TILES_PAD, WIDTH, CHUNK, RECOMPUTE, BLOCK_K,
            )  # fmt: skip
            y += y_p
        if split:
            partial = part_ptr + (i * SPLITS).to(tl.int64) * K + offs_k
            tl.store(partial + part * K, y, mask=k_ok)
            tl.debug_barrier()  # every thread's partial is stored before the arrival is published
            if tl.atomic_add(sem_ptr + i, 1, sem="acq_rel") == SPLITS - 1:
                # the last part of this row: sum the partials in part order
                y = tl.zeros([BLOCK_K], dtype=tl.float32)
                for p in range(0, SPLITS):
                    y += tl.load(partial + p * K, mask=k_ok, other=0.0, cache_modifier=".cg")
                _store_row(y, m, bd_ptr, y_ptr, offs_k, k_ok, stride_ym, stride_yk, HAS_DOWN_BIAS)
        else:
            _store_row(y, m, bd_ptr, y_ptr, offs_k, k_ok, stride_ym, stride_yk, HAS_DOWN_BIAS)


def row_width(n_tiles: int, slots: int) -> int:
    """Scratch entries a row of the main kernel holds (its WIDTH): rows with more take _heavy_kernel."""
    return min(n_tiles * slots, MAX_WIDTH)


# the main kernel's configs, chosen once per key by its autotuner
_up_down_launch = TunedLaunch(_twell_up_down_kernel)


@triton.jit
def _row_totals_kernel(
    cnt_ptr, key_ptr, part_ptr, heavy_ptr, sem_ptr, M, n_tiles, capacity, ORDER: tl.constexpr, BLOCK_M: tl.constexpr,
    TILES_PAD: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    """For BLOCK_M rows of counts: their total entries (true counts) to part_ptr[program] (int64; the
    density probe adds the programs' on the host), with ORDER each row's sort key, its total clamped to
    255 as a byte (one radix pass; rows past 255 entries are heavy-kernel rows anyway), GROUPS keys a row
    ([GROUPS, M]: pass g's key of row m, its entries in the pass's tiles); and the heavy-row kernels'
    counters zeroed: the heavy list's length (by program 0) and this program's rows' share of the per-row
    arrival counts. One launch where torch took five (sum, clamp, cast, the probe's sum, a zero fill)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_t = tl.arange(0, TILES_PAD)
    rows = offs_m < M
    mask = rows[:, None] & (offs_t < n_tiles)[None, :]
    cnt = tl.load(cnt_ptr + offs_m.to(tl.int64)[:, None] * n_tiles + offs_t[None, :], mask=mask, other=0)
    total = tl.sum(cnt, axis=1)
    tl.store(part_ptr + tl.program_id(0), tl.sum(total.to(tl.int64), axis=0))
    if ORDER:
        if GROUPS > 1:
            for g in range(0, GROUPS):  # pass g: tiles [T g // G, T (g + 1) // G)
                in_pass = (offs_t >= n_tiles * g // GROUPS) & (offs_t < n_tiles * (g + 1) // GROUPS)
                part = tl.sum(tl.where(in_pass[None, :], cnt, 0), axis=1)
                tl.store(key_ptr + g * M + offs_m, tl.minimum(part, 255).to(tl.uint8), mask=rows)
        else:
            tl.store(key_ptr + offs_m, tl.minimum(total, 255).to(tl.uint8), mask=rows)
    zero = tl.zeros([BLOCK_M], dtype=tl.int32)
    tl.store(sem_ptr + offs_m, zero, mask=offs_m < capacity)
    tl.store(heavy_ptr + offs_m * 0, zero, mask=offs_m == 0)


def twell_up_down(
    x: torch.Tensor,
    words: torch.Tensor,
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
    hot_pos: torch.Tensor | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """y [M, K] from x [M, K] and the TwELL arrays (words, counts; twell.format's layout, slots past
    each count never read) of act(x gate_weight^T + gate_bias).

    up_weight: [N, K] or None (non-gated: h = gate values, squared with `square`); gate_weight: [N, K],
    read only for overflowing tiles (count > slots), whose entries are recomputed; down_weight_t:
    [N, K] (= down_weight.t()). threshold: the activation's (as given to the gate). K <= policy.MAX_K:
    whole rows are held in registers. order: rows heaviest first (an argsort of the row totals on the
    device; it changes which program takes a row, never the row's result). hot_pos: int32 [N], the
    packer's hot map (neurons >= 0 were packed without): overflowing tiles leave them out too. groups:
    the main kernel's passes, each over a contiguous range of tiles (at most one a tile; module
    docstring).
    """
    check_input("x", x)
    check_threshold(threshold)
    m, k = x.shape
    if k > policy.MAX_K:
        raise ValueError(f"twell_up_down needs K <= {policy.MAX_K} (rows live in registers), got K={k}")
    if not isinstance(gate_weight, torch.Tensor) or gate_weight.dim() != 2:
        raise ValueError(f"gate_weight must be a 2-dim tensor [N, {k}]")
    n = gate_weight.shape[0]
    if not all(isinstance(t, torch.Tensor) for t in (words, counts)) or words.dim() != 3:
        raise ValueError("twell_up_down expects words [M, T, S] and counts [M, T] tensors")
    n_tiles, slots = words.shape[1], words.shape[2]
    if counts.shape != (m, n_tiles) or words.shape[0] != m:
        raise ValueError(
            f"twell_up_down expects words [{m}, T, S] and counts [{m}, T], got {list(words.shape)} and "
            f"{list(counts.shape)}"
        )
    if n_tiles != cdiv(n, tile_n):
        raise ValueError(f"{n_tiles} tiles do not cover N={n} at tile_n={tile_n}")
    for name, t in (("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight_t", down_weight_t)):
        if t is not None and (tuple(t.shape) != (n, k) or t.dtype != x.dtype or t.device != x.device):
            raise ValueError(
                f"{name} must be [{n}, {k}] {x.dtype} on {x.device}, got {list(t.shape)} {t.dtype} on {t.device}"
            )
    check_tile(tile_n, slots)
    # the kernels index the TwELL arrays as dense [M, T, S] / [M, T] of these types
    for name, t, dtype in (("words", words, word_dtype(x.dtype)), ("counts", counts, torch.int32)):
        check_operand(name, t, tuple(t.shape), x, dtype)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (indexed as a dense array), got strides {t.stride()}")
    if up_bias is not None and up_weight is None:
        raise ValueError("up_bias needs up_weight (a plain FFN has its bias as gate_bias)")
    for name, b, size in (("gate_bias", gate_bias, n), ("up_bias", up_bias, n), ("down_bias", down_bias, k)):
        check_bias(name, b, size, x)
    check_pos(hot_pos, n, x)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(
            f"out must be {list(x.shape)} {x.dtype} on {x.device}, got {list(out.shape)} {out.dtype} on {out.device}"
        )
    return launch_up_down(
        x, words, counts, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, down_bias, tile_n=tile_n,
        threshold=threshold, drelu=drelu, square=square, out=out, order=order, hot_pos=hot_pos, groups=groups,
    )[0]  # fmt: skip


def launch_up_down(
    x, words, counts, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, down_bias, *, tile_n, threshold,
    drelu=False, square=False, out=None, order=True, hot_pos=None, up_out=None, groups=1,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """twell_up_down without its input checks, for callers that checked at the op boundary (the
    dispatcher); returns (y, kept): kept, int64 [P] on the device, parts of the total of counts (the
    density probe's numerator: their sum; counted by the launch that builds the row order). up_out:
    None, or [M, U] contiguous in x's dtype (the training forward's record): the main kernel's rows
    (no overflowing tile, at most min(T * S, MAX_WIDTH) entries) store their first U entries' u there,
    in entry order (tiles, then slots), rounded to the dtype; other slots are left as they were. groups:
    the main kernel as that many passes (at most one a tile), pass g over the tiles [T * g // groups,
    T * (g + 1) // groups), y carried between them in fp32 (not with up_out); rows past the width whose
    passes each fit are walked there (module docstring). Launches: row totals, the
    argsort of their keys (order; a pass's rows by their entries in it), the main kernel (autotuned once
    per key, TunedLaunch) once a pass,
    the heavy-row kernel; no zero fill."""
    policy.check_neuron_groups(groups, "groups")
    if groups > 1 and up_out is not None:
        raise ValueError(f"up_out (the training record) is stored by one pass only, got groups={groups}")
    m, k = x.shape
    n = gate_weight.shape[0]
    n_tiles, slots = words.shape[1], words.shape[2]
    groups = min(groups, n_tiles)
    y = torch.empty_like(x) if out is None else out
    # y of the main kernel's rows between its passes: fp32, so the passes give one pass's bits
    acc = torch.empty(m, k, dtype=torch.float32, device=x.device) if groups > 1 else None
    width = row_width(n_tiles, slots)
    programs = persistent_programs(x.device, 8)
    # a row's entries (main kernel), then a heavy-row program's (after it, in stream order)
    g_scratch = torch.empty(max(m, programs), width, dtype=torch.float32, device=x.device)
    n_scratch = torch.empty(max(m, programs), width, dtype=torch.int32, device=x.device)
    capacity = max(1, min(m, PARTIAL_BYTES // (SPLITS * k * 4)))
    # heavy[0]: rows listed by the main kernel, heavy[1:1 + m]: their ids; sem = heavy[1 + m:]: parts
    # arrived per row. The row totals' launch zeroes heavy[0] and sem.
    heavy = torch.empty(1 + m + capacity, dtype=torch.int32, device=x.device)
    partials = torch.empty(capacity, SPLITS, k, dtype=torch.float32, device=x.device)
    dummy = x
    up = (up_weight, up_bias if up_bias is not None else dummy) if up_weight is not None else (dummy, dummy)
    strides = (
        *(up_weight.stride() if up_weight is not None else (0, 0)),
        down_weight_t.stride(0),
        down_weight_t.stride(1),
        y.stride(0),
        y.stride(1),
    )
    tiles_pad = max(next_power_of_2(n_tiles), 2)
    flags = {
        "HAS_UP": up_weight is not None,
        "HAS_UP_BIAS": up_bias is not None,
        "HAS_DOWN_BIAS": down_bias is not None,
        "DRELU": drelu,
        "TILE_N": tile_n,
        "SLOTS": slots,
        "TILES_PAD": tiles_pad,
        "WIDTH": width,
        "BLOCK_K": next_power_of_2(k),
    }
    down_bias = down_bias if down_bias is not None else dummy
    # a pass's rows heaviest first by their entries in the pass (the whole row's with one pass)
    keys = torch.empty(groups, m, dtype=torch.uint8, device=x.device) if order else counts
    block_m = max(16, 8192 // tiles_pad)
    parts = max(1, cdiv(m, block_m))  # program 0 zeroes heavy[0] even with no rows
    kept = torch.empty(parts, dtype=torch.int64, device=x.device)
    _row_totals_kernel[(parts,)](
        counts, keys, kept, heavy, heavy[1 + m :], m, n_tiles, capacity, ORDER=order, BLOCK_M=block_m,
        TILES_PAD=tiles_pad, GROUPS=groups,
    )  # fmt: skip
    # pass g's rows (int64), or counts as a placeholder without order: the kernel reads either
    row_order = torch.argsort(keys, dim=1, descending=True) if order else counts.expand(groups, *counts.shape)
    bucket = m_bucket(m)
    # one key for one pass and the passes (the autotuner's two, by acc's dtype): the passes take its config
    key = (bucket, k, tile_n, slots, flags["HAS_UP"], width, x.dtype, order, up_out is not None)
    for g in range(groups):
        _up_down_launch(
            key, (m,), x, words, counts, row_order[g], heavy, *up, down_weight_t, down_bias, y, acc, g_scratch,
            n_scratch, up_out, k, n_tiles, n_tiles * g // groups, n_tiles * (g + 1) // groups, bucket, x.stride(0),
            x.stride(1), *strides, HAS_ORDER=order, CHUNK=CHUNK, STORE_U=up_out is not None,
            U_WIDTH=up_out.shape[1] if up_out is not None else 0, GROUPS=groups,
            GROUPS_PAD=next_power_of_2(groups), FIRST=g == 0, LAST=g == groups - 1, **flags,
        )  # fmt: skip
    # neurons recomputed at a time: a [RECOMPUTE, BLOCK_K] tile of W_g in registers, kept ones fit the scratch
    recompute = 1 << (min(16, max(1, 16384 // flags["BLOCK_K"]), tile_n, width).bit_length() - 1)
    _heavy_kernel[(programs,)](
        x, words, counts, heavy, heavy[1 + m :], partials, gate_weight,
        gate_bias if gate_bias is not None else dummy, *up, down_weight_t, down_bias,
        hot_pos if hot_pos is not None else counts, y, g_scratch,
        n_scratch, n, k, n_tiles, capacity,
        threshold_in(threshold, x.dtype), x.stride(0), x.stride(1), gate_weight.stride(0), gate_weight.stride(1),
        *strides, HAS_GATE_BIAS=gate_bias is not None, HAS_HOT=hot_pos is not None, SQUARE=square, CHUNK=CHUNK,
        RECOMPUTE=recompute, SPLITS=SPLITS, num_warps=4, **flags,
    )  # fmt: skip
    return y, kept
