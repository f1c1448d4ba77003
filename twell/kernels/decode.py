"""Decode path: few tokens, bound by bytes. All of W_g is read, but only the active rows of W_u and W_d.

Two kernels per call, no host synchronisation and no memset (CUDA graphs capture it):
1. gate + up, one program per (block of BLOCK_N neurons, block of tokens): g = x W_g[blk]^T (+ bias),
   kept = not (g <= threshold); the block's active neurons (kept for some token of the block) load
   their W_u rows (masked loads of inactive rows move no bytes) and h = act(g) * u, rounded like the
   dense FFN rounds it. The block's active neuron ids are compacted to the front of its segment of
   `ids`, their h columns likewise to `hc` (BLOCK_M contiguous values an entry), their number to
   `counts`. With decode_ffn(pipeline=P) (two or more tokens; measured only as a benchmark variant) a
   program takes P neuron blocks, each block's W_u rows read in the K loop that streams the next block's
   W_g rows, so the up rows' latency hides under the gate's stream; the same bits.
2. down, one program per (K block, token block, split): y_part = hc[entries] W_d^T[ids, kblk] in fp32
   over the split's entries, walked in neuron-block order. A split is either a run-time share of the
   token block's entries (sized by their number: one split at low density) or a static group of
   neuron blocks. With one split the program writes y directly; otherwise partials go to a scratch
   buffer and the last program of each (K block, token block) to arrive (a counter, zeroed by kernel 1
   and reset by that program) sums them in split order: deterministic, no atomics on data.

One token at K <= 2048 (down_rows) skips the list: kernel 1 reads each active neuron's W_u and W_d
rows together and writes its block's fp32 row of y (sum of h[n] W_d[n, :]) and count; the rows kernel
sums the rows of blocks with a nonzero count (two memory rounds: counts, rows) instead of the list
path's counts, then ids and h, then W_d gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from twell.kernels.common import (
    cdiv,
    check_bias,
    check_input,
    check_operand,
    check_threshold,
    dot_precision,
    interpreting,
    next_power_of_2,
    threshold_in,
)


@triton.jit
def _rows_times_x(
    x_ptr,
    w_ptr,
    rows,
    cols,
    m_ok,
    w_rows_ok,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EACH: tl.constexpr,
):
    """x[rows] @ w[cols]^T in fp32, [BLOCK_M, BLOCK_N]; rows of w outside w_rows_ok are not read. One
    token (BLOCK_M == 1) is a GEMV on the CUDA cores: products accumulate per lane, one reduction at
    the end (no 16-row padding of the tensor-core path), or with EACH one reduction per K step (no
    [BLOCK_K, BLOCK_N] accumulator: registers left for loads in flight)."""
    if BLOCK_M == 1 and not EACH:
        part = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w_mask = w_rows_ok[None, :] & k_ok[:, None]
        wt = tl.load(w_ptr + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        if BLOCK_M == 1:
            xk = tl.load(x_ptr + rows * stride_xm + offs_k * stride_xk, mask=k_ok, other=0.0)
            if EACH:
                acc += tl.sum(xk.to(tl.float32)[:, None] * wt.to(tl.float32), axis=0)[None, :]
            else:
                part += xk.to(tl.float32)[:, None] * wt.to(tl.float32)
        else:
            x_mask = m_ok[:, None] & k_ok[None, :]
            xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=x_mask, other=0.0)
            acc = tl.dot(xt, wt, acc, input_precision=DOT_PRECISION)
    if BLOCK_M == 1 and not EACH:
        acc = tl.sum(part, axis=0)[None, :]
    return acc


@triton.jit
def _active_rows_times_x(
    x_row, w_ptr, offs_n, active, n_active, K, stride_xk, stride_wn, stride_wk, UP_K: tl.constexpr
):
    """x . w[n] for the block's active neurons n (0 elsewhere), [1, BLOCK_N], one token: each active
    row is read whole, UP_K at a time, so a block pays one memory latency per active neuron instead of
    one per K step of a masked block product."""
    slot = tl.cumsum(active.to(tl.int32), axis=0) - 1
    u = tl.zeros(offs_n.shape, dtype=tl.float32)
    for j in range(0, n_active):
        neuron = tl.sum(tl.where(active & (slot == j), offs_n, 0), axis=0)
        dot = tl.full([], 0.0, tl.float32)
        for k0 in range(0, K, UP_K):
            offs_k = k0 + tl.arange(0, UP_K)
            k_ok = offs_k < K
            xk = tl.load(x_row + offs_k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
            wk = tl.load(w_ptr + neuron.to(tl.int64) * stride_wn + offs_k * stride_wk, mask=k_ok, other=0.0)
            dot += tl.sum(xk * wk.to(tl.float32), axis=0)
        u = tl.where(offs_n == neuron, dot, u)
    return u[None, :]


@triton.jit
def _active_rows_down(
    x_row, wu_ptr, bu_ptr, wd_ptr, hg, offs_n, active, n_active, K, stride_xk, stride_un, stride_uk, stride_dn,
    stride_dk, HAS_UP: tl.constexpr, HAS_UP_BIAS: tl.constexpr, DRELU: tl.constexpr, UP_K: tl.constexpr,
):  # fmt: skip
    """One token, K <= UP_K: sum over the block's active neurons n of h[n] W_d[n, :] in fp32, [UP_K]
    (0 past K), with h[n] = hg[n] * act(x . W_u[n]) rounded as the dense FFN rounds it (hg: the
    activated gate, [BLOCK_N]). A neuron's W_u and W_d rows are read whole and together, so the block
    pays one memory latency per active neuron for both projections."""
    dtype = x_row.dtype.element_ty
    offs_k = tl.arange(0, UP_K)
    k_ok = offs_k < K
    slot = tl.cumsum(active.to(tl.int32), axis=0) - 1
    row = tl.zeros([UP_K], dtype=tl.float32)
    if HAS_UP:
        xk = tl.load(x_row + offs_k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
    for j in range(0, n_active):
        this = active & (slot == j)
        neuron = tl.sum(tl.where(this, offs_n, 0), axis=0).to(tl.int64)
        h = tl.sum(tl.where(this, hg, 0.0), axis=0)
        wd = tl.load(wd_ptr + neuron * stride_dn + offs_k * stride_dk, mask=k_ok, other=0.0)
        if HAS_UP:
            wu = tl.load(wu_ptr + neuron * stride_un + offs_k * stride_uk, mask=k_ok, other=0.0)
            u = tl.sum(xk * wu.to(tl.float32), axis=0)
            if HAS_UP_BIAS:
                u += tl.load(bu_ptr + neuron).to(tl.float32)
            u = u.to(dtype).to(tl.float32)
            if DRELU:
                u = tl.where(u <= 0.0, 0.0, u)
            h = h * u
        row += h.to(dtype).to(tl.float32) * wd.to(tl.float32)
    return row


@triton.jit
def _prefetch_rows_to_l2(ptr, rows, wanted, K, stride_n, LINE: tl.constexpr, LINES: tl.constexpr):
    """Asks L2 for rows[wanted] of a [N, K] array (unit stride on K), LINE elements a 128-byte line, and
    waits for nothing: the kernel that reads them next finds them in L2. GPU only (PTX prefetch)."""
    line = tl.arange(0, LINES) * LINE
    ptrs = ptr + rows.to(tl.int64)[:, None] * stride_n + line[None, :]
    ask = (wanted[:, None] & (line[None, :] < K)).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, ask],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _gate_and_up(
    x_ptr, wg_ptr, wu_ptr, rows, m_ok, gate_cols, gate_ok, up_cols, up_ok, K, stride_xm, stride_xk, stride_gn,
    stride_gk, stride_un, stride_uk, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_UP: tl.constexpr,
):  # fmt: skip
    """(x[rows] @ wg[gate_cols]^T, x[rows] @ wu[up_cols]^T) in fp32 in one K loop, rows of wg / wu outside
    gate_ok / up_ok not read (BLOCK_M > 1): the next neuron block's gate streams with this block's up
    rows, so the up rows' latency hides under the gate's stream. Each product takes _rows_times_x's steps
    (the same bits)."""
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x_mask = m_ok[:, None] & k_ok[None, :]
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=x_mask, other=0.0)
        g_mask = gate_ok[None, :] & k_ok[:, None]
        wg = tl.load(wg_ptr + gate_cols[None, :] * stride_gn + offs_k[:, None] * stride_gk, mask=g_mask, other=0.0)
        acc_g = tl.dot(xt, wg, acc_g, input_precision=DOT_PRECISION)
        if HAS_UP:
            u_mask = up_ok[None, :] & k_ok[:, None]
            wu = tl.load(wu_ptr + up_cols[None, :] * stride_un + offs_k[:, None] * stride_uk, mask=u_mask, other=0.0)
            acc_u = tl.dot(xt, wu, acc_u, input_precision=DOT_PRECISION)
    return acc_g, acc_u


@triton.jit
def _gate_values(
    acc, bg_ptr, offs_n, n_ok, m_ok, threshold, dtype: tl.constexpr, HAS_GATE_BIAS: tl.constexpr,
    SQUARE: tl.constexpr,
):  # fmt: skip
    """From a block's gate product: (kept, h = act(g), active neurons, their number), g rounded as the
    dense gate rounds it."""
    if HAS_GATE_BIAS:
        acc += tl.load(bg_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    g = acc.to(dtype).to(tl.float32)  # the dense gate's rounding
    kept = ((g > threshold) | (g != g)) & m_ok[:, None] & n_ok[None, :]  # not (g <= t): NaN kept, as by relu
    h = tl.where(kept, g, 0.0)
    if SQUARE:
        h = (h * h).to(dtype).to(tl.float32)
    active = tl.max(kept.to(tl.int32), axis=0) > 0
    return kept, h, active, tl.sum(active.to(tl.int32), axis=0)


@triton.jit
def _times_up(h, u, kept, bu_ptr, offs_n, active, dtype: tl.constexpr, HAS_UP_BIAS: tl.constexpr, DRELU: tl.constexpr):
    """h * act'(u) on kept entries (0 elsewhere), u (+ bias) rounded as the dense up projection rounds it."""
    if HAS_UP_BIAS:
        u += tl.load(bu_ptr + offs_n, mask=active, other=0.0).to(tl.float32)[None, :]
    u = u.to(dtype).to(tl.float32)
    if DRELU:
        u = tl.where(u <= 0.0, 0.0, u)
    return tl.where(kept, h * u, 0.0)


