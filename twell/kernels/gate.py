"""Gate GEMM with TwELL epilogue, and the same packing applied to a dense matrix.

Algorithm 1 of the paper: each program computes an output tile S = x[m0:m0+BLOCK_M] @ W_g[n0:n0+TILE_N]^T
in fp32, adds the bias, and packs each row's kept entries (not <= threshold) to the front of the
tile's SLOTS slots with a row-wise prefix sum, one word a slot (twell.kernels.words: value and column
in the tile); the true count goes to counts[m, tile]. Slots past the count are left unwritten (the
consumers mask by count). The dense gate never reaches global memory. A count above SLOTS marks the
row as an overflow row (the launchers never drop it: see twell.kernels.dispatch). The pack pass
(pack_dense, for a cuBLAS gate) packs the same layout by the same prefix sum.

hot_pos (both launchers): int32 [N], >= 0 for the neurons a caller computes by dense products
(twell.kernels.dispatch's hot neurons), -1 elsewhere; those neurons are never packed (their columns
count as inactive). Their pre-activations are the caller's to compute (a cuBLAS product over their
gate rows): handing them over from the packers cost a masked store over every tile value, which
doubled the pack pass (0.90 -> 1.90 ms at 131072 tokens and 352 hot neurons, ffn-20261202-033016.json;
gathering the hot columns 16 a step cost more: 2.27, ffn-20261202-220027.json).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from twell.format import word_dtype
from twell.kernels.common import (
    TunedLaunch,
    cdiv,
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
from twell.kernels.words import encode

SMEM_LIMIT = 227 * 1024  # H100 / H200 per-block shared memory


@triton.jit
def _pack_rows(keep, value, offs_m, M, tile, words_ptr, cnt_ptr, n_tiles, TILE_N: tl.constexpr, SLOTS: tl.constexpr):
    """Pack the kept entries of one [BLOCK_M, TILE_N] tile of values (the dtype they are stored in) to
    the front of their rows' slots by a row-wise prefix sum, and store the rows' true counts. Row bases
    in int64: 32-bit addressing measured slower (5.23 against 4.97 ms at M=131072, K=2048, N=5632,
    ../shared/probes/pack_epilogue_probe.json)."""
    keep_i = keep.to(tl.int32)
    # a product with a triangular matrix on the tensor cores instead of the prefix sum measured 2.6x
    # slower in the pack pass and 15% in the fused gate (gpu_check-prefill-20261201-205835.json)
    pos = tl.cumsum(keep_i, axis=1) - 1
    rows = offs_m.to(tl.int64)
    row_ok = offs_m < M
    slot = ((rows * n_tiles + tile) * SLOTS)[:, None] + pos
    columns = tl.broadcast_to(tl.arange(0, TILE_N)[None, :], value.shape)
    tl.store(words_ptr + slot, encode(value, columns), mask=keep & (pos < SLOTS) & row_ok[:, None])
    tl.store(cnt_ptr + rows * n_tiles + tile, tl.sum(keep_i, axis=1), mask=row_ok)


@triton.jit
def _squared(value, SQUARE: tl.constexpr):
    """value², computed in fp32 and stored in value's dtype (relu², non-gated FFNs), or value."""
    if SQUARE:
        v = value.to(tl.float32)
        value = (v * v).to(value.dtype)
    return value


@triton.jit
def _drop_hot(value, cols, N, pos_ptr):
    """value [BLOCK_M, TILE_N] (cols: the tile's global columns) with the hot neurons' columns (hot_pos
    >= 0) set to -inf: never kept, NaN included."""
    pos = tl.load(pos_ptr + cols, mask=cols < N, other=-1)
    return tl.where((pos >= 0)[None, :], float("-inf"), value)


