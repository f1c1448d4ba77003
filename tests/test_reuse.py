"""Weight-row reuse on the prefill path (twell.kernels.reuse: dense_columns and the pack pass that leaves the
listed neurons out, dense_hidden, dense_down_; the overflow recompute's flags) against float64 references
(CPU: Triton's interpreter, fp32/fp16; GPU: bf16 too; sm_90 builds: no spills, pipelined loops)."""

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, compile_for_hopper, rel_err
from ffn_cases import TOL, GatedBlock, gated_ref, make_ffn, plain_ref

import twell
from twell.kernels import dispatch, gate, policy, reuse
from twell.kernels.gate import pack_dense
from twell.kernels.policy import LayerConfig

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every buffer the pack pass and the products allocate starts as garbage: NaN hidden values, -1 TwELL
    words / counts / union entries / lengths / pair counts (per tile and per block), flags of 7, so
    anything a kernel reads before writing, or fails to write, shows."""
    alloc = gate._alloc
    monkeypatch.setattr(gate, "_alloc", lambda *a: tuple(t.fill_(-1) for t in alloc(*a)))
    empty = reuse.ReuseBlocks.empty

    def poisoned(*args):
        blocks = empty(*args)
        for t in (blocks.tile_union, blocks.tile_lengths, blocks.union, blocks.lengths, blocks.pairs):
            t.fill_(-1)
        blocks.flags.fill_(7)
        return blocks

    monkeypatch.setattr(reuse.ReuseBlocks, "empty", staticmethod(poisoned))
    hidden = reuse.hidden_buffer
    monkeypatch.setattr(reuse, "hidden_buffer", lambda *a: hidden(*a).fill_(float("nan")))
    dispatch.forget_layers()


def _block_counts(h, rows, threshold, hot_pos=None):
    """Per block of `rows` rows, how many of its rows keep each column (hot columns: never), [B, N]."""
    keep = ~(h.double() <= threshold)  # NaN kept
    if hot_pos is not None:
        keep &= (hot_pos < 0).to(keep.device)[None, :]
    m, n = h.shape
    blocks = -(-m // rows)
    padded = torch.zeros(blocks * rows, n, dtype=torch.int64, device=h.device)
    padded[:m] = keep.long()
    return padded.reshape(blocks, rows, n).sum(1)


def _expected_dense(counts, reuse_min, per_tile, tile_n):
    """The dense columns of each block: kept in >= reuse_min rows, the first per_tile of each tile by
    column."""
    wanted = counts >= reuse_min
    blocks, n = wanted.shape
    tiles = -(-n // tile_n)
    padded = torch.zeros(blocks, tiles * tile_n, dtype=torch.bool, device=wanted.device)
    padded[:, :n] = wanted
    place = padded.reshape(blocks, tiles, tile_n).long().cumsum(2).reshape(blocks, -1)[:, :n]
    return wanted & (place <= per_tile)


def _union(blocks, b):
    """Block b's dense neurons in union order (the compacted list the products read)."""
    return blocks.union[b, : blocks.lengths[b]].long()


