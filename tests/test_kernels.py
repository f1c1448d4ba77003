"""Triton kernels against float64 references (CPU: Triton's interpreter, fp32/fp16; GPU: bf16 too)."""

import gc
import math

import pytest
import torch
import triton
from conftest import DEVICE, HAS_CUDA, compile_for_hopper, rel_err, slow_unless
from ffn_cases import TOL, decode_args, gated_ref, make_ffn, plain_ref

import twell
from twell.format import TwELL, kept_mask
from twell.kernels import dispatch, gate, policy, reference, updown
from twell.kernels.decode import decode_ffn
from twell.kernels.gate import gate_twell, pack_dense
from twell.kernels.policy import LayerConfig
from twell.kernels.updown import twell_up_down

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# empty rows, typical sparse rows and a few fully dense rows (every tile overflows; the prefill path
# recomputes those tiles, which is slow in the interpreter, hence few)
MIXED = [0.0, 0.03, 0.1, 0.02, 0.05, 0.01, 0.04, 0.0, 0.03, 1.0]


@pytest.fixture(autouse=True)
def poisoned_twell_buffers(monkeypatch):
    """Kernel-allocated TwELL arrays start as -1 (a word of a NaN value at column 0xFFFF), so any slot
    inside a count or any count a kernel fails to write shows."""
    alloc = gate._alloc

    def poisoned(*args):
        words, counts = alloc(*args)
        return words.fill_(-1), counts.fill_(-1)

    monkeypatch.setattr(gate, "_alloc", poisoned)


def _twell(words, counts, shape, tile_n, dtype):
    """Kernel arrays as a TwELL (without dense backup: only valid on rows that do not overflow)."""
    empty = torch.empty(0, dtype=torch.int64, device=words.device)
    return TwELL(words, counts, empty, torch.empty(0, shape[1], dtype=dtype, device=words.device), shape, tile_n)


def _counted(words, counts):
    """The words inside each count (the spec zeroes the rest; kernels leave them unwritten)."""
    valid = torch.arange(words.shape[-1], device=words.device) < counts.clamp(max=words.shape[-1]).unsqueeze(-1)
    return torch.where(valid, words, 0).cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("square", [False, True], ids=["relu", "relu2"])
@pytest.mark.parametrize(
    "m,n,tile_n,slots", [(1, 40, 16, 4), (37, 300, 64, 8), (130, 256, 256, 32)], ids=["m1-n40", "m37-n300", "m130-n256"]
)
@pytest.mark.parametrize("config", [(4, 2, 1), (16, 4, 1)], ids=["rows4", "rows16"])
def test_pack_dense_matches_the_spec(m, n, tile_n, slots, square, dtype, config):
    """Bit-exact against format.pack, with a threshold (0.3) that fp16/bf16 cannot represent exactly,
    at two row blocks (partial last blocks; the overflow rows' first slots hold their first entries)."""
    g = torch.Generator().manual_seed(m * n)
    h = torch.randn(m, n, generator=g)
    h[::3] -= 3.0  # mostly-empty rows
    h[1::5] += 5.0  # fully dense rows: overflow
    h = h.to(dtype)
    h[0, :3] = 0.3  # exactly the rounded threshold: dropped, as torch drops it
    h[0, -2] = float("nan")  # kept, as by relu
    words, counts = pack_dense(h.to(DEVICE), 0.3, tile_n, slots, square=square, config=config)
    kept = torch.where(kept_mask(h, 0.3), h * h, 0.0) if square else h
    spec = twell.pack(kept, tile_n=tile_n, slots=slots, threshold=0.0 if square else 0.3)
    assert torch.equal(counts.cpu(), spec.counts)
    assert torch.equal(_counted(words, counts), spec.words), "every slot inside a count, bit for bit"
    got = _twell(words.cpu(), counts.cpu(), (m, n), tile_n, dtype)
    assert got.values.isnan().sum() == 1


def test_pack_autotunes_over_its_table(monkeypatch):
    """On a GPU the pack's autotuner tunes over every row of PACK_CONFIGS; the interpreter's one config
    (no tuning) is the table's first."""
    monkeypatch.setattr(gate, "interpreting", lambda: False)
    assert [(c.kwargs["BLOCK_M"], c.num_warps, c.num_stages) for c in gate._pack_configs()] == gate.PACK_CONFIGS
    monkeypatch.setattr(gate, "interpreting", lambda: True)
    assert [(c.kwargs["BLOCK_M"], c.num_warps, c.num_stages) for c in gate._pack_configs()] == gate.PACK_CONFIGS[:1]


def test_pack_dense_leaves_out_hot_columns():
    """Hot neurons' columns (hot_pos >= 0, in any order, many in one tile) are never packed: the TwELL is
    the one of the other columns, NaN and overflow rows included."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 300, generator=g)
    h[1::5] += 5.0  # dense rows: overflow
    h[2, 7] = h[3, 100] = float("nan")
    index = torch.tensor([0, 7, 64, 65, 200, 299] + list(range(10, 50)))
    pos = torch.full((300,), -1, dtype=torch.int32)
    pos[index] = torch.randperm(len(index), generator=g, dtype=torch.int32)
    words, counts = pack_dense(h.to(DEVICE), 0.0, 64, 8, hot_pos=pos.to(DEVICE))
    cold = h.clone()
    cold[:, index] = -1.0
    spec = twell.pack(cold, tile_n=64, slots=8, threshold=0.0)
    assert torch.equal(counts.cpu(), spec.counts) and torch.equal(_counted(words, counts), spec.words)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("threshold", [0.0, 0.3, -0.3, 1e-3, 60000.0, -2.5])
def test_gate_threshold_decides_as_the_rounded_value(threshold, dtype):
    """The fused gate's fp32 bound keeps an fp32 value exactly when the value rounded to the output dtype
    passes the threshold as torch decides it: random values around it, the bound and its fp32
    neighbours (the ties), the dtype's largest value, infinities and NaN."""
    bound = gate.gate_threshold(threshold, dtype)
    g = torch.Generator().manual_seed(1)
    near = threshold + torch.randn(100_000, generator=g) * max(abs(threshold), 1e-3) * 0.01
    ties = torch.tensor([bound]).nextafter(torch.tensor([-math.inf])), torch.tensor([bound])
    ties += (ties[1].nextafter(torch.tensor([math.inf])),)
    edge = torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).max, math.inf, -math.inf, math.nan, 0.0, -0.0])
    a = torch.cat([near, *ties, edge]).float()
    assert torch.equal(~(a <= bound), ~(a.to(dtype) <= threshold))


def test_dispatch_reads_strided_biases(sparse_paths):
    case = make_ffn(100, 40, 96, MIXED, torch.float32, DEVICE, seed=7, biases=True)
    strided = {k: torch.stack([b, b], 1)[:, 0] for k, b in case.items() if k.endswith("bias")}
    assert not any(b.is_contiguous() for b in strided.values())
    for m in (1, 100):  # decode and prefill
        y = dispatch.gated_ffn_cuda(
            case["x"][:m],
            case["gate_weight"],
            case["up_weight"],
            case["down_weight"],
            strided["gate_bias"],
            strided["up_bias"],
            strided["down_bias"],
            0.0,
            False,
            sparse_paths,
        )
        assert rel_err(y, gated_ref(case)[:m]) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,k,n", [(1, 16, 64), (33, 40, 300), (257, 24, 96)], ids=["m1", "m33", "m257"])