# (BLOCK_M, BLOCK_K, num_warps, num_stages); BLOCK_N is the TwELL tile width: one GEMM tile packs exactly
# one TwELL tile. The probe's config (128 x 128 x 64, 4 stages, 8 warps: 4.97 ms at M=131072, K=2048,
# N=5632 against cuBLAS's 4.22, ../shared/probes/pack_epilogue_probe.json) first; 3 stages measured 5.52
# there. The kernel before this one (host descriptors, fp32 threshold copy, row and column masks, the
# epilogue in two reshaped column halves) measured 6.03 at best (gpu_check-prefill-20261201-204221.json).
GATE_CONFIGS = [
    (128, 64, 8, 4),
    (128, 64, 8, 3),
    (128, 32, 8, 6),
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


def _smem(block_m: int, block_k: int, stages: int, tile_n: int, element: int) -> int:
    """Shared memory of a config: its pipelined operand tiles (fp32 operands need twice bf16's) and the
    epilogue's fp32 accumulator tile (what the flattened loop's layout conversion holds: ptxas's 196640
    bytes at 128 x 128 x 64, 4 stages; 262176 at tile 256 with two 128-column slices, which raised
    OutOfResources on the H200: fuzz-20261201-214924.json)."""
    return stages * (block_m + tile_n) * block_k * element + block_m * tile_n * 4


def _prune(configs, named_args, **kwargs):
    """Configs whose operand tiles fit shared memory (fused_gate_supported guarantees one does; the
    interpreter has no such limit)."""
    if interpreting():
        return configs
    tile_n, element = kwargs["TILE_N"], named_args["x_ptr"].element_size()
    return [
        c
        for c in configs
        if _smem(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"], c.num_stages, tile_n, element) <= SMEM_LIMIT
    ]


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bk, w, s in GATE_CONFIGS[: 1 if interpreting() else None]
    ],
    key=["M_BUCKET", "N", "K", "TILE_N", "SLOTS"],
    cache_results=True,  # tuned configs persist on disk across processes
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _gate_twell_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    words_ptr,
    cnt_ptr,
    pos_ptr,
    M,
    N,
    K,
    M_BUCKET,
    n_tiles,
    threshold,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    HAS_HOT: tl.constexpr,
    SQUARE: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    VALUE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr = 8,
):
    """Persistent gate GEMM whose epilogue packs each output tile (_pack_rows), built as the probe's
    lean kernel (../shared/probes/pack_epilogue_probe.py): descriptors made on the device, the loop's
    step a constexpr (PROGRAMS, the grid size), the loop flattened so the pipeliner issues the next
    tile's loads during this tile's epilogue, the keep test on the value in the output dtype. What the
    probe lacked, each as cheap as found: the bias (one add a value; loaded as -inf past N, which also
    drops the columns past N that TMA fills with zeros), the run-time threshold (a scalar), NaN kept
    (the unordered compare), rows past M (a row mask on the stores), EVEN_N (no column mask at all when
    N is a multiple of TILE_N and there is no bias), SQUARE and HAS_HOT (compiled in only where used).
    The keep test runs on the fp32 accumulator against gate_threshold's bound, before the rounding to
    VALUE: ptxas (sm_90) spills 48 words in the loop that way, 245 comparing the rounded value with the
    run-time threshold (the probe, with a constant 0, 90)."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[TILE_N, BLOCK_K])
    grid_m = tl.cdiv(M, BLOCK_M)
    n_out = grid_m * n_tiles
    k_steps = tl.cdiv(K, BLOCK_K)
    for out_tile in tl.range(tl.program_id(0), n_out, PROGRAMS, flatten=True):
        pid_m, tile, acc = _gate_tile(
            x_desc, w_desc, out_tile, grid_m, n_tiles, k_steps, DOT_PRECISION, TILE_N, BLOCK_M, BLOCK_K, GROUP_M
        )
        cols = tile * TILE_N + tl.arange(0, TILE_N)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=float("-inf")).to(tl.float32)[None, :]
        elif not EVEN_N:
            acc = tl.where((cols < N)[None, :], acc, float("-inf"))
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if HAS_HOT:
            acc = _drop_hot(acc, cols, N, pos_ptr)
        # the value the dense FFN sees is the gate rounded to VALUE; threshold is the fp32 bound that
        # decides as that rounded value would (gate_threshold): the compare runs before the rounding
        keep = ~(acc <= threshold)  # NaN is kept, as by relu
        value = _squared(acc.to(VALUE), SQUARE)
        _pack_rows(keep, value, offs_m, M, tile, words_ptr, cnt_ptr, n_tiles, TILE_N, SLOTS)


PACK_CONFIGS = [
    # (BLOCK_M, num_warps, num_stages) of the prefix-sum pack. 1.12-1.27 ms at M=131072, N=5632 whatever
    # the row block (16 rows, 4 warps best; gpu_check-prefill-20261201-205835.json) against 0.35 for its
    # bytes (the gate read once): bound by instructions (ptxas, sm_90: ~35 a value at 16 rows, a third
    # of them the store's layout conversion), not by memory
    (16, 4, 1),
    (32, 4, 1),
    (4, 2, 1),
    (8, 4, 1),
    (16, 8, 1),
]


def _pack_configs() -> list[triton.Config]:
    """PACK_CONFIGS as the autotuner's configs; the first alone when interpreting (with one config the
    autotuner does not tune, which the interpreter cannot)."""
    rows = PACK_CONFIGS[:1] if interpreting() else PACK_CONFIGS
    return [triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s) for bm, w, s in rows]


@triton.autotune(
    configs=_pack_configs(),
    key=["M_BUCKET", "N", "TILE_N", "SLOTS"],
    cache_results=True,
)
@triton.jit
def _pack_dense_kernel(
    h_ptr,
    words_ptr,
    cnt_ptr,
    pos_ptr,
    M,
    N,
    M_BUCKET,
    n_tiles,
    threshold,
    stride_hm,
    stride_hn,
    HAS_HOT: tl.constexpr,
    SQUARE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One [BLOCK_M, TILE_N] tile a program, packed by a row-wise prefix sum (_pack_rows)."""
    pid_m = tl.program_id(0)
    tile = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile * TILE_N + tl.arange(0, TILE_N)
    rows = offs_m.to(tl.int64)[:, None]
    row_ok = (offs_m < M)[:, None]
    ptrs = h_ptr + rows * stride_hm + cols[None, :] * stride_hn
    value = tl.load(ptrs, mask=row_ok & (cols < N)[None, :], other=float("-inf"))  # -inf: never kept
    if HAS_HOT:
        value = _drop_hot(value, cols, N, pos_ptr)
    keep = ~(value <= tl.cast(threshold, h_ptr.dtype.element_ty))  # NaN is kept, as by relu
    _pack_rows(keep, _squared(value, SQUARE), offs_m, M, tile, words_ptr, cnt_ptr, n_tiles, TILE_N, SLOTS)