def _pre(m, n, rows, dtype, seed):
    """Gate pre-activations where blocks share columns: each block has its own frequent columns (fire in
    ~60% of its rows), the rest fire in ~3% of the rows; a few NaN."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, n, generator=g, dtype=torch.float64) - 1.9
    for b in range(-(-m // rows)):
        cols = torch.randperm(n, generator=g)[: n // 10]
        h[b * rows : (b + 1) * rows, cols] += 2.2
    h[3, 5] = float("nan")
    h[min(m - 1, rows + 1), 5] = float("nan")
    return h.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "m,n,tile_n,slots,rows,reuse_min,per_tile",
    [
        (37, 300, 64, 8, 16, 2, 64),  # M not a multiple of the block, N not of the tile
        (70, 100, 32, 4, 32, 3, 2),  # per_tile cuts the lists: a tile's later columns stay sparse
        (20, 40, 16, 4, 16, 1, 16),  # every kept column dense: nothing left in TwELL
        (33, 96, 32, 8, 16, 100, 96),  # no column reaches reuse_min: no block has dense neurons
        (150, 300, 128, 16, 64, 4, 16),  # a block of two 32-row counting steps; four pack programs a block
        (21, 64, 32, 32, 16, 3, 32),  # threshold below 0: the padding rows (past M) must not count
    ],
    ids=["m37-n300", "capped", "all-dense", "none-dense", "b64", "negative-threshold"],
)
def test_pack_leaves_the_blocks_dense_columns_out(m, n, tile_n, slots, rows, reuse_min, per_tile, dtype):
    """Per block and tile, the columns kept in >= reuse_min rows are listed (ascending, up to per_tile),
    flagged, counted, and left out of TwELL: TwELL equals the pack of h with those columns dropped per
    block."""
    h = _pre(m, n, rows, dtype, seed=m + n)
    threshold = -1.5 if slots == 32 else 0.0
    words, counts, blocks = pack_dense(h, threshold, tile_n, slots, reuse=(rows, reuse_min, per_tile))
    block_counts = _block_counts(h, rows, threshold)
    dense = _expected_dense(block_counts, reuse_min, per_tile, tile_n)
    assert torch.equal(blocks.flags.cpu(), dense.to(torch.uint8).cpu())
    for b in range(dense.shape[0]):
        for t in range(blocks.tile_lengths.shape[1]):
            cols = slice(t * tile_n, (t + 1) * tile_n)
            length = int(blocks.tile_lengths[b, t])
            assert length == int(dense[b, cols].sum())
            assert (
                blocks.tile_union[b, t, :length].tolist() == dense[b, cols].nonzero().flatten().add(t * tile_n).tolist()
            )
            assert int(blocks.pairs[b, t]) == int(torch.where(dense[b, cols], block_counts[b, cols], 0).sum())
        assert int(blocks.lengths[b]) == int(dense[b].sum())
        assert _union(blocks, b).tolist() == dense[b].nonzero().flatten().tolist()
    dropped = h.clone()
    dropped[dense.repeat_interleave(rows, 0)[:m]] = float("-inf")
    ref_words, ref_counts = pack_dense(dropped, threshold, tile_n, slots)
    assert torch.equal(counts, ref_counts)
    valid = torch.arange(slots, device=DEVICE) < counts.clamp(max=slots).unsqueeze(-1)
    assert torch.equal(torch.where(valid, words, 0), torch.where(valid, ref_words, 0))
    if reuse_min == 1:
        assert int(counts.clamp(min=0).sum()) == 0
    if reuse_min == 100:
        assert int(blocks.lengths.sum()) == 0


def test_pack_counts_no_hot_column_for_reuse():
    """Hot columns go to hot_values and are never a block's dense column, however often they fire."""
    m, n, rows = 40, 64, 16
    h = _pre(m, n, rows, torch.float32, seed=3)
    h[:, 10:12] = 1.0  # fire in every row
    pos = torch.full((n,), -1, dtype=torch.int32)
    pos[10], pos[11] = 0, 1
    hot = (pos.to(DEVICE), torch.full((m, 2), float("nan"), device=DEVICE))
    words, counts, blocks = pack_dense(h, 0.0, 32, 8, hot=hot, reuse=(rows, 2, 32))
    dense = _expected_dense(_block_counts(h, rows, 0.0, pos), 2, 32, 32)
    assert torch.equal(blocks.flags.cpu(), dense.to(torch.uint8).cpu())
    assert not blocks.flags[:, 10:12].any()
    assert torch.equal(hot[1], h[:, 10:12])