def test_gate_twell_packs_the_gate(m, k, n, dtype, bias):
    """The persistent gate kernel (several output tiles per program, partial last tiles in M and N)."""
    case = make_ffn(m, k, n, [0.0, 0.05, 0.1, 0.01], dtype, DEVICE, seed=m + n, biases=bias)
    threshold = 0.05
    config = (16, 16, 4, 1)
    words, counts = gate_twell(case["x"], case["gate_weight"], case["gate_bias"], threshold, 64, 16, config=config)
    got = twell.unpack(_twell(words, counts, (m, n), 64, dtype)).double()
    c = {k_: (t.double() if t is not None else None) for k_, t in case.items()}
    ref = torch.nn.functional.linear(c["x"], c["gate_weight"], c["gate_bias"])
    ref = torch.where(ref > threshold, ref, 0.0)
    assert not (counts > 16).any(), "case was built not to overflow"
    assert rel_err(got, ref) <= TOL[dtype]
    assert torch.equal(counts.sum(1).cpu(), (got != 0).sum(1).cpu())
    gate_pre = torch.nn.functional.linear(case["x"], case["gate_weight"], case["gate_bias"])
    spec = twell.pack(gate_pre.cpu(), tile_n=64, slots=16, threshold=threshold)
    if dtype == torch.float32:  # fp32 accumulation order differs from torch's in the last bit
        assert torch.equal(counts.cpu(), spec.counts)
        assert torch.equal(_counted(words, counts).bitwise_and(0xFFFF), spec.words.bitwise_and(0xFFFF))
    padding = torch.arange(16, device=counts.device) >= counts.unsqueeze(-1)
    assert (words[padding] == -1).all(), "slots past the count are left as they were (no pad stores)"


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gate_twell_keeps_no_column_past_n_below_zero(bias):
    """A negative threshold keeps most entries: the columns past N (TMA fills W_g's missing rows with
    zeros) must still count as absent, through the bias loaded as -inf there or the column mask."""
    case = make_ffn(45, 24, 40, [1.0], torch.float32, DEVICE, seed=11, biases=bias)
    words, counts = gate_twell(case["x"], case["gate_weight"], case["gate_bias"], -0.5, 32, 32, config=(16, 16, 4, 1))
    pre = torch.nn.functional.linear(case["x"], case["gate_weight"], case["gate_bias"])
    spec = twell.pack(pre.cpu(), tile_n=32, slots=32, threshold=-0.5)
    assert torch.equal(counts.cpu(), spec.counts)
    assert torch.equal(_counted(words, counts).bitwise_and(0xFFFF), spec.words.bitwise_and(0xFFFF))


def test_gate_configs_that_overflow_shared_memory_are_pruned(monkeypatch):
    """Configs past the shared-memory limit never launch: the operand stages plus the epilogue's fp32
    slice of the accumulator (fp32 operands, and bf16 at tile 256 with 64-wide K steps, raised
    OutOfResources on the H200)."""

    monkeypatch.setattr(gate, "interpreting", lambda: False)
    configs = [triton.Config({"BLOCK_M": 128, "BLOCK_K": bk}, num_stages=4) for bk in (32, 64, 128)]

    def kept(dtype, tile_n):
        pruned = gate._prune(configs, {"x_ptr": torch.empty(1, dtype=dtype)}, TILE_N=tile_n)
        return [c.kwargs["BLOCK_K"] for c in pruned]

    # 4 stages x (128 + 128) x 64 x 2 B = 128 KiB, + 128 x 128 x 4 B = 192 KiB <= 227
    assert kept(torch.bfloat16, 128) == [32, 64]
    assert kept(torch.float32, 128) == [32]
    assert kept(torch.bfloat16, 256) == [32]  # 64-wide: 192 KiB of stages + 128 KiB
    assert kept(torch.float32, 256) == []


def test_gate_twell_counts_overflow_and_refuses_unaligned_rows():
    case = make_ffn(20, 16, 64, [1.0], torch.float32, DEVICE, seed=2)
    words, counts = gate_twell(case["x"], case["gate_weight"], None, 0.0, 32, 4)
    ref = torch.nn.functional.linear(case["x"], case["gate_weight"]).view(20, 2, 32)
    assert torch.equal(counts, (ref > 0).sum(-1, dtype=torch.int32)), "true counts, past the slots"
    x = torch.randn(4, 33, device=DEVICE, dtype=torch.float16)  # 66-byte rows: no TMA
    w = torch.randn(64, 33, device=DEVICE, dtype=torch.float16)
    assert not gate.fused_gate_supported(x, w, 64)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gate_twell(x, w, None, 0.0, 64, 16)


GATE_SM90_COMPILE = """
import subprocess
from pathlib import Path
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from twell.kernels import gate

def arg_type(name):
    if not name.endswith("_ptr"):
        return "fp32" if name == "threshold" else "i32"
    return {"words_ptr": "*i32", "cnt_ptr": "*i32", "pos_ptr": "*i32"}.get(name, "*bf16")

def stack(kernel, consts, options):
    signature = {n: "constexpr" if n in consts else arg_type(n) for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if signature[n] != "constexpr" and (n.endswith("_ptr") or n.startswith("stride") or n in ("K", "N"))}
    out = compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    Path("k.cubin").write_bytes(out.asm["cubin"])
    usage = subprocess.run([str(cuobjdump), "-res-usage", "k.cubin"], capture_output=True, text=True).stdout
    return int(usage.split("STACK:")[1].split()[0]), usage

cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
pack = dict(SQUARE=False, TILE_N=128, SLOTS=16, stride_hn=1)
for (bm, warps, stages), hot in [(c, h) for c in gate.PACK_CONFIGS for h in (False, True)]:
    consts = dict(pack, BLOCK_M=bm, HAS_HOT=hot)
    spilled, usage = stack(gate._pack_dense_kernel.fn, consts, dict(num_warps=warps, num_stages=stages))
    assert spilled == 0 and "LOCAL:0 " in usage, (consts, usage)
fused = dict(HAS_BIAS=True, HAS_HOT=False, SQUARE=False, EVEN_N=True, DOT_PRECISION="tf32", VALUE=tl.bfloat16,
             TILE_N=128, SLOTS=16, PROGRAMS=132, GROUP_M=8)
bm, bk, warps, stages = gate.GATE_CONFIGS[0]
spilled, usage = stack(gate._gate_twell_kernel.fn, dict(fused, BLOCK_M=bm, BLOCK_K=bk),
                       dict(num_warps=warps, num_stages=stages))
# the probe kernel spills 448 bytes; the keep test on the rounded value with a run-time threshold 824+
assert spilled <= 512, usage
"""


