"""Sparse training of the twell FFNs: a forward that keeps a compact record of the hidden layer,
and the backward computed from that record (the paper's training path; only the gate GEMM is dense).

Record of one call (M token rows, W = width slots per row, policy.train_width: about N/32), written by
_train_forward_kernel:
    counts [M] int32      true number of kept neurons of the row (kept: not g <= threshold; NaN kept)
    ids    [M, W] int32   the kept neurons, in increasing order (slots past the count: zeros)
    gate   [M, W] dtype   their gate pre-activation g (the dense gate rounded to the dtype, as torch does)
    up     [M, W] dtype   their up value u = x . W_u[n] + b_u, rounded (gated FFNs; empty for plain ones)
8 bytes a slot (bf16): at W=256, M=32768 67 MB, against 369 MB for one dense [M, N] bf16 activation at
N=5632. A row with more than W kept neurons is a dense-backup row: its record is unused; the forward
walks the dense gate row and the backward recomputes its gate, up and hidden gradients from x and the
weights (a GEMV over W_g, the active rows of W_u and W_d^T; the recomputed gate can differ from
cuBLAS's in the last bit, so a gate within rounding of the threshold may be kept differently), so
gradients are exact at any sparsity without a dense [M, N] buffer or a host round trip. The dense
[M, N] gate lives only during the forward. The forward also sums |h| and counts nonzero h per row:
the L1 penalty's term, whose gradient dl1 * sign(h) the backward adds to dh.

Backward, per kept (m, n), with dh = dy_m . W_d^T[n] (+ dl1 * sign h):
    gated: dg = dh * a(u) (a: ReLU with dReLU, else identity), du = dh * g * a'(u), h = g * a(u)
    plain: dg = dh (relu) or 2 g dh (relu²), h = g or g²
- _train_dx_kernel, one program per row, heaviest rows first: dx_m = sum_n dg W_g[n] + du W_u[n]
  (three weight rows gathered per pair, as the forward's up+down kernel gathers two), storing (dg, du,
  h) at each entry's record slot. Dense-backup rows: the heaviest ceil(M / BACKUP_SHARE) rows through
  cuBLAS GEMMs over those rows and one elementwise kernel for their hidden gradients
  (_backup_grads_kernel), any past them through the persistent per-row walk of _train_backup_kernel;
  their dW and dbias terms land in fp32 accumulators.
- The pairs grouped by neuron (CSC): a stable sort of the record's neuron ids (invalid slots keyed N;
  int16 keys where N allows, two radix passes) and segment starts by searchsorted, all on the device.
- _train_dw_kernel, one program per (16 neurons, K block): dW_g[n] = sum_m dg x_m, dW_u[n] = sum_m du
  x_m, dW_d^T[n] = sum_m h dy_m over the group's pairs (their token rows and coefficients copied into
  neuron order once by _neuron_order_kernel, read contiguously) by tensor-core products, plus the
  accumulators, stored once in the weight dtype: no atomics per pair.
W_d is read as rows of down_weight^T ([N, K], unit stride on K), the layout sparsify stores.

Hot neurons (LayerConfig.train_hot): the layer's H most frequent neurons of its previous call are
hidden from the record (their gate columns set to -inf) and computed by cuBLAS products over just them,
forward and backward (_hot_columns, _hot_backward). A layer measured dense (LayerConfig.train_dense_above,
_TrainState) trains as dense autograd does: _dense_forward keeps g, u and h for _dense_backward.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from twell.kernels import policy
from twell.kernels.common import (
    cdiv,
    check_bias,
    check_input,
    check_operand,
    check_threshold,
    dot_precision,
    next_power_of_2,
    persistent_programs,
    threshold_in,
)
from twell.kernels.gate import launch_pack_dense
from twell.kernels.updown import launch_up_down, row_width
from twell.kernels.words import decode

# Gate columns the forward compacts at a time: each step is a prefix sum across the program's threads (shuffles
# and a barrier), so 1024 columns (8 a thread at 4 warps) take a quarter of the steps of 256. A dense-backup row's
# chunks go through its record slots: at most the width (_chunk).
SCAN = 1024
# dW (_train_dw_kernel): neurons a program owns (16: the smallest tensor-core product), pairs gathered a step, K
# columns a program owns, warps, and loop stages: every load of the loop (pair indices, their x / dy gathers,
# coefficients) goes STAGES - 1 steps ahead through cp.async (K divisible by 16, as the launcher specialises it:
# the K mask then keeps 16-byte vectors). ptxas for sm_90 (Triton 3.6): 92 registers a thread at 64 x 128 with 8
# warps (2 programs an SM). Measured at K=2048, N=5632, 0.5%, 32768 tokens: 3.3 ms (~3 TB/s of the 9.8 GB of
# gathered x / dy rows), 3.4-7.0 ms at other tiles, warps and stages (train-20261202-133531.json to -133938.json,
# train-variants-20261202-143145.json); Nsight (ncu-20261202-142900.json): 86% L2 hits, 25% occupancy by
# registers, latency-bound.
DW_GROUP = 16
DW_PAIRS = 64
DW_BLOCK_K = 128
DW_WARPS = 8
DW_STAGES = 3
# _neuron_order_kernel: sorted pairs a program (past the record's pairs a program only reads starts[N])
ORDER_BLOCK = 1024
# DW_MAXNREG: the dW kernel's register cap (Triton's maxnreg; 0: none). Nsight (NOTES, session 7, third run):
# 2 blocks an SM by registers, 25% occupancy, half the stalls waiting on the gathers. Registers go 8 a thread at
# a time, so 3 blocks of 8 warps need <= 80: ptxas for sm_90 (Triton 3.6) then keeps 16 bytes of stack a
# thread. Measured, 32768 tokens 0.5% (train-variants-20261202-181050.json), dW ms uncapped / 80: K=2048 uniform
# 3.19 / 2.80, skewed 3.26 / 3.03; K=4096 uniform 15.77 / 13.76, skewed 14.57 / 12.90.
DW_MAXNREG = 80
# dx (_train_dx_kernel): loop stages of its entry loop (a loop without a dot is pipelined only with tl.range's
# num_stages). 3: the next steps' ids, record values and weight rows load ahead through cp.async (24 KB of shared
# memory at K=2048, 49 KB at K=4096); 1: each step waits for its gathers. Measured, uniform 0.5%, 32768 tokens:
# dx 1.94 ms against 1.65 at K=2048 (train-20261202-140149.json against -140018.json), 13.81 against 14.96 at
# K=4096 (-140353.json against -120318.json).
DX_STAGES = 1
# Dense-backup rows (more kept neurons than the record's width): the heaviest ceil(M / BACKUP_SHARE)
# rows go through one dense pass of cuBLAS GEMMs over those rows (_dense_backup: ~8 [M/32, K] x [K, N]
# products, ~0.25 ms at K=2048, N=5632, M=32768; ~1.2 ms at K=4096, N=14336), rows past them through
# the persistent per-row walk of _train_backup_kernel (BACKUP_PROGRAMS programs; [ROWS, BLOCK_K]
# weight tiles of BACKUP_TILE elements, three live at once). The uniform benchmark inputs have 0.04%
# (K=2048, 0.5%) to 1.7% (K=4096, 1%) of their rows past the width (train-20261130-234135.json): all
# in the dense pass at 1/32; the one-row-per-program walk took ~10 ms for one K=2048 row.
BACKUP_SHARE = 32
BACKUP_PROGRAMS = 264
BACKUP_TILE = 2048
# A layer measured under LayerConfig.train_dense_above (_TrainState): its dense pass takes 1.25x the
# rows past the width its last measured call had, as a power of two, at least BACKUP_MIN_ROWS (at
# most M), in place of ceil(M / BACKUP_SHARE): 16-32 rows at 0.5% uniform (12 rows past the width in
# 32768, train-20261201-230349.json: ~0.2 ms of the dense pass's GEMMs saved), and enough for a denser
# layer's rows instead of the walk. Past BACKUP_MAX_SHARE of its rows (the pass then costs about a third
# of the dense FFN step), the layer trains dense.
BACKUP_MIN_ROWS = 16
BACKUP_MAX_SHARE = 0.125
# _backup_grads_kernel's tile and warps: elementwise over the dense pass's [T, N] products, 16 elements a
# thread a tensor (ptxas for sm_90: 64 x 128 at 4 warps spills 1.2 KB a thread); _dense_hidden_kernel (a
# dense-mode forward's h) the same tiles, a program's BACKUP_BLOCK_T rows over all N (1024 programs at
# 32768 tokens; its row counts and partial sums stay in registers)
BACKUP_BLOCK_T = 32
BACKUP_BLOCK_N = 128
BACKUP_WARPS = 8
# _dense_hidden_kernel with RECORD (the packed forward's dense rows: a prefix sum along each tile row too)
# at the same tiles: ptxas for sm_90 spills it at 8 warps (255 registers, 40 bytes of stack with W_u);
# 16 warps take 106
DENSE_ROW_WARPS = 16
# LayerConfig.train_forward_pack (_pack_forward): the dense gate packed to TwELL at the prefill path's
# layout (policy.TILE_N / SLOTS), y by the prefill up+down kernel, the record written from the TwELL
# words by _pack_record_kernel, PACK_BLOCK_M rows a program (a [PACK_BLOCK_M, SLOTS] tile a tile step).
PACK_TILE_N = policy.TILE_N
PACK_SLOTS = policy.SLOTS
PACK_BLOCK_M = 32
# The rows it leaves go through the row kernel, persistent (a program an SM), REDO_ENTRIES entries a step
# (at most _row_entries'): a few long rows (~260 entries past the width), each a program's alone, where one
# entry a step would take ~1.4 us an entry.
REDO_ENTRIES = 8
# The rows the pack path cannot serve through cuBLAS instead (_dense_rows), read at each call (a benchmark
# variant: --backward-constant FORWARD_DENSE_ROWS=0): the heaviest T of them (_share_rows of the rows the
# layer's last measured call left, else ceil(M / BACKUP_SHARE); a fixed number, no host sync), their
# tile counts zeroed before the up+down kernel (its main kernel then takes them as empty rows, its heavy
# kernel never sees them). The CPU simulation of the benchmark's uniform K=4096 N=14336 0.5% input
# (make_inputs' rows, 4096 of them) lists ~4.6% of the rows, nearly all for more entries than the up+down
# row width (256 < kept <= 512, the record width), ~0.2% past the record width: the 2.61 + 4.30 ms of the
# heavy and row kernels (train-20261202-120318.json) become two [T, K] x [K, N] products (T = 2048 at
# 32768 tokens: ~0.7 ms) and one elementwise kernel. Rows past T stay with the row kernel (exact).
FORWARD_DENSE_ROWS = True


@dataclass
class _TrainState:
    """A layer's training calls under LayerConfig.train_dense_above: its last measured call's (nonzero h,
    rows past the width) on their way to the host (pending: event or None, host int64 [2], M * N, M),
    whether its next calls train dense, and how its last forward ran (its backward follows it; either
    backward is exact on either record, so a backward that does not follow its own forward is only
    slower, never wrong)."""

    pending: tuple | None = None
    dense: bool = False
    forward_dense: bool = False
    past_share: float | None = None  # the share of rows past the width in the last landed measurement
    listed_share: float | None = None  # the share of rows the packed forward could not serve (_pack_forward)
    hot: torch.Tensor | None = None  # LayerConfig.train_hot: the hot neurons of the next call (int64, device)

    def update(self, dense_above: float) -> None:
        """Take a landed measurement into account (never waits for one)."""
        if self.pending is not None and (self.pending[0] is None or self.pending[0].query()):
            _, host, possible, rows = self.pending
            self.pending = None
            nonzero, past_width, listed = host.tolist()
            self.past_share = past_width / max(rows, 1)
            self.listed_share = listed / max(rows, 1)
            self.dense = nonzero > dense_above * possible or self.past_share > BACKUP_MAX_SHARE

    def backup_rows(self, m: int) -> int:
        """Rows of a call of m tokens that the backward's dense pass takes (BACKUP_MIN_ROWS)."""
        return _share_rows(self.past_share, m)

    def forward_rows(self, m: int) -> int:
        """Rows of a call of m tokens that the packed forward's dense pass takes (_dense_rows); none after a
        measured call that left no row (its ~15 small launches saved; a row that appears takes the row
        kernel, exact, until the next measurement lands)."""
        return 0 if self.listed_share == 0 else _share_rows(self.listed_share, m)

    def measure(
        self, nonzero: torch.Tensor, past_width: torch.Tensor, listed: torch.Tensor, possible: int, rows: int
    ) -> None:
        """Queue a call's measurement (nonzero h, rows past the width, rows the packed forward could not
        serve) to the host; one in flight (a newer one would never land while the host runs ahead)."""
        if self.pending is not None:
            return
        values = torch.stack([nonzero.to(torch.int64), past_width.to(torch.int64), listed.to(torch.int64)])
        # one path on every device (the CPU suite runs it): a host copy, pinned and asynchronous from a GPU
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
        host.copy_(values, non_blocking=values.is_cuda)
        ready = None
        if values.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        self.pending = (ready, host, possible, rows)