def _dense_part(case, blocks, m, threshold, drelu, squared, gated):
    """float64 reference of the blocks' dense neurons' share of y: per block, h over its union's
    neurons (the dense route's semantics), times those neurons' W_d rows."""
    c = {k: (v.double().cpu() if v is not None else None) for k, v in case.items()}
    gate_w, gate_b = (c["gate_weight"], c["gate_bias"]) if gated else (c["up_weight"], c["up_bias"])
    y = torch.zeros(m, c["x"].shape[1], dtype=torch.float64)
    for b in range(blocks.lengths.shape[0]):
        union = _union(blocks, b).cpu()
        r = slice(b * blocks.rows, min(m, (b + 1) * blocks.rows))
        g = c["x"][r] @ gate_w[union].T + (gate_b[union] if gate_b is not None else 0)
        h = torch.where(g <= threshold, 0.0, g)
        if gated:
            u = c["x"][r] @ c["up_weight"][union].T + (c["up_bias"][union] if c["up_bias"] is not None else 0)
            h = h * (u.clamp(min=0) if drelu else u)
        elif squared:
            h = h * h
        y[r] = h @ c["down_weight"][:, union].T
    return y


VARIANTS = ["gated", "fatrelu-bias", "drelu", "plain", "relu2"]


def _products(case, blocks, pre, gated, threshold, variant, y0):
    """y0 + the blocks' dense share through dense_hidden (a NaN-poisoned hidden buffer) and dense_down_."""
    up = (case["up_weight"], case["up_bias"]) if gated else (None, None)
    hidden = reuse.dense_hidden(
        case["x"], pre, blocks, *up, threshold=threshold, drelu=variant == "drelu", square=variant == "relu2"
    )
    return reuse.dense_down_(y0.clone(), blocks, hidden, case["down_weight"].t())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m,rows,k", [(37, 16, 40), (70, 32, 200)], ids=["m37-b16-k40", "m70-b32-k200"])
def test_reuse_products_match_float64(variant, dtype, m, rows, k):
    """y += each block's dense neurons' h W_d^T[union]: against float64 at awkward shapes (K past one step
    of the hidden products and one column block of the down products; unions past one hidden program
    and one down step), the hidden buffer NaN-poisoned (only each block's own union columns are read)."""
    n = 150
    gated = variant in ("gated", "fatrelu-bias", "drelu")
    case = make_ffn(m, k, n, [0.2, 0.05, 0.4], dtype, DEVICE, seed=m + rows, biases=variant == "fatrelu-bias",
                    gated=gated)  # fmt: skip
    threshold = 0.02 if variant == "fatrelu-bias" else 0.0
    gate_w, gate_b = (case["gate_weight"], case["gate_bias"]) if gated else (case["up_weight"], case["up_bias"])
    pre = torch.nn.functional.linear(case["x"], gate_w, gate_b)
    _, _, blocks = pack_dense(pre, threshold, 32, 8, reuse=(rows, 2, 16))
    assert int(blocks.lengths.min()) > 0  # every block has dense neurons
    assert int(blocks.lengths.max()) > max(reuse.HIDDEN_CONFIGS[0][0], reuse.DOWN_CONFIGS[0][0])
    y0 = torch.randn(m, k, dtype=dtype).to(DEVICE)
    y = _products(case, blocks, pre, gated, threshold, variant, y0)
    ref = y0.double().cpu() + _dense_part(case, blocks, m, threshold, variant == "drelu", variant == "relu2", gated)
    assert rel_err(y.cpu(), ref) <= TOL[dtype] * (4 if variant == "relu2" else 1)