@pytest.mark.slow  # a build for sm_90: `make test-all` (docs/testing.md)
def test_pack_and_gate_kernels_compile_for_hopper(tmp_path):
    """Triton's compiler and ptxas build the pack pass (every config, with and without hot columns left
    out) for sm_90 without register spills, and the fused gate's first config (bf16, bias) with no more
    spills than the lean probe kernel's (the spill that made the kernel before its rebuild slow)."""
    compile_for_hopper(GATE_SM90_COMPILE, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,m", [(2048, 5632, 16384), (4096, 14336, 4099)], ids=["2048x5632", "4096x14336-m4099"])
def test_gate_and_pack_routes_agree_at_real_shapes(k, n, m):
    """bf16 at real shapes, ~0.5% density plus dense rows (overflow), a partial last row block, NaN in
    the gate: the pack gives the same arrays bit for bit at every config;
    the fused gate (each config) agrees with cuBLAS + pack wherever its own fp32 sums decide alike (its
    counts on >= 99.9% of (row, tile) pairs, and the words inside every count that agrees)."""
    g = torch.Generator(device="cuda").manual_seed(k + m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    b = torch.full((n,), -2.6, device="cuda", dtype=torch.bfloat16)  # ~0.5% of a unit-variance gate
    x[7::97] *= 8.0  # denser rows: some tiles overflow their slots
    pre = torch.nn.functional.linear(x, w, b)
    pre[3, 100] = float("nan")
    ref_words, ref_counts = pack_dense(pre, 0.0, 128, 16, config=gate.PACK_CONFIGS[0])
    assert (ref_counts > 16).any() and 0.002 < ref_counts.sum().item() / (m * n) < 0.02
    for config in gate.PACK_CONFIGS[1:]:
        words, counts = pack_dense(pre, 0.0, 128, 16, config=config)
        assert torch.equal(counts, ref_counts), config
        assert torch.equal(_counted(words, counts), _counted(ref_words, ref_counts)), config
    cublas_words, cublas_counts = pack_dense(torch.nn.functional.linear(x, w, b), 0.0, 128, 16)
    for config in gate.GATE_CONFIGS:
        words, counts = gate_twell(x, w, b, 0.0, 128, 16, config=config)
        same = counts == cublas_counts
        assert same.float().mean() >= 0.999, config
        agree = _counted(words, counts)[same.cpu()] == _counted(cublas_words, cublas_counts)[same.cpu()]
        assert agree.float().mean() >= 0.999, config


UPDOWN_CASES = {
    # m, k, n, scratch width, rows heaviest first, parts of a heavy row, heavy rows split (the rest whole)
    "m1": (1, 16, 64, 256, True, 8, 1),
    "m40": (40, 72, 200, 256, True, 8, 40),
    "m40-in-order": (40, 72, 200, 256, False, 3, 40),
    "m40-narrow": (40, 72, 200, 8, True, 4, 40),
    "m40-narrow-few-split": (40, 72, 200, 8, True, 2, 3),
    "m24-k33": (24, 33, 130, 256, True, 5, 2),
}


def _alternating(i, variant, j, cover):
    """Whether `variant` is one of `cover` and the j-th dtype is its dtype in the i-th case: the cover's
    variants alternate between fp32 and fp16 within a case and between cases."""
    return variant in cover and (i + cover.index(variant)) % 2 == j


# The default run keeps every variant in every dtype at m1, and in each other case the four variants that
# between them take every branch of the kernels (fatrelu: up, biases, a threshold; drelu: dReLU without
# biases; plain: no up; relu2: squared values), each in one dtype, two fp32 and two fp16 a case, alternating
# between cases. Slow: gated and gated-bias there (their branches are fatrelu's and drelu's), the other dtype.
UPDOWN_VARIANTS = ["gated", "gated-bias", "drelu", "plain", "relu2", "fatrelu"]
UPDOWN_COVER = ["fatrelu", "drelu", "plain", "relu2"]
UPDOWN_PARAMS = [
    slow_unless(c == "m1" or _alternating(i, v, j, UPDOWN_COVER), c, v, d, id=f"{c}-{v}-{d}")
    for i, c in enumerate(UPDOWN_CASES)
    for v in UPDOWN_VARIANTS
    for j, d in enumerate(DTYPES)
]


@pytest.mark.parametrize("case_id,variant,dtype", UPDOWN_PARAMS)
def test_up_down_matches_reference(case_id, dtype, variant, monkeypatch):
    """Rows with empty, sparse and overflowing tiles (recomputed by the heavy-row kernel), ragged last
    tile, awkward K, output poisoned; a narrow scratch sends rows with many entries to the heavy-row
    kernel too, split in parts (more parts than some rows have entries or tiles) or, past the
    partials' capacity, whole."""
    m, k, n, width, order, splits, split_rows = UPDOWN_CASES[case_id]
    gated = variant not in ("plain", "relu2")
    biases = variant in ("gated-bias", "fatrelu")
    case = make_ffn(m, k, n, MIXED, dtype, DEVICE, seed=k * n, biases=biases, gated=gated)
    tile_n, slots = 32, 8
    threshold = 0.02 if variant == "fatrelu" else 0.0
    gate_w, gate_b = (case["gate_weight"], case["gate_bias"]) if gated else (case["up_weight"], case["up_bias"])
    pre = torch.nn.functional.linear(case["x"], gate_w, gate_b)
    words, counts = pack_dense(pre, threshold, tile_n, slots, square=variant == "relu2")
    if m > 1:
        assert (counts > slots).any() and (counts <= slots).all(1).any(), "rows with and without overflow"
    monkeypatch.setattr(updown, "MAX_WIDTH", width)
    monkeypatch.setattr(updown, "SPLITS", splits)
    monkeypatch.setattr(updown, "PARTIAL_BYTES", split_rows * splits * k * 4)
    out = torch.full_like(case["x"], float("nan"))
    twell_up_down(
        case["x"],
        words,
        counts,
        gate_w,
        gate_b,
        case["up_weight"] if gated else None,
        case["up_bias"] if gated else None,
        case["down_weight"].t(),
        case["down_bias"],
        tile_n=tile_n,
        threshold=threshold,
        drelu=variant == "drelu",
        square=variant == "relu2",
        out=out,
        order=order,
    )
    if gated:
        ref = gated_ref(case, threshold, drelu=variant == "drelu")
    else:
        ref = plain_ref(case, squared=variant == "relu2")
    assert rel_err(out, ref) <= TOL[dtype] * (4 if variant == "relu2" else 1)


def test_up_down_heavy_rows_split_or_whole_give_the_same_bits(monkeypatch):
    """Which heavy rows get split depends on the order the main kernel lists them in (atomics on a
    GPU): a row taken whole must come out bit for bit as its split partials would."""
    case = make_ffn(40, 72, 200, MIXED, torch.float32, DEVICE, seed=3, biases=True)
    pre = torch.nn.functional.linear(case["x"], case["gate_weight"], case["gate_bias"])
    words, counts = pack_dense(pre, 0.0, 32, 8)
    monkeypatch.setattr(updown, "MAX_WIDTH", 8)
    monkeypatch.setattr(updown, "SPLITS", 4)
    runs = []
    for split_rows in (40, 1):
        monkeypatch.setattr(updown, "PARTIAL_BYTES", split_rows * 4 * 72 * 4)
        runs.append(
            twell_up_down(
                case["x"],
                words,
                counts,
                case["gate_weight"],
                case["gate_bias"],
                case["up_weight"],
                case["up_bias"],
                case["down_weight"].t(),
                case["down_bias"],
                tile_n=32,
                threshold=0.0,
            )  # fmt: skip
        )
    assert (counts.sum(1) > 8).sum() > 10, "most rows heavy"
    assert torch.equal(runs[0], runs[1])


def _recorded_passes(monkeypatch) -> tuple[list, list, set, list]:
    """(passes, heavy, keys, orders): each main-kernel launch's (tile_lo, tile_hi, FIRST, LAST), each heavy-row
    launch's list of rows (sorted ids; a row listed twice shows twice), the main launches' config keys, and
    each main launch's row order."""
    passes, heavy, keys, orders = [], [], set(), []
    launch, heavy_kernel = updown._up_down_launch, updown._heavy_kernel
    names = updown._twell_up_down_kernel.arg_names

    def main(key, grid, *args, **kwargs):
        bound = dict(zip(names, args, strict=False))
        passes.append((bound["tile_lo"], bound["tile_hi"], kwargs["FIRST"], kwargs["LAST"]))
        keys.add(key)
        orders.append(bound["order_ptr"].clone())
        launch(key, grid, *args, **kwargs)

    class Heavy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                listed = args[3]  # heavy[0]: how many, heavy[1:]: the row ids
                heavy.append(sorted(listed[1 : 1 + int(listed[0])].tolist()))
                heavy_kernel[grid](*args, **kwargs)

            return run

    monkeypatch.setattr(updown, "_up_down_launch", main)
    monkeypatch.setattr(updown, "_heavy_kernel", Heavy())
    return passes, heavy, keys, orders


# sparse and empty rows, one with overflowing tiles (row 5), two past a row width of 12 entries (rows 12, 30;
# row 30 also past it in one of two passes)
GROUPS_DENSITIES = [
    0.12 if i == 5 else 0.06 if i == 12 else 0.07 if i == 30 else [0.03, 0.01, 0.02, 0.0][i % 4] for i in range(37)
]


# Slow: the gated variant in fp16 and the plain one in fp32 (the same branches in the other dtype)
@pytest.mark.parametrize(
    "variant,dtype",
    [
        pytest.param("fatrelu-bias", torch.float32, id="fatrelu-bias-fp32"),
        pytest.param("plain", torch.float16, id="plain-fp16"),
        pytest.param("fatrelu-bias", torch.float16, id="fatrelu-bias-fp16", marks=pytest.mark.slow),
        pytest.param("plain", torch.float32, id="plain-fp32", marks=pytest.mark.slow),
    ],
)
def test_up_down_neuron_group_passes_against_one_pass(variant, dtype, poisoned_empty, monkeypatch):
    """groups = 2, 3 (uneven ranges of the 5 tiles; the last tile ragged) and 64 (one pass a tile)
    against one pass, with biases, awkward K and M: rows with entries in some groups only, empty rows,
    heavy rows listed once, by the first pass, and computed once after the passes. Heavy in the passes:
    an overflowing tile, or more than the row width in some pass; rows past the width whose passes each
    fit are walked in the passes (within tolerance of float64), every other row gets one pass's bits. The
    carry, the scratch and y start poisoned. The passes launch at the one pass's config key (other warps
    reduce u in another order: other bits on the GPU), each with its rows ordered by their entries in it."""
    m, k, n, tile_n, slots, width = 37, 40, 300, 64, 8, 12
    gated = variant != "plain"
    case = make_ffn(m, k, n, GROUPS_DENSITIES, dtype, DEVICE, seed=5, biases=True, gated=gated)
    threshold = 0.02 if gated else 0.0
    gate_w, gate_b = (case["gate_weight"], case["gate_bias"]) if gated else (case["up_weight"], case["up_bias"])
    words, counts = pack_dense(torch.nn.functional.linear(case["x"], gate_w, gate_b), threshold, tile_n, slots)
    monkeypatch.setattr(updown, "MAX_WIDTH", width)
    overflow = (counts > slots).any(1)

    def heavy_in(groups):  # the rows the passes leave to the heavy kernel
        bounds = [5 * g // groups for g in range(groups + 1)]
        widest = torch.stack([counts[:, lo:hi].sum(1) for lo, hi in zip(bounds, bounds[1:], strict=False)], 1)
        return overflow | (widest > width).any(1)

    heavy_rows = {groups: heavy_in(groups) for groups in (1, 2, 3, 64)}
    in_groups = torch.stack([counts[:, lo:hi].sum(1) for lo, hi in ((0, 1), (1, 3), (3, 5))], 1)
    light = ~heavy_rows[1]
    assert (heavy_rows[1] & ~overflow).any() and overflow.any(), "heavy rows of both kinds"
    assert (heavy_rows[1] & ~heavy_rows[3]).any() and (heavy_rows[1] & heavy_rows[2] & ~overflow).any(), (
        "rows past the width walked in the passes, and one still past it in a pass"
    )
    assert (light & (in_groups == 0).any(1) & (in_groups > 0).any(1)).any(), "light rows missing from a group"
    assert (light & (counts.sum(1) == 0)).any()
    passes, heavy, keys, orders = _recorded_passes(monkeypatch)
    up = (case["up_weight"], case["up_bias"]) if gated else (None, None)
    runs = {}
    for groups in (1, 2, 3, 64):
        out = torch.full_like(case["x"], float("nan"))
        twell_up_down(
            case["x"], words, counts, gate_w, gate_b, *up, case["down_weight"].t(), case["down_bias"], tile_n=tile_n,
            threshold=threshold, out=out, groups=groups,
        )  # fmt: skip
        runs[groups] = out
    ranges = [(t, t + 1, t == 0, t == 4) for t in range(5)]
    assert passes == [
        (0, 5, True, True), (0, 2, True, False), (2, 5, False, True),
        (0, 1, True, False), (1, 3, False, False), (3, 5, False, True), *ranges,
    ]  # fmt: skip
    assert heavy == [torch.nonzero(heavy_rows[g]).flatten().tolist() for g in (1, 2, 3, 64)]
    assert len(keys) == 1, keys
    for (lo, hi, _, _), rows in zip(passes, orders, strict=True):  # each pass: its rows heaviest in the pass first
        assert sorted(rows.tolist()) == list(range(m))
        in_pass = counts[:, lo:hi].sum(1).clamp(max=255)[rows]
        assert (in_pass[:-1] >= in_pass[1:]).all(), (lo, hi)
    ref = gated_ref(case, threshold) if gated else plain_ref(case, threshold)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for groups in (1, 2, 3, 64):
        assert rel_err(runs[groups], ref) <= TOL[dtype], f"{groups} groups"
        same = heavy_rows[groups] == heavy_rows[1]  # walked alike: one pass's bits
        assert torch.equal(runs[groups][same].view(bits), runs[1][same].view(bits)), f"{groups} groups"


def test_up_down_groups_are_checked():
    """groups: a positive int (not a bool), and one pass where the training record is stored."""
    case = make_ffn(4, 16, 64, [0.1], torch.float32, DEVICE)
    words, counts = pack_dense(case["x"] @ case["gate_weight"].T, 0.0, 32, 8)
    args = (case["x"], words, counts, case["gate_weight"], None, case["up_weight"], None, case["down_weight"].t())
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match=f"groups must be a positive int, got {bad!r}"):
            twell_up_down(*args, None, tile_n=32, threshold=0.0, groups=bad)
    with pytest.raises(ValueError, match="up_out .* one pass only, got groups=2"):
        updown.launch_up_down(*args, None, tile_n=32, threshold=0.0, groups=2, up_out=torch.empty(4, 2))
    assert LayerConfig().neuron_groups == policy.NEURON_GROUPS == 1  # off until measured
    for bad in (0, -1, False, 1.5, None):
        with pytest.raises(ValueError, match=f"neuron_groups must be a positive int, got {bad!r}"):
            LayerConfig(neuron_groups=bad)


def test_up_down_checks_its_arrays():
    case = make_ffn(4, 16, 64, [0.1], torch.float32, DEVICE)
    words, counts = pack_dense(case["x"] @ case["gate_weight"].T, 0.0, 32, 8)
    args = (case["gate_weight"], None, case["up_weight"], None, case["down_weight"].t(), None)
    with pytest.raises(ValueError, match="counts"):
        twell_up_down(case["x"], words, counts[:, :1], *args, tile_n=32, threshold=0.0)
    with pytest.raises(ValueError, match="do not cover"):
        twell_up_down(case["x"], words, counts, *args, tile_n=16, threshold=0.0)
    with pytest.raises(ValueError, match=r"down_weight_t must be \[64, 16\]"):
        bad = (*args[:4], case["down_weight"], None)  # [K, N], not its transpose
        twell_up_down(case["x"], words, counts, *bad, tile_n=32, threshold=0.0)
    with pytest.raises(ValueError, match="out must be"):
        twell_up_down(case["x"], words, counts, *args, tile_n=32, threshold=0.0, out=case["x"][:2])


def _bad_args(case, change):
    """decode_ffn's / twell_up_down's common arguments (gated, with biases), one of them changed."""
    args = {
        "x": case["x"],
        "gate_weight": case["gate_weight"],
        "gate_bias": case["gate_bias"],
        "up_weight": case["up_weight"],
        "up_bias": case["up_bias"],
        "down_weight_t": case["down_weight"].t(),
        "down_bias": case["down_bias"],
        "threshold": 0.0,
    }
    return {**args, **change(args)}


# (id, change of the arguments, message): each check the launchers make before any launch
COMMON_BAD_INPUTS = [
    ("x-3d", lambda a: {"x": a["x"][None]}, r"x must be a 2-dim tensor \[M, K\], got \[1, 4, 16\]"),
    ("x-int", lambda a: {"x": a["x"].int()}, "x must be float32, float16 or bfloat16, got torch.int32"),
    ("x-width", lambda a: {"x": a["x"][:, :8]}, r"gate_weight must be \[64, 8\] torch.float32"),
    ("up-dtype", lambda a: {"up_weight": a["up_weight"].half()}, r"up_weight must be \[64, 16\] torch.float32"),
    ("gate-bias-size", lambda a: {"gate_bias": a["gate_bias"][:8]}, r"gate_bias must be \[64\]"),
    ("down-bias-size", lambda a: {"down_bias": a["gate_bias"]}, r"down_bias must be \[16\]"),
    ("bias-dtype", lambda a: {"down_bias": a["down_bias"].double()}, r"down_bias must be \[16\] torch.float32"),
    ("bias-device", lambda a: {"up_bias": a["up_bias"].to("meta")}, r"up_bias must be \[64\] torch.float32 on"),
    ("bias-stride", lambda a: {"gate_bias": a["gate_bias"].repeat(2)[::2]}, "gate_bias must have unit stride"),
    ("up-bias-alone", lambda a: {"up_weight": None}, "up_bias needs up_weight"),
    ("threshold", lambda a: {"threshold": float("nan")}, "threshold must be a finite float, got nan"),
]


@pytest.mark.parametrize("change,match", [c[1:] for c in COMMON_BAD_INPUTS], ids=[c[0] for c in COMMON_BAD_INPUTS])
def test_decode_checks_its_inputs(change, match):
    case = make_ffn(4, 16, 64, [0.1], torch.float32, DEVICE, biases=True)
    a = _bad_args(case, change)
    with pytest.raises(ValueError, match=match):
        decode_ffn(
            a["x"], a["gate_weight"], a["gate_bias"], a["up_weight"], a["up_bias"], a["down_weight_t"],
            a["down_bias"], a["threshold"],
        )  # fmt: skip


@pytest.mark.parametrize("change,match", [c[1:] for c in COMMON_BAD_INPUTS], ids=[c[0] for c in COMMON_BAD_INPUTS])
def test_up_down_checks_its_inputs(change, match):
    case = make_ffn(4, 16, 64, [0.1], torch.float32, DEVICE, biases=True)
    words, counts = pack_dense(case["x"] @ case["gate_weight"].T, 0.0, 32, 8)
    a = _bad_args(case, change)
    with pytest.raises(ValueError, match=match):
        twell_up_down(
            a["x"], words, counts, a["gate_weight"], a["gate_bias"], a["up_weight"], a["up_bias"],
            a["down_weight_t"], a["down_bias"], tile_n=32, threshold=a["threshold"],
        )  # fmt: skip


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda w, c: (w.int(), c), r"words must be \[4, 2, 8\] torch.int64"),
        (lambda w, c: (w, c.long()), r"counts must be \[4, 2\] torch.int32"),
        (lambda w, c: (w, c.t().contiguous().t()), "counts must be contiguous"),
        (lambda w, c: (w.transpose(0, 1).contiguous().transpose(0, 1), c), "words must be contiguous"),
        (lambda w, c: (w[..., :6], c), "power-of-two slots, got 6"),
    ],
    ids=["words-dtype", "counts-dtype", "counts-strided", "words-strided", "slots"],
)
def test_up_down_checks_its_twell_arrays(change, match):
    """The TwELL arrays are indexed as dense [M, T, S] arrays of fixed types: anything else would be
    read past its end or as the wrong type."""
    case = make_ffn(4, 16, 64, [0.1], torch.float32, DEVICE)
    arrays = change(*pack_dense(case["x"] @ case["gate_weight"].T, 0.0, 32, 8))
    args = (case["gate_weight"], None, case["up_weight"], None, case["down_weight"].t(), None)
    with pytest.raises(ValueError, match=match):
        twell_up_down(case["x"], *arrays, *args, tile_n=32, threshold=0.0)
    with pytest.raises(ValueError, match="out must be .* on cpu, got .* on meta"):
        out = torch.empty_like(case["x"], device="meta")
        twell_up_down(
            case["x"],
            *pack_dense(case["x"] @ case["gate_weight"].T, 0.0, 32, 8),
            *args,
            tile_n=32,
            threshold=0.0,
            out=out,
        )


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x, w, b: gate_twell(x.int(), w, b, 0.0, 32, 8), "x must be float32, float16 or bfloat16"),
        (lambda x, w, b: gate_twell(x, w.double(), b, 0.0, 32, 8), r"weight must be \[64, 16\] torch.float32"),
        (lambda x, w, b: gate_twell(x, w, b[:32], 0.0, 32, 8), r"bias must be \[64\]"),
        (lambda x, w, b: gate_twell(x, w, b, float("inf"), 32, 8), "threshold must be a finite float"),
        (lambda x, w, b: pack_dense((x @ w.T).int(), 0.0, 32, 8), "h must be float32, float16 or bfloat16"),
        (lambda x, w, b: pack_dense(x @ w.T, float("nan"), 32, 8), "threshold must be a finite float"),
        (lambda x, w, b: pack_dense(x @ w.T, 0.0, 32, 8, hot_pos=w[:, 0].long()), r"hot_pos must be \[64\] torch.int"),
        (lambda x, w, b: gate_twell(x, w, b, 0.0, 32, 8, hot_pos=w[:32, 0].int()), r"hot_pos must be \[64\]"),
    ],
    ids=[
        "gate-x-dtype",
        "gate-weight-dtype",
        "gate-bias-size",
        "gate-threshold",
        "pack-dtype",
        "pack-threshold",
        "pack-hot-pos-dtype",
        "gate-hot-pos-size",
    ],  # fmt: skip
)
def test_gate_launchers_check_their_inputs(call, match):
    case = make_ffn(4, 16, 64, [0.1], torch.float32, DEVICE, biases=True)
    with pytest.raises(ValueError, match=match):
        call(case["x"], case["gate_weight"], case["gate_bias"])


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty / empty_like return NaN (floats) or -1 (ints): any element a kernel reads before
    writing it, or fails to write, shows in the result."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