def _share_rows(share: float | None, m: int) -> int:
    """Rows a dense pass over a call of m tokens takes: 1.25x a measured share of them, as a power of two,
    at least BACKUP_MIN_ROWS, at most m; ceil(m / BACKUP_SHARE) before any measurement (share None)."""
    if share is None:
        return -(-m // BACKUP_SHARE)
    return min(m, max(BACKUP_MIN_ROWS, next_power_of_2(math.ceil(1.25 * share * m))))


# id(gate weight behind any view) -> {(shape, offset): state}; an entry goes when its tensor is freed
_train_layers: dict[int, dict[tuple, _TrainState]] = {}


def train_state(gate_weight: torch.Tensor) -> _TrainState:
    """The training state of the layer whose gate weight (a plain FFN's up weight) this is."""
    base = gate_weight._base if gate_weight._base is not None else gate_weight
    if id(base) not in _train_layers:
        _train_layers[id(base)] = {}
        weakref.finalize(base, _train_layers.pop, id(base), None)
    key = (tuple(gate_weight.shape), gate_weight.storage_offset())
    return _train_layers[id(base)].setdefault(key, _TrainState())


def forget_train_layers() -> None:
    """Drop every layer's training state (tests and benchmarks start from a clean one)."""
    _train_layers.clear()


@triton.jit
def _round(v, DTYPE: tl.constexpr):
    """v rounded to the activation dtype (what torch stores between ops), back in fp32."""
    return v.to(DTYPE).to(tl.float32)


@triton.jit
def _kept(g, threshold):
    return (g > threshold) | (g != g)  # not (g <= t): NaN kept, as by relu


@triton.jit
def _hidden(g, u, HAS_UP: tl.constexpr, DRELU: tl.constexpr, SQUARE: tl.constexpr, DTYPE: tl.constexpr):
    """h of kept entries: g * a(u) for gated FFNs, g or g² for plain ones, rounded as torch rounds it."""
    if HAS_UP:
        if DRELU:
            u = tl.where(u <= 0.0, 0.0, u)
        h = g * u
    elif SQUARE:
        h = g * g
    else:
        h = g
    return _round(h, DTYPE)


@triton.jit
def _sign(h):
    """d|h|/dh as torch.abs's backward gives it (0 at 0)."""
    return tl.where(h > 0.0, 1.0, tl.where(h < 0.0, -1.0, 0.0))


@triton.jit
def _hidden_grads(dh, g, u, HAS_UP: tl.constexpr, DRELU: tl.constexpr, SQUARE: tl.constexpr):
    """(dg, du) of kept entries from dh = dL/dh."""
    if HAS_UP:
        if DRELU:
            dg = dh * tl.where(u <= 0.0, 0.0, u)
            du = tl.where(u > 0.0, dh * g, 0.0)
        else:
            dg = dh * u
            du = dh * g
    elif SQUARE:
        dg = 2.0 * g * dh
        du = dg
    else:
        dg = dh
        du = dg
    return dg, du


@triton.jit
def _up_values(
    xv, neurons, valid, offs_k, k_ok, wu_ptr, bu_ptr, stride_un, HAS_UP_BIAS: tl.constexpr, DTYPE: tl.constexpr
):
    """u = x . W_u[n] (+ b_u) of the valid entries' neurons [E], rounded to the dtype."""
    tile_ok = valid[:, None] & k_ok[None, :]
    wu = tl.load(wu_ptr + neurons[:, None] * stride_un + offs_k[None, :], mask=tile_ok, other=0.0)
    u = tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
    if HAS_UP_BIAS:
        u += tl.load(bu_ptr + neurons, mask=valid, other=0.0).to(tl.float32)
    return _round(u, DTYPE)


@triton.jit
def _compact(pre_row, c0, N, threshold, ids_row, gate_row, before, LIMIT, SCAN: tl.constexpr):
    """Append the kept entries of gate columns [c0, c0 + SCAN) behind `before` entries (only slots below
    LIMIT are written); returns how many the chunk holds."""
    cols = c0 + tl.arange(0, SCAN)
    v = tl.load(pre_row + cols, mask=cols < N, other=0.0)
    keep = _kept(v.to(tl.float32), threshold) & (cols < N)
    pos = before + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    stored = keep & (pos < LIMIT)
    tl.store(ids_row + pos, cols, mask=stored)
    tl.store(gate_row + pos, v, mask=stored)
    return tl.sum(keep.to(tl.int32), axis=0)


@triton.jit
def _forward_entries(
    y, l1, nonzero, xv, ids_row, gate_row, up_row, count, offs_k, k_ok, wu_ptr, bu_ptr, wd_ptr, stride_un, stride_dn,
    STORE_UP: tl.constexpr, HAS_UP: tl.constexpr, HAS_UP_BIAS: tl.constexpr, DRELU: tl.constexpr,
    SQUARE: tl.constexpr, DTYPE: tl.constexpr, ENTRIES: tl.constexpr,
):  # fmt: skip
    """y + sum over the first `count` record entries of h W_d^T[n], with sum |h| and the number of
    nonzero h added to l1 and nonzero; their u into up_row with STORE_UP. ENTRIES entries a step: their
    weight rows gathered as one [ENTRIES, BLOCK_K] tile each (more loads in flight a program)."""
    for e0 in range(0, count, ENTRIES):
        e = e0 + tl.arange(0, ENTRIES)
        valid = e < count
        neurons = tl.load(ids_row + e, mask=valid, other=0).to(tl.int64)
        g = tl.load(gate_row + e, mask=valid, other=0.0).to(tl.float32)
        u = g
        if HAS_UP:
            u = _up_values(xv, neurons, valid, offs_k, k_ok, wu_ptr, bu_ptr, stride_un, HAS_UP_BIAS, DTYPE)
            if STORE_UP:
                tl.store(up_row + e, u, mask=valid)
        tile_ok = valid[:, None] & k_ok[None, :]
        wd = tl.load(wd_ptr + neurons[:, None] * stride_dn + offs_k[None, :], mask=tile_ok, other=0.0)
        h = _hidden(g, u, HAS_UP, DRELU, SQUARE, DTYPE)  # 0 past the count: g and u load as 0
        y += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
        l1 += tl.sum(tl.abs(h), axis=0)
        nonzero += tl.sum((h != 0.0).to(tl.int32), axis=0)
    return y, l1, nonzero


@triton.jit
def _forward_row(
    m, pre_ptr, x_ptr, wu_ptr, bu_ptr, wd_ptr, bd_ptr, y_ptr, ids_ptr, gate_ptr, up_ptr, cnt_ptr, l1_ptr, nz_ptr,
    N, K, threshold, stride_pm, stride_xm, stride_un, stride_dn, stride_ym,
    HAS_UP: tl.constexpr, HAS_UP_BIAS: tl.constexpr, HAS_DOWN_BIAS: tl.constexpr, DRELU: tl.constexpr,
    SQUARE: tl.constexpr, WIDTH: tl.constexpr, SCAN: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
    ENTRIES: tl.constexpr,
):  # fmt: skip
    """Row m (int64): compact the dense gate row into the record, then y_m = sum h W_d^T[n] (+ b_d), and
    the row's sum |h| and nonzero count for the L1 penalty. A row past WIDTH walks its gate row again,
    CHUNK columns (<= WIDTH) at a time through its record slots."""
    pre_row = pre_ptr + m * stride_pm
    ids_row = ids_ptr + m * WIDTH
    gate_row = gate_ptr + m * WIDTH
    up_row = up_ptr + m * WIDTH
    dtype = y_ptr.dtype.element_ty
    total = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, N, SCAN):
        total += _compact(pre_row, c0, N, threshold, ids_row, gate_row, total, WIDTH, SCAN)
    tl.store(cnt_ptr + m, total)
    # slots past the count hold zeros (a dense-backup row's up slots too): a fully defined record
    up_count = tl.where(total > WIDTH, 0, total)
    for c0 in range(0, WIDTH, CHUNK):
        slots = c0 + tl.arange(0, CHUNK)
        pad = (slots >= total) & (slots < WIDTH)
        tl.store(ids_row + slots, tl.zeros([CHUNK], dtype=tl.int32), mask=pad)
        tl.store(gate_row + slots, tl.zeros([CHUNK], dtype=gate_ptr.dtype.element_ty), mask=pad)
        if HAS_UP:
            up_pad = (slots >= up_count) & (slots < WIDTH)
            tl.store(up_row + slots, tl.zeros([CHUNK], dtype=up_ptr.dtype.element_ty), mask=up_pad)
    tl.debug_barrier()  # the entry loops read record slots other threads of this program wrote
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    xv = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    y = tl.zeros([BLOCK_K], dtype=tl.float32)
    l1 = tl.zeros([], dtype=tl.float32)
    nonzero = tl.zeros([], dtype=tl.int32)
    if total <= WIDTH:
        y, l1, nonzero = _forward_entries(
            y, l1, nonzero, xv, ids_row, gate_row, up_row, total, offs_k, k_ok, wu_ptr, bu_ptr, wd_ptr, stride_un,
            stride_dn, True, HAS_UP, HAS_UP_BIAS, DRELU, SQUARE, dtype, ENTRIES,
        )  # fmt: skip
    else:
        for c0 in range(0, N, CHUNK):
            count = _compact(pre_row, c0, N, threshold, ids_row, gate_row, 0, WIDTH, CHUNK)
            tl.debug_barrier()
            y, l1, nonzero = _forward_entries(
                y, l1, nonzero, xv, ids_row, gate_row, up_row, count, offs_k, k_ok, wu_ptr, bu_ptr, wd_ptr,
                stride_un, stride_dn, False, HAS_UP, HAS_UP_BIAS, DRELU, SQUARE, dtype, ENTRIES,
            )  # fmt: skip
            tl.debug_barrier()  # the next chunk overwrites the slots
    if HAS_DOWN_BIAS:
        y += tl.load(bd_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_k, y.to(dtype), mask=k_ok)
    tl.store(l1_ptr + m, l1)
    tl.store(nz_ptr + m, nonzero)