def test_reuse_hidden_reads_the_gate_output_not_a_recomputed_gate():
    """g comes from pre (the values the pack saw): a pre that differs from x W_g^T changes h accordingly."""
    m, k, n, rows = 32, 24, 64, 16
    case = make_ffn(m, k, n, [0.3], torch.float32, DEVICE, seed=9)
    pre = torch.nn.functional.linear(case["x"], case["gate_weight"])
    _, _, blocks = pack_dense(pre, 0.0, 32, 8, reuse=(rows, 2, 16))
    hidden = reuse.dense_hidden(case["x"], 2 * pre, blocks, case["up_weight"], None, threshold=0.0)
    u = torch.nn.functional.linear(case["x"].double(), case["up_weight"].double())
    for b in range(blocks.lengths.shape[0]):
        union, r = _union(blocks, b), slice(b * rows, (b + 1) * rows)
        expected = (2 * pre[r][:, union]).double().clamp(min=0) * u[r][:, union]
        assert torch.allclose(hidden[r, : len(union)].double(), expected, rtol=1e-5, atol=1e-5)


def test_reuse_products_leave_blocks_without_dense_neurons_alone():
    """A block whose union is empty keeps y's bits; one with neurons changes."""
    m, k, n, rows = 48, 24, 64, 16
    case = make_ffn(m, k, n, [0.3], torch.float32, DEVICE, seed=5)
    pre = torch.nn.functional.linear(case["x"], case["gate_weight"])
    _, _, blocks = pack_dense(pre, 0.0, 32, 8, reuse=(rows, 2, 16))
    blocks.lengths[1] = 0
    y0 = torch.randn(m, k).to(DEVICE)
    y = _products(case, blocks, pre, True, 0.0, "gated", y0)
    assert torch.equal(y[rows : 2 * rows], y0[rows : 2 * rows])
    assert not torch.equal(y[:rows], y0[:rows]) and not torch.equal(y[2 * rows :], y0[2 * rows :])


def test_reuse_products_check_their_arguments():
    """Wrong shapes name what was expected and what came."""
    m, k, n = 32, 24, 64
    case = make_ffn(m, k, n, [0.3], torch.float32, DEVICE, seed=2)
    pre = torch.nn.functional.linear(case["x"], case["gate_weight"])
    _, _, blocks = pack_dense(pre, 0.0, 32, 8, reuse=(16, 2, 16))
    with pytest.raises(ValueError, match=r"pre must be a \[32, N\] tensor, got \[31, 64\]"):
        reuse.dense_hidden(case["x"], pre[:31], blocks, case["up_weight"], None, threshold=0.0)
    with pytest.raises(ValueError, match=r"blocks for M=32, N=48 need union \[2, C\] and flags \[2, 48\]"):
        reuse.dense_hidden(case["x"], pre[:, :48], blocks, None, None, threshold=0.0)
    with pytest.raises(ValueError, match="up_bias needs up_weight"):
        reuse.dense_hidden(case["x"], pre, blocks, None, case["gate_weight"][:, 0], threshold=0.0)
    hidden = reuse.dense_hidden(case["x"], pre, blocks, case["up_weight"], None, threshold=0.0)
    with pytest.raises(ValueError, match=r"hidden must be \[32, 32\] torch.float32"):
        reuse.dense_down_(torch.zeros(m, k, device=DEVICE), blocks, hidden[:, :16], case["down_weight"].t())
    with pytest.raises(ValueError, match="pack config BLOCK_M must divide the reuse rows 16, got 32"):
        pack_dense(pre, 0.0, 32, 8, config=(32, 4, 1), reuse=(16, 2, 16))


def _sparse_paths(**changes):
    """Calls of more than 64 tokens take the prefill path; fused_gate on: with reuse the dispatcher must
    take cuBLAS + the pack pass (the fused gate lists no dense neurons)."""
    return LayerConfig(decode_max_m=64, prefill_min_m=65, hot_rate=None, fused_gate=True, **changes)


# MIXED of test_kernels: empty rows, sparse rows and a fully dense one in ten (its tiles overflow, so the
# heavy kernel recomputes them from W_g, where it must leave out the block's dense neurons)
MIXED = [0.0, 0.03, 0.1, 0.02, 0.05, 0.01, 0.04, 0.0, 0.03, 1.0]
PREFILL_CASES = [
    ("gated", torch.float32, 16, 2),
    ("fatrelu-bias", torch.float32, 32, 2),
    ("drelu", torch.float16, 16, 3),
    ("plain", torch.float32, 16, 2),
    ("relu2", torch.float16, 32, 2),
    ("gated", torch.float16, 16, 1),  # every kept neuron of a block dense, overflowing rows included
]


