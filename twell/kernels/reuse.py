"""Weight-row reuse on the prefill path: a token block's shared neurons by dense tensor-core products.

The sparse up+down stage fetches two weight rows (W_u[n], W_d^T[n]) for every active (token, neuron)
pair. Tokens near each other share neurons, so per block of ROWS consecutive tokens, the neurons
active in at least reuse_min of its rows (the pack pass counts them: twell.kernels.gate.pack_dense's
`reuse`) are left out of TwELL and computed here over just those neurons, their rows loaded once for
the block:
A block's union is its tiles' lists in tile order (at most per_tile neurons a tile, so no pass
compacts them across tiles: each program maps its union positions to (tile, place) by a prefix sum of
the block's per-tile lengths, as the up+down kernel maps a row's entries).
- _reuse_hidden_kernel, one program per (block, HIDDEN_CHUNK of its union): g = x_block W_g[U]^T (+ bias,
  rounded to x's dtype as the dense gate is), u = x_block W_u[U]^T likewise, h = act(g) * u (drelu:
  relu(u)), or act(g) (squared) without up; h rounded to x's dtype into a [M, capacity] buffer;
- _reuse_down_kernel, one program per (block, BLOCK_K columns of y): y_block += h_block W_d^T[U],
  over the union CHUNK at a time, in fp32, then rounded: no atomics, the same bits every run.
The gate is recomputed (one more weight row per dense neuron and block) rather than handed over by the
packer: a hand-over is a scatter over every tile (v15b in benchmarks/NOTES.md: ~0.4-0.6 ms at 131072
tokens) into a buffer the size of the gate. Semantics are the dense route's (twell.kernels.dense): act
keeps g where not (g <= threshold), NaN included.
Blocks with an empty union launch programs that return at once; y rows past M are never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from twell.kernels import policy
from twell.kernels.common import check_bias, check_input, check_threshold, dot_precision, threshold_in, tl_dtype

HIDDEN_CHUNK = 64  # union neurons a hidden program computes: each re-reads the block's x rows (L2)
CHUNK = 32  # union neurons a step of the down products (their K dimension)
BLOCK_K = 64  # K step of the hidden products
DOWN_BLOCK_K = 128  # columns of y a down program owns


@dataclass
class ReuseBlocks:
    """What the pack pass records per block of `rows` consecutive rows and TwELL tile (twell.kernels.gate.
    pack_dense): union int32 [blocks, tiles, per_tile] (the tile's dense neurons of the block, ascending;
    entries past its length unspecified), lengths int32 [blocks, tiles], flags uint8 [blocks, N] (1:
    dense in that block), pairs int32 [blocks, tiles] (the kept entries the dense neurons cover: the
    layer's density probe counts them)."""

    rows: int
    reuse_min: int
    per_tile: int
    union: torch.Tensor
    lengths: torch.Tensor
    flags: torch.Tensor
    pairs: torch.Tensor

    @property
    def capacity(self) -> int:
        """Union positions of a block: the columns of its hidden buffer."""
        return self.union.shape[1] * self.per_tile

    @staticmethod
    def empty(m: int, n: int, tile_n: int, reuse, device) -> ReuseBlocks:
        """Buffers for pack_dense's reuse=(rows, reuse_min, per_tile), checked."""
        if not isinstance(reuse, tuple) or len(reuse) != 3:
            raise ValueError(f"reuse must be a (rows, reuse_min, per_tile) tuple, got {reuse!r}")
        rows, reuse_min, per_tile = reuse
        if rows not in policy.REUSE_BLOCKS[1:] or isinstance(rows, bool):
            raise ValueError(f"reuse rows must be one of {policy.REUSE_BLOCKS[1:]}, got {rows!r}")
        for name, value in (("reuse_min", reuse_min), ("per_tile", per_tile)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"reuse {name} must be an int >= 1, got {value!r}")
        blocks, tiles = triton.cdiv(m, rows), triton.cdiv(n, tile_n)
        return ReuseBlocks(
            rows,
            reuse_min,
            per_tile,
            torch.empty(blocks, tiles, per_tile, dtype=torch.int32, device=device),
            torch.empty(blocks, tiles, dtype=torch.int32, device=device),
            torch.empty(blocks, n, dtype=torch.uint8, device=device),
            torch.empty(blocks, tiles, dtype=torch.int32, device=device),
        )


def per_tile(tile_n: int) -> int:
    """Dense neurons a block may hold per TwELL tile: policy.REUSE_MAX_SHARE of it (at least one)."""
    return max(1, int(tile_n * policy.REUSE_MAX_SHARE))


@triton.jit
def _union_neurons(union_ptr, lens, incl, block, offs_j, j_ok, n_tiles, per_tile, TILES_PAD: tl.constexpr):
    """Neuron ids (int64) of the block's union positions offs_j: position j lies in the first tile whose
    inclusive length exceeds j."""
    offs_t = tl.arange(0, TILES_PAD)
    tile = tl.sum((incl[None, :] <= offs_j[:, None]).to(tl.int32), axis=1)
    start = tl.sum(tl.where(offs_t[None, :] == tile[:, None], (incl - lens)[None, :], 0), axis=1)
    at = (block.to(tl.int64) * n_tiles + tile) * per_tile + offs_j - start
    return tl.load(union_ptr + at, mask=j_ok, other=0).to(tl.int64)


@triton.jit
def _block_lengths(len_ptr, block, n_tiles, TILES_PAD: tl.constexpr):
    """The block's per-tile union lengths [TILES_PAD], their inclusive prefix sum and their total."""
    offs_t = tl.arange(0, TILES_PAD)
    lens = tl.load(len_ptr + block.to(tl.int64) * n_tiles + offs_t, mask=offs_t < n_tiles, other=0)
    incl = tl.cumsum(lens, axis=0)
    return lens, incl, tl.sum(lens, axis=0)


@triton.jit
def _reuse_hidden_kernel(
    x_ptr, wg_ptr, bg_ptr, wu_ptr, bu_ptr, union_ptr, len_ptr, h_ptr, M, K, n_tiles, per_tile, capacity, threshold,
    stride_xm, stride_xk, stride_gn, stride_gk, stride_un, stride_uk, TILES_PAD: tl.constexpr,
    HAS_UP: tl.constexpr, HAS_GATE_BIAS: tl.constexpr, HAS_UP_BIAS: tl.constexpr, DRELU: tl.constexpr,
    SQUARE: tl.constexpr, DOT_PRECISION: tl.constexpr, VALUE: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """h[block rows, union chunk] of one (row block, CHUNK of its union) (module docstring)."""
    block = tl.program_id(0)
    offs_j = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    lens, incl, n_dense = _block_lengths(len_ptr, block, n_tiles, TILES_PAD)
    if tl.program_id(1) * CHUNK >= n_dense:
        return
    j_ok = offs_j < n_dense
    neuron = _union_neurons(union_ptr, lens, incl, block, offs_j, j_ok, n_tiles, per_tile, TILES_PAD)
    offs_m = block.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    g = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
    u = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        xa = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk, m_ok[:, None] & k_ok[None, :], 0.0)
        w_ok = j_ok[:, None] & k_ok[None, :]
        wg = tl.load(wg_ptr + neuron[:, None] * stride_gn + k[None, :] * stride_gk, w_ok, 0.0)
        g = tl.dot(xa, tl.trans(wg), g, input_precision=DOT_PRECISION)
        if HAS_UP:
            wu = tl.load(wu_ptr + neuron[:, None] * stride_un + k[None, :] * stride_uk, w_ok, 0.0)
            u = tl.dot(xa, tl.trans(wu), u, input_precision=DOT_PRECISION)
    if HAS_GATE_BIAS:
        g += tl.load(bg_ptr + neuron, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    g = g.to(VALUE).to(tl.float32)  # the dense gate's rounding
    h = tl.where(g <= threshold, 0.0, g)  # not (g <= t): NaN kept, as by relu
    if HAS_UP:
        if HAS_UP_BIAS:
            u += tl.load(bu_ptr + neuron, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        u = u.to(VALUE).to(tl.float32)
        if DRELU:
            u = tl.where(u <= 0.0, 0.0, u)
        h = h * u
    elif SQUARE:
        h = h * h
    tl.store(h_ptr + offs_m[:, None] * capacity + offs_j[None, :], h.to(VALUE), mask=m_ok[:, None] & j_ok[None, :])


@triton.jit
def _reuse_down_kernel(
    h_ptr, wd_ptr, union_ptr, len_ptr, y_ptr, M, K, n_tiles, per_tile, capacity, stride_dn, stride_dk, stride_ym,
    stride_yk, TILES_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[block rows, BLOCK_K columns] += h_block W_d^T[union] (module docstring)."""
    block = tl.program_id(0)
    lens, incl, n_dense = _block_lengths(len_ptr, block, n_tiles, TILES_PAD)
    if n_dense == 0:
        return
    offs_m = block.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m_ok = offs_m < M
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    acc = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    for j0 in range(0, n_dense, CHUNK):
        offs_j = j0 + tl.arange(0, CHUNK)
        j_ok = offs_j < n_dense
        neuron = _union_neurons(union_ptr, lens, incl, block, offs_j, j_ok, n_tiles, per_tile, TILES_PAD)
        h = tl.load(h_ptr + offs_m[:, None] * capacity + offs_j[None, :], m_ok[:, None] & j_ok[None, :], 0.0)
        w_ok = j_ok[:, None] & k_ok[None, :]
        wd = tl.load(wd_ptr + neuron[:, None] * stride_dn + offs_k[None, :] * stride_dk, w_ok, 0.0)
        acc = tl.dot(h, wd, acc, input_precision=DOT_PRECISION)
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_k[None, :] * stride_yk
    ok = m_ok[:, None] & k_ok[None, :]
    y = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32) + acc
    tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=ok)


def hidden_buffer(m: int, blocks: ReuseBlocks, dtype, device) -> torch.Tensor:
    """The [M, capacity] hidden activations of the blocks' dense neurons (column j: union entry j)."""
    return torch.empty(m, blocks.capacity, dtype=dtype, device=device)


def reuse_products_(
    y: torch.Tensor,
    x: torch.Tensor,
    blocks: ReuseBlocks,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight_t: torch.Tensor,
    *,
    threshold: float,
    drelu: bool = False,
    square: bool = False,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """In place on y [M, K]: y += the blocks' dense neurons' share of the FFN, h W_d^T[union] per block.
    x [M, K]; gate_weight / up_weight (None: non-gated, h = act(g), squared with `square`) /
    down_weight_t: [N, K]; hidden: the [M, capacity] buffer (hidden_buffer; tests pass a poisoned one).
    Returns y."""
    check_input("x", x)
    check_threshold(threshold)
    m, k = x.shape
    if not isinstance(gate_weight, torch.Tensor) or gate_weight.dim() != 2:
        raise ValueError(f"gate_weight must be a 2-dim tensor [N, {k}], got {type(gate_weight).__name__}")
    n = gate_weight.shape[0]
    for name, t in (("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight_t", down_weight_t)):
        if t is not None and (
            not isinstance(t, torch.Tensor) or tuple(t.shape) != (n, k) or t.dtype != x.dtype or t.device != x.device
        ):
            got = f"{list(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be [N, {k}] {x.dtype} on {x.device}, got {got}")
    for name, b in (("gate_bias", gate_bias), ("up_bias", up_bias)):
        check_bias(name, b, n, x)
    if up_bias is not None and up_weight is None:
        raise ValueError("up_bias needs up_weight (a plain FFN has its bias as gate_bias)")
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
        got = f"{list(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"y must be {list(x.shape)} {x.dtype} on {x.device}, got {got}")
    n_blocks = triton.cdiv(m, blocks.rows)
    if blocks.flags.shape != (n_blocks, n) or blocks.union.shape[0] != n_blocks:
        raise ValueError(
            f"blocks of {blocks.rows} rows for M={m}, N={n} need union [{n_blocks}, T, S] and flags "
            f"[{n_blocks}, {n}], got {list(blocks.union.shape)} and {list(blocks.flags.shape)}"
        )
    if hidden is None:
        hidden = hidden_buffer(m, blocks, x.dtype, x.device)
    elif hidden.shape != (m, blocks.capacity) or hidden.dtype != x.dtype or not hidden.is_contiguous():
        raise ValueError(f"hidden must be a contiguous [{m}, {blocks.capacity}] {x.dtype}, got {list(hidden.shape)}")
    if m == 0:
        return y
    _hidden(x, blocks, gate_weight, gate_bias, up_weight, up_bias, hidden, threshold, drelu, square)
    return _down_(y, blocks, hidden, down_weight_t)


def _layout(blocks) -> tuple[int, int, int]:
    """(tiles, per_tile, capacity) kernel arguments."""
    return blocks.union.shape[1], blocks.per_tile, blocks.capacity


def _tiles_pad(blocks) -> int:
    return max(triton.next_power_of_2(blocks.union.shape[1]), 2)


def _hidden(x, blocks, gate_weight, gate_bias, up_weight, up_bias, hidden, threshold, drelu, square) -> None:
    """Phase 1 of reuse_products_ (its arguments checked there): the blocks' dense h into `hidden`."""
    m, k = x.shape
    up = (up_weight, up_bias if up_bias is not None else x) if up_weight is not None else (x, x)
    up_strides = up_weight.stride() if up_weight is not None else (0, 0)
    _reuse_hidden_kernel[(triton.cdiv(m, blocks.rows), triton.cdiv(blocks.capacity, HIDDEN_CHUNK))](
        x, gate_weight, gate_bias if gate_bias is not None else x, *up, blocks.union, blocks.lengths, hidden, m, k,
        *_layout(blocks), threshold_in(threshold, x.dtype), x.stride(0), x.stride(1), gate_weight.stride(0),
        gate_weight.stride(1), *up_strides, TILES_PAD=_tiles_pad(blocks), HAS_UP=up_weight is not None,
        HAS_GATE_BIAS=gate_bias is not None, HAS_UP_BIAS=up_bias is not None, DRELU=drelu, SQUARE=square,
        DOT_PRECISION=dot_precision(x.dtype), VALUE=tl_dtype(x.dtype), ROWS=blocks.rows, CHUNK=HIDDEN_CHUNK,
        BLOCK_K=BLOCK_K, num_warps=4 if blocks.rows <= 32 else 8, num_stages=3,
    )  # fmt: skip


def _down_(y, blocks, hidden, down_weight_t) -> torch.Tensor:
    """Phase 2 of reuse_products_ (its arguments checked there): y += hidden W_d^T[union] per block."""
    m, k = y.shape
    _reuse_down_kernel[(triton.cdiv(m, blocks.rows), triton.cdiv(k, DOWN_BLOCK_K))](
        hidden, down_weight_t, blocks.union, blocks.lengths, y, m, k, *_layout(blocks), down_weight_t.stride(0),
        down_weight_t.stride(1), y.stride(0), y.stride(1), TILES_PAD=_tiles_pad(blocks),
        DOT_PRECISION=dot_precision(y.dtype), ROWS=blocks.rows, CHUNK=CHUNK, BLOCK_K=DOWN_BLOCK_K,
        num_warps=8 if blocks.rows >= 64 else 4, num_stages=3,
    )  # fmt: skip
    return y