DECODE_CASES = {
    # m, k, n, densities, gate_up_config, down_config, down_rows (None: the launcher's choice)
    "m1-list": (1, 16, 64, MIXED[1:2], (16, 16, 4, 1, False), (16, 2, 16, 4, 4), False),
    "m1-list-empty": (1, 40, 100, [0.0], (16, 32, 4, 1, False), (16, 2, 16, 4, 4), False),
    "m1-list-super-blocks": (1, 24, 1100, [0.03], (16, 16, 4, 1, False), (16, 3, 16, 8, 4), False),
    "m1-list-defaults": (1, 40, 100, [1.0], (16, 16, 4, 1, True), None, False),
    "m1-rows-each": (1, 40, 100, [1.0], (16, 16, 4, 1, True), None, None),
    "m1-rows-empty": (1, 40, 100, [0.0], (16, 32, 4, 1, False), None, None),
    "m1-rows-blocks": (1, 130, 1100, [0.02], (16, 64, 4, 1, False), None, True),
    "m16-splits": (16, 40, 200, MIXED, (16, 32, 4, 1, False), (32, 3, 16, 8, 4), None),
    "m16-groups": (16, 40, 200, MIXED, (16, 32, 4, 1, False), (32, 2, 16, 0, 4), None),
    "m70-blocks": (70, 130, 100, MIXED, (32, 64, 4, 1, True), (64, 1, 16, 16, 4), None),
    "m3-dense": (3, 24, 48, [1.0], (16, 16, 4, 1, False), None, None),
    "m2-super-blocks": (2, 24, 1100, [0.0, 0.01, 0.3, 0.0, 0.02], (16, 16, 4, 1, False), (16, 3, 16, 8, 4), None),
    "m40-defaults": (40, 24, 300, MIXED, None, None, None),
    "m300-defaults": (300, 24, 100, MIXED, None, None, None),
}