@triton.jit
def _train_forward_kernel(
    pre_ptr, x_ptr, wu_ptr, bu_ptr, wd_ptr, bd_ptr, y_ptr, ids_ptr, gate_ptr, up_ptr, cnt_ptr, l1_ptr, nz_ptr,
    rows_ptr, N, K, threshold, stride_pm, stride_xm, stride_un, stride_dn, stride_ym,
    HAS_UP: tl.constexpr, HAS_UP_BIAS: tl.constexpr, HAS_DOWN_BIAS: tl.constexpr, DRELU: tl.constexpr,
    SQUARE: tl.constexpr, WIDTH: tl.constexpr, SCAN: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
    ENTRIES: tl.constexpr, LISTED: tl.constexpr,
):  # fmt: skip
    """_forward_row of row program_id; LISTED: persistent over the rows listed in rows (rows[0]: their
    number, rows[1 + i]: row ids; the rows _pack_record_kernel leaves), all their outputs written (y
    over the up+down kernel's)."""
    if LISTED:
        for i in range(tl.program_id(0), tl.load(rows_ptr), tl.num_programs(0)):
            _forward_row(
                tl.load(rows_ptr + 1 + i).to(tl.int64), pre_ptr, x_ptr, wu_ptr, bu_ptr, wd_ptr, bd_ptr, y_ptr,
                ids_ptr, gate_ptr, up_ptr, cnt_ptr, l1_ptr, nz_ptr, N, K, threshold, stride_pm, stride_xm, stride_un,
                stride_dn, stride_ym, HAS_UP, HAS_UP_BIAS, HAS_DOWN_BIAS, DRELU, SQUARE, WIDTH, SCAN, CHUNK,
                BLOCK_K, ENTRIES,
            )  # fmt: skip
    else:
        _forward_row(
            tl.program_id(0).to(tl.int64), pre_ptr, x_ptr, wu_ptr, bu_ptr, wd_ptr, bd_ptr, y_ptr, ids_ptr,
            gate_ptr, up_ptr, cnt_ptr, l1_ptr, nz_ptr, N, K, threshold, stride_pm, stride_xm, stride_un, stride_dn,
            stride_ym, HAS_UP, HAS_UP_BIAS, HAS_DOWN_BIAS, DRELU, SQUARE, WIDTH, SCAN, CHUNK, BLOCK_K, ENTRIES,
        )  # fmt: skip