@triton.jit
def _decode_gate_up_kernel(
    x_ptr,
    wg_ptr,
    bg_ptr,
    wu_ptr,
    bu_ptr,
    wd_ptr,
    stride_dn,
    stride_dk,
    rows_ptr,
    hc_ptr,
    ids_ptr,
    cnt_ptr,
    sem_ptr,
    n_sems,
    M,
    N,
    K,
    threshold,
    stride_xm,
    stride_xk,
    stride_gn,
    stride_gk,
    stride_un,
    stride_uk,
    HAS_UP: tl.constexpr,
    HAS_GATE_BIAS: tl.constexpr,
    HAS_UP_BIAS: tl.constexpr,
    DRELU: tl.constexpr,
    SQUARE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EACH: tl.constexpr,
    UP_K: tl.constexpr,
    SEM_BLOCK: tl.constexpr,
    PREFETCH_LINE: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    DOWN_ROWS: tl.constexpr,
    PIPE: tl.constexpr,
):
    """Program (p, t) takes token block t and the PIPE neuron blocks p * PIPE ... (PIPE > 1: BLOCK_M > 1,
    not DOWN_ROWS): each block's up rows are read in the K loop that streams the next block's gate."""
    pid_p = tl.program_id(0)
    pid_m = tl.program_id(1)
    n_blocks = tl.cdiv(N, BLOCK_N)
    if pid_p == 0 and pid_m == 0:  # the down kernel's arrival counters start at zero
        for s0 in range(0, n_sems, SEM_BLOCK):
            offs_s = s0 + tl.arange(0, SEM_BLOCK)
            tl.store(sem_ptr + offs_s, tl.zeros([SEM_BLOCK], tl.int32), mask=offs_s < n_sems)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    rows = offs_m.to(tl.int64)
    dtype = hc_ptr.dtype.element_ty
    offs_n = pid_p * PIPE * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = _rows_times_x(
        x_ptr, wg_ptr, rows, offs_n.to(tl.int64), m_ok, n_ok, K, stride_xm, stride_xk, stride_gn, stride_gk,
        DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, EACH,
    )  # fmt: skip
    if DOWN_ROWS:  # one token: the block's share of y, summed over blocks by the rows kernel
        kept, h, active, n_active = _gate_values(
            acc, bg_ptr, offs_n, n_ok, m_ok, threshold, dtype, HAS_GATE_BIAS, SQUARE
        )
        row = _active_rows_down(
            x_ptr + pid_m * stride_xm, wu_ptr, bu_ptr, wd_ptr, tl.sum(h, axis=0), offs_n, active, n_active, K,
            stride_xk, stride_un, stride_uk, stride_dn, stride_dk, HAS_UP, HAS_UP_BIAS, DRELU, UP_K,
        )  # fmt: skip
        if n_active > 0:  # the down kernel reads the rows of blocks with a nonzero count only
            offs_k = tl.arange(0, UP_K)
            tl.store(rows_ptr + pid_p.to(tl.int64) * K + offs_k, row, mask=offs_k < K)
        tl.store(cnt_ptr + pid_p, n_active)
        return
    for i in tl.static_range(PIPE):
        pid_n = pid_p * PIPE + i
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        cols = offs_n.to(tl.int64)
        kept, h, active, n_active = _gate_values(
            acc, bg_ptr, offs_n, n_ok, m_ok, threshold, dtype, HAS_GATE_BIAS, SQUARE
        )
        if PREFETCH_LINES > 0:  # the down kernel's W_d rows, from HBM to L2 while this kernel runs on
            _prefetch_rows_to_l2(wd_ptr, offs_n, active, K, stride_dn, PREFETCH_LINE, PREFETCH_LINES)
        if i + 1 < PIPE:  # the next block's gate, and this block's up rows, in one K loop
            acc, u = _gate_and_up(
                x_ptr, wg_ptr, wu_ptr, rows, m_ok, cols + BLOCK_N, offs_n + BLOCK_N < N, cols, active, K, stride_xm,
                stride_xk, stride_gn, stride_gk, stride_un, stride_uk, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                HAS_UP,
            )  # fmt: skip
            if HAS_UP:
                h = _times_up(h, u, kept, bu_ptr, offs_n, active, dtype, HAS_UP_BIAS, DRELU)
        elif HAS_UP:
            if n_active > 0:
                if BLOCK_M == 1:
                    u = _active_rows_times_x(
                        x_ptr + pid_m * stride_xm, wu_ptr, offs_n, active, n_active, K, stride_xk, stride_un,
                        stride_uk, UP_K,
                    )  # fmt: skip
                else:
                    u = _rows_times_x(
                        x_ptr, wu_ptr, rows, cols, m_ok, active, K, stride_xm, stride_xk, stride_un, stride_uk,
                        DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, EACH,
                    )  # fmt: skip
                h = _times_up(h, u, kept, bu_ptr, offs_n, active, dtype, HAS_UP_BIAS, DRELU)
        slot = tl.cumsum(active.to(tl.int32), axis=0) - 1
        seg = pid_m.to(tl.int64) * n_blocks * BLOCK_N + pid_n * BLOCK_N
        tl.store(ids_ptr + seg + slot, offs_n, mask=active)
        # the block's active columns of h, compacted like ids: entry e holds h[token block, ids[e]]
        local_m = tl.arange(0, BLOCK_M)
        tl.store(hc_ptr + (seg + slot)[None, :] * BLOCK_M + local_m[:, None], h.to(dtype), mask=active[None, :])
        tl.store(cnt_ptr + pid_m * n_blocks + pid_n, n_active, mask=pid_n < n_blocks)