# the launchers' configs, chosen once per key by the autotuners
_gate_twell_launch = TunedLaunch(_gate_twell_kernel)
_pack_dense_launch = TunedLaunch(_pack_dense_kernel)


def _alloc(m: int, n: int, tile_n: int, slots: int, dtype, device):
    """(words, counts) of a TwELL of [m, n] values of `dtype` (twell.format's layout)."""
    n_tiles = cdiv(n, tile_n)
    words = torch.empty(m, n_tiles, slots, dtype=word_dtype(dtype), device=device)
    counts = torch.empty(m, n_tiles, dtype=torch.int32, device=device)
    return words, counts


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
    return any(_smem(bm, bk, s, tile_n, element) <= SMEM_LIMIT for bm, bk, _, s in GATE_CONFIGS)


def gate_twell(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    threshold: float,
    tile_n: int,
    slots: int,
    square: bool = False,
    config: tuple[int, int, int, int] | None = None,
    hot_pos: torch.Tensor | None = None,
):
    """TwELL arrays (words, counts) of act_t(x @ weight^T + bias), x: [M, K], weight: [N, K] (layout:
    twell.format; slots past each count unwritten); the dense gate never reaches memory.

    square: store act² (relu², non-gated FFNs). Counts are true counts: > slots means the row overflows.
    The operands must pass fused_gate_supported (cuBLAS + pack_dense serves the rest). config: one row
    of GATE_CONFIGS instead of autotuning (tests, benchmarks). hot_pos: module docstring.
    """
    check_input("x", x)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        got = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"gate_twell expects x [M, K] and weight [N, K], got {list(x.shape)} and {got}")
    check_operand("weight", weight, tuple(weight.shape), x)
    check_bias("bias", bias, weight.shape[0], x)
    check_threshold(threshold)
    check_pos(hot_pos, weight.shape[0], x)
    if not fused_gate_supported(x, weight, tile_n):
        raise ValueError(
            "gate_twell needs unit stride on K, 16-byte aligned rows and a config that fits shared memory "
            "(see fused_gate_supported)"
        )
    check_tile(tile_n, slots)
    return launch_gate_twell(x, weight, bias, threshold, tile_n, slots, square, config, hot_pos)