@triton.jit
def _pack_record_kernel(
    words_ptr, tcnt_ptr, ids_ptr, gate_ptr, up_ptr, cnt_ptr, l1_ptr, nz_ptr, redo_ptr, M, n_tiles,
    HAS_UP: tl.constexpr, DRELU: tl.constexpr, TILE_N: tl.constexpr, SLOTS: tl.constexpr, WIDTH: tl.constexpr,
    LIMIT: tl.constexpr, TILES_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """The record of rows [m0, m0 + BLOCK_M) (m0 = BLOCK_M * program_id) from the TwELL words and
    counts of their dense gate: a row with no tile over SLOTS and at most LIMIT entries (<= WIDTH;
    the up+down kernel stored its entries' u in the record's up slots, in entry order) gets its
    entries tile by tile (ids = tile * TILE_N + column, gate: the word's value), zero pads, its count,
    sum |h| and nonzero h. Other rows are appended to the list redo (redo[0]: their number, zeroed by
    the caller; redo[1 + i]: row ids), nothing else written (the row kernel takes them: LISTED)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m.to(tl.int64)
    offs_t = tl.arange(0, TILES_PAD)
    row_ok = offs_m < M
    tiles = rows[:, None] * n_tiles + offs_t[None, :]
    cnt = tl.load(tcnt_ptr + tiles, mask=row_ok[:, None] & (offs_t < n_tiles)[None, :], other=0)
    total = tl.sum(cnt, axis=1)
    packed = row_ok & (tl.max(cnt, axis=1) <= SLOTS) & (total <= LIMIT)
    left = row_ok & ~packed
    first = tl.atomic_add(redo_ptr, tl.sum(left.to(tl.int32), axis=0))
    tl.store(redo_ptr + 1 + first + tl.cumsum(left.to(tl.int32), axis=0) - 1, offs_m, mask=left)
    tl.store(cnt_ptr + offs_m, total, mask=packed)
    dtype = gate_ptr.dtype.element_ty
    offs_s = tl.arange(0, SLOTS)
    before = tl.zeros([BLOCK_M], dtype=tl.int32)
    l1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    nonzero = tl.zeros([BLOCK_M], dtype=tl.int32)
    for t in range(0, n_tiles):
        c = tl.load(tcnt_ptr + rows * n_tiles + t, mask=packed, other=0)
        valid = offs_s[None, :] < c[:, None]  # c is 0 on rows not packed here
        word = tl.load(words_ptr + (rows * n_tiles + t)[:, None] * SLOTS + offs_s[None, :], mask=valid, other=0)
        g, column = decode(word, dtype)
        slot = rows[:, None] * WIDTH + before[:, None] + offs_s[None, :]
        tl.store(ids_ptr + slot, t * TILE_N + column, mask=valid)
        tl.store(gate_ptr + slot, g.to(dtype), mask=valid)
        u = g
        if HAS_UP:
            u = tl.load(up_ptr + slot, mask=valid, other=0.0).to(tl.float32)
        h = _hidden(g, u, HAS_UP, DRELU, False, dtype)  # 0 outside valid: g and u load as 0
        l1 += tl.sum(tl.abs(h), axis=1)
        nonzero += tl.sum((h != 0.0).to(tl.int32), axis=1)
        before += c
    for c0 in range(0, WIDTH, CHUNK):
        slots = c0 + tl.arange(0, CHUNK)
        pad = packed[:, None] & (slots[None, :] >= total[:, None]) & (slots < WIDTH)[None, :]
        at = rows[:, None] * WIDTH + slots[None, :]
        tl.store(ids_ptr + at, tl.zeros([BLOCK_M, CHUNK], dtype=tl.int32), mask=pad)
        tl.store(gate_ptr + at, tl.zeros([BLOCK_M, CHUNK], dtype=dtype), mask=pad)
        if HAS_UP:
            tl.store(up_ptr + at, tl.zeros([BLOCK_M, CHUNK], dtype=dtype), mask=pad)
    tl.store(l1_ptr + offs_m, l1, mask=packed)
    tl.store(nz_ptr + offs_m, nonzero, mask=packed)


@triton.jit
def _backup_row(
    dx, xv, dyv, dl1, offs_k, k_ok, N, K, threshold, wg_ptr, bg_ptr, wu_ptr, bu_ptr, wd_ptr, stride_gn, stride_un,
    stride_dn, dwg_ptr, dwu_ptr, dwd_ptr, dbg_ptr, dbu_ptr,
    HAS_UP: tl.constexpr, HAS_GATE_BIAS: tl.constexpr, HAS_UP_BIAS: tl.constexpr, DRELU: tl.constexpr,
    SQUARE: tl.constexpr, DTYPE: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """dx of a dense-backup row over all N neurons, ROWS at a time: its gate recomputed from W_g (only
    active neurons' rows of W_u and W_d^T are loaded), its dW and dbias terms added with fp32 atomics."""
    offs_r = tl.arange(0, ROWS)
    for n0 in range(0, N, ROWS):
        rows = n0 + offs_r
        ok = rows < N
        rows64 = rows.to(tl.int64)
        tile_ok = ok[:, None] & k_ok[None, :]
        wg = tl.load(wg_ptr + rows64[:, None] * stride_gn + offs_k[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        g = tl.sum(wg * xv[None, :], axis=1)
        if HAS_GATE_BIAS:
            g += tl.load(bg_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        g = _round(g, DTYPE)
        kept = _kept(g, threshold) & ok
        kept_tile = kept[:, None] & k_ok[None, :]
        wd = tl.load(wd_ptr + rows64[:, None] * stride_dn + offs_k[None, :], mask=kept_tile, other=0.0)
        dh = tl.sum(wd.to(tl.float32) * dyv[None, :], axis=1)
        u = g
        if HAS_UP:
            wu = tl.load(wu_ptr + rows64[:, None] * stride_un + offs_k[None, :], mask=kept_tile, other=0.0)
            wu = wu.to(tl.float32)
            u = tl.sum(wu * xv[None, :], axis=1)
            if HAS_UP_BIAS:
                u += tl.load(bu_ptr + rows, mask=ok, other=0.0).to(tl.float32)
            u = _round(u, DTYPE)
        h = tl.where(kept, _hidden(g, u, HAS_UP, DRELU, SQUARE, DTYPE), 0.0)
        dg, du = _hidden_grads(dh + dl1 * _sign(h), g, u, HAS_UP, DRELU, SQUARE)
        dg = tl.where(kept, dg, 0.0)
        du = tl.where(kept, du, 0.0)
        dx += tl.sum(dg[:, None] * wg, axis=0)
        out = rows64[:, None] * K + offs_k[None, :]
        tl.atomic_add(dwg_ptr + out, dg[:, None] * xv[None, :], mask=kept_tile, sem="relaxed")
        tl.atomic_add(dwd_ptr + out, h[:, None] * dyv[None, :], mask=kept_tile, sem="relaxed")
        if HAS_GATE_BIAS:
            tl.atomic_add(dbg_ptr + rows, dg, mask=kept, sem="relaxed")
        if HAS_UP:
            dx += tl.sum(du[:, None] * wu, axis=0)
            tl.atomic_add(dwu_ptr + out, du[:, None] * xv[None, :], mask=kept_tile, sem="relaxed")
            if HAS_UP_BIAS:
                tl.atomic_add(dbu_ptr + rows, du, mask=kept, sem="relaxed")
    return dx


@triton.jit
def _train_dx_kernel(
    rows_ptr, dy_ptr, dl1_ptr, wg_ptr, wu_ptr, wd_ptr, ids_ptr, gate_ptr, up_ptr, cnt_ptr, cg_ptr, cu_ptr,
    ch_ptr, dx_ptr, K, stride_dym, stride_gn, stride_un, stride_dn, stride_dxm,
    HAS_UP: tl.constexpr, DRELU: tl.constexpr, SQUARE: tl.constexpr, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr,
    ENTRIES: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Row m = rows[program_id] (heaviest first, so long rows start early instead of trailing the
    launch): dx_m, and each record entry's (dg, du, h) stored at the entry's record slot, where the dW
    kernel gathers them through the neuron-sorted slot list. Dense-backup rows are left to _dense_backup and
    _train_backup_kernel. dl1: the gradient of sum |h| (the L1 penalty's), added to dh as dl1 * sign(h)."""
    m = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    count = tl.load(cnt_ptr + m)
    if count > WIDTH:
        return
    dl1 = tl.load(dl1_ptr)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    dyv = tl.load(dy_ptr + m * stride_dym + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    dx = tl.zeros([BLOCK_K], dtype=tl.float32)
    dtype = dx_ptr.dtype.element_ty
    slot = m * WIDTH
    # ENTRIES entries a step, their weight rows as [ENTRIES, BLOCK_K] tiles; STAGES > 1 loads
    # them stages ahead through cp.async
    for e0 in tl.range(0, count, ENTRIES, num_stages=STAGES):
        e = e0 + tl.arange(0, ENTRIES)
        valid = e < count
        tile_ok = valid[:, None] & k_ok[None, :]
        neurons = tl.load(ids_ptr + slot + e, mask=valid, other=0).to(tl.int64)
        g = tl.load(gate_ptr + slot + e, mask=valid, other=0.0).to(tl.float32)
        u = g
        if HAS_UP:
            u = tl.load(up_ptr + slot + e, mask=valid, other=0.0).to(tl.float32)
        wd = tl.load(wd_ptr + neurons[:, None] * stride_dn + offs_k[None, :], mask=tile_ok, other=0.0)
        h = _hidden(g, u, HAS_UP, DRELU, SQUARE, dtype)
        dh = tl.sum(wd.to(tl.float32) * dyv[None, :], axis=1) + dl1 * _sign(h)
        dg, du = _hidden_grads(dh, g, u, HAS_UP, DRELU, SQUARE)  # 0 past the count: g, u, dh load or sum to 0
        wg = tl.load(wg_ptr + neurons[:, None] * stride_gn + offs_k[None, :], mask=tile_ok, other=0.0)
        dx += tl.sum(dg[:, None] * wg.to(tl.float32), axis=0)
        tl.store(cg_ptr + slot + e, dg.to(dtype), mask=valid)
        tl.store(ch_ptr + slot + e, h.to(dtype), mask=valid)
        if HAS_UP:
            wu = tl.load(wu_ptr + neurons[:, None] * stride_un + offs_k[None, :], mask=tile_ok, other=0.0)
            dx += tl.sum(du[:, None] * wu.to(tl.float32), axis=0)
            tl.store(cu_ptr + slot + e, du.to(dtype), mask=valid)
    tl.store(dx_ptr + m * stride_dxm + offs_k, dx.to(dtype), mask=k_ok)


@triton.jit
def _train_backup_kernel(
    rows_ptr, dy_ptr, dl1_ptr, x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, wd_ptr, cnt_ptr, dx_ptr, dwg_ptr, dwu_ptr,
    dwd_ptr, dbg_ptr, dbu_ptr, M, N, K, first, threshold, stride_dym, stride_xm, stride_gn, stride_un, stride_dn,
    stride_dxm,
    HAS_UP: tl.constexpr, HAS_GATE_BIAS: tl.constexpr, HAS_UP_BIAS: tl.constexpr, DRELU: tl.constexpr,
    SQUARE: tl.constexpr, WIDTH: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The dense-backup rows past the first `first` of rows (heaviest first: those are _dense_backup's),
    persistent: program i takes ranks first + i, first + i + programs, ... until a rank holds a row
    within the width. One program walks a row's N neurons (_backup_row): slow (~N steps of a weight
    row each), an overflow for layers with more than one dense-backup row in BACKUP_SHARE."""
    i = first + tl.program_id(0)
    m = tl.load(rows_ptr + tl.minimum(i, M - 1)).to(tl.int64)
    busy = (i < M) & (tl.load(cnt_ptr + m) > WIDTH)
    dl1 = tl.load(dl1_ptr)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    dtype = dx_ptr.dtype.element_ty
    while busy:
        dyv = tl.load(dy_ptr + m * stride_dym + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        dx = _backup_row(
            tl.zeros([BLOCK_K], dtype=tl.float32), xv, dyv, dl1, offs_k, k_ok, N, K, threshold, wg_ptr, bg_ptr,
            wu_ptr, bu_ptr, wd_ptr, stride_gn, stride_un, stride_dn, dwg_ptr, dwu_ptr, dwd_ptr, dbg_ptr, dbu_ptr,
            HAS_UP, HAS_GATE_BIAS, HAS_UP_BIAS, DRELU, SQUARE, dtype, ROWS,
        )  # fmt: skip
        tl.store(dx_ptr + m * stride_dxm + offs_k, dx.to(dtype), mask=k_ok)
        i += tl.num_programs(0)
        m = tl.load(rows_ptr + tl.minimum(i, M - 1)).to(tl.int64)
        busy = (i < M) & (tl.load(cnt_ptr + m) > WIDTH)


@triton.jit
def _backup_grads_kernel(
    pre_ptr, up_ptr, dhp_ptr, cnt_ptr, dl1_ptr, dg_ptr, du_ptr, h_ptr, accbg_ptr, accbu_ptr, cols_ptr, colcnt_ptr,
    T, N, threshold,
    HAS_UP: tl.constexpr, HAS_GATE_BIAS: tl.constexpr, HAS_UP_BIAS: tl.constexpr, DRELU: tl.constexpr,
    SQUARE: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, STORE_H: tl.constexpr,
    HOT: tl.constexpr,
):  # fmt: skip
    """The dense pass's hidden gradients, one [BLOCK_T, BLOCK_N] tile of its [T, N] products at a time
    (all [T, N], unit stride on N): from the gate g (pre), up u and dh = dy W_d^T of the pass's rows,
    (dg, du, h) in the dtype (h only with STORE_H: a dense-mode layer kept its forward's), zero outside
    kept entries of dense-backup rows (count > WIDTH), and the tile's column sums of dg / du added to
    the fp32 bias accumulators. One pass over the tile in place of torch's ~20 elementwise kernels.
    HOT: the N columns are the hot neurons cols [N] (int64; _hot_grads, WIDTH -1: every row): the bias
    sums land at their neurons, and each column's kept entries are counted into colcnt [N] (int32)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    backup = tl.load(cnt_ptr + offs_t, mask=offs_t < T, other=0) > WIDTH
    ok = (offs_t < T)[:, None] & (offs_n < N)[None, :]
    at = offs_t.to(tl.int64)[:, None] * N + offs_n[None, :]
    dtype = dg_ptr.dtype.element_ty
    g = tl.load(pre_ptr + at, mask=ok, other=0.0).to(tl.float32)
    u = g
    if HAS_UP:
        u = tl.load(up_ptr + at, mask=ok, other=0.0).to(tl.float32)
    kept = _kept(g, threshold) & backup[:, None] & ok
    h = tl.where(kept, _hidden(g, u, HAS_UP, DRELU, SQUARE, dtype), 0.0)
    dh = tl.load(dhp_ptr + at, mask=ok, other=0.0).to(tl.float32) + tl.load(dl1_ptr) * _sign(h)
    dg, du = _hidden_grads(dh, g, u, HAS_UP, DRELU, SQUARE)
    dg = tl.where(kept, dg, 0.0)
    tl.store(dg_ptr + at, dg.to(dtype), mask=ok)
    if STORE_H:
        tl.store(h_ptr + at, h.to(dtype), mask=ok)
    neurons = offs_n
    if HOT:
        neurons = tl.load(cols_ptr + offs_n, mask=offs_n < N, other=0)
        tl.atomic_add(colcnt_ptr + offs_n, tl.sum(kept.to(tl.int32), axis=0), mask=offs_n < N, sem="relaxed")
    if HAS_GATE_BIAS:
        tl.atomic_add(accbg_ptr + neurons, tl.sum(dg, axis=0), mask=offs_n < N, sem="relaxed")
    if HAS_UP:
        du = tl.where(kept, du, 0.0)
        tl.store(du_ptr + at, du.to(dtype), mask=ok)
        if HAS_UP_BIAS:
            tl.atomic_add(accbu_ptr + neurons, tl.sum(du, axis=0), mask=offs_n < N, sem="relaxed")


@triton.jit
def _dense_hidden_kernel(
    pre_ptr, up_ptr, h_ptr, kept_ptr, l1_ptr, nz_ptr, rows_ptr, write_ptr, ids_ptr, gate_ptr, rec_up_ptr, T, N,
    threshold,
    HAS_UP: tl.constexpr, DRELU: tl.constexpr, SQUARE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_KEPT: tl.constexpr, RECORD: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    """The hidden activation of T dense rows, rows [t0, t0 + BLOCK_T) (t0 = BLOCK_T * program_id) over
    all N, BLOCK_N columns a step (all [T, N], unit stride on N): h from the gate g (pre) and up u in the
    dtype, each row's sum |h| (fp32) and nonzero count of h, with STORE_KEPT its kept count (not g <=
    threshold: the record width it would need). RECORD (the packed forward's dense rows, _dense_rows):
    row t's kept entries, in column order, also go to the record row rows[t] (int64) where write[t]
    (int8) is set: the first WIDTH of them at its slots of ids, gate (g) and rec_up (u), by a prefix
    sum along the tile's rows behind the entries of its earlier columns."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    dtype = h_ptr.dtype.element_ty
    kept_rows = tl.zeros([BLOCK_T], dtype=tl.int32)
    if RECORD:
        write = t_ok & (tl.load(write_ptr + offs_t, mask=t_ok, other=0) != 0)
        record_rows = tl.load(rows_ptr + offs_t, mask=write, other=0)
    l1 = tl.zeros([BLOCK_T], dtype=tl.float32)
    nonzero = tl.zeros([BLOCK_T], dtype=tl.int32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = t_ok[:, None] & (offs_n < N)[None, :]
        at = offs_t.to(tl.int64)[:, None] * N + offs_n[None, :]
        g = tl.load(pre_ptr + at, mask=ok, other=0.0).to(tl.float32)
        u = g
        if HAS_UP:
            u = tl.load(up_ptr + at, mask=ok, other=0.0).to(tl.float32)
        kept = _kept(g, threshold) & ok
        h = tl.where(kept, _hidden(g, u, HAS_UP, DRELU, SQUARE, dtype), 0.0)
        tl.store(h_ptr + at, h.to(dtype), mask=ok)
        if RECORD:
            pos = kept_rows[:, None] + tl.cumsum(kept.to(tl.int32), axis=1) - 1
            stored = kept & write[:, None] & (pos < WIDTH)
            slot = record_rows[:, None] * WIDTH + pos
            tl.store(ids_ptr + slot, offs_n[None, :] + tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.int32), mask=stored)
            tl.store(gate_ptr + slot, g.to(dtype), mask=stored)
            if HAS_UP:
                tl.store(rec_up_ptr + slot, u.to(dtype), mask=stored)
        kept_rows += tl.sum(kept.to(tl.int32), axis=1)
        l1 += tl.sum(tl.abs(h), axis=1)
        nonzero += tl.sum((h != 0.0).to(tl.int32), axis=1)
    if STORE_KEPT:
        tl.store(kept_ptr + offs_t, kept_rows, mask=t_ok)
    tl.store(l1_ptr + offs_t, l1, mask=t_ok)
    tl.store(nz_ptr + offs_t, nonzero, mask=t_ok)


@triton.jit
def _neuron_order_kernel(
    order_ptr, starts_ptr, cg_ptr, cu_ptr, ch_ptr, pair_rows_ptr, og_ptr, ou_ptr, oh_ptr, N, HAS_UP: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The dW kernel's inputs in neuron order, for the record's pairs only (p < starts[N]; the sort puts
    the invalid slots after them): pair p's token row order[p] // WIDTH (int32) and its coefficients
    (dg, du, h) from its record slot order[p]. One pass reading the sorted slots once."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = p < tl.load(starts_ptr + N)
    q = tl.load(order_ptr + p, mask=ok, other=0)
    tl.store(pair_rows_ptr + p, (q // WIDTH).to(tl.int32), mask=ok)
    tl.store(og_ptr + p, tl.load(cg_ptr + q, mask=ok), mask=ok)
    if HAS_UP:
        tl.store(ou_ptr + p, tl.load(cu_ptr + q, mask=ok), mask=ok)
    tl.store(oh_ptr + p, tl.load(ch_ptr + q, mask=ok), mask=ok)


@triton.jit
def _train_dw_kernel(
    pair_rows_ptr, starts_ptr, x_ptr, dy_ptr, cg_ptr, cu_ptr, ch_ptr, accg_ptr, accu_ptr, accd_ptr, accbg_ptr,
    accbu_ptr, dwg_ptr, dwu_ptr, dwd_ptr, dbg_ptr, dbu_ptr, N, K, stride_xm, stride_dym,
    HAS_UP: tl.constexpr, HAS_GATE_BIAS: tl.constexpr, HAS_UP_BIAS: tl.constexpr, GROUP: tl.constexpr,
    PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Neurons [n0, n0 + GROUP) (n0 = GROUP * program_id(0)), columns of K block program_id(1): the
    program owns these dW rows' block, so it writes them whole, with no atomics. Its neurons' pairs
    are contiguous in the sorted list (p in starts[n0] .. starts[n0 + GROUP]); PAIRS at a time, the
    gathered x and dy rows [PAIRS, BLOCK_K] are multiplied by a [GROUP, PAIRS] coefficient tile that
    holds pair p's coefficient in its neuron's row and zeros elsewhere: one tensor-core product adds
    every pair to its own neuron's row. Pairs come in neuron order, rows increasing, so each step's
    tile gathers rows shared by its neighbours' K blocks; program_id(0) varies fastest, so resident
    programs work on one K block and its x / dy columns stay in L2. The accumulators hold the
    dense-backup rows' terms (the dx kernel's atomics) and are added once at the end."""
    n0 = tl.program_id(0) * GROUP
    offs_n = n0 + tl.arange(0, GROUP)
    n_ok = offs_n < N
    begin = tl.load(starts_ptr + offs_n, mask=n_ok, other=0)
    end = tl.load(starts_ptr + offs_n + 1, mask=n_ok, other=0)
    lo = tl.load(starts_ptr + n0)
    hi = tl.load(starts_ptr + tl.minimum(n0 + GROUP, N))
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    dtype = dwg_ptr.dtype.element_ty
    acc_g = tl.zeros([GROUP, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([GROUP, BLOCK_K], dtype=tl.float32)
    acc_d = tl.zeros([GROUP, BLOCK_K], dtype=tl.float32)
    sum_g = tl.zeros([GROUP], dtype=tl.float32)
    sum_u = tl.zeros([GROUP], dtype=tl.float32)
    for p0 in tl.range(lo, hi, PAIRS, num_stages=STAGES):  # stages: the pair indices load steps ahead
        p = p0 + tl.arange(0, PAIRS)
        ok = p < hi
        owner = (begin[:, None] <= p[None, :]) & (p[None, :] < end[:, None])  # [GROUP, PAIRS]
        m = tl.load(pair_rows_ptr + p, mask=ok, other=0)  # the pair's token row
        tile_ok = ok[:, None] & k_ok[None, :]
        xt = tl.load(x_ptr + m[:, None] * stride_xm + offs_k[None, :], mask=tile_ok, other=0.0)
        cg = tl.where(owner, tl.load(cg_ptr + p, mask=ok, other=0.0)[None, :], 0.0)
        acc_g = tl.dot(cg.to(dtype), xt, acc_g, input_precision=PRECISION)
        if HAS_GATE_BIAS:
            sum_g += tl.sum(cg.to(tl.float32), axis=1)
        if HAS_UP:
            cu = tl.where(owner, tl.load(cu_ptr + p, mask=ok, other=0.0)[None, :], 0.0)
            acc_u = tl.dot(cu.to(dtype), xt, acc_u, input_precision=PRECISION)
            if HAS_UP_BIAS:
                sum_u += tl.sum(cu.to(tl.float32), axis=1)
        dyt = tl.load(dy_ptr + m[:, None] * stride_dym + offs_k[None, :], mask=tile_ok, other=0.0)
        ch = tl.where(owner, tl.load(ch_ptr + p, mask=ok, other=0.0)[None, :], 0.0)
        acc_d = tl.dot(ch.to(dtype), dyt, acc_d, input_precision=PRECISION)
    out = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    out_ok = n_ok[:, None] & k_ok[None, :]
    tl.store(dwg_ptr + out, (acc_g + tl.load(accg_ptr + out, mask=out_ok, other=0.0)).to(dtype), mask=out_ok)
    if HAS_UP:
        tl.store(dwu_ptr + out, (acc_u + tl.load(accu_ptr + out, mask=out_ok, other=0.0)).to(dtype), mask=out_ok)
    tl.store(dwd_ptr + out, (acc_d + tl.load(accd_ptr + out, mask=out_ok, other=0.0)).to(dtype), mask=out_ok)
    if tl.program_id(1) == 0:
        if HAS_GATE_BIAS:
            tl.store(dbg_ptr + offs_n, (sum_g + tl.load(accbg_ptr + offs_n, mask=n_ok, other=0.0)).to(dtype), mask=n_ok)
        if HAS_UP_BIAS:
            tl.store(dbu_ptr + offs_n, (sum_u + tl.load(accbu_ptr + offs_n, mask=n_ok, other=0.0)).to(dtype), mask=n_ok)


def _check_rows(name: str, t: torch.Tensor, n: int, k: int, x: torch.Tensor) -> None:
    if tuple(t.shape) != (n, k) or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(
            f"{name} must be [{n}, {k}] {x.dtype} on {x.device}, got {list(t.shape)} {t.dtype} on {t.device}"
        )
    if t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along K (rows gathered whole), got strides {t.stride()}")


def _check_weights(x2, gate_weight, up_weight, down_weight_t, width) -> tuple[int, int]:
    m, k = x2.shape
    if k > policy.MAX_K:
        raise ValueError(f"the training kernels need K <= {policy.MAX_K} (rows live in registers), got K={k}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    n = gate_weight.shape[0]
    for name, t in (("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight_t", down_weight_t)):
        if t is not None:
            _check_rows(name, t, n, k, x2)
    return m, n


def _check_biases(x, n, gate_bias, up_weight, up_bias, down_bias) -> None:
    if up_bias is not None and up_weight is None:
        raise ValueError("up_bias needs up_weight (a plain FFN has its bias as gate_bias)")
    for name, b, size in (("gate_bias", gate_bias, n), ("up_bias", up_bias, n), ("down_bias", down_bias, x.shape[1])):
        check_bias(name, b, size, x)


def _check_record(x, ids, gate, up, counts, has_up: bool, l1_grad) -> None:
    """The record train_forward wrote for x: the kernels index it as dense [M, W] rows of these types."""
    m, width = x.shape[0], ids.shape[1]
    for name, t, shape, dtype in (
        ("ids", ids, (m, width), torch.int32),
        ("gate", gate, (m, width), x.dtype),
        ("up", up, (m, width if has_up else 0), x.dtype),
        ("counts", counts, (m,), torch.int32),
    ):
        check_operand(name, t, shape, x, dtype)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (indexed as a dense array), got strides {t.stride()}")
    if not (isinstance(l1_grad, torch.Tensor) and l1_grad.numel() == 1 and l1_grad.dtype == torch.float32):
        raise ValueError(f"l1_grad must be a one-element float32 tensor, got {l1_grad!r}")
    if l1_grad.device != x.device:
        raise ValueError(f"l1_grad must be on {x.device}, got {l1_grad.device}")


def _row_warps(block_k: int, backup: bool = False, entries: int = 1) -> int:
    """Warps of the one-row-per-program kernels: whole rows in registers. ptxas for sm_90 (Triton 3.9,
    with the launcher's divisibility hints): the dx kernel takes 87 registers a thread at K=2048 with 4
    warps, 161 at K=8192 with 8. The dense-backup overflow kernel (backup) is irregular under this
    ptxas: at K=2048 8 warps spill 32 bytes without W_u and 16 warps take 96-122 registers; at K=4096
    8 warps take 250-254, 16 spill 80 bytes; at K=8192 every count spills (296-712 bytes), which
    only that rare path pays. Entries gathered a step (`entries`) past 2 double the warps per doubling:
    each [entries, BLOCK_K] weight tile then takes the registers of a 2-entry tile a thread."""
    if backup:
        return 8 if block_k == 4096 else 16
    return min(16, (8 if block_k > 2048 else 4) * max(1, entries // 2))


def _row_entries(entries: int, block_k: int) -> int:
    """Entries a step of the row kernels at rows of block_k: LayerConfig.train_entries, at most
    16384 / block_k (a [entries, BLOCK_K] tile within 16 warps' registers: ptxas for sm_90 spills the
    forward kernel at K=4096 with 8 entries)."""
    return min(entries, max(1, 16384 // block_k))


def _check_entries(entries: int) -> None:
    if not isinstance(entries, int) or isinstance(entries, bool) or entries not in policy.TRAIN_ENTRIES:
        raise ValueError(f"entries must be one of {policy.TRAIN_ENTRIES}, got {entries!r}")


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Buffers the kernels write in full (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _chunk(width: int) -> int:
    """Gate columns per step of a dense-backup row: at most the width, so a chunk fits its slots."""
    return min(SCAN, 1 << (width.bit_length() - 1))


def train_forward(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight_t: torch.Tensor,
    down_bias: torch.Tensor | None,
    *,
    threshold: float,
    drelu: bool,
    square: bool,
    width: int,
    entries: int = 1,
    dense_above: float | None = None,
    hot: int = 0,
    forward_pack: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(y, ids, gate, up, counts, l1, nonzero): y [M, K] of the FFN, its record (module docstring),
    sum |h| over the hidden activation h [M, N] (fp32) and the number of its nonzeros (int64).

    x: [M, K] with unit stride on K; gate_weight, up_weight (None: plain FFN, h = relu_t(gate) or its
    square), down_weight_t: [N, K] with unit stride on K (down_weight_t = down_weight.t()). entries:
    record entries the row kernel gathers a step (LayerConfig.train_entries). dense_above:
    LayerConfig.train_dense_above; a layer training dense (_TrainState) runs _dense_forward. hot:
    LayerConfig.train_hot, the layer's hot neurons (_hot_columns) by cuBLAS products over just them.
    forward_pack: LayerConfig.train_forward_pack, the sparse forward through the prefill kernels
    (_pack_forward; relu² keeps the row kernel).
    """
    check_input("x", x, unit_stride=True)
    check_threshold(threshold)
    _check_entries(entries)
    policy.check_train_dense_above(dense_above)
    policy.check_train_hot(hot)
    if not isinstance(forward_pack, bool):
        raise ValueError(f"forward_pack must be a bool, got {forward_pack!r}")
    m, n = _check_weights(x, gate_weight, up_weight, down_weight_t, width)
    if hot > n:
        raise ValueError(f"hot must be at most the {n} hidden neurons, got {hot}")
    _check_biases(x, n, gate_bias, up_weight, up_bias, down_bias)
    args = (x, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, down_bias, threshold, drelu, square, width)
    state = train_state(gate_weight) if dense_above is not None or hot else None
    if dense_above is None:
        return _sparse_forward(*args, entries, state, hot, forward_pack)[0]
    # under CUDA-graph capture the layer's state is frozen: no event queries, no new measurements
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing:
        state.update(dense_above)
    state.forward_dense = state.dense
    if state.dense:
        *out, past_width, unserved = _dense_forward(*args, state, hot)
    else:
        out, unserved = _sparse_forward(*args, entries, state, hot, forward_pack)
        past_width = (out[4] > width).sum()
        unserved = past_width if unserved is None else unserved
    if not capturing:
        state.measure(out[-1], past_width, unserved, m * n, m)
    return tuple(out)


def _dense_forward(
    x,
    gate_weight,
    gate_bias,
    up_weight,
    up_bias,
    down_weight_t,
    down_bias,
    threshold,
    drelu,
    square,
    width,
    state,
    hot,
) -> tuple[torch.Tensor, ...]:
    """train_forward's outputs for a layer training dense, its rows past the width and past the packed
    forward's limit (_pack_limit; its measure for _TrainState.forward_rows): what dense
    autograd's forward computes (gate and up by cuBLAS, h by one elementwise kernel that also counts
    each row's kept entries and sums |h| and nonzero h, y by cuBLAS), with a record whose every row is
    past the width (its contents unused). g, u and h stay for the backward (_dense_saved, keyed by the
    record's counts) as dense autograd keeps its activations: the backward then runs dense autograd's
    six products (_dense_backward with them), none recomputed. The hot neurons' record is filled too (a
    sparse backward of this record is exact)."""
    m, n = x.shape[0], gate_weight.shape[0]
    pre = F.linear(x, gate_weight, gate_bias)
    up = F.linear(x, up_weight, up_bias) if up_weight is not None else pre
    h, l1, nonzero, kept = _hidden_rows(
        pre, up if up_weight is not None else None, threshold, drelu, square, store_kept=True
    )  # fmt: skip
    y = F.linear(h, down_weight_t.t(), down_bias)
    ids = _alloc((m, width), torch.int32, x.device)
    gate = _alloc((m, width), x.dtype, x.device)
    up_record = _alloc((m, width if up_weight is not None else 0), x.dtype, x.device)
    counts = torch.full((m,), width + 1, dtype=torch.int32, device=x.device)
    _keep_for_backward(counts, pre, up, h)
    hot_ids = _hot_columns(state, pre, hot, threshold)
    hot_up = up.index_select(1, hot_ids) if up_weight is not None else up_record.new_empty(m, 0)
    hot_record = (hot_ids, pre.index_select(1, hot_ids), hot_up)
    # the rows past the width, and those the packed forward would leave (its measure: tile overflows aside)
    totals = (l1.sum(), nonzero.sum(dtype=torch.int64), (kept > width).sum(), (kept > _pack_limit(width, n)).sum())
    return y, ids, gate, up_record, counts, *hot_record, *totals


# A dense-mode forward's (g, u, h) [M, N] for its backward, keyed by the address of the record's counts
# (unique among live tensors; the entry goes when that counts tensor is freed, so a forward whose
# backward never runs, or an activation-checkpointed first forward, leaves nothing behind). A backward
# that finds no entry for its record (a counts tensor seen through another object) recomputes them
# (_dense_backward): slower, never wrong.
_dense_saved: dict[int, tuple[torch.Tensor, ...]] = {}


def _keep_for_backward(counts: torch.Tensor, *saved: torch.Tensor) -> None:
    key = counts.data_ptr()
    _dense_saved[key] = (weakref.ref(counts), *saved)
    weakref.finalize(counts, _drop_saved, key)


def _drop_saved(key: int) -> None:
    entry = _dense_saved.get(key)
    if entry is not None and entry[0]() is None:  # not a newer record's
        del _dense_saved[key]


def _saved_for(counts: torch.Tensor, m: int, n: int) -> tuple[torch.Tensor, ...] | None:
    """The (g, u, h) a dense-mode forward kept for the record whose counts these are, if any."""
    entry = _dense_saved.get(counts.data_ptr()) if m > 0 else None
    if entry is None or entry[0]() is None or entry[1].shape != (m, n) or entry[1].device != counts.device:
        return None
    return entry[1:]


def _sparse_forward(
    x,
    gate_weight,
    gate_bias,
    up_weight,
    up_bias,
    down_weight_t,
    down_bias,
    threshold,
    drelu,
    square,
    width,
    entries,
    state=None,
    hot=0,
    pack=False,
) -> tuple[torch.Tensor, ...]:
    """(train_forward's outputs, unserved) by the record kernel, or with `pack` (not relu²) by _pack_forward
    (its dense rows with FORWARD_DENSE_ROWS) and the record kernel for the rows it leaves; the hot neurons
    (hot of them: _hot_columns) by cuBLAS products over just them, their gate columns hidden from the
    record (set to -inf). unserved: the rows the packed forward could not serve (a 0-dim tensor; None
    without it)."""
    m, k = x.shape
    n = gate_weight.shape[0]
    pre = torch.nn.functional.linear(x, gate_weight, gate_bias)  # dense: the gate GEMM (cuBLAS)
    hot_ids = _hot_columns(state, pre, hot, threshold)
    hot_gate = pre.index_select(1, hot_ids)
    if hot:
        pre.index_fill_(1, hot_ids, float("-inf"))
    y = _alloc((m, k), x.dtype, x.device)
    ids = _alloc((m, width), torch.int32, x.device)
    gate = _alloc((m, width), x.dtype, x.device)
    up = _alloc((m, width if up_weight is not None else 0), x.dtype, x.device)
    counts = _alloc((m,), torch.int32, x.device)
    row_l1 = _alloc((m,), torch.float32, x.device)
    row_nonzero = _alloc((m,), torch.int32, x.device)
    redo, unserved = None, None
    if m > 0:
        block_k = next_power_of_2(k)
        row_entries = _row_entries(entries, block_k)
        if pack and not square:
            dense_rows = 0
            if FORWARD_DENSE_ROWS:
                dense_rows = state.forward_rows(m) if state is not None else _share_rows(None, m)
            redo, unserved = _pack_forward(
                pre, x, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, down_bias, threshold, drelu,
                (y, ids, gate, up, counts, row_l1, row_nonzero), dense_rows,
            )  # fmt: skip
        grid, listed = (m,), redo is not None
        if listed:  # the rows _pack_forward left: persistent, more entries a step (few rows, each alone)
            row_entries = _row_entries(REDO_ENTRIES, block_k)
            grid = (persistent_programs(x.device, 1),)
        _train_forward_kernel[grid](
            pre, x, up_weight if up_weight is not None else x, up_bias if up_bias is not None else x,
            down_weight_t, down_bias if down_bias is not None else x, y, ids, gate, up, counts, row_l1, row_nonzero,
            redo, n, k, threshold_in(threshold, x.dtype), pre.stride(0), x.stride(0),
            up_weight.stride(0) if up_weight is not None else 0, down_weight_t.stride(0), y.stride(0),
            HAS_UP=up_weight is not None, HAS_UP_BIAS=up_bias is not None, HAS_DOWN_BIAS=down_bias is not None,
            DRELU=drelu, SQUARE=square, WIDTH=width, SCAN=SCAN, CHUNK=_chunk(width), BLOCK_K=block_k,
            ENTRIES=row_entries, LISTED=listed, num_warps=_row_warps(block_k, entries=row_entries),
        )  # fmt: skip
    l1, nonzero = row_l1.sum(), row_nonzero.sum(dtype=torch.int64)
    hot_up = x.new_empty(m, 0)
    if hot:
        if up_weight is not None:
            hot_bias = up_bias.index_select(0, hot_ids) if up_bias is not None else None
            hot_up = F.linear(x, up_weight.index_select(0, hot_ids), hot_bias)
        h, hot_l1, hot_nonzero = _hot_hidden(
            hot_gate, hot_up if up_weight is not None else None, threshold, drelu, square
        )
        y.addmm_(h, down_weight_t.index_select(0, hot_ids))
        l1, nonzero = l1 + hot_l1, nonzero + hot_nonzero
    return (y, ids, gate, up, counts, hot_ids, hot_gate, hot_up, l1, nonzero), unserved


def _pack_limit(width: int, n: int) -> int:
    """Entries of the rows the packed forward serves: at most the record's width and the up+down kernel's
    row width (at the pack layout's tiles)."""
    return min(width, row_width(cdiv(n, PACK_TILE_N), PACK_SLOTS))


def _pack_forward(
    pre, x, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, down_bias, threshold, drelu, record,
    dense_rows,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """LayerConfig.train_forward_pack: the dense gate pre [M, N] packed to TwELL (launch_pack_dense),
    y by the up+down kernel (launch_up_down, storing its rows' u in the record's up slots), then the
    record, sum |h| and nonzero h of every row without an overflowing tile and within both the record's
    width and the up+down kernel's row width (_pack_limit; _pack_record_kernel). The other rows
    (overflowing tiles, past a width: ~0.04% of the rows at K=2048, 0.5% uniform; ~4.6% at K=4096, where
    the row width 256 is half the record's): the heaviest dense_rows of them (0: none) by cuBLAS
    (_dense_rows; their tile counts zeroed first, so the up+down and record kernels take them as empty
    rows, then overwritten), the rest listed. Returns (redo, listed): redo int32 [1 + M], the list the row
    kernel then computes whole, as without the switch (their y from it too); listed, the number of rows
    not served (a 0-dim tensor). record: (y, ids, gate, up, counts, row_l1, row_nonzero), in place."""
    y, ids, gate, up, counts, row_l1, row_nonzero = record
    m, width = ids.shape
    has_up = up_weight is not None
    words, tile_counts = launch_pack_dense(pre, threshold, PACK_TILE_N, PACK_SLOTS)
    # the pack's counts are the true counts, also of an overflowing tile: a row's total is its kept count
    totals = tile_counts.sum(1, dtype=torch.int32)
    listed = (tile_counts.amax(1) > PACK_SLOTS) | (totals > _pack_limit(width, pre.shape[1]))
    if dense_rows:
        top = torch.topk(torch.where(listed, totals, -1), dense_rows, sorted=False).indices
        covered = listed.index_select(0, top)
        _copy_rows(tile_counts, top, covered, 0)
    launch_up_down(
        x, words, tile_counts, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, down_bias,
        tile_n=PACK_TILE_N, threshold=threshold, drelu=drelu, out=y, up_out=up if has_up else None,
    )  # fmt: skip
    n_tiles = tile_counts.shape[1]
    redo = torch.zeros(1 + m, dtype=torch.int32, device=x.device)
    _pack_record_kernel[(cdiv(m, PACK_BLOCK_M),)](
        words, tile_counts, ids, gate, up, counts, row_l1, row_nonzero, redo, m, n_tiles, HAS_UP=has_up,
        DRELU=drelu, TILE_N=PACK_TILE_N, SLOTS=PACK_SLOTS, WIDTH=width, LIMIT=_pack_limit(width, pre.shape[1]),
        TILES_PAD=max(2, next_power_of_2(n_tiles)), BLOCK_M=PACK_BLOCK_M,
        CHUNK=min(64, next_power_of_2(width)),
    )  # fmt: skip
    if dense_rows:
        _dense_rows(
            top, covered, totals.index_select(0, top), pre, x, up_weight, up_bias, down_weight_t, down_bias,
            threshold, drelu, record,
        )  # fmt: skip
    return redo, listed.sum()


def _dense_rows(
    top, covered, top_totals, pre, x, up_weight, up_bias, down_weight_t, down_bias, threshold, drelu, record
) -> None:  # fmt: skip
    """The rows `covered` (bool [T]) among `top` (int64 [T]: a fixed number of rows, no host sync) of the
    packed forward, as dense autograd computes them: x's and the dense gate's rows gathered, u = x W_u^T
    (+ b_u) by cuBLAS, h, sum |h|, nonzero h and a row within the width's record (ids, gate, up of its kept
    entries) by one elementwise kernel (_hidden_rows), y = h W_d (+ b_d) by cuBLAS; their y, counts
    (top_totals: the true kept counts), row_l1 and row_nonzero written over the record (y, ids, gate, up,
    counts, row_l1, row_nonzero); the other rows of `top` keep theirs. A covered row's other record slots
    (all of a row past the width, unused) hold the record kernel's zeros (its tile counts were zeroed)."""
    y, ids, gate, up, counts, row_l1, row_nonzero = record
    g = pre.index_select(0, top)
    u = F.linear(x.index_select(0, top), up_weight, up_bias) if up_weight is not None else None
    write = (covered & (top_totals <= ids.shape[1])).to(torch.int8)
    h, l1, nonzero, _ = _hidden_rows(g, u, threshold, drelu, False, record=(top, write, ids, gate, up))
    _copy_rows(y, top, covered, F.linear(h, down_weight_t.t(), down_bias))
    _copy_rows(counts, top, covered, top_totals)
    _copy_rows(row_l1, top, covered, l1)
    _copy_rows(row_nonzero, top, covered, nonzero)


def _copy_rows(out: torch.Tensor, rows: torch.Tensor, chosen: torch.Tensor, values) -> None:
    """out[rows[i]] = values[i] (a tensor of rows, or a scalar) where chosen[i], in place; the others of
    rows keep theirs (rows unique; a fixed number of them, chosen on the device: no host sync)."""
    old = out.index_select(0, rows)
    out.index_copy_(0, rows, torch.where(chosen.view(-1, *[1] * (out.dim() - 1)), values, old))


def _hot_columns(state: _TrainState | None, pre: torch.Tensor, hot: int, threshold: float) -> torch.Tensor:
    """The call's hot neurons (int64 [hot], a copy: the backward updates the layer's in place): the most
    frequent of the layer's previous call (train_backward), or of this call's gate pre [M, N] on a
    layer's first call; none (empty) with hot 0. On the device, no host synchronisation."""
    if not hot:
        return torch.empty(0, dtype=torch.int64, device=pre.device)
    if state.hot is None or state.hot.numel() != hot or state.hot.device != pre.device:
        state.hot = torch.topk((~(pre <= threshold)).sum(0), hot, sorted=False).indices
    return state.hot.clone()


def _hot_hidden(g, u, threshold, drelu, square) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, sum |h|, nonzero h) of the hot columns from their gate g and up u [M, H] in the dtype (u None
    for a plain FFN), as the record kernels compute h, in one elementwise kernel (_dense_hidden_kernel
    over the H columns): h in the dtype, the sum fp32 and the count int64 (one-element tensors)."""
    h, l1, nonzero, _ = _hidden_rows(g, u, threshold, drelu, square)  # no kept counts: the record's exclude them
    return h, l1.sum(), nonzero.sum(dtype=torch.int64)


def _hidden_rows(
    g, u, threshold, drelu, square, *, store_kept=False, record=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(h, sum |h|, nonzero h, kept) of T rows from their gate g and up u [T, N] in the dtype (u None for a
    plain FFN), as the record kernels compute h, by _dense_hidden_kernel: h [T, N] in the dtype, per row
    the sum fp32 and the count int32 [T], kept: with store_kept the rows' kept counts (int32 [T]), else
    None. record: (rows int64 [T], write int8 [T], ids, gate, up) to store each written row's first
    WIDTH kept entries in the record (_dense_rows)."""
    t, n = g.shape
    h = _alloc((t, n), g.dtype, g.device)
    l1 = _alloc((t,), torch.float32, g.device)
    nonzero = _alloc((t,), torch.int32, g.device)
    kept = _alloc((t,), torch.int32, g.device) if store_kept else None
    rows, write, ids, gate, rec_up = record if record is not None else (l1, l1, l1, l1, l1)
    if t > 0:
        _dense_hidden_kernel[(cdiv(t, BACKUP_BLOCK_T),)](
            g, u if u is not None else g, h, kept if store_kept else l1, l1, nonzero, rows, write, ids, gate,
            rec_up, t, n, threshold_in(threshold, g.dtype), HAS_UP=u is not None, DRELU=drelu, SQUARE=square,
            BLOCK_T=BACKUP_BLOCK_T, BLOCK_N=BACKUP_BLOCK_N, STORE_KEPT=store_kept, RECORD=record is not None,
            WIDTH=ids.shape[1] if record is not None else 0,
            num_warps=DENSE_ROW_WARPS if record is not None else BACKUP_WARPS,
        )  # fmt: skip
    return h, l1, nonzero, kept


def _neuron_segments(ids: torch.Tensor, counts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The record's (m, n) pairs grouped by neuron, on the device: (order, starts) with
    order[starts[n]:starts[n + 1]] the record slots (m * W + j) of neuron n, rows increasing. Slots past
    a row's count and all slots of dense-backup rows are keyed N and sort last."""
    width = ids.shape[1]
    slot = torch.arange(width, device=ids.device, dtype=torch.int32)
    valid = (slot[None, :] < counts[:, None]) & (counts[:, None] <= width)
    key_dtype = torch.int16 if n < torch.iinfo(torch.int16).max else torch.int32  # int16: half the radix passes
    keys = torch.where(valid, ids, n).to(key_dtype).reshape(-1)
    sorted_keys, order = torch.sort(keys, stable=True)
    # int32 offsets where they fit: the dW kernel's loop over them then takes a third fewer registers
    small = keys.numel() < 2**31
    starts = torch.searchsorted(sorted_keys, torch.arange(n + 1, device=ids.device, dtype=key_dtype), out_int32=small)
    return order, starts


def _dense_backup(
    top, dx, dy, l1_grad, x, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, counts, bias_acc, width, *,
    threshold, drelu, square,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The dense-backup rows among `top` (the heaviest rows, a fixed number: no host sync), as dense
    autograd computes them, in cuBLAS GEMMs over those rows alone and one elementwise kernel: dx rows
    written (the others of `top` keep the dx kernel's), dbias terms added to the fp32 accumulators
    bias_acc = (bg, bu). Returns their dW terms (g, u, d; u is g's tensor for a plain FFN) as fp32
    [N, K] accumulators: each GEMM's result cast once, in place of zeros and an add."""
    xb, dyb, top_counts = x.index_select(0, top), dy.index_select(0, top), counts.index_select(0, top)
    dg, du, h = _hidden_pass(
        xb, dyb, top_counts, l1_grad, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, bias_acc, width,
        threshold=threshold, drelu=drelu, square=square,
    )  # fmt: skip
    dxb = dg @ gate_weight
    acc_g = _fp32_product(dg.t(), xb)
    acc_d = _fp32_product(h.t(), dyb)
    acc_u = acc_g
    if up_weight is not None:
        dxb = dxb + du @ up_weight
        acc_u = _fp32_product(du.t(), xb)
    _copy_rows(dx, top, top_counts > width, dxb)
    return acc_g, acc_u, acc_d


def _fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as an fp32 tensor: on CUDA cuBLAS writes fp32 from half-precision inputs itself (mm's
    out_dtype), with no half-precision result and cast pass ([N, K] each: 0.12 ms of three at K=2048,
    0.56 at K=4096, train-variants-20261202-183443.json's other_kernels); elsewhere the product is cast."""
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def _hidden_pass(
    x, dy, counts, l1_grad, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, bias_acc, width, *, threshold,
    drelu, square, saved=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dg, du, h) [T, N] in the dtype of the T rows x, dy (du is dg for a plain FFN): their gate, up and
    dh = dy W_d^T by cuBLAS, the hidden gradients by one elementwise kernel, zero outside the kept
    entries of rows with counts > width (width -1: every row); their dbias terms added to bias_acc.
    saved: (g, u, h) of those rows as a dense-mode forward kept them (u is g for a plain FFN): only dh
    is a product then."""
    t, n = x.shape[0], gate_weight.shape[0]
    has_up = up_weight is not None
    if saved is None:
        pre = F.linear(x, gate_weight, gate_bias)
        up = F.linear(x, up_weight, up_bias) if has_up else pre
        h = _alloc((t, n), x.dtype, x.device)
    else:
        pre, up, h = saved
    dhp = F.linear(dy, down_weight_t)
    dg = _alloc((t, n), x.dtype, x.device)
    du = _alloc((t, n), x.dtype, x.device) if has_up else dg
    _backup_grads_kernel[(cdiv(t, BACKUP_BLOCK_T), cdiv(n, BACKUP_BLOCK_N))](
        pre, up, dhp, counts, l1_grad, dg, du, h, bias_acc[0], bias_acc[1], counts, counts, t, n,
        threshold_in(threshold, x.dtype), HAS_UP=has_up, HAS_GATE_BIAS=gate_bias is not None,
        HAS_UP_BIAS=up_bias is not None, DRELU=drelu, SQUARE=square, WIDTH=width, BLOCK_T=BACKUP_BLOCK_T,
        BLOCK_N=BACKUP_BLOCK_N, STORE_H=saved is None, HOT=False, num_warps=BACKUP_WARPS,
    )  # fmt: skip
    return dg, du, h


def _dense_backward(
    dy, l1_grad, x, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, counts, *, threshold, drelu, square,
    saved=None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """train_backward's weight and input gradients of a layer training dense: every row through
    _hidden_pass and cuBLAS (the record unused), as dense autograd computes them; saved: the (g, u, h)
    its forward kept (_saved_for; None: recomputed, two more products)."""
    n = gate_weight.shape[0]
    f32 = {"dtype": torch.float32, "device": x.device}
    bias_acc = tuple(torch.zeros(n if b is not None else 0, **f32) for b in (gate_bias, up_bias))
    dg, du, h = _hidden_pass(
        x, dy, counts, l1_grad, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, bias_acc, -1,
        threshold=threshold, drelu=drelu, square=square, saved=saved,
    )  # fmt: skip
    dx = dg @ gate_weight
    dwu = dg.new_empty(0)
    if up_weight is not None:
        dx.addmm_(du, up_weight)
        dwu = du.t() @ x
    return dx, dg.t() @ x, dwu, h.t() @ dy, bias_acc[0].to(x.dtype), bias_acc[1].to(x.dtype)


def _check_hot(x, n, hot, has_up):
    """The record's hot part (hot_ids int64 [H], hot_gate [M, H], hot_up [M, H or 0]); None where H is 0."""
    if hot is None or hot[0].numel() == 0:
        return None
    hot_ids, hot_gate, hot_up = hot
    h = hot_ids.shape[0]
    check_operand("hot_ids", hot_ids, (h,), x, torch.int64)
    check_operand("hot_gate", hot_gate, (x.shape[0], h), x, x.dtype)
    check_operand("hot_up", hot_up, (x.shape[0], h if has_up else 0), x, x.dtype)
    for name, t in (("hot_gate", hot_gate), ("hot_up", hot_up)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (indexed as a dense array), got strides {t.stride()}")
    if h > n:
        raise ValueError(f"hot_ids must name at most the {n} hidden neurons, got {h}")
    return hot


def _hot_backward(
    hot, dx, dy, l1_grad, x, gate_weight, up_weight, down_weight_t, counts, acc, *, threshold, drelu, square,
    has_gate_bias,
) -> torch.Tensor:  # fmt: skip
    """The hot neurons' share of the gradients, by cuBLAS products over just them: dh = dy W_d^T[hot],
    (dg, du, h) with the dl1 sign h term and their dbias terms by _hot_grads, dx += dg W_g[hot] + du
    W_u[hot], and their dW rows added to the fp32 accumulators acc = (g, u, d, bg, bu) (empty bias
    accumulators take none; u is g's for a plain FFN), which the dW kernel adds (no record pair of a
    hot neuron: the forward hid them). Returns the hot columns' kept counts (int32 [H], _next_hot)."""
    hot_ids, g, u = hot
    has_up = up_weight is not None
    acc_g, acc_u, acc_d, acc_bg, acc_bu = acc
    dhp = F.linear(dy, down_weight_t.index_select(0, hot_ids))
    dg, du, h, kept = _hot_grads(
        g, u if has_up else None, dhp, counts, l1_grad, hot_ids, acc_bg if has_gate_bias else None,
        acc_bu if acc_bu.numel() else None, threshold=threshold, drelu=drelu, square=square,
    )  # fmt: skip
    dx.addmm_(dg, gate_weight.index_select(0, hot_ids))
    acc_g.index_add_(0, hot_ids, (dg.t() @ x).float())
    acc_d.index_add_(0, hot_ids, (h.t() @ dy).float())
    if has_up:
        dx.addmm_(du, up_weight.index_select(0, hot_ids))
        acc_u.index_add_(0, hot_ids, (du.t() @ x).float())
    return kept


def _hot_grads(
    g, u, dhp, counts, l1_grad, hot_ids, acc_bg, acc_bu, *, threshold, drelu, square
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(dg, du, h, kept) of the hot columns in one elementwise kernel (_backup_grads_kernel with HOT):
    from their gate g, up u (None: plain FFN; du is then dg) and dhp = dy W_d^T[hot] [M, H] in the dtype
    and the L1 term dl1 * sign h, zero outside kept entries; their column sums of dg / du added to
    acc_bg / acc_bu (fp32 [N], at the hot neurons; None: no bias), kept: each column's kept entries
    (int32 [H]). counts: the record's [M] (every row taken)."""
    m, n_hot = g.shape
    has_up = u is not None
    dg = _alloc((m, n_hot), g.dtype, g.device)
    du = _alloc((m, n_hot), g.dtype, g.device) if has_up else dg
    h = _alloc((m, n_hot), g.dtype, g.device)
    kept = torch.zeros(n_hot, dtype=torch.int32, device=g.device)
    if m > 0 and n_hot > 0:
        _backup_grads_kernel[(cdiv(m, BACKUP_BLOCK_T), cdiv(n_hot, BACKUP_BLOCK_N))](
            g, u if has_up else g, dhp, counts, l1_grad, dg, du, h, acc_bg if acc_bg is not None else dg,
            acc_bu if acc_bu is not None else dg, hot_ids, kept, m, n_hot, threshold_in(threshold, g.dtype),
            HAS_UP=has_up, HAS_GATE_BIAS=acc_bg is not None, HAS_UP_BIAS=acc_bu is not None, DRELU=drelu,
            SQUARE=square, WIDTH=-1, BLOCK_T=BACKUP_BLOCK_T, BLOCK_N=BACKUP_BLOCK_N, STORE_H=True, HOT=True,
            num_warps=BACKUP_WARPS,
        )  # fmt: skip
    return dg, du, h, kept


def _next_hot(state: _TrainState, hot_ids: torch.Tensor, hot_kept: torch.Tensor, starts: torch.Tensor) -> None:
    """The layer's hot neurons for its next call, in place (a CUDA graph's replays re-derive them): the
    most frequent of this call's, counted from the record's neuron segments (rows within the width)
    and the hot columns' kept entries (hot_kept, _hot_backward's)."""
    if state.hot is None or state.hot.shape != hot_ids.shape:
        return
    counts = (starts[1:] - starts[:-1]).to(torch.int64)
    counts.index_copy_(0, hot_ids, hot_kept.to(torch.int64))
    state.hot.copy_(torch.topk(counts, hot_ids.numel(), sorted=False).indices)


def train_backward(
    dy: torch.Tensor,
    l1_grad: torch.Tensor,
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight_t: torch.Tensor,
    has_down_bias: bool,
    ids: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    counts: torch.Tensor,
    *,
    threshold: float,
    drelu: bool,
    square: bool,
    entries: int = 1,
    dense_above: float | None = None,
    hot: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """(dx, d gate_weight, d up_weight, d down_weight_t, d gate_bias, d up_bias, d down_bias) from the
    record (ids, gate, up, counts; hot: its (hot_ids, hot_gate, hot_up), None: no hot neurons) of
    train_forward with the same weights, biases and flags; dy, x: [M, K] with unit stride on K;
    l1_grad: the gradient of train_forward's l1 (a one-element fp32 tensor); entries, dense_above: as
    for train_forward (the dx kernel's; a layer whose last forward trained dense runs _dense_backward).
    Gradients of absent tensors are empty."""
    check_input("x", x, unit_stride=True)
    check_threshold(threshold)
    _check_entries(entries)
    policy.check_train_dense_above(dense_above)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("ids must be the record's [M, W] int32 tensor")
    m, n = _check_weights(x, gate_weight, up_weight, down_weight_t, ids.shape[1])
    k = x.shape[1]
    if dy.shape != x.shape or dy.dtype != x.dtype or dy.stride(1) != 1:
        raise ValueError(f"dy must be {list(x.shape)} {x.dtype} with unit stride on K, got {list(dy.shape)} {dy.dtype}")
    width = ids.shape[1]
    _check_biases(x, n, gate_bias, up_weight, up_bias, None)
    _check_record(x, ids, gate, up, counts, up_weight is not None, l1_grad)
    hot = _check_hot(x, n, hot, up_weight is not None)
    dbd = dy.sum(0, dtype=torch.float32).to(x.dtype) if has_down_bias else dy.new_empty(0)
    state = train_state(gate_weight) if dense_above is not None or hot is not None else None
    saved = _saved_for(counts, m, n)
    if saved is not None or (state is not None and m > 0 and state.forward_dense):
        dense = _dense_backward(
            dy, l1_grad, x, gate_weight, gate_bias, up_weight, up_bias, down_weight_t, counts, threshold=threshold,
            drelu=drelu, square=square, saved=saved,
        )  # fmt: skip
        return (*dense, dbd)
    f32 = {"dtype": torch.float32, "device": x.device}
    dx = _alloc((m, k), x.dtype, x.device)
    has_up = up_weight is not None
    dwg = _alloc((n, k), x.dtype, x.device)
    dwu = _alloc((n, k), x.dtype, x.device) if has_up else dwg.new_empty(0)
    dwd = _alloc((n, k), x.dtype, x.device)
    dbg = _alloc((n,), x.dtype, x.device) if gate_bias is not None else dwg.new_empty(0)
    dbu = _alloc((n,), x.dtype, x.device) if up_bias is not None else dwg.new_empty(0)
    # dense-backup rows' dbias terms (the dense pass's kernel, the backup kernel's atomics), added by the dW
    # kernel as their dW terms are (the accumulators _dense_backup returns)
    acc_bg = torch.zeros(n if gate_bias is not None or hot is not None else 0, **f32)
    acc_bu = torch.zeros(n if up_bias is not None else 0, **f32)
    # the dense-backup paths recompute the gate of every neuron: hot ones get a -inf bias (never kept;
    # theirs is the hot products'), acc_bg then takes the bias terms even without a gate bias (unused)
    recompute_bias = gate_bias
    if hot is not None:
        recompute_bias = gate_bias.clone() if gate_bias is not None else x.new_zeros(n)
        recompute_bias.index_fill_(0, hot[0], float("-inf"))
    # (dg, du, h) of each record pair at its record slot (copied into neuron order for the dW kernel)
    coef_g = _alloc((m * width,), x.dtype, x.device)
    coef_u = _alloc((m * width,), x.dtype, x.device) if has_up else coef_g
    coef_h = _alloc((m * width,), x.dtype, x.device)
    if m > 0:
        block_k = next_power_of_2(k)
        row_entries = _row_entries(entries, block_k)
        wu = up_weight if has_up else x
        order, starts = _neuron_segments(ids, counts, n)
        rows = torch.argsort(counts, descending=True)  # heaviest first (dense-backup rows lead)
        _train_dx_kernel[(m,)](
            rows, dy, l1_grad, gate_weight, wu, down_weight_t, ids, gate, up, counts, coef_g, coef_u, coef_h,
            dx, k, dy.stride(0), gate_weight.stride(0), wu.stride(0), down_weight_t.stride(0), dx.stride(0),
            HAS_UP=has_up, DRELU=drelu, SQUARE=square, WIDTH=width, BLOCK_K=block_k, ENTRIES=row_entries,
            STAGES=DX_STAGES, num_warps=_row_warps(block_k, entries=row_entries),
        )  # fmt: skip
        top = state.backup_rows(m) if state is not None else _share_rows(None, m)
        acc_g, acc_u, acc_d = _dense_backup(
            rows[:top], dx, dy, l1_grad, x, gate_weight, recompute_bias, up_weight, up_bias, down_weight_t, counts,
            (acc_bg, acc_bu), width, threshold=threshold, drelu=drelu, square=square,
        )  # fmt: skip
        _train_backup_kernel[(BACKUP_PROGRAMS,)](
            rows, dy, l1_grad, x, gate_weight, recompute_bias if recompute_bias is not None else x, wu,
            up_bias if up_bias is not None else x, down_weight_t, counts, dx, acc_g, acc_u, acc_d, acc_bg, acc_bu,
            m, n, k, top, threshold_in(threshold, x.dtype), dy.stride(0), x.stride(0), gate_weight.stride(0),
            wu.stride(0), down_weight_t.stride(0), dx.stride(0), HAS_UP=has_up,
            HAS_GATE_BIAS=recompute_bias is not None, HAS_UP_BIAS=up_bias is not None, DRELU=drelu, SQUARE=square,
            WIDTH=width, ROWS=max(1, min(16, BACKUP_TILE // block_k)), BLOCK_K=block_k,
            num_warps=_row_warps(block_k, True),
        )  # fmt: skip
        if hot is not None:
            hot_kept = _hot_backward(
                hot, dx, dy, l1_grad, x, gate_weight, up_weight, down_weight_t, counts,
                (acc_g, acc_u, acc_d, acc_bg, acc_bu), threshold=threshold, drelu=drelu, square=square,
                has_gate_bias=gate_bias is not None,
            )  # fmt: skip
            _next_hot(state, hot[0], hot_kept, starts)
        dw_block_k = min(DW_BLOCK_K, max(16, block_k))
        # every K-block program of a neuron group reads all its coefficients: copied into neuron order once
        # (contiguous reads); gathered through the slot list in the kernel instead, dW took 6.77 ms
        # against 3.37 (K=2048, 32768 tokens: train-20261201-213944.json)
        pair_rows = torch.empty(m * width, dtype=torch.int32, device=x.device)
        sorted_g, sorted_h = torch.empty_like(coef_g), torch.empty_like(coef_h)
        sorted_u = torch.empty_like(coef_u) if has_up else sorted_g
        _neuron_order_kernel[(cdiv(m * width, ORDER_BLOCK),)](
            order, starts, coef_g, coef_u, coef_h, pair_rows, sorted_g, sorted_u, sorted_h, n, HAS_UP=has_up,
            WIDTH=width, BLOCK=ORDER_BLOCK,
        )  # fmt: skip
        coef_g, coef_u, coef_h = sorted_g, sorted_u, sorted_h
        _train_dw_kernel[(cdiv(n, DW_GROUP), cdiv(k, dw_block_k))](
            pair_rows, starts, x, dy, coef_g, coef_u, coef_h, acc_g, acc_u, acc_d, acc_bg, acc_bu, dwg, dwu, dwd, dbg,
            dbu, n, k, x.stride(0), dy.stride(0), HAS_UP=has_up, HAS_GATE_BIAS=gate_bias is not None,
            HAS_UP_BIAS=up_bias is not None, GROUP=DW_GROUP, PAIRS=DW_PAIRS, BLOCK_K=dw_block_k,
            PRECISION=dot_precision(x.dtype), STAGES=DW_STAGES, num_warps=DW_WARPS,
            **({"maxnreg": DW_MAXNREG} if DW_MAXNREG else {}),
        )  # fmt: skip
    else:  # no pairs: the gradients of the weights are zeros
        for t in (dwg, dwu, dwd, dbg, dbu):
            t.zero_()
    return dx, dwg, dwu, dwd, dbg, dbu, dbd
