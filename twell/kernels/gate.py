"""Gate GEMM with TwELL epilogue, and the same packing applied to a dense matrix.

Algorithm 1 of the paper: each program computes an output tile S = x[m0:m0+BLOCK_M] @ W_g[n0:n0+TILE_N]^T
in fp32, adds the bias, and packs each row's kept entries (not <= threshold) to the front of the
tile's SLOTS slots with a row-wise prefix sum, one word a slot (twell.kernels.words: value and column
in the tile); the true count goes to counts[m, tile]. Slots past the count are left unwritten (the
consumers mask by count). The dense gate never reaches global memory. A count above SLOTS marks the
row as an overflow row (the launchers never drop it: see twell.kernels.dispatch).

hot (both launchers): (hot_pos, hot_values) for a caller that computes some neurons by dense products
(twell.kernels.dispatch's hot neurons). hot_pos: int32 [N], neuron n's column in
hot_values [M, H] or -1; those neurons are never packed (their columns count as inactive), and their
pre-activations (bias added, rounded to the output dtype, before any activation) go to hot_values.
Positions are not checked on the host (that would wait for the device); one outside [0, H) makes its
neuron a packed one, never a store outside hot_values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from twell.format import word_dtype
from twell.kernels.common import (
    TunedLaunch,
    autotune_configs,
    check_bias,
    check_input,
    check_operand,
    check_pos,
    check_threshold,
    check_tile,
    compute_capability,
    dot_precision,
    interpreting,
    m_bucket,
    persistent_programs,
    threshold_in,
    tl_dtype,
)
from twell.kernels.reuse import dense_columns
from twell.kernels.words import encode

SMEM_LIMIT = 227 * 1024  # H100 / H200 per-block shared memory


@triton.jit
def _pack_slice(
    acc,
    offs_m,
    tile,
    col0,
    before,
    M,
    N,
    threshold,
    words_ptr,
    n_tiles,
    VALUE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    SQUARE: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """Pack columns [col0, col0 + WIDTH) of one TwELL tile (rows offs_m, fp32 values `acc`, stored as
    VALUE) behind the `before` entries each row already holds in this tile; returns the rows' counts
    including this slice. Row bases in int64: 32-bit addressing measured slower (5.23 against 4.97 ms
    at M=131072, K=2048, N=5632, ../shared/probes/pack_epilogue_probe.json)."""
    offs_c = col0 + tl.arange(0, WIDTH)
    in_bounds = (offs_m < M)[:, None] & ((tile * TILE_N + offs_c) < N)[None, :]
    keep = ((acc > threshold) | (acc != acc)) & in_bounds  # not (acc <= t): NaN is kept, as by relu
    keep_i = keep.to(tl.int32)
    # a product with a triangular matrix on the tensor cores instead of the prefix sum measured 2.6x
    # slower in the pack pass and 15% in the fused gate (gpu_check-prefill-20261201-205835.json)
    pos = before[:, None] + tl.cumsum(keep_i, axis=1) - 1
    if SQUARE:
        acc = acc * acc
    slot_ptr = ((offs_m.to(tl.int64) * n_tiles + tile) * SLOTS)[:, None] + pos
    word = encode(acc.to(VALUE), tl.broadcast_to(offs_c[None, :], acc.shape))
    tl.store(words_ptr + slot_ptr, word, mask=keep & (pos < SLOTS))
    return before + tl.sum(keep_i, axis=1)


@triton.jit
def _pack_tile(
    acc, offs_m, tile, M, N, threshold, words_ptr, cnt_ptr, pos_ptr, hot_ptr, n_hot, n_tiles,
    VALUE: tl.constexpr, TILE_N: tl.constexpr, SLOTS: tl.constexpr, SQUARE: tl.constexpr, SPLIT: tl.constexpr,
    HAS_HOT: tl.constexpr,
):  # fmt: skip
    """Pack one [BLOCK_M, TILE_N] fp32 tile into TwELL slots and store its rows' counts, in SPLIT column
    slices (1 or 2: fewer live registers next to a GEMM accumulator); with HAS_HOT, the hot neurons'
    columns go to hot_ptr [M, n_hot] instead. Gathering each slot by a row reduction instead was 2.5x
    slower on the H200 (benchmarks/NOTES.md)."""
    if HAS_HOT:
        cols = tile * TILE_N + tl.arange(0, TILE_N)
        pos = tl.load(pos_ptr + cols, mask=cols < N, other=-1)
        hot = ((pos >= 0) & (pos < n_hot))[None, :]  # a position past hot_values is no store
        hot_off = offs_m.to(tl.int64)[:, None] * n_hot + pos[None, :]
        tl.store(hot_ptr + hot_off, acc.to(hot_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & hot)
        acc = tl.where(hot, float("-inf"), acc)  # never kept, NaN included
    cnt = tl.zeros([offs_m.shape[0]], dtype=tl.int32)
    if SPLIT == 1:
        cnt = _pack_slice(
            acc, offs_m, tile, 0, cnt, M, N, threshold, words_ptr, n_tiles, VALUE, TILE_N, SLOTS, SQUARE, TILE_N
        )
    else:
        left, right = tl.split(tl.permute(tl.reshape(acc, [acc.shape[0], 2, TILE_N // 2]), [0, 2, 1]))
        cnt = _pack_slice(
            left, offs_m, tile, 0, cnt, M, N, threshold, words_ptr, n_tiles, VALUE, TILE_N, SLOTS, SQUARE, TILE_N // 2
        )
        cnt = _pack_slice(
            right, offs_m, tile, TILE_N // 2, cnt, M, N, threshold, words_ptr, n_tiles, VALUE, TILE_N, SLOTS, SQUARE,
            TILE_N // 2,
        )  # fmt: skip
    tl.store(cnt_ptr + offs_m.to(tl.int64) * n_tiles + tile, cnt, mask=offs_m < M)


# (BLOCK_M, BLOCK_K, num_warps, num_stages, SPLIT); BLOCK_N is the TwELL tile width: one GEMM tile packs
# exactly one TwELL tile. Measured on the H200 at M=131072, K=2048, N=5632, tile 128
# (gpu_check-prefill-20261201-204221.json; cuBLAS alone 4.35, + the pack pass 5.47): SPLIT 2 6.03 ms,
# SPLIT 1 9.45 (ptxas, sm_90: 184 against 768 bytes of spills a thread), 3 stages 6.60, BLOCK_K 32 with
# 8 stages 8.27; at K=4096, N=14336, M=65536 SPLIT 2 13.8 against cuBLAS's 11.3. The probe's kernel ran
# 4.97 with no bias, a constant threshold and NaN dropped: those features cost the registers
# (benchmarks/gate_epilogue.py, gate_epilogue-20261201-205328.json).
GATE_CONFIGS = [
    (128, 64, 8, 4, 2),
    (128, 64, 8, 4, 1),
]


@triton.jit
def _gate_tile(
    x_desc, w_desc, out_tile, grid_m, n_tiles, k_steps,
    DOT_PRECISION: tl.constexpr, TILE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """Output tile `out_tile` of the persistent gate GEMM: (row block, column tile, fp32 x W_g^T tile),
    TMA loads of x and W_g. Grouped order: programs that run together share W_g tiles in L2."""
    group = out_tile // (GROUP_M * n_tiles)
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (out_tile % (GROUP_M * n_tiles)) % group_size
    tile = (out_tile % (GROUP_M * n_tiles)) // group_size
    acc = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
    for ks in range(k_steps):
        a = x_desc.load([pid_m * BLOCK_M, ks * BLOCK_K])
        b = w_desc.load([tile * TILE_N, ks * BLOCK_K])
        acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
    return pid_m, tile, acc


def _smem(block_m: int, block_k: int, stages: int, tile_n: int, element: int, split: int) -> int:
    """Shared memory of a config: its pipelined operand tiles (fp32 operands need twice bf16's) and the
    epilogue's fp32 slice of the accumulator (what the flattened loop's layout conversion holds:
    ptxas's 196640 bytes at 128 x 128 x 64, 4 stages, SPLIT 1; 262176 at tile 256, SPLIT 2, which
    raised OutOfResources on the H200: fuzz-20261201-214924.json)."""
    return stages * (block_m + tile_n) * block_k * element + block_m * (tile_n // split) * 4


def _prune(configs, named_args, **kwargs):
    """Configs whose operand tiles fit shared memory (fused_gate_supported guarantees one does; the
    interpreter has no such limit)."""
    if interpreting():
        return configs
    tile_n, element = kwargs["TILE_N"], named_args["x_desc"].base.element_size()
    return [
        c
        for c in configs
        if _smem(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"], c.num_stages, tile_n, element, c.kwargs["SPLIT"])
        <= SMEM_LIMIT
    ]


def _set_blocks(nargs):
    """Descriptor block shapes follow the config being run."""
    nargs["x_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["w_desc"].block_shape = [nargs["TILE_N"], nargs["BLOCK_K"]]


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "SPLIT": sp}, num_warps=w, num_stages=s, pre_hook=_set_blocks)
        for bm, bk, w, s, sp in GATE_CONFIGS[: 1 if interpreting() else None]
    ],
    key=["M_BUCKET", "N", "K", "TILE_N", "SLOTS"],
    cache_results=True,  # tuned configs persist on disk across processes
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _gate_twell_kernel(
    x_desc,
    w_desc,
    b_ptr,
    words_ptr,
    cnt_ptr,
    pos_ptr,
    hot_ptr,
    n_hot,
    M,
    N,
    K,
    M_BUCKET,
    n_tiles,
    threshold,
    HAS_BIAS: tl.constexpr,
    HAS_HOT: tl.constexpr,
    SQUARE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    VALUE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr = 8,
):
    """Persistent gate GEMM (TMA loads of x and W_g tiles) whose epilogue packs each output tile. The
    flattened loop lets the pipeliner issue the next tile's loads during this tile's epilogue (the
    probe kernel of ../shared/probes/pack_epilogue_probe.py, flattened: 4.97 ms against cuBLAS's 4.22
    for the gate alone at M=131072, K=2048, N=5632)."""
    grid_m = tl.cdiv(M, BLOCK_M)
    n_out = grid_m * n_tiles
    k_steps = tl.cdiv(K, BLOCK_K)
    for out_tile in tl.range(tl.program_id(0), n_out, tl.num_programs(0), flatten=True):
        pid_m, tile, acc = _gate_tile(
            x_desc, w_desc, out_tile, grid_m, n_tiles, k_steps, DOT_PRECISION, TILE_N, BLOCK_M, BLOCK_K, GROUP_M
        )
        if HAS_BIAS:
            cols = tile * TILE_N + tl.arange(0, TILE_N)
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        # decide on the value the dense FFN sees: the gate rounded to the output dtype
        acc = acc.to(VALUE).to(tl.float32)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        _pack_tile(
            acc, offs_m, tile, M, N, threshold, words_ptr, cnt_ptr, pos_ptr, hot_ptr, n_hot, n_tiles, VALUE, TILE_N,
            SLOTS, SQUARE, SPLIT, HAS_HOT,
        )  # fmt: skip


PACK_CONFIGS = [
    # (BLOCK_M, num_warps, num_stages). 1.12-1.27 ms at M=131072, N=5632 whatever the row block (16
    # rows, 4 warps best; gpu_check-prefill-20261201-205835.json) against 0.35 for its bytes (the gate
    # read once): bound by the prefix sum's shuffles, not by memory
    (16, 4, 1),
    (32, 4, 1),
    (4, 2, 1),
    (8, 4, 1),
    (16, 8, 1),
]


@triton.jit
def _load_tile(h_ptr, offs_m, tile, M, N, stride_hm, stride_hn, TILE_N: tl.constexpr):
    offs_n = tile * TILE_N + tl.arange(0, TILE_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :] * stride_hn
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


def _prune_pack(configs, named_args, **kwargs):
    """With reuse, a program's rows lie in one reuse block: BLOCK_M must divide REUSE_ROWS (both powers
    of two, so BLOCK_M <= REUSE_ROWS)."""
    rows = kwargs["REUSE_ROWS"]
    return [c for c in configs if rows == 0 or c.kwargs["BLOCK_M"] <= rows]


@triton.autotune(
    configs=autotune_configs(PACK_CONFIGS, lambda bm, w, s: {"BLOCK_M": bm}),
    key=["M_BUCKET", "N", "TILE_N", "SLOTS", "REUSE_ROWS"],
    cache_results=True,
    prune_configs_by={"early_config_prune": _prune_pack},
)
@triton.jit
def _pack_dense_kernel(
    h_ptr,
    words_ptr,
    cnt_ptr,
    pos_ptr,
    hot_ptr,
    flag_ptr,
    n_hot,
    M,
    N,
    M_BUCKET,
    n_tiles,
    threshold,
    stride_hm,
    stride_hn,
    HAS_HOT: tl.constexpr,
    REUSE_ROWS: tl.constexpr,
    SQUARE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One [BLOCK_M, TILE_N] tile a program; with REUSE_ROWS, the columns its reuse block lists as dense
    (flag_ptr: one byte per (block, neuron), twell.kernels.reuse.dense_columns) are left out of TwELL."""
    pid_m = tl.program_id(0)
    tile = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = _load_tile(h_ptr, offs_m, tile, M, N, stride_hm, stride_hn, TILE_N)
    if REUSE_ROWS > 0:  # BLOCK_M divides REUSE_ROWS (_prune_pack): the program's rows share a block
        cols = tile * TILE_N + tl.arange(0, TILE_N)
        block = (pid_m * BLOCK_M // REUSE_ROWS).to(tl.int64)
        dense = tl.load(flag_ptr + block * N + cols, mask=cols < N, other=0)
        acc = tl.where(dense[None, :] != 0, float("-inf"), acc)  # never kept, NaN included
    _pack_tile(
        acc, offs_m, tile, M, N, threshold, words_ptr, cnt_ptr, pos_ptr, hot_ptr, n_hot, n_tiles,
        h_ptr.dtype.element_ty, TILE_N, SLOTS, SQUARE, 1, HAS_HOT,
    )  # fmt: skip


# the launchers' configs, chosen once per key by the autotuners
_gate_twell_launch = TunedLaunch(_gate_twell_kernel)
_pack_dense_launch = TunedLaunch(_pack_dense_kernel)


def _alloc(m: int, n: int, tile_n: int, slots: int, dtype, device):
    """(words, counts) of a TwELL of [m, n] values of `dtype` (twell.format's layout)."""
    n_tiles = triton.cdiv(n, tile_n)
    words = torch.empty(m, n_tiles, slots, dtype=word_dtype(dtype), device=device)
    counts = torch.empty(m, n_tiles, dtype=torch.int32, device=device)
    return words, counts


def hot_values(m: int, n_hot: int, dtype, device) -> torch.Tensor:
    """The [M, H] buffer the packers fill with the hot neurons' pre-activations."""
    return torch.empty(m, n_hot, dtype=dtype, device=device)


def _hot_args(hot, dummy) -> tuple:
    """(pos_ptr, hot_ptr, n_hot) kernel arguments."""
    if hot is None:
        return dummy, dummy, 0
    return hot[0], hot[1], hot[1].shape[1]


def check_hot(hot, m: int, n: int, x: torch.Tensor) -> None:
    """An optional (hot_pos int32 [N], hot_values [M, H] in x's dtype, contiguous) pair."""
    if hot is None:
        return
    if not isinstance(hot, tuple) or len(hot) != 2:
        raise ValueError("hot must be a (hot_pos, hot_values) pair")
    pos, values = hot
    check_pos(pos, n, x)
    if not isinstance(values, torch.Tensor) or values.dim() != 2:
        raise ValueError(f"hot_values must be a tensor [{m}, H], got {type(values).__name__}")
    check_operand("hot_values", values, (m, values.shape[1]), x)
    if not values.is_contiguous():
        raise ValueError(f"hot_values must be contiguous, got strides {values.stride()}")


def fused_gate_supported(x: torch.Tensor, weight: torch.Tensor, tile_n: int) -> bool:
    """Whether gate_twell can take these operands: TMA needs unit stride on K, 16-byte aligned rows and
    base addresses, and a Hopper-class GPU (compute capability >= 9); on a GPU, some config's operand
    tiles must fit shared memory at this tile width (fp32 fits none: it raised OutOfResources)."""
    aligned = all(
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (x, weight)
    )
    if not aligned or not x.is_cuda:
        return aligned
    if compute_capability(x.device)[0] < 9:
        return False
    element = x.element_size()
    return any(_smem(bm, bk, s, tile_n, element, sp) <= SMEM_LIMIT for bm, bk, _, s, sp in GATE_CONFIGS)


def gate_twell(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: float,
    tile_n: int,
    slots: int,
    square: bool = False,
    config: tuple[int, int, int, int, int] | None = None,
    hot: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """TwELL arrays (words, counts) of act_t(x @ weight^T + bias), x: [M, K], weight: [N, K] (layout:
    twell.format; slots past each count unwritten); the dense gate never reaches memory.

    square: store act² (relu², non-gated FFNs). Counts are true counts: > slots means the row overflows.
    The operands must pass fused_gate_supported (cuBLAS + pack_dense serves the rest). config: one row
    of GATE_CONFIGS instead of autotuning (tests, benchmarks). hot: (hot_pos, hot_values), module
    docstring.
    """
    check_input("x", x)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        got = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"gate_twell expects x [M, K] and weight [N, K], got {list(x.shape)} and {got}")
    check_operand("weight", weight, tuple(weight.shape), x)
    check_bias("bias", bias, weight.shape[0], x)
    check_threshold(threshold)
    check_hot(hot, x.shape[0], weight.shape[0], x)
    if not fused_gate_supported(x, weight, tile_n):
        raise ValueError(
            "gate_twell needs unit stride on K, 16-byte aligned rows and a config that fits shared memory "
            "(see fused_gate_supported)"
        )
    check_tile(tile_n, slots)
    return launch_gate_twell(x, weight, bias, threshold, tile_n, slots, square, config, hot)


def launch_gate_twell(x, weight, bias, threshold, tile_n, slots, square=False, config=None, hot=None):
    """gate_twell without its input checks, for callers that checked at the op boundary (the
    dispatcher). Autotuned once per (token bucket, shape, layout, dtype, hot or not), then launched
    with that config (TunedLaunch)."""
    m, k = x.shape
    n = weight.shape[0]
    words, counts = _alloc(m, n, tile_n, slots, x.dtype, x.device)
    n_tiles = counts.shape[1]
    programs = persistent_programs(x.device, 1)
    # block shapes are set per config by _set_blocks
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [16, 16])
    w_desc = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [16, 16])

    def grid(meta):
        return (min(programs, triton.cdiv(m, meta["BLOCK_M"]) * n_tiles),)

    bucket = m_bucket(m)
    args = (
        x_desc, w_desc, bias if bias is not None else x, words, counts, *_hot_args(hot, counts), m, n, k, bucket,
        n_tiles, threshold_in(threshold, x.dtype),
    )  # fmt: skip
    flags = {
        "HAS_BIAS": bias is not None,
        "HAS_HOT": hot is not None,
        "SQUARE": square,
        "DOT_PRECISION": dot_precision(x.dtype),
        "VALUE": tl_dtype(x.dtype),
        "TILE_N": tile_n,
        "SLOTS": slots,
    }
    if config is None:
        _gate_twell_launch((bucket, n, k, tile_n, slots, x.dtype, hot is None), grid, *args, **flags)
        return words, counts
    block_m, block_k, warps, stages, split = config
    meta = {"BLOCK_M": block_m, "BLOCK_K": block_k, "SPLIT": split, "num_warps": warps, "num_stages": stages}
    _set_blocks({"x_desc": x_desc, "w_desc": w_desc, "TILE_N": tile_n, **meta})
    _gate_twell_kernel.fn[grid](*args, **flags, **meta)
    return words, counts