# The default run keeps every variant in every dtype in m1-list and m3-dense (fast), and in each other case
# the four variants that between them take every branch of the kernels (drelu: up, biases, dReLU; nobias:
# up without biases or dReLU; plain: no up; relu2: squared), each in one dtype, two fp32 and two fp16 a
# case, alternating between cases. Slow: gated there (its branches are drelu's and nobias's), the other dtype.
DECODE_VARIANTS = ["gated", "drelu", "plain", "relu2", "nobias"]
DECODE_COVER = ["drelu", "nobias", "plain", "relu2"]
DECODE_PARAMS = [
    slow_unless(c in ("m1-list", "m3-dense") or _alternating(i, v, j, DECODE_COVER), c, v, d, id=f"{c}-{v}-{d}")
    for i, c in enumerate(DECODE_CASES)
    for v in DECODE_VARIANTS
    for j, d in enumerate(DTYPES)
]


@pytest.mark.parametrize("case_id,variant,dtype", DECODE_PARAMS)
def test_decode_matches_reference(case_id, dtype, variant, poisoned_empty):
    """Several splits by entries and by neuron-block groups (partials summed by the last program),
    several super-blocks and token blocks, one token by the list and by block rows, empty and full
    active lists, awkward K and N; every output and scratch element poisoned before the kernels run."""
    m, k, n, densities, gate_up_config, down_config, down_rows = DECODE_CASES[case_id]
    gated = variant in ("gated", "drelu", "nobias")
    case = make_ffn(m, k, n, densities, dtype, DEVICE, seed=m * k, biases=variant != "nobias", gated=gated)
    y = decode_ffn(
        *decode_args(case, gated),
        drelu=variant == "drelu",
        square=variant == "relu2",
        gate_up_config=gate_up_config,
        down_config=down_config,
        down_rows=down_rows,
    )
    ref = gated_ref(case, drelu=variant == "drelu") if gated else plain_ref(case, squared=variant == "relu2")
    assert y.dtype == dtype and y.shape == (m, k)
    assert rel_err(y, ref) <= TOL[dtype] * (4 if variant == "relu2" else 1)


def test_decode_is_deterministic():
    """Partials of several splits are summed in a fixed order: the same bits on every call."""
    case = make_ffn(16, 40, 200, MIXED, torch.float32, DEVICE, seed=5, biases=True)
    args = (case["x"], case["gate_weight"], case["gate_bias"], case["up_weight"], case["up_bias"])
    runs = [
        decode_ffn(*args, case["down_weight"].t(), case["down_bias"], 0.0, down_config=(32, 4, 16, 8, 4)) for _ in "ab"
    ]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize(
    "m,n,gate_up_config,pipeline,variant,dtype",
    [
        # 13 blocks: the last program's 1 of 3, in each of two token blocks
        (70, 200, (16, 32, 4, 1, False), 3, "drelu", torch.float32),
        (16, 200, (16, 32, 4, 1, False), 2, "plain", torch.float16),  # no up: the gates alone
        (70, 100, (32, 64, 4, 1, True), 2, "nobias", torch.float32),  # two token blocks, a ragged one
        pytest.param(16, 200, (16, 32, 4, 1, False), 4, "relu2", torch.float16, marks=pytest.mark.slow),
    ],
)
def test_decode_pipeline_gives_one_block_a_programs_bits(
    m, n, gate_up_config, pipeline, variant, dtype, poisoned_empty
):
    """Kernel 1 with several neuron blocks a program, each block's up rows read with the next block's gate:
    the bits of one block a program (the same products, step for step), with empty and full blocks, a
    ragged last program, every output and scratch element poisoned."""
    gated = variant in ("drelu", "nobias")
    densities = [0.0, 0.02, 0.3, 0.0, 0.05, 1.0]
    case = make_ffn(m, 40, n, densities, dtype, DEVICE, seed=m + n, biases=variant != "nobias", gated=gated)
    kwargs = dict(drelu=variant == "drelu", square=variant == "relu2", gate_up_config=gate_up_config)
    runs = [decode_ffn(*decode_args(case, gated), **kwargs, pipeline=p) for p in (1, pipeline)]
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(runs[1].view(bits), runs[0].view(bits))
    ref = gated_ref(case, drelu=variant == "drelu") if gated else plain_ref(case, squared=variant == "relu2")
    assert rel_err(runs[1], ref) <= TOL[dtype] * (4 if variant == "relu2" else 1)