@functools.lru_cache(maxsize=64)
def gate_threshold(threshold: float, dtype: torch.dtype) -> float:
    """The fp32 bound t with: an fp32 a rounded to `dtype` (to nearest, ties to even) is kept by the
    layer's threshold exactly when a > t (NaN: not a <= t, kept). So the fused gate tests its
    accumulator before rounding it, as the dense FFN tests the rounded gate. Cached: every launch asks."""
    kept = threshold_in(threshold, dtype) + 0.0  # what torch compares a `dtype` tensor with; -0.0 is 0.0
    if dtype == torch.float32:
        return kept
    # the midpoint between `kept` and the next `dtype` value up (the largest finite value's would be
    # one ulp above it) is exact in fp32; it rounds to whichever of the two is even
    ints = torch.int16  # bf16 and fp16 words
    word = torch.tensor([kept], dtype=dtype).view(ints)
    step = 1 if kept > 0 else -1
    up = torch.ones_like(word) if kept == 0 else word + step
    above = up.view(dtype).double().item()
    if math.isinf(above):
        above = 2 * kept - (word - step).view(dtype).double().item()
    middle = torch.tensor([(kept + above) / 2], dtype=torch.float32)
    if middle.to(dtype).double().item() > kept:  # the midpoint rounds up: keep from it on
        middle = torch.nextafter(middle, torch.tensor([-math.inf]))
    return middle.item()


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the TMA descriptors the fused gate makes on the device (Triton asks its
    allocator at launch; torch's caching allocator serves it, inside CUDA-graph capture too)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def launch_gate_twell(x, weight, bias, threshold, tile_n, slots, square=False, config=None, hot_pos=None):
    """gate_twell without its input checks, for callers that checked at the op boundary (the
    dispatcher). Autotuned once per (token bucket, shape, layout, dtype, hot or not), then launched
    with that config (TunedLaunch)."""
    m, k = x.shape
    n = weight.shape[0]
    words, counts = _alloc(m, n, tile_n, slots, x.dtype, x.device)
    n_tiles = counts.shape[1]
    programs = persistent_programs(x.device, 1)
    if x.is_cuda:  # device-made descriptors measured faster than host ones (gate_epilogue-20261201-205328.json)
        triton.set_allocator(_descriptor_scratch)

    def grid(meta):
        # the kernel steps by PROGRAMS: with fewer tiles than programs, each program takes one or none
        return (min(programs, cdiv(m, meta["BLOCK_M"]) * n_tiles),)

    bucket = m_bucket(m)
    args = (
        x, weight, bias if bias is not None else x, words, counts, hot_pos if hot_pos is not None else counts, m, n, k,
        bucket, n_tiles,
        gate_threshold(threshold, x.dtype), x.stride(0), weight.stride(0),
    )  # fmt: skip
    flags = {
        "HAS_BIAS": bias is not None,
        "HAS_HOT": hot_pos is not None,
        "SQUARE": square,
        "EVEN_N": n % tile_n == 0,
        "DOT_PRECISION": dot_precision(x.dtype),
        "VALUE": tl_dtype(x.dtype),
        "TILE_N": tile_n,
        "SLOTS": slots,
        "PROGRAMS": programs,
    }
    if config is None:
        _gate_twell_launch((bucket, n, k, tile_n, slots, x.dtype, hot_pos is None), grid, *args, **flags)
        return words, counts
    block_m, block_k, warps, stages = config
    meta = {"BLOCK_M": block_m, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}
    _gate_twell_kernel.fn[grid](*args, **flags, **meta)
    return words, counts


def pack_dense(
    h: torch.Tensor,
    threshold: float,
    tile_n: int,
    slots: int,
    square: bool = False,
    hot_pos: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
):
    """TwELL arrays (words, counts) of a dense pre-activation h [M, N]: the pack pass for a cuBLAS gate.
    hot_pos: module docstring. config: one row of PACK_CONFIGS instead of autotuning
    (tests, benchmarks)."""
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"pack_dense expects h [M, N], got {list(h.shape) if isinstance(h, torch.Tensor) else h}")
    check_input("h", h)
    check_threshold(threshold)
    check_pos(hot_pos, h.shape[1], h)
    check_tile(tile_n, slots)
    return launch_pack_dense(h, threshold, tile_n, slots, square, hot_pos, config)


def launch_pack_dense(h, threshold, tile_n, slots, square=False, hot_pos=None, config=None):
    """pack_dense without its input checks, for callers that checked at the op boundary (the
    dispatcher). Autotuned once per (token bucket, N, layout, dtype, hot or not), then launched with
    that config (TunedLaunch)."""
    m, n = h.shape
    words, counts = _alloc(m, n, tile_n, slots, h.dtype, h.device)
    n_tiles = counts.shape[1]
    bucket = m_bucket(m)
    args = (
        h, words, counts, hot_pos if hot_pos is not None else counts, m, n, bucket, n_tiles,
        threshold_in(threshold, h.dtype), h.stride(0), h.stride(1),
    )  # fmt: skip
    flags = {"HAS_HOT": hot_pos is not None, "SQUARE": square, "TILE_N": tile_n, "SLOTS": slots}

    def grid(meta):
        return (cdiv(m, meta["BLOCK_M"]), n_tiles)

    if config is None:
        _pack_dense_launch((bucket, n, tile_n, slots, h.dtype, hot_pos is None), grid, *args, **flags)
    else:
        block_m, warps, stages = config
        _pack_dense_kernel.fn[grid](*args, **flags, BLOCK_M=block_m, num_warps=warps, num_stages=stages)
    return words, counts