@triton.jit
def _store_tile(
    acc, rows, m_ok, offs_k, k_ok, bd_ptr, y_ptr, part_ptr, sem, pid_s, splits, M, K, stride_ym, stride_yk,
    HAS_DOWN_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ARRIVE: tl.constexpr,
):  # fmt: skip
    """A down kernel's fp32 [BLOCK_M, BLOCK_K] tile of y (rows, K columns offs_k): stored (+ bias) with one
    split; otherwise this split's partial goes to part_ptr and, with ARRIVE, the last split to arrive at
    the tile's counter `sem` sums the partials in split order (deterministic) and resets the counter (a
    rerun of the kernel alone: autotuning, replays); without ARRIVE a later kernel sums them
    (_sum_parts_kernel)."""
    out_mask = m_ok[:, None] & k_ok[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_k[None, :] * stride_yk
    if splits == 1:
        if HAS_DOWN_BIAS:
            acc += tl.load(bd_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = part_ptr + rows[:, None] * K + offs_k[None, :]
        split_stride = tl.cast(M, tl.int64) * K  # one split's [M, K] partials
        tl.store(part + pid_s * split_stride, acc, mask=out_mask)
        if ARRIVE:
            tl.debug_barrier()  # every thread's partial is stored before the arrival is published
            arrived = tl.atomic_add(sem, 1, sem="acq_rel")
            if arrived == splits - 1:  # the last split of this tile: sum the partials in split order
                total = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
                for split in range(0, splits):
                    total += tl.load(part + split * split_stride, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_DOWN_BIAS:
                    total += tl.load(bd_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(sem, 0)


@triton.jit
def _decode_down_kernel(
    hc_ptr,
    ids_ptr,
    cnt_ptr,
    wd_ptr,
    bd_ptr,
    y_ptr,
    part_ptr,
    sem_ptr,
    M,
    K,
    n_blocks,
    stride_dn,
    stride_dk,
    stride_ym,
    stride_yk,
    HAS_DOWN_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NB: tl.constexpr,
    SUPER: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT_MIN: tl.constexpr,
    ARRIVE: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    max_splits = tl.num_programs(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    k_ok = offs_k < K
    rows = offs_m.to(tl.int64)
    # the token block's entries, in neuron-block order: entry e lies in the first block whose inclusive
    # count exceeds e
    cnt_row = cnt_ptr + pid_m * n_blocks
    seg = pid_m.to(tl.int64) * n_blocks * BLOCK_N
    if SPLIT_MIN > 0:
        # splits of the entries: as many as hold SPLIT_MIN entries each, at most the launched ones (one
        # split, the common case at low density, writes y with no partials). An entry's block is found in
        # two steps, so that no [CHUNK, n_blocks] table is formed: its super-block of SUPER blocks, then
        # the block inside it (that super-block's counts loaded again per entry: cache hits).
        offs_w = tl.arange(0, SUPER)
        blk2 = tl.arange(0, NB // SUPER)[:, None] * SUPER + offs_w[None, :]
        super_cnt = tl.sum(tl.load(cnt_row + blk2, mask=blk2 < n_blocks, other=0), axis=1)
        super_incl = tl.cumsum(super_cnt, axis=0)
        total = tl.sum(super_cnt, axis=0)
        splits = tl.minimum(tl.maximum(tl.cdiv(total, SPLIT_MIN), 1), max_splits)
        e_lo = total * pid_s // splits
        e_hi = total * (pid_s + 1) // splits
    else:  # split s takes the entries of neuron blocks [s * SUPER, (s + 1) * SUPER)
        offs_b = tl.arange(0, SUPER)
        cnt = tl.load(cnt_row + pid_s * SUPER + offs_b, mask=pid_s * SUPER + offs_b < n_blocks, other=0)
        incl = tl.cumsum(cnt, axis=0)
        splits = max_splits
        e_lo = 0
        e_hi = tl.sum(cnt, axis=0)
    if pid_s < splits:
        acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for c0 in range(e_lo, e_hi, CHUNK):
            e = c0 + tl.arange(0, CHUNK)
            valid = e < e_hi
            if SPLIT_MIN > 0:
                before_s = super_incl[None, :] <= e[:, None]  # [CHUNK, NB / SUPER]
                sup = tl.sum(before_s.to(tl.int32), axis=1)
                rest = e - tl.sum(tl.where(before_s, super_cnt[None, :], 0), axis=1)  # rank in the super-block
                blk = sup[:, None] * SUPER + offs_w[None, :]  # [CHUNK, SUPER]
                cnt_w = tl.load(cnt_row + blk, mask=valid[:, None] & (blk < n_blocks), other=0)
                before = tl.cumsum(cnt_w, axis=1) <= rest[:, None]
                local = sup * SUPER + tl.sum(before.to(tl.int32), axis=1)
                pos = seg + local * BLOCK_N + rest - tl.sum(tl.where(before, cnt_w, 0), axis=1)
            else:
                before = incl[None, :] <= e[:, None]  # [CHUNK, SUPER]
                local = pid_s * SUPER + tl.sum(before.to(tl.int32), axis=1)
                pos = seg + local * BLOCK_N + e - tl.sum(tl.where(before, cnt[None, :], 0), axis=1)
            neuron = tl.load(ids_ptr + pos, mask=valid, other=0).to(tl.int64)
            wd = tl.load(
                wd_ptr + neuron[:, None] * stride_dn + offs_k[None, :] * stride_dk, valid[:, None] & k_ok[None, :], 0.0
            )
            if BLOCK_M == 1:  # one token: no 16-row padding
                hv = tl.load(hc_ptr + pos, mask=valid, other=0.0)
                acc += tl.sum(hv.to(tl.float32)[:, None] * wd.to(tl.float32), axis=0)[None, :]
            else:
                local_m = tl.arange(0, BLOCK_M)
                hv = tl.load(hc_ptr + pos[:, None] * BLOCK_M + local_m[None, :], mask=valid[:, None], other=0.0)
                acc = tl.dot(tl.trans(hv), wd, acc, input_precision=DOT_PRECISION)
        _store_tile(
            acc, rows, m_ok, offs_k, k_ok, bd_ptr, y_ptr, part_ptr, sem_ptr + pid_m * tl.num_programs(0) + pid_k,
            pid_s, splits, M, K, stride_ym, stride_yk, HAS_DOWN_BIAS, BLOCK_M, BLOCK_K, ARRIVE,
        )  # fmt: skip


@triton.jit
def _decode_down_rows_kernel(
    rows_ptr, cnt_ptr, bd_ptr, y_ptr, n_rows, K, stride_yk, HAS_DOWN_BIAS: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One token: y = the sum of kernel 1's block rows (+ bias), one program per K block, ROWS blocks a
    step (one step up to ROWS blocks): their counts, then the rows of those with active neurons."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for r0 in range(0, n_rows, ROWS):
        offs_r = r0 + tl.arange(0, ROWS)
        r_ok = offs_r < n_rows
        r_ok &= tl.load(cnt_ptr + offs_r, mask=r_ok, other=0) > 0
        mask = r_ok[:, None] & k_ok[None, :]
        acc += tl.sum(
            tl.load(rows_ptr + offs_r.to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask, other=0.0), axis=0
        )
    if HAS_DOWN_BIAS:
        acc += tl.load(bd_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_k * stride_yk, acc.to(y_ptr.dtype.element_ty), mask=k_ok)


# (BLOCK_N, BLOCK_K, num_warps, num_stages, EACH) of the gate + up kernel for one token and for more;
# the fastest at both of K=2048/N=5632 and K=4096/N=14336 on an H200 (gpu_check-decode-20261130-161902.json,
# -230248.json, -231118.json).
GATE_UP_CONFIG = {1: (16, 512, 4, 3, False), 2: (64, 128, 4, 4, False)}
# One token with K > 2048: 256-wide K steps reduced each step (72 registers, ~3x the programs per SM of
# the config above, more of W_g in flight): 44.7 against 48.7 us per layer at K=4096; 14.9 against
# 14.1 us at K=2048 (gpu_check-decode-20261130-231118.json).
GATE_UP_CONFIG_WIDE = (16, 256, 4, 3, True)
# (BLOCK_K, SPLITS, CHUNK, SPLIT_MIN, num_warps) of the down kernel by token block (BLOCK_M).
# SPLIT_MIN > 0: a token block's entries are cut at run time into as many splits as hold SPLIT_MIN
# entries each, at most SPLITS (one split: no partials); one token at K=2048 / 4096 took 13.8 / 40.3 us
# a layer against 15.4 / 44.8 with static groups (gpu_check-floors-20261201-113017.json).
# SPLIT_MIN = 0: split s takes the entries of neuron blocks [s * SPLITS, (s + 1) * SPLITS), a static
# group: 2-4x faster than run-time splits for 16-64 tokens, where the chain of loads per chunk (counts,
# ids, then hc and W_d) is not overlapped; 64 tokens gain from smaller K blocks (34.6 against 40.6 us
# at K=2048). gpu_check-decode-20261201-114215.json, -114635.json.
DOWN_CONFIG = {1: (32, 4, 64, 64, 4), 16: (128, 8, 16, 0, 4), 32: (128, 8, 16, 0, 4), 64: (64, 8, 32, 0, 4)}


def _check_ffn(caller, x, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, down_bias, threshold):
    """(M, K, N) of a decode launcher's arguments, checked (ValueError naming expected and actual)."""
    check_input("x", x)
    check_threshold(threshold)
    m, k = x.shape
    if not isinstance(gate_weight, torch.Tensor) or gate_weight.dim() != 2:
        raise ValueError(f"{caller} expects gate_weight [N, {k}] (K of x)")
    n = gate_weight.shape[0]
    for name, t in (("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight_t", down_weight_t)):
        if t is not None:
            check_operand(name, t, (n, k), x)  # [N, K of x], x's dtype and device
    if up_bias is not None and up_weight is None:
        raise ValueError("up_bias needs up_weight (a plain FFN has its bias as gate_bias)")
    for name, b, size in (("gate_bias", gate_bias, n), ("up_bias", up_bias, n), ("down_bias", down_bias, k)):
        check_bias(name, b, size, x)
    return m, k, n


@dataclass(frozen=True)
class _DecodePlan:
    """decode_ffn's configuration for one call: kernel 1's (BLOCK_N, BLOCK_K, warps, stages, EACH), the
    down kernel's (BLOCK_K, splits, CHUNK, SPLIT_MIN, warps) with splits counted in programs, the block
    counts, and whether one token goes by block rows."""

    gate_up: tuple
    down: tuple
    block_m: int
    n_blocks: int
    m_blocks: int
    k_blocks: int
    up_k: int
    group: int  # neuron blocks a static split walks (SPLIT_MIN 0), else 0
    down_rows: bool


def _decode_plan(m: int, k: int, n: int, gate_up_config, down_config, down_rows) -> _DecodePlan:
    """The launcher's choice of configs for m tokens of width k over n neurons (decode_ffn's arguments
    override them)."""
    default = GATE_UP_CONFIG_WIDE if m == 1 and k > 2048 else GATE_UP_CONFIG[min(m, 2)]
    gate_up = tuple(gate_up_config or default)
    n_blocks = cdiv(n, gate_up[0])
    block_m = 1 if m == 1 else min(max(next_power_of_2(m), 16), 64)
    down_k, splits, chunk, split_min, down_warps = down_config or DOWN_CONFIG[block_m]
    if splits < 1 or split_min < 0:
        raise ValueError(f"down_config needs SPLITS >= 1 and SPLIT_MIN >= 0, got {down_config}")
    group = 0
    if split_min == 0:  # static groups of `splits` neuron blocks
        group, splits = splits, cdiv(n_blocks, splits)
    up_k = min(next_power_of_2(k), 4096)
    if down_rows is None:  # measured faster at K = 2048, slower at 4096 (the rows helper's registers)
        down_rows = k <= 2048
    return _DecodePlan(
        gate_up=gate_up,
        down=(down_k, splits, chunk, split_min, down_warps),
        block_m=block_m,
        n_blocks=n_blocks,
        m_blocks=cdiv(m, block_m),
        k_blocks=cdiv(k, down_k),
        up_k=up_k,
        group=group,
        down_rows=bool(down_rows) and m == 1 and k <= up_k,
    )


def decode_ffn(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight_t: torch.Tensor,
    down_bias: torch.Tensor | None,
    threshold: float,
    *,
    drelu: bool = False,
    square: bool = False,
    gate_up_config: tuple[int, int, int, int, bool] | None = None,
    down_config: tuple[int, int, int, int, int] | None = None,
    prefetch: bool = True,
    down_rows: bool | None = None,
    rows_config: tuple[int, int] | None = None,
    pipeline: int = 1,
) -> torch.Tensor:
    """y [M, K] in the dtype of x: down(act(gate(x)) * up(x)), or down(act(gate(x))) without up_weight
    (act² with square).

    x: [M, K]; gate_weight, up_weight: [N, K]; down_weight_t: [N, K] (= down_weight.t(), unit stride on K
    for coalesced row loads); biases contiguous. Exact at any density: a dense call reads every row.
    The configs override GATE_UP_CONFIG(_WIDE) / DOWN_CONFIG (tests, benchmarks); prefetch=False leaves
    out kernel 1's L2 prefetch of the active W_d rows at one token (benchmarks); down_rows takes one
    token by block rows (True; only one token with K <= 4096, the list otherwise) or by the list
    (False), None leaving it to K. pipeline: neuron blocks a kernel-1 program takes, each block's up rows
    read in the K loop that streams the next block's gate (two or more tokens; 1: one block a program).
    """
    _check_ffn("decode_ffn", x, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, down_bias, threshold)
    return launch_decode(
        x, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, down_bias, threshold, drelu=drelu,
        square=square, gate_up_config=gate_up_config, down_config=down_config, prefetch=prefetch,
        down_rows=down_rows, rows_config=rows_config, pipeline=pipeline,
    )  # fmt: skip


def launch_decode(
    x, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, down_bias, threshold, *, drelu=False,
    square=False, gate_up_config=None, down_config=None, prefetch=True, down_rows=None, rows_config=None, pipeline=1,
):  # fmt: skip
    """decode_ffn without its input checks: for callers that checked them (the dispatcher, after the op
    boundary's)."""
    (m, k), n = x.shape, gate_weight.shape[0]
    if m == 0 or n == 0 or k == 0:  # no tokens, neurons or width: y is the down bias (no launch)
        y = torch.zeros_like(x)
        return y + down_bias if down_bias is not None else y
    plan = _decode_plan(m, k, n, gate_up_config, down_config, down_rows)
    if not isinstance(pipeline, int) or isinstance(pipeline, bool) or pipeline < 1:
        raise ValueError(f"pipeline must be a positive int, got {pipeline!r}")
    if pipeline > 1 and plan.block_m == 1:
        raise ValueError(f"pipeline > 1 needs two or more tokens (one token reads its active rows whole), got {m}")
    block_n, block_k, warps, stages, each = plan.gate_up
    down_k, splits, chunk, split_min, down_warps = plan.down
    block_m, n_blocks, m_blocks, k_blocks, up_k = plan.block_m, plan.n_blocks, plan.m_blocks, plan.k_blocks, plan.up_k
    group, down_rows = plan.group, plan.down_rows
    precision = dot_precision(x.dtype)
    counts = torch.empty(m_blocks * n_blocks, dtype=torch.int32, device=x.device)
    y = torch.empty_like(x)
    if down_rows:  # kernel 1 writes its block's row of y: no list, no partials, no counters
        rows = torch.empty(n_blocks, k, dtype=torch.float32, device=x.device)
        hc, ids, sems = x, counts, counts[:0]
    else:
        hc = torch.empty(m_blocks * n_blocks * block_n, block_m, dtype=x.dtype, device=x.device)
        ids = torch.empty(m_blocks * n_blocks * block_n, dtype=torch.int32, device=x.device)
        sems = torch.empty(max(k_blocks * m_blocks, 1), dtype=torch.int32, device=x.device)
        parts = torch.empty(splits if splits > 1 else 0, m, k, dtype=torch.float32, device=x.device)
    # PTX prefetch of the active W_d rows into L2 for the list path's down kernel: one token, on an NVIDIA
    # GPU, rows with unit stride on K. It took 1-2.5% off one token's layer and added 2-10% to 16-64
    # tokens at K=4096, where the union's rows compete with W_g's stream
    # (gpu_check-decode-20261201-115846.json).
    nvidia = x.is_cuda and torch.version.hip is None and not interpreting()
    prefetch = prefetch and nvidia and m == 1 and not down_rows and down_weight_t.stride(1) == 1
    line = 128 // x.element_size()
    _decode_gate_up_kernel[(cdiv(n_blocks, pipeline), m_blocks)](
        x,
        gate_weight,
        gate_bias if gate_bias is not None else x,
        up_weight if up_weight is not None else x,
        up_bias if up_bias is not None else x,
        down_weight_t,
        down_weight_t.stride(0),
        down_weight_t.stride(1),
        rows if down_rows else x,
        hc,
        ids,
        counts,
        sems,
        sems.numel(),
        m,
        n,
        k,
        threshold_in(threshold, x.dtype),
        x.stride(0),
        x.stride(1),
        gate_weight.stride(0),
        gate_weight.stride(1),
        *(up_weight.stride() if up_weight is not None else (0, 0)),
        HAS_UP=up_weight is not None,
        HAS_GATE_BIAS=gate_bias is not None,
        HAS_UP_BIAS=up_bias is not None,
        DRELU=drelu,
        SQUARE=square,
        DOT_PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EACH=each,
        UP_K=up_k,
        SEM_BLOCK=256,
        PREFETCH_LINE=line,
        PREFETCH_LINES=next_power_of_2(cdiv(k, line)) if prefetch else 0,
        DOWN_ROWS=down_rows,
        PIPE=pipeline,
        num_warps=warps,
        num_stages=stages,
    )
    if down_rows:
        chunk_rows = min(next_power_of_2(n_blocks), 1024)
        # 32 values a thread: 14.2 against 14.7 us a layer with 64 (exact 0.5%, K=2048), 17.9 against
        # 18.6 at 5%; wider K blocks slower (gpu_check-decode-20261201-131455.json)
        rows_k, rows_warps = rows_config or (16, max(4, min(16, chunk_rows // 64)))
        _decode_down_rows_kernel[(cdiv(k, rows_k),)](
            rows, counts, down_bias if down_bias is not None else x, y, n_blocks, k, y.stride(1),
            HAS_DOWN_BIAS=down_bias is not None, ROWS=chunk_rows, BLOCK_K=rows_k, num_warps=rows_warps,
        )  # fmt: skip
        return y
    _decode_down_kernel[(k_blocks, m_blocks, splits)](
        hc,
        ids,
        counts,
        down_weight_t,
        down_bias if down_bias is not None else x,
        y,
        parts,
        sems,
        m,
        k,
        n_blocks,
        down_weight_t.stride(0),
        down_weight_t.stride(1),
        y.stride(0),
        y.stride(1),
        HAS_DOWN_BIAS=down_bias is not None,
        DOT_PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=down_k,
        NB=max(next_power_of_2(n_blocks), 32) if split_min > 0 else 32,  # unused by groups
        SUPER=32 if split_min > 0 else group,
        CHUNK=chunk,
        SPLIT_MIN=split_min,
        ARRIVE=True,
        num_warps=down_warps,
    )
    return y