def pack_dense(
    h: torch.Tensor,
    threshold: float,
    tile_n: int,
    slots: int,
    square: bool = False,
    hot: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: tuple[int, int, int] | None = None,
    reuse: tuple[int, int, int] | None = None,
):
    """TwELL arrays (words, counts) of a dense pre-activation h [M, N]: the pack pass for a cuBLAS gate.
    hot: (hot_pos, hot_values), module docstring. config: one row of PACK_CONFIGS instead of autotuning
    (tests, benchmarks). reuse: (rows, reuse_min, per_tile): per block of `rows` consecutive rows, the
    columns kept in at least reuse_min of its rows (at most per_tile a tile, first by column) are left
    out of TwELL and listed in a third return value, a twell.kernels.reuse.ReuseBlocks (its dense_columns
    runs first: the pack itself only reads the block's flags)."""
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"pack_dense expects h [M, N], got {list(h.shape) if isinstance(h, torch.Tensor) else h}")
    check_input("h", h)
    check_threshold(threshold)
    check_hot(hot, h.shape[0], h.shape[1], h)
    check_tile(tile_n, slots)
    return launch_pack_dense(h, threshold, tile_n, slots, square, hot, config, reuse)


def launch_pack_dense(h, threshold, tile_n, slots, square=False, hot=None, config=None, reuse=None):
    """pack_dense without its input checks, for callers that checked at the op boundary (the
    dispatcher). Autotuned once per (token bucket, N, layout, dtype, hot or not), then launched with
    that config (TunedLaunch)."""
    m, n = h.shape
    words, counts = _alloc(m, n, tile_n, slots, h.dtype, h.device)
    n_tiles = counts.shape[1]
    bucket = m_bucket(m)
    pos, hot_buf, n_hot = _hot_args(hot, counts)
    blocks = None
    if reuse is not None:
        blocks = dense_columns(h, threshold, tile_n, reuse, hot[0] if hot is not None else None, n_hot)
    rows = blocks.rows if blocks is not None else 0
    args = (
        h, words, counts, pos, hot_buf, blocks.flags if blocks is not None else counts, n_hot, m, n, bucket, n_tiles,
        threshold_in(threshold, h.dtype), h.stride(0), h.stride(1),
    )  # fmt: skip
    flags = {"HAS_HOT": hot is not None, "REUSE_ROWS": rows, "SQUARE": square, "TILE_N": tile_n, "SLOTS": slots}

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]), n_tiles)

    if config is None:
        _pack_dense_launch((bucket, n, tile_n, slots, h.dtype, hot is None, rows), grid, *args, **flags)
    else:
        block_m, warps, stages = config
        if rows % block_m:
            raise ValueError(f"pack config BLOCK_M must divide the reuse rows {rows}, got {block_m}")
        _pack_dense_kernel.fn[grid](*args, **flags, BLOCK_M=block_m, num_warps=warps, num_stages=stages)
    return (words, counts) if blocks is None else (words, counts, blocks)
