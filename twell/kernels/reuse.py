"""Weight-row reuse on the prefill path: a token block's shared neurons by dense tensor-core products.

The sparse up+down stage fetches two weight rows (W_u[n], W_d^T[n]) for every active (token, neuron)
pair. Tokens near each other share neurons, so per block of ROWS consecutive tokens, the neurons
active in at least reuse_min of its rows are left out of TwELL and computed here over just those
neurons, their rows loaded once for the block. Three steps, each deterministic (no atomics, no host
reads: graph-capturable):
- dense_columns (before the pack pass, twell.kernels.gate.pack_dense's `reuse`): _dense_columns_kernel,
  one light program per (block, TwELL tile), reads the block's rows of the dense gate output h once and
  counts each column's kept entries (hot neurons never), lists the tile's columns kept in >= reuse_min
  rows (the first per_tile by column), sets their flag bytes (the pack pass and the overflow recompute
  leave flagged neurons out) and counts their entries; _compact_union_kernel, one program per block,
  concatenates the tiles' lists (a prefix sum of the block's per-tile lengths) into the block's union,
  so the products read neuron ids by position;
- dense_hidden (while the gate output lives): _reuse_hidden_kernel, one program per (block, CHUNK of
  its union): g is the gate output itself, gathered at the union's columns (the value the pack saw: no
  recomputed gate, one weight row fewer per neuron), u = x_block W_u[U]^T by tl.dot over K (+ bias,
  rounded to x's dtype as the dense up is), h = act(g) * u (drelu: relu(u)), or act(g) (squared)
  without up; h in x's dtype into [M, capacity];
- dense_down_ (after the sparse stage): _reuse_down_kernel, one program per (block, BLOCK_K columns of
  y): y_block += h_block W_d^T[U], y loaded first into the fp32 accumulator, over the union CHUNK at a
  time, then rounded (two roundings of y, as the hot neurons' addmm).
Semantics are the dense route's (twell.kernels.dense): act keeps g where not (g <= threshold), NaN
included. Blocks with an empty union launch programs that return at once; rows past M are never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from twell.kernels import policy
from twell.kernels.common import (
    autotune_configs,
    check_bias,
    check_input,
    check_operand,
    check_threshold,
    dot_precision,
    interpreting,
    m_bucket,
    threshold_in,
    tl_dtype,
)

# (CHUNK, BLOCK_K, num_warps, num_stages), autotuned per (token bucket, K, block rows); not yet measured
# on the GPU. v1's single config (64, 64, 8 warps, 3 stages: its K loop pipelined, cp.async in ptxas's
# sm_90 build) ran 1.36 ms at 131072 tokens, topics 64/3, against ~1.0 for its bytes: CHUNK 128 halves
# the x re-reads (one per chunk), fewer K steps per stage trade registers for latency cover.
HIDDEN_CONFIGS = [
    (64, 64, 8, 3),
    (128, 64, 8, 3),
    (128, 32, 8, 4),
    (64, 128, 8, 3),
    (64, 64, 4, 4),
]
# v1 (32, 128, 8 warps, 3 stages, a prefix-sum search per step) ran 2.29 ms against ~0.5 for its bytes:
# short programs (10 steps at a 309-neuron union) that paid their latency chains in full. The union is
# now compact (one load per step), y is read before the loop, and larger steps / column blocks cut the
# programs and h's re-reads (one per column block).
DOWN_CONFIGS = [
    (32, 128, 4, 3),
    (64, 128, 8, 3),
    (64, 256, 8, 3),
    (128, 128, 8, 3),
    (64, 128, 4, 4),
    (32, 256, 8, 4),
]
# fp32 accumulator elements a thread may hold (ptxas sm_90, bf16, biases): hidden [ROWS, CHUNK] 64 spilled
# (128 rows, CHUNK 128, 8 warps: 255 registers + 8 bytes of stack), down [ROWS, BLOCK_K] 128 spilled
HIDDEN_ACC_PER_THREAD = 32
DOWN_ACC_PER_THREAD = 64
MAX_BLOCKS = 65535  # row blocks of one call: the kernels' second grid dimension (CUDA's limit)
COUNT_ROWS = 4096  # elements of a counting step: [COUNT_ROWS // TILE_N, TILE_N] (32 rows at tile 128)


@dataclass
class ReuseBlocks:
    """dense_columns' record per block of `rows` consecutive rows: tile_union int32 [blocks, tiles,
    per_tile] and tile_lengths int32 [blocks, tiles] (each tile's dense neurons of the block, ascending;
    entries past a length unspecified); union int32 [blocks, capacity] and lengths int32 [blocks] (the
    tiles' lists one after another); flags uint8 [blocks, N] (1: dense in that block); pairs int32
    [blocks, tiles] (the kept entries the dense neurons cover: the layer's density probe counts them)."""

    rows: int
    reuse_min: int
    per_tile: int
    tile_union: torch.Tensor
    tile_lengths: torch.Tensor
    union: torch.Tensor
    lengths: torch.Tensor
    flags: torch.Tensor
    pairs: torch.Tensor

    @property
    def capacity(self) -> int:
        """Union positions of a block: the columns of its hidden buffer."""
        return self.tile_union.shape[1] * self.per_tile

    @staticmethod
    def empty(m: int, n: int, tile_n: int, reuse, device) -> ReuseBlocks:
        """Buffers for reuse=(rows, reuse_min, per_tile), checked."""
        if not isinstance(reuse, tuple) or len(reuse) != 3:
            raise ValueError(f"reuse must be a (rows, reuse_min, per_tile) tuple, got {reuse!r}")
        rows, reuse_min, per_tile = reuse
        if rows not in policy.REUSE_BLOCKS[1:] or isinstance(rows, bool):
            raise ValueError(f"reuse rows must be one of {policy.REUSE_BLOCKS[1:]}, got {rows!r}")
        for name, value in (("reuse_min", reuse_min), ("per_tile", per_tile)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"reuse {name} must be an int >= 1, got {value!r}")
        blocks, tiles = triton.cdiv(m, rows), triton.cdiv(n, tile_n)
        if blocks > MAX_BLOCKS:
            raise ValueError(f"reuse takes at most {MAX_BLOCKS} blocks of {rows} rows, got M={m} ({blocks} blocks)")
        return ReuseBlocks(
            rows,
            reuse_min,
            per_tile,
            torch.empty(blocks, tiles, per_tile, dtype=torch.int32, device=device),
            torch.empty(blocks, tiles, dtype=torch.int32, device=device),
            torch.empty(blocks, tiles * per_tile, dtype=torch.int32, device=device),
            torch.empty(blocks, dtype=torch.int32, device=device),
            torch.empty(blocks, n, dtype=torch.uint8, device=device),
            torch.empty(blocks, tiles, dtype=torch.int32, device=device),
        )


def per_tile(tile_n: int) -> int:
    """Dense neurons a block may hold per TwELL tile: policy.REUSE_MAX_SHARE of it (at least one)."""
    return max(1, int(tile_n * policy.REUSE_MAX_SHARE))


@triton.jit
def _dense_columns_kernel(
    h_ptr, pos_ptr, tile_union_ptr, tile_len_ptr, flag_ptr, pairs_ptr, M, N, n_tiles, n_hot, threshold, reuse_min,
    per_tile, stride_hm, stride_hn, HAS_HOT: tl.constexpr, ROWS: tl.constexpr, TILE_N: tl.constexpr,
    SUB: tl.constexpr,
):  # fmt: skip
    """One (tile, block): its columns' kept counts over the block's rows (SUB rows a step, unrolled so
    the loads are in flight together), the dense ones listed, flagged and their entries counted. Tiles
    vary fastest: programs running together read neighbouring segments of the same rows."""
    tile = tl.program_id(0)
    block = tl.program_id(1)
    cols = tile * TILE_N + tl.arange(0, TILE_N)
    col_ok = cols < N
    active = tl.zeros([TILE_N], dtype=tl.int32)
    for r0 in tl.static_range(0, ROWS, SUB):
        offs_m = block.to(tl.int64) * ROWS + r0 + tl.arange(0, SUB)
        ok = (offs_m < M)[:, None] & col_ok[None, :]
        ptrs = h_ptr + offs_m[:, None] * stride_hm + cols[None, :] * stride_hn
        acc = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        keep = ((acc > threshold) | (acc != acc)) & ok  # not (acc <= t): NaN kept, as by the pack
        active += tl.sum(keep.to(tl.int32), axis=0)
    if HAS_HOT:  # as the pack: a position past n_hot is a packed neuron
        pos = tl.load(pos_ptr + cols, mask=col_ok, other=-1)
        active = tl.where((pos >= 0) & (pos < n_hot), 0, active)
    wanted = active >= reuse_min
    place = tl.cumsum(wanted.to(tl.int32), axis=0) - 1
    dense = wanted & (place < per_tile)
    at = block.to(tl.int64) * n_tiles + tile
    tl.store(tile_union_ptr + at * per_tile + place, cols, mask=dense)
    tl.store(tile_len_ptr + at, tl.sum(dense.to(tl.int32), axis=0))
    tl.store(pairs_ptr + at, tl.sum(tl.where(dense, active, 0), axis=0))
    tl.store(flag_ptr + block.to(tl.int64) * N + cols, dense.to(flag_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _compact_union_kernel(
    tile_union_ptr, tile_len_ptr, union_ptr, len_ptr, n_tiles, per_tile, capacity, TILES_PAD: tl.constexpr,
    PER_TILE_PAD: tl.constexpr,
):  # fmt: skip
    """One block: its tiles' lists, one after another, into its union; their total into lengths."""
    block = tl.program_id(0).to(tl.int64)
    offs_t = tl.arange(0, TILES_PAD)
    offs_s = tl.arange(0, PER_TILE_PAD)
    lens = tl.load(tile_len_ptr + block * n_tiles + offs_t, mask=offs_t < n_tiles, other=0)
    start = tl.cumsum(lens, axis=0) - lens
    ok = offs_s[None, :] < lens[:, None]
    src = tl.load(tile_union_ptr + (block * n_tiles + offs_t)[:, None] * per_tile + offs_s[None, :], mask=ok)
    tl.store(union_ptr + block * capacity + start[:, None] + offs_s[None, :], src, mask=ok)
    tl.store(len_ptr + block, tl.sum(lens, axis=0))


def _fitting(configs, rows: int, width: str, per_thread: int):
    """The configs whose accumulator [rows, width] holds at most per_thread elements a thread (the
    interpreter keeps its one config)."""
    if interpreting():
        return configs
    return [c for c in configs if rows * c.kwargs[width] <= per_thread * 32 * c.num_warps]


def _prune_hidden(configs, named_args, **kwargs):
    return _fitting(configs, kwargs["ROWS"], "CHUNK", HIDDEN_ACC_PER_THREAD)


def _prune_down(configs, named_args, **kwargs):
    return _fitting(configs, kwargs["ROWS"], "BLOCK_K", DOWN_ACC_PER_THREAD)


@triton.autotune(
    configs=autotune_configs(HIDDEN_CONFIGS, lambda c, bk, w, s: {"CHUNK": c, "BLOCK_K": bk}),
    key=["M_BUCKET", "K", "ROWS", "HAS_UP"],
    cache_results=True,
    prune_configs_by={"early_config_prune": _prune_hidden},
)
@triton.jit
def _reuse_hidden_kernel(
    x_ptr, pre_ptr, wu_ptr, bu_ptr, union_ptr, len_ptr, h_ptr, M, K, M_BUCKET, capacity, threshold, stride_xm,
    stride_xk, stride_pm, stride_pn, stride_un, stride_uk, HAS_UP: tl.constexpr, HAS_UP_BIAS: tl.constexpr,
    DRELU: tl.constexpr, SQUARE: tl.constexpr, DOT_PRECISION: tl.constexpr, VALUE: tl.constexpr,
    ROWS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """h[block rows, union chunk] of one (CHUNK of its union, row block) (module docstring). Chunks vary
    fastest: a block's programs run together and share its x rows in L2."""
    block = tl.program_id(1)
    n_dense = tl.load(len_ptr + block)
    if tl.program_id(0) * CHUNK >= n_dense:
        return
    offs_j = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    j_ok = offs_j < n_dense
    neuron = tl.load(union_ptr + block.to(tl.int64) * capacity + offs_j, mask=j_ok, other=0).to(tl.int64)
    offs_m = block.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m_ok = offs_m < M
    if HAS_UP:
        offs_k = tl.arange(0, BLOCK_K)
        u = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            xa = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk, m_ok[:, None] & k_ok[None, :], 0.0
            )
            wu = tl.load(
                wu_ptr + neuron[:, None] * stride_un + k[None, :] * stride_uk, j_ok[:, None] & k_ok[None, :], 0.0
            )
            u = tl.dot(xa, tl.trans(wu), u, input_precision=DOT_PRECISION)
    ok = m_ok[:, None] & j_ok[None, :]
    g = tl.load(pre_ptr + offs_m[:, None] * stride_pm + neuron[None, :] * stride_pn, mask=ok, other=0.0)
    g = g.to(tl.float32)
    h = tl.where(g <= threshold, 0.0, g)  # not (g <= t): NaN kept, as by relu
    if HAS_UP:
        if HAS_UP_BIAS:
            u += tl.load(bu_ptr + neuron, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        u = u.to(VALUE).to(tl.float32)  # the dense up's rounding
        if DRELU:
            u = tl.where(u <= 0.0, 0.0, u)
        h = h * u
    elif SQUARE:
        h = h * h
    tl.store(h_ptr + offs_m[:, None] * capacity + offs_j[None, :], h.to(VALUE), mask=ok)


@triton.autotune(
    configs=autotune_configs(DOWN_CONFIGS, lambda c, bk, w, s: {"CHUNK": c, "BLOCK_K": bk}),
    key=["M_BUCKET", "K", "ROWS"],
    cache_results=True,
    restore_value=["y_ptr"],  # in place: each config tried starts from the same y
    prune_configs_by={"early_config_prune": _prune_down},
)
@triton.jit
def _reuse_down_kernel(
    h_ptr, wd_ptr, union_ptr, len_ptr, y_ptr, M, K, M_BUCKET, capacity, stride_dn, stride_dk, stride_ym, stride_yk,
    DOT_PRECISION: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[block rows, BLOCK_K columns] += h_block W_d^T[union] of one (column block, row block) (module
    docstring). Column blocks vary fastest: a block's programs run together and share its h in L2."""
    block = tl.program_id(1)
    n_dense = tl.load(len_ptr + block)
    if n_dense == 0:
        return
    offs_m = block.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m_ok = offs_m < M
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_k[None, :] * stride_yk
    ok = m_ok[:, None] & k_ok[None, :]
    acc = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)  # issued before the loop: its latency hidden
    union = union_ptr + block.to(tl.int64) * capacity
    for j0 in range(0, n_dense, CHUNK):
        offs_j = j0 + tl.arange(0, CHUNK)
        j_ok = offs_j < n_dense
        neuron = tl.load(union + offs_j, mask=j_ok, other=0).to(tl.int64)
        h = tl.load(h_ptr + offs_m[:, None] * capacity + offs_j[None, :], m_ok[:, None] & j_ok[None, :], 0.0)
        wd = tl.load(
            wd_ptr + neuron[:, None] * stride_dn + offs_k[None, :] * stride_dk, j_ok[:, None] & k_ok[None, :], 0.0
        )
        acc = tl.dot(h, wd, acc, input_precision=DOT_PRECISION)
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def dense_columns(h: torch.Tensor, threshold: float, tile_n: int, reuse, hot_pos=None, n_hot: int = 0) -> ReuseBlocks:
    """The blocks' dense neurons of a dense gate output h [M, N] (module docstring), for reuse =
    (rows, reuse_min, per_tile); hot_pos int32 [N] (-1 or >= n_hot: not hot): hot neurons never count.
    Called by pack_dense (its arguments checked there), which then leaves the flagged columns out."""
    m, n = h.shape
    blocks = ReuseBlocks.empty(m, n, tile_n, reuse, h.device)
    n_blocks, n_tiles = blocks.tile_lengths.shape
    if m == 0:
        return blocks
    _dense_columns_kernel[(n_tiles, n_blocks)](
        h, hot_pos if hot_pos is not None else blocks.tile_lengths, blocks.tile_union, blocks.tile_lengths,
        blocks.flags, blocks.pairs, m, n, n_tiles, n_hot, threshold_in(threshold, h.dtype), blocks.reuse_min,
        blocks.per_tile, h.stride(0), h.stride(1), HAS_HOT=hot_pos is not None, ROWS=blocks.rows, TILE_N=tile_n,
        SUB=min(blocks.rows, max(COUNT_ROWS // tile_n, 1)), num_warps=4,
    )  # fmt: skip
    _compact_union_kernel[(n_blocks,)](
        blocks.tile_union, blocks.tile_lengths, blocks.union, blocks.lengths, n_tiles, blocks.per_tile,
        blocks.capacity, TILES_PAD=max(triton.next_power_of_2(n_tiles), 2),
        PER_TILE_PAD=max(triton.next_power_of_2(blocks.per_tile), 2), num_warps=4,
    )  # fmt: skip
    return blocks


def hidden_buffer(m: int, blocks: ReuseBlocks, dtype, device) -> torch.Tensor:
    """The [M, capacity] hidden activations of the blocks' dense neurons (column j: union entry j)."""
    return torch.empty(m, blocks.capacity, dtype=dtype, device=device)


def _check_blocks(blocks, m: int, n: int) -> None:
    n_blocks = triton.cdiv(m, blocks.rows)
    if not isinstance(blocks, ReuseBlocks) or blocks.flags.shape != (n_blocks, n) or blocks.union.shape[0] != n_blocks:
        got = (
            f"{list(blocks.union.shape)} and {list(blocks.flags.shape)}" if isinstance(blocks, ReuseBlocks) else blocks
        )
        raise ValueError(f"blocks for M={m}, N={n} need union [{n_blocks}, C] and flags [{n_blocks}, {n}], got {got}")


def dense_hidden(
    x: torch.Tensor,
    pre: torch.Tensor,
    blocks: ReuseBlocks,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    *,
    threshold: float,
    drelu: bool = False,
    square: bool = False,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blocks' dense neurons' hidden activations [M, capacity] (column j: the block's union entry j;
    the others unwritten). x [M, K]; pre [M, N]: the gate output the blocks were listed from (bias
    added, x's dtype); up_weight [N, K] (None: non-gated, h = act(pre), squared with `square`) and its
    bias; hidden: the buffer to fill (hidden_buffer; tests pass a poisoned one). Returns it."""
    check_input("x", x)
    check_threshold(threshold)
    m, k = x.shape
    if not isinstance(pre, torch.Tensor) or pre.dim() != 2 or pre.shape[0] != m:
        raise ValueError(
            f"pre must be a [{m}, N] tensor, got {list(pre.shape) if isinstance(pre, torch.Tensor) else pre}"
        )
    n = pre.shape[1]
    check_operand("pre", pre, (m, n), x)
    if up_weight is not None:
        check_operand("up_weight", up_weight, (n, k), x)
    if up_bias is not None and up_weight is None:
        raise ValueError("up_bias needs up_weight (a plain FFN's bias is in pre)")
    check_bias("up_bias", up_bias, n, x)
    _check_blocks(blocks, m, n)
    if hidden is None:
        hidden = hidden_buffer(m, blocks, x.dtype, x.device)
    elif hidden.shape != (m, blocks.capacity) or hidden.dtype != x.dtype or not hidden.is_contiguous():
        raise ValueError(f"hidden must be a contiguous [{m}, {blocks.capacity}] {x.dtype}, got {list(hidden.shape)}")
    if m == 0:
        return hidden
    up = (up_weight, up_bias if up_bias is not None else x) if up_weight is not None else (x, x)
    up_strides = up_weight.stride() if up_weight is not None else (0, 0)
    n_blocks = blocks.lengths.shape[0]
    _reuse_hidden_kernel[lambda meta: (triton.cdiv(blocks.capacity, meta["CHUNK"]), n_blocks)](
        x, pre, *up, blocks.union, blocks.lengths, hidden, m, k, m_bucket(m), blocks.capacity,
        threshold_in(threshold, x.dtype), x.stride(0), x.stride(1), pre.stride(0), pre.stride(1), *up_strides,
        HAS_UP=up_weight is not None, HAS_UP_BIAS=up_bias is not None, DRELU=drelu, SQUARE=square,
        DOT_PRECISION=dot_precision(x.dtype), VALUE=tl_dtype(x.dtype), ROWS=blocks.rows,
    )  # fmt: skip
    return hidden


def dense_down_(
    y: torch.Tensor, blocks: ReuseBlocks, hidden: torch.Tensor, down_weight_t: torch.Tensor
) -> torch.Tensor:
    """In place on y [M, K]: y += hidden W_d^T[union] per block (hidden: dense_hidden's; down_weight_t
    [N, K]). Returns y."""
    check_input("y", y)
    m, k = y.shape
    if not isinstance(down_weight_t, torch.Tensor) or down_weight_t.dim() != 2:
        raise ValueError(f"down_weight_t must be a 2-dim tensor [N, {k}], got {type(down_weight_t).__name__}")
    n = down_weight_t.shape[0]
    check_operand("down_weight_t", down_weight_t, (n, k), y)
    _check_blocks(blocks, m, n)
    check_operand("hidden", hidden, (m, blocks.capacity), y)
    if not hidden.is_contiguous():
        raise ValueError(f"hidden must be contiguous, got strides {hidden.stride()}")
    if m == 0:
        return y
    n_blocks = blocks.lengths.shape[0]
    _reuse_down_kernel[lambda meta: (triton.cdiv(k, meta["BLOCK_K"]), n_blocks)](
        hidden, down_weight_t, blocks.union, blocks.lengths, y, m, k, m_bucket(m), blocks.capacity,
        down_weight_t.stride(0), down_weight_t.stride(1), y.stride(0), y.stride(1),
        DOT_PRECISION=dot_precision(y.dtype), ROWS=blocks.rows,
    )  # fmt: skip
    return y