@pytest.mark.parametrize(
    "variant,dtype,rows,reuse_min", PREFILL_CASES, ids=[f"{v}-{str(d)[6:]}-b{r}-min{n}" for v, d, r, n in PREFILL_CASES]
)
def test_prefill_with_reuse_is_exact(variant, dtype, rows, reuse_min, monkeypatch):
    """The dispatcher's prefill path with reuse on: TwELL, the overflow recompute and the dense blocks
    each take a neuron exactly once (overflowing rows in blocks with dense columns), M=90 (not a
    multiple of the block)."""
    m, k, n = 90, 40, 200
    gated = variant in ("gated", "fatrelu-bias", "drelu")
    case = make_ffn(m, k, n, MIXED, dtype, DEVICE, seed=31, biases=variant == "fatrelu-bias", gated=gated)
    threshold = 0.02 if variant == "fatrelu-bias" else 0.0
    config = _sparse_paths(reuse_rows=rows, reuse_min=reuse_min, dense_above=1.0)
    seen = []
    products = reuse.dense_down_
    monkeypatch.setattr(reuse, "dense_down_", lambda y, b, *a: seen.append(b) or products(y, b, *a))
    if gated:
        args = [case[c] for c in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
        y = dispatch.gated_ffn_cuda(case["x"], *args, threshold, variant == "drelu", config)
        ref = gated_ref(case, threshold, variant == "drelu")
    else:
        args = [case[c] for c in ("up_weight", "down_weight", "up_bias", "down_bias")]
        y = dispatch.ffn_cuda(case["x"], *args, threshold, variant == "relu2", config)
        ref = plain_ref(case, threshold, variant == "relu2")
    (blocks,) = seen
    assert blocks.rows == rows and int(blocks.lengths.sum()) > 0
    assert rel_err(y, ref) <= TOL[dtype] * (4 if variant == "relu2" else 1)
    # the density probe counts the dense blocks' entries as well
    bias = case["gate_bias"] if gated else case["up_bias"]
    pre = torch.nn.functional.linear(case["x"].double(), args[0].double(), bias.double() if bias is not None else None)
    state = dispatch.layer_state(args[0], m)
    state.update(config)
    assert state.density == pytest.approx(float((pre > threshold).double().mean()), abs=0.01)


def test_prefill_with_hot_neurons_and_reuse_is_exact(monkeypatch):
    """Hot neurons (the layer-wide hybrid) and the blocks' dense neurons together: no neuron twice, and
    the density probe counts sparse, block-dense and hot entries."""
    m, k, n = 90, 40, 200
    case = make_ffn(m, k, n, MIXED, torch.float32, DEVICE, seed=41, biases=True)
    config = _sparse_paths(reuse_rows=16, reuse_min=2, dense_above=1.0).replace(hot_rate=0.05)
    args = [case[c] for c in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
    ref = gated_ref(case, 0.02)
    first = dispatch.gated_ffn_cuda(case["x"], *args, 0.02, False, config)  # measures the hot neurons
    second = dispatch.gated_ffn_cuda(case["x"], *args, 0.02, False, config)
    state = dispatch.layer_state(args[0], m)
    assert state.hot is not None and len(state.hot.index) > 0
    assert rel_err(first, ref) <= 1e-5 and rel_err(second, ref) <= 1e-5
    pre = torch.nn.functional.linear(case["x"].double(), args[0].double(), args[3].double())
    state.update(config)
    assert state.density == pytest.approx(float((pre > 0.02).double().mean()), abs=0.01)


def test_reuse_beyond_the_grid_limit_is_refused_and_the_dispatcher_packs_plainly(monkeypatch):
    """More row blocks than the kernels' grid takes: pack_dense refuses, the prefill path runs without
    reuse (no dense products) and stays exact."""
    monkeypatch.setattr(reuse, "MAX_BLOCKS", 4)
    with pytest.raises(ValueError, match=r"reuse takes at most 4 blocks of 16 rows, got M=90 \(6 blocks\)"):
        pack_dense(torch.randn(90, 32, device=DEVICE), 0.0, 32, 8, reuse=(16, 2, 8))
    seen = []
    monkeypatch.setattr(reuse, "dense_down_", lambda *a: seen.append(1))
    m, k, n = 90, 40, 200
    case = make_ffn(m, k, n, MIXED, torch.float32, DEVICE, seed=7)
    args = [case[c] for c in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
    config = _sparse_paths(reuse_rows=16, reuse_min=2, dense_above=1.0)
    y = dispatch.gated_ffn_cuda(case["x"], *args, 0.0, False, config)
    assert not seen
    assert rel_err(y, gated_ref(case, 0.0)) <= 1e-5


def test_layer_config_reuse_fields():
    """Off by default; reuse_rows one of the kernels' blocks, reuse_min >= 1; both travel in op_args."""
    assert policy.DEFAULT.reuse_rows == 0
    config = LayerConfig(reuse_rows=64, reuse_min=4)
    assert policy.from_op_args(*config.op_args()) == config
    assert policy.op_config(*config.op_args()) == config
    with pytest.raises(ValueError, match=r"reuse_rows must be one of \(0, 16, 32, 64, 128\), got 48"):
        LayerConfig(reuse_rows=48)
    with pytest.raises(ValueError, match="reuse_min must be an int >= 1, got 0"):
        LayerConfig(reuse_min=0)
    with pytest.raises(ValueError, match=r"reuse rows must be one of \(16, 32, 64, 128\), got 8"):
        pack_dense(torch.randn(4, 32, device=DEVICE), 0.0, 32, 8, reuse=(8, 2, 32))
    with pytest.raises(ValueError, match="reuse per_tile must be an int >= 1, got 0"):
        pack_dense(torch.randn(4, 32, device=DEVICE), 0.0, 32, 8, reuse=(16, 2, 0))
    assert reuse.per_tile(128) == 32 and reuse.per_tile(16) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 64, 128])
def test_reuse_on_the_gpu_in_bf16(rows):
    """Real tile shapes in bf16 (M not a multiple of the block, blocks sharing neurons by chance at 1%),
    against float64."""
    m, k, n = 4096 + 7, 512, 2048
    case = make_ffn(m, k, n, [0.01, 0.02], torch.bfloat16, "cuda", seed=rows, biases=True)
    config = _sparse_paths(reuse_rows=rows, reuse_min=2, dense_above=1.0)
    args = [case[c] for c in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
    y = dispatch.gated_ffn_cuda(case["x"], *args, 0.0, False, config)
    assert rel_err(y, gated_ref(case)) <= 1e-2


@pytest.mark.gpu
def test_reuse_captures_in_cuda_graphs_and_compiles_whole(monkeypatch):
    """No host synchronisation on the reuse path: a CUDA-graph capture replays to the eager result, and
    torch.compile(fullgraph=True) traces the module without a graph break."""
    seen = []
    products = reuse.dense_down_
    monkeypatch.setattr(reuse, "dense_down_", lambda *a: seen.append(1) or products(*a))
    torch.manual_seed(0)
    block = GatedBlock(256, 1024).to("cuda", torch.bfloat16).eval()
    torch.nn.init.constant_(block.mlp.gate_proj.bias, -0.05)
    twell.sparsify(block, layer_config={"decode_max_m": 8, "prefill_min_m": 257, "reuse_rows": 64, "reuse_min": 2})
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = block(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(x)
        graph.replay()
        torch.cuda.synchronize()
        compiled = torch.compile(block, fullgraph=True)(x)
    assert seen
    assert torch.equal(captured, eager)
    assert rel_err(compiled, eager) <= 1e-2


REUSE_SM90_COMPILE = """
import subprocess
from pathlib import Path
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from twell.kernels import gate, reuse

INT32 = ("union_ptr", "tile_union_ptr", "tile_len_ptr", "len_ptr", "pairs_ptr", "pos_ptr", "cnt_ptr", "words_ptr")

def arg_type(name):
    if not name.endswith("_ptr"):
        return "fp32" if name == "threshold" else "i32"
    return "*i32" if name in INT32 else "*u8" if name == "flag_ptr" else "*bf16"

def configs(kernel, table, rows):  # the autotuner's configs after its pruning
    listed = [triton.Config({"CHUNK": c, "BLOCK_K": bk}, num_warps=w, num_stages=s) for c, bk, w, s in table]
    prune = (kernel.early_config_prune or (lambda c, n, **kw: c))
    return [(kernel.fn, {"ROWS": rows, **c.kwargs}, dict(num_warps=c.num_warps, num_stages=c.num_stages))
            for c in prune(listed, {}, ROWS=rows)]

flags = dict(HAS_UP=True, HAS_UP_BIAS=True, DRELU=False, SQUARE=False, DOT_PRECISION="tf32", VALUE=tl.bfloat16,
             HAS_HOT=True, TILE_N=128, SLOTS=16)
builds = []
for rows in (16, 64, 128):
    builds += configs(reuse._reuse_hidden_kernel, reuse.HIDDEN_CONFIGS, rows)
    builds += configs(reuse._reuse_down_kernel, reuse.DOWN_CONFIGS, rows)
    columns = dict(ROWS=rows, SUB=min(rows, reuse.COUNT_ROWS // 128))
    builds.append((reuse._dense_columns_kernel, columns, dict(num_warps=4)))
builds.append((reuse._compact_union_kernel, dict(TILES_PAD=128, PER_TILE_PAD=32), dict(num_warps=4)))
builds += [(gate._pack_dense_kernel.fn, dict(REUSE_ROWS=64, BLOCK_M=bm), dict(num_warps=w, num_stages=s))
           for bm, w, s in gate.PACK_CONFIGS]
cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
for kernel, consts, options in builds:
    consts = {**{n: v for n, v in flags.items() if n in kernel.arg_names}, **consts}
    # unit strides are specialised to 1 by the launcher (contiguous rows), the rest divisible by 16
    unit = ("stride_xk", "stride_uk", "stride_dk", "stride_yk", "stride_hn")
    consts.update({n: 1 for n in unit if n in kernel.arg_names})
    signature = {n: "constexpr" if n in consts else arg_type(n) for n in kernel.arg_names}
    aligned = ("K", "N", "capacity")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if signature[n] != "constexpr" and (n.endswith("_ptr") or n.startswith("stride") or n in aligned)}
    out = compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    Path("k.cubin").write_bytes(out.asm["cubin"])
    usage = subprocess.run([str(cuobjdump), "-res-usage", "k.cubin"], capture_output=True, text=True).stdout
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, (kernel.__name__, consts, options, usage)  # no spills
    if "CHUNK" in consts:  # the products' loops pipelined: the gathered rows by asynchronous copies
        assert "cp.async" in out.asm["ptx"], (kernel.__name__, consts, options)
"""


def test_reuse_kernels_compile_for_hopper_without_spills(tmp_path):
    """Triton's compiler and ptxas build the reuse kernels for sm_90 (no GPU needed) at 16, 64 and 128
    rows with every config their autotuners keep (the down kernel's pruning drops the ones that
    spilled): no register spills, the products' loops pipelined (asynchronous copies)."""
    compile_for_hopper(REUSE_SM90_COMPILE, tmp_path)