def test_decode_pipeline_is_checked():
    """pipeline: a positive int (not a bool), and more than one block a program only for two or more tokens."""
    case = make_ffn(2, 16, 64, [0.1], torch.float32, DEVICE)
    args = decode_args(case, True)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=f"pipeline must be a positive int, got {bad!r}"):
            decode_ffn(*args, pipeline=bad)
    one = make_ffn(1, 16, 64, [0.1], torch.float32, DEVICE)
    with pytest.raises(ValueError, match="pipeline > 1 needs two or more tokens"):
        decode_ffn(*decode_args(one, True), pipeline=2)


def test_decode_rows_of_more_blocks_than_a_step(poisoned_empty):
    """One token by block rows with more blocks than the rows kernel takes a step (1024)."""
    case = make_ffn(1, 8, 2100, [0.05], torch.float32, DEVICE, seed=3, biases=True)
    args = (case["x"], case["gate_weight"], case["gate_bias"], case["up_weight"], case["up_bias"])
    y = decode_ffn(*args, case["down_weight"].t(), case["down_bias"], 0.0, gate_up_config=(2, 8, 1, 1, False))
    assert rel_err(y, gated_ref(case)) <= TOL[torch.float32]


@pytest.mark.parametrize("down_config", [(16, 0, 16, 4, 4), (16, 2, 16, -1, 4)], ids=["no-splits", "split-min"])
def test_decode_refuses_a_down_config_it_cannot_run(down_config):
    case = make_ffn(4, 16, 64, [0.1], torch.float32, DEVICE)
    args = (case["x"], case["gate_weight"], None, case["up_weight"], None, case["down_weight"].t(), None, 0.0)
    with pytest.raises(ValueError, match="down_config needs SPLITS >= 1 and SPLIT_MIN >= 0"):
        decode_ffn(*args, down_config=down_config)


@pytest.mark.parametrize("m,n", [(5, 0), (1, 0), (0, 64)], ids=["no-neurons", "one-token-no-neurons", "no-tokens"])
def test_decode_of_an_empty_call_is_the_down_bias(m, n, poisoned_empty):
    """No neurons (every y row is the down bias) or no tokens: no launch, nothing left unwritten."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, 8, generator=g).to(DEVICE)
    w = torch.randn(n, 8, generator=g).to(DEVICE)
    bias = torch.randn(8, generator=g).to(DEVICE)
    y = decode_ffn(x, w, None, w, None, w, bias, 0.0)
    assert y.shape == (m, 8) and torch.equal(y, bias.expand(m, 8))
    assert torch.equal(decode_ffn(x, w, None, w, None, w, None, 0.0), torch.zeros(m, 8, device=DEVICE))


@pytest.mark.parametrize("m", [1, 3])
def test_decode_of_no_width_is_empty(m):
    """K = 0 (tokens and neurons, but no features): an empty y, no launch (a kernel would fail)."""
    x, w = torch.zeros(m, 0, device=DEVICE), torch.zeros(64, 0, device=DEVICE)
    assert decode_ffn(x, w, None, w, None, w, None, 0.0).shape == (m, 0)


DECODE_SM90_COMPILE = """
import subprocess
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from twell.kernels import decode

def arg_type(name):
    if not name.endswith("_ptr"):
        return "fp32" if name == "threshold" else "i32"
    return {"ids_ptr": "*i32", "cnt_ptr": "*i32", "sem_ptr": "*i32", "rows_ptr": "*fp32", "part_ptr": "*fp32"}.get(
        name, "*bf16")

def gate_up(m, k, pipe=1):  # the launcher's choice for m tokens of width k (pipe: blocks a program)
    wide = m == 1 and k > 2048
    bn, bk, warps, stages, each = decode.GATE_UP_CONFIG_WIDE if wide else decode.GATE_UP_CONFIG[min(m, 2)]
    rows = m == 1 and k <= 2048
    consts = dict(BLOCK_M=m, BLOCK_N=bn, BLOCK_K=bk, EACH=each, UP_K=min(triton.next_power_of_2(k), 4096),
                  PREFETCH_LINES=k // 64 if m == 1 and not rows else 0, DOWN_ROWS=rows, PIPE=pipe)
    return decode._decode_gate_up_kernel, consts, dict(num_warps=warps, num_stages=stages)

def down(m, n_blocks):
    bk, splits, chunk, split_min, warps = decode.DOWN_CONFIG[m]
    consts = dict(BLOCK_M=m, BLOCK_N=16 if m == 1 else 64, BLOCK_K=bk, CHUNK=chunk, SPLIT_MIN=split_min,
                  NB=triton.next_power_of_2(n_blocks) if split_min else 32, SUPER=32 if split_min else splits)
    return decode._decode_down_kernel, consts, dict(num_warps=warps)

flags = dict(HAS_UP=True, HAS_GATE_BIAS=True, HAS_UP_BIAS=True, HAS_DOWN_BIAS=True, DRELU=False, SQUARE=False,
             DOT_PRECISION="tf32", SEM_BLOCK=256, PREFETCH_LINE=64, ARRIVE=True)
cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
for kernel, consts, options in [
    gate_up(1, 2048), gate_up(1, 4096), gate_up(16, 4096), gate_up(64, 4096), gate_up(16, 4096, 2),
    down(1, 896), down(16, 224), down(64, 224),
    (decode._decode_down_rows_kernel, dict(ROWS=512, BLOCK_K=16), dict(num_warps=8)),
    (decode._decode_down_rows_kernel, dict(ROWS=1024, BLOCK_K=16), dict(num_warps=16)),
]:
    consts = {**{n: v for n, v in flags.items() if n in kernel.arg_names}, **consts}
    # unit strides are specialised to 1 by the launcher (contiguous rows), the rest divisible by 16
    unit = ("stride_xk", "stride_gk", "stride_uk", "stride_dk", "stride_yk")
    consts.update({n: 1 for n in unit if n in kernel.arg_names})
    signature = {n: "constexpr" if n in consts else arg_type(n) for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if signature[n] != "constexpr" and (n.endswith("_ptr") or n.startswith("stride") or n in ("K", "N"))}
    out = compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    Path("k.cubin").write_bytes(out.asm["cubin"])
    usage = subprocess.run([str(cuobjdump), "-res-usage", "k.cubin"], capture_output=True, text=True).stdout
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, (kernel.__name__, consts, usage)  # no spills
"""


@pytest.mark.slow  # a build for sm_90: `make test-all` (docs/testing.md)
def test_decode_kernels_compile_for_hopper_without_spills(tmp_path):
    """Triton's compiler and ptxas build the decode kernels for sm_90 (no GPU needed) with the
    launcher's configs, at one token (K = 2048 by block rows, 4096 by the list), 16 and 64 tokens (16 also
    with two blocks a kernel-1 program), with no register spills (a spill would cost the GPU what the
    interpreter cannot show)."""
    compile_for_hopper(DECODE_SM90_COMPILE, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_decode_on_the_gpu_with_and_without_the_w_down_prefetch(m):
    """bf16 at a model's width (the interpreter has no bf16 products and no PTX prefetch): kernel 1's L2
    prefetch of the active W_d rows (the list path at one token) and its pipeline of two blocks a program
    (more tokens) change no bit, and every token count
    and both one-token paths match the float64 reference."""
    case = make_ffn(m, 1024, 2816, [0.005, 0.02, 0.0, 0.3], torch.bfloat16, "cuda", seed=m, biases=True)
    args = (case["x"], case["gate_weight"], case["gate_bias"], case["up_weight"], case["up_bias"])
    args += (case["down_weight"].t().contiguous(), case["down_bias"], 0.0)
    runs = [decode_ffn(*args, prefetch=p, down_rows=False) for p in (True, False)]
    assert torch.equal(runs[0], runs[1])
    if m > 1:  # two neuron blocks a kernel-1 program: the same bits in bf16 on the tensor cores too
        assert torch.equal(decode_ffn(*args, pipeline=2), runs[0])
    assert rel_err(runs[0], gated_ref(case)) <= TOL[torch.bfloat16]
    assert rel_err(decode_ffn(*args, down_rows=True), gated_ref(case)) <= TOL[torch.bfloat16]


@pytest.fixture
def sparse_paths():
    """A LayerConfig routing calls to the kernels whatever the measured defaults: decode up to 64
    tokens, prefill above (through the fused gate; test_prefill_through_each_gate_route covers the
    other route too)."""
    dispatch.forget_layers()
    return LayerConfig(decode_max_m=64, prefill_min_m=65, fused_gate=True)


# Slow: the default layout (a route ignoring the config's layout passes there; other tests run both routes at it)
@pytest.mark.parametrize("fused", [False, True], ids=["cublas-gate", "fused-gate"])
@pytest.mark.parametrize(
    "tile_n,slots",
    [pytest.param(128, 16, id="default-layout", marks=pytest.mark.slow), pytest.param(32, 4, id="layer-layout")],
)
def test_prefill_through_each_gate_route(fused, tile_n, slots, sparse_paths, monkeypatch):
    """Each gate route packs at the layout of the layer's config, which up+down then reads."""
    config = sparse_paths.replace(fused_gate=fused, tile_n=tile_n, slots=slots)
    calls = []
    for name, at in (("launch_gate_twell", 4), ("launch_pack_dense", 2)):  # where each takes tile_n, slots
        fn = getattr(dispatch, name)
        spy = lambda *a, _f=fn, _n=name, _at=at, **k: calls.append((_n, *a[_at : _at + 2])) or _f(*a, **k)
        monkeypatch.setattr(dispatch, name, spy)
    updown = dispatch.launch_up_down
    monkeypatch.setattr(dispatch, "launch_up_down", lambda *a, **k: calls.append(k["tile_n"]) or updown(*a, **k))
    case = make_ffn(100, 40, 96, MIXED, torch.float32, DEVICE, seed=9, biases=True)
    args = [case[k] for k in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
    y = dispatch.gated_ffn_cuda(case["x"], *args, 0.0, False, config)
    # on a GPU fp32 operands fit no fused-gate config: they take cuBLAS + the pack pass
    fused = fused and gate.fused_gate_supported(case["x"], case["gate_weight"], tile_n)
    assert calls == [("launch_gate_twell" if fused else "launch_pack_dense", tile_n, slots), tile_n]
    assert rel_err(y, gated_ref(case)) <= 1e-5


def test_neuron_groups_reach_the_up_down_launch(monkeypatch):
    """A layer's neuron_groups survives the op's route arguments (library.route_config, what the CUDA
    implementation builds its LayerConfig with) and the dispatcher's prefill launches up+down in that
    many passes; the result is the dense FFN's."""
    from twell.kernels import library

    dispatch.forget_layers()
    grouped = LayerConfig(hot_rate=None, tile_n=32, slots=8).replace(route="prefill", neuron_groups=3)
    groups = []
    launch = dispatch.launch_up_down
    monkeypatch.setattr(dispatch, "launch_up_down", lambda *a, **k: groups.append(k["groups"]) or launch(*a, **k))
    case = make_ffn(37, 24, 100, [0.05], torch.float32, DEVICE, seed=3, biases=True)
    args = [case[k] for k in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
    y = dispatch.gated_ffn_cuda(case["x"], *args, 0.0, False, library.route_config(*grouped.op_args()))
    dispatch.gated_ffn_cuda(case["x"][:3], *args, 0.0, False, grouped.replace(neuron_groups=1))
    assert groups == [3, 1]
    assert rel_err(y, gated_ref(case)) <= 1e-5


# every variant and dtype at 1 and 16 tokens (decode); the prefill path (3-10 s a case in the
# interpreter) at 70 tokens for every variant in fp32 and two in the other dtypes, and past one 128-row
# block of its kernels (131 tokens) for three. Slow: relu2 at 70 tokens in fp16 (at 131 in the default
# run), and 131 tokens but for relu2 (every variant indexes the rows past the first block alike).
DISPATCH_CASES = (
    [(v, m, d) for v in ("gated", "fatrelu-bias", "drelu", "plain", "relu2") for m in (1, 16) for d in DTYPES]
    + [(v, 70, torch.float32) for v in ("gated", "fatrelu-bias", "drelu", "plain", "relu2")]
    + [(v, 70, d) for v in ("gated", "relu2") for d in DTYPES[1:]]
    + [("gated", 131, torch.float32), ("fatrelu-bias", 131, torch.float16), ("relu2", 131, DTYPES[-1])]
)
DISPATCH_SLOW = [("relu2", 70, torch.float16), ("gated", 131, torch.float32), ("fatrelu-bias", 131, torch.float16)]


@pytest.mark.parametrize(
    "variant,m,dtype",
    [slow_unless(c not in DISPATCH_SLOW, *c, id=f"{c[0]}-m{c[1]}-{str(c[2])[6:]}") for c in DISPATCH_CASES],
)
def test_dispatch_is_exact_on_every_path(m, dtype, variant, sparse_paths):
    """Decode (M <= 256) and prefill paths, with empty, dense (overflowing) and sparse rows."""
    k, n = 40, 200
    gated = variant in ("gated", "fatrelu-bias", "drelu")
    case = make_ffn(m, k, n, MIXED, dtype, DEVICE, seed=m, biases=variant == "fatrelu-bias", gated=gated)
    threshold = 0.02 if variant == "fatrelu-bias" else 0.0
    x = case["x"].reshape(1, m, k)
    dispatch.forget_layers()
    if gated:
        y = dispatch.gated_ffn_cuda(
            x,
            case["gate_weight"],
            case["up_weight"],
            case["down_weight"],
            case["gate_bias"],
            case["up_bias"],
            case["down_bias"],
            threshold,
            variant == "drelu",
            sparse_paths,
        )
        ref = gated_ref(case, threshold, variant == "drelu")
    else:
        biases = (case["up_bias"], case["down_bias"])
        y = dispatch.ffn_cuda(
            x, case["up_weight"], case["down_weight"], *biases, threshold, variant == "relu2", sparse_paths
        )
        ref = plain_ref(case, threshold, variant == "relu2")
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y.reshape(m, k), ref) <= TOL[dtype] * (4 if variant == "relu2" else 1)


HOT_CASES = [
    ("gated", torch.float32, False),
    ("fatrelu-bias", torch.float32, True),
    ("drelu", torch.float16, False),
    ("relu2", torch.float16, True),
]


@pytest.mark.parametrize(
    "variant,dtype,fused", HOT_CASES, ids=[f"{v}-{str(d)[6:]}-{'fused' if f else 'cublas'}" for v, d, f in HOT_CASES]
)
def test_hot_neurons_run_dense_and_stay_exact(variant, dtype, fused, sparse_paths, monkeypatch):
    """After a prefill call measured the layer, its frequent neurons take dense products, and the packer
    and the overflow recompute (the dense rows) leave them out: exact, no neuron counted twice."""
    config = sparse_paths.replace(fused_gate=fused, hot_rate=0.05, dense_above=1.0)  # MIXED is ~13% dense
    m, k, n = 70, 40, 200
    gated = variant in ("gated", "fatrelu-bias", "drelu")
    case = make_ffn(m, k, n, MIXED, dtype, DEVICE, seed=21, biases=variant == "fatrelu-bias", gated=gated)
    threshold = 0.02 if variant == "fatrelu-bias" else 0.0
    if gated:
        args = [case[c] for c in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
        call = lambda: dispatch.gated_ffn_cuda(case["x"], *args, threshold, variant == "drelu", config)  # noqa: E731
        ref = gated_ref(case, threshold, variant == "drelu")
    else:
        args = [case[c] for c in ("up_weight", "down_weight", "up_bias", "down_bias")]
        call = lambda: dispatch.ffn_cuda(case["x"], *args, threshold, variant == "relu2", config)  # noqa: E731
        ref = plain_ref(case, threshold, variant == "relu2")
    maps = []
    updown = dispatch.launch_up_down
    monkeypatch.setattr(dispatch, "launch_up_down", lambda *a, **kw: maps.append(kw["hot_pos"]) or updown(*a, **kw))
    first = call()  # measures which neurons fire in more than 5% of the rows
    state = dispatch.layer_state(args[0], m)
    assert maps == [None] and state.hot is None and state.hot_pending is not None
    second = call()  # reads the measurement, then uses it
    # MIXED's dense rows alone make every neuron fire in 10% of the rows: the cap, 25% of N, holds
    assert state.hot.index.tolist() == sorted(state.hot.index.tolist()) and len(state.hot.index) == 48
    assert state.hot.pos[state.hot.index].tolist() == list(range(48)) and maps[1] is state.hot.pos
    assert int((state.hot.pos >= 0).sum()) == 48
    tol = TOL[dtype] * (4 if variant == "relu2" else 1)
    assert rel_err(first, ref) <= tol and rel_err(second, ref) <= tol
    # the second call's density probe counts the hot neurons' active entries too
    bias = case["gate_bias"] if gated else case["up_bias"]
    pre = torch.nn.functional.linear(case["x"].double(), args[0].double(), bias.double() if bias is not None else None)
    state.update(config, args[0].shape[-1])
    assert state.density == pytest.approx(float((pre > threshold).double().mean()), abs=0.01)


@pytest.mark.parametrize(
    "counts,rate,hot",
    [
        ([50] * 20 + [0] * 60, 0.1, 16),  # 20 above the rate: 16, a multiple of HOT_ALIGN
        ([50] * 40 + [0] * 40, 0.1, 16),  # capped at 25% of N = 20, rounded down
        ([50] * 10 + [0] * 70, 0.1, 0),  # fewer than HOT_ALIGN: none
        ([10] * 80, 0.1, 0),  # at the rate is not above it
    ],
)
def test_hot_neurons_are_the_most_frequent(counts, rate, hot):
    counts = torch.tensor(counts, dtype=torch.int32)
    counts[:16] += torch.arange(16, dtype=torch.int32)  # the 16 most frequent are the first ones
    chosen = dispatch._hot_neurons(counts, counts, 100, rate)
    if hot == 0:
        assert chosen is None
    else:
        assert chosen.index.tolist() == list(range(hot)) and chosen.pos.tolist() == list(range(hot)) + [-1] * (80 - hot)


@pytest.mark.parametrize(
    "dense_above,by_width,falls_back",
    [
        (None, None, True),  # the default rows: 0.8% at K=24
        (0.05, None, False),
        (None, ((24, 0.05), (0, 0.008)), False),  # the layer's width (24) takes the first row
        (None, ((25, 0.05), (0, 0.008)), True),  # narrower than the first row: the second
        (0.05, ((0, 0.008),), False),  # a layer's own number wins over the rows
    ],
)
def test_dense_layers_fall_back_to_dense(dense_above, by_width, falls_back, sparse_paths, monkeypatch):
    """A prefill call denser than the layer's dense_above (by its width where None) sends its next calls
    dense (still exact)."""
    if by_width is not None:
        monkeypatch.setattr(policy, "DENSE_ABOVE", by_width)
    config = sparse_paths.replace(dense_above=dense_above, hot_rate=None)
    case = make_ffn(80, 24, 64, [0.03], torch.float32, DEVICE, seed=3)
    args = (case["gate_weight"], case["up_weight"], case["down_weight"], None, None, None, 0.0, False, config)
    first = dispatch.gated_ffn_cuda(case["x"], *args)
    state = dispatch.layer_state(case["gate_weight"], 80)
    assert state.pending is not None and state.dense_calls_left == 0
    second = dispatch.gated_ffn_cuda(case["x"], *args)  # reads the first call's density (3%)
    assert state.density > 0.02
    assert state.dense_calls_left == (policy.DENSE_RETRY - 1 if falls_back else 0)
    assert (state.pending is None) == falls_back  # a sparse call queues the next probe
    ref = gated_ref(case)
    assert rel_err(first, ref) <= 1e-5 and rel_err(second, ref) <= 1e-5


def test_a_layer_dense_in_few_neurons_stays_sparse(sparse_paths, monkeypatch):
    """A layer whose density sits in a few always-active neurons measures dense on its first call, but
    that call also measured its hot neurons: with those dense, the rest is sparse, and so its calls stay."""
    case = make_ffn(80, 24, 64, [0.0], torch.float32, DEVICE, seed=7)  # no other neuron fires
    gate_bias = torch.zeros(64, device=DEVICE)
    gate_bias[:16] = 100.0  # 16 neurons fire on every token: 25% density
    args = (case["gate_weight"], case["up_weight"], case["down_weight"], gate_bias, None, None, 0.0, False)
    maps = []
    updown = dispatch.launch_up_down
    monkeypatch.setattr(dispatch, "launch_up_down", lambda *a, **kw: maps.append(kw["hot_pos"]) or updown(*a, **kw))
    ys = [dispatch.gated_ffn_cuda(case["x"], *args, sparse_paths) for _ in range(3)]
    state = dispatch.layer_state(case["gate_weight"], 80)
    assert state.hot.index.tolist() == list(range(16)) and state.density == 0.25
    assert len(maps) == 3 and maps[1] is maps[2] is state.hot.pos and state.dense_calls_left == 0
    ref = reference.gated_ffn_reference(case["x"].double(), *(a.double() if a is not None else None for a in args[:6]))
    assert all(rel_err(y, ref) <= 1e-5 for y in ys)


def test_default_dispatch_runs_dense_where_kernels_lose():
    """Between the decode and prefill thresholds, calls take the dense path: exact, never slower."""
    dispatch.forget_layers()
    m = policy.DECODE_MAX_M + 1
    assert m < policy.PREFILL_MIN_M
    case = make_ffn(m, 24, 64, [0.05], torch.float32, DEVICE, seed=m)
    args = (case["gate_weight"], case["up_weight"], case["down_weight"], None, None, None, 0.0, False)
    got = dispatch.gated_ffn_cuda(case["x"], *args, policy.DEFAULT)
    assert torch.equal(got, reference.gated_ffn_reference(case["x"], *args))


@pytest.mark.parametrize("m", [1, 80], ids=["decode", "prefill"])
def test_nn_linear_layout_runs_dense(m, sparse_paths, monkeypatch):
    """A down weight in the plain nn.Linear layout is never copied per call: the call runs dense."""
    case = make_ffn(m, 24, 64, [0.05], torch.float32, DEVICE, seed=m)
    down = case["down_weight"].contiguous()
    monkeypatch.setattr(dispatch, "launch_decode", None)  # any kernel call would fail
    monkeypatch.setattr(dispatch, "launch_up_down", None)
    args = (case["gate_weight"], case["up_weight"], down, None, None, None, 0.0, False)
    assert torch.equal(
        dispatch.gated_ffn_cuda(case["x"], *args, sparse_paths), reference.gated_ffn_reference(case["x"], *args)
    )


@pytest.mark.parametrize("density,path", [(0.005, "decode"), (0.03, "dense")])
def test_decode_serves_more_tokens_where_prefill_measured_the_layer_sparse(density, path, monkeypatch):
    """decode_max_m < M <= decode_sparse_max_m decodes only once a prefill probe found the layer sparse."""
    config = policy.LayerConfig(prefill_min_m=65)
    dispatch.forget_layers()
    calls = []
    monkeypatch.setattr(dispatch, "launch_decode", lambda *a, **k: calls.append("decode") or decode_ffn(*a, **k))
    case = make_ffn(80, 24, 256, [density], torch.float32, DEVICE, seed=4)
    args = (case["gate_weight"], case["up_weight"], case["down_weight"], None, None, None, 0.0, False, config)
    m = config.decode_sparse_max_m
    few = case["x"][:m]
    dispatch.gated_ffn_cuda(few, *args)  # nothing measured yet: dense
    dispatch.gated_ffn_cuda(case["x"], *args)  # prefill: queues the probe
    y = dispatch.gated_ffn_cuda(few, *args)
    assert calls == (["decode"] if path == "decode" else [])
    assert rel_err(y, gated_ref(case)[:m]) <= 1e-5


def test_a_probe_in_flight_is_not_replaced(sparse_paths):
    """While a layer's density probe has not landed, later calls queue no new one (else, with the host
    ahead of the GPU, the newest probe would never have landed when the next call looks)."""
    case = make_ffn(80, 24, 64, [0.03], torch.float32, DEVICE, seed=3)
    args = (case["gate_weight"], case["up_weight"], case["down_weight"], None, None, None, 0.0, False, sparse_paths)
    dispatch.gated_ffn_cuda(case["x"], *args)
    state = dispatch.layer_state(case["gate_weight"], 80)

    class NotLanded:
        def query(self):
            return False

    first = state.pending = (NotLanded(), *state.pending[1:])
    dispatch.gated_ffn_cuda(case["x"], *args)
    assert state.pending is first and state.dense_calls_left == 0


def test_layer_state_goes_with_its_weight():
    """Per-layer density state is dropped when the weight is freed (no leak, no inheritance by address)."""
    dispatch.forget_layers()
    weight = torch.nn.Parameter(torch.randn(8, 4))
    state = dispatch.layer_state(weight[2:6], 300)  # a view (fused gate_up rows) keys by its base
    assert dispatch.layer_state(weight[2:6], 300) is state
    assert dispatch.layer_state(weight[0:4], 300) is not state
    del weight, state
    gc.collect()
    assert not dispatch._layers
