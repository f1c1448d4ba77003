"""LayerConfig.train_forward_pack: the sparse training forward through the prefill kernels
(backward._pack_forward: pack pass, up+down kernel, the record from the TwELL words) against the row
kernel it replaces and float64 references (CPU: Triton's interpreter, fp32/fp16; GPU: bf16 at a real
shape). Every buffer the training path allocates starts poisoned (test_backward's fixture)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, compile_for_hopper, rel_err, slow_unless
from ffn_cases import gated_ref, make_ffn, plain_ref
from test_backward import VARIANTS, _check_grads, _leaves, _train_op, poisoned_buffers  # noqa: F401

import twell
from twell.format import pack
from twell.kernels import backward

# empty, sparse, past-width (0.3 of 80 > 16) rows, and rows whose 6-10 entries overflow a tile's slots
DENSITIES = [0.0, 0.05, 0.3, 0.1, 0.02, 0.125]
NAMES = ("y", "ids", "gate", "up", "counts", "hot_ids", "hot_gate", "hot_up", "l1", "nonzero")
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10}


@pytest.fixture
def layout(request, monkeypatch):
    """The pack layout (tile_n, slots) of the test: small tiles so a few rows overflow a tile."""
    tile_n, slots = request.param
    monkeypatch.setattr(backward, "PACK_TILE_N", tile_n)
    monkeypatch.setattr(backward, "PACK_SLOTS", slots)
    return tile_n, slots


def _spy_redo(monkeypatch):
    """The rows _pack_forward lists for the row kernel (sorted), per call."""
    calls = []
    pack_forward = backward._pack_forward

    def spy(*args):
        redo = pack_forward(*args)
        calls.append(redo[1 : 1 + int(redo[0])].sort().values)
        return redo

    monkeypatch.setattr(backward, "_pack_forward", spy)
    return calls


def _both(case, gated, threshold, drelu, squared=False, width=16, hot=0):
    """The op's outputs with the switch off and on (no autograd)."""
    outs = []
    with torch.no_grad():
        for p in (False, True):
            out = _train_op(case, gated, threshold, drelu, squared, width, hot=hot, forward_pack=p)
            outs.append(dict(zip(NAMES, out, strict=True)))
    return outs


def _ids(cases):
    return [f"{variant}-{str(dtype)[6:]}" for variant, dtype in cases]


FORWARD_CASES = [
    ("gated-relu-bias", torch.float32),
    ("gated-fatrelu-bias", torch.float32),
    ("gated-drelu", torch.float32),
    ("plain-relu-bias", torch.float32),
    ("gated-relu-bias", torch.float16),
    ("plain-relu-bias", torch.float16),
]


LAYOUTS = {"t32s4": (32, 4), "t64s16": (64, 16)}
# The default run keeps every variant, and each layout with a gated FFN with biases, dReLU without, a
# plain one, fp32 and fp16. Slow: the other combinations (gated-relu-bias in fp32 repeats fatrelu's branches).
FORWARD_KEPT = {
    ("gated-fatrelu-bias", torch.float32, "t32s4"),
    ("gated-drelu", torch.float32, "t32s4"),
    ("plain-relu-bias", torch.float16, "t32s4"),
    ("gated-relu-bias", torch.float16, "t64s16"),
    ("gated-drelu", torch.float32, "t64s16"),
    ("plain-relu-bias", torch.float32, "t64s16"),
}


@pytest.mark.parametrize(
    "variant,dtype,layout",
    [
        slow_unless((v, d, name) in FORWARD_KEPT, v, d, layout, id=f"{_ids([(v, d)])[0]}-{name}")
        for v, d in FORWARD_CASES
        for name, layout in LAYOUTS.items()
    ],
    indirect=["layout"],
)
def test_forward_matches_the_row_kernel(variant, dtype, layout, monkeypatch):
    """M=72, K=40, N=80 (partial last tile): the record bit for bit (ids, gate, counts; up within an
    ulp), y against the row kernel and float64, sum |h| and nonzero h. The redo rows are exactly those
    with an overflowing tile or past the width."""
    gated, biases, threshold, drelu, squared = VARIANTS[variant]
    case = make_ffn(72, 40, 80, DENSITIES, dtype, DEVICE, seed=7, biases=biases, gated=gated)
    redo = _spy_redo(monkeypatch)
    off, on = _both(case, gated, threshold, drelu)
    tile_n, slots = layout
    gate_w, gate_b = (case["gate_weight"], case["gate_bias"]) if gated else (case["up_weight"], case["up_bias"])
    pre = F.linear(case["x"], gate_w, gate_b)
    tiles = pack(pre, tile_n=tile_n, slots=slots, threshold=threshold).counts
    expected_redo = (tiles > slots).any(1) | (tiles.sum(1) > 16)
    assert torch.equal(redo[0].long(), expected_redo.nonzero().flatten())
    assert (~expected_redo).sum() > 36  # most rows packed
    if slots < 16:  # rows within the width overflowing a tile (16 slots hold any row within 16)
        assert ((tiles > slots).any(1) & (tiles.sum(1) <= 16)).any()
    for name in ("ids", "counts", "nonzero", "hot_ids"):
        assert torch.equal(on[name], off[name]), name
    torch.testing.assert_close(on["gate"], off["gate"], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(on["up"], off["up"], rtol=2 * EPS[dtype], atol=1e-30, equal_nan=True)
    assert rel_err(on["l1"], off["l1"]) <= 1e-5
    ref = gated_ref(case, threshold, drelu) if gated else plain_ref(case, threshold)
    tol = {torch.float32: 1e-5, torch.float16: 1e-2}[dtype]
    assert rel_err(on["y"], ref) <= tol and rel_err(on["y"], off["y"]) <= tol


@pytest.mark.parametrize("layout", [(64, 16)], indirect=True, ids=["t64s16"])
def test_rows_past_the_width_within_their_tiles(layout, monkeypatch):
    """N=128 at 16 slots a tile of 64: rows of ~26 entries fit their tiles (the up+down kernel's main
    rows, row width 32) but not the record's 16: listed, recorded as the row kernel records them."""
    redo = _spy_redo(monkeypatch)
    case = make_ffn(16, 24, 128, [0.2, 0.05], torch.float32, DEVICE, seed=6)
    off, on = _both(case, True, 0.0, False)
    tiles = pack(F.linear(case["x"], case["gate_weight"]), tile_n=64, slots=16).counts
    past = (tiles.sum(1) > 16) & (tiles <= 16).all(1)
    assert past.any()
    assert torch.equal(redo[0].long(), ((tiles > 16).any(1) | (tiles.sum(1) > 16)).nonzero().flatten())
    for name in ("ids", "gate", "up", "counts", "nonzero"):
        assert torch.equal(on[name], off[name]), name
    assert rel_err(on["y"], off["y"]) <= 1e-5 and rel_err(on["l1"], off["l1"]) <= 1e-5


@pytest.mark.parametrize("layout", [(32, 8)], indirect=True, ids=["t32s8"])
def test_nan_in_x(layout, monkeypatch):
    """A NaN in x makes its row's gate NaN (all kept: past the width, redone); the other rows packed."""
    redo = _spy_redo(monkeypatch)
    case = make_ffn(24, 24, 64, [0.05, 0.1, 0.0], torch.float16, DEVICE, seed=2, biases=True)
    case["x"][5, 3] = float("nan")
    off, on = _both(case, True, 0.0, False)
    assert 5 in redo[0].tolist() and len(redo[0]) < 24
    for name in ("ids", "counts", "nonzero"):
        assert torch.equal(on[name], off[name]), name
    torch.testing.assert_close(on["gate"], off["gate"], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(on["up"], off["up"], rtol=2 * EPS[torch.float16], atol=1e-30)
    assert torch.isnan(on["y"][5]).all() and torch.isnan(on["l1"]) and torch.isnan(off["l1"])
    ok = torch.arange(24) != 5
    assert rel_err(on["y"][ok], gated_ref(case)[ok]) <= 1e-2


@pytest.mark.parametrize("layout", [(32, 8)], indirect=True, ids=["t32s8"])
def test_relu2_keeps_the_row_kernel(layout, monkeypatch):
    """relu² packs g² (the prefill path's values), not the record's g: the row kernel serves it."""
    redo = _spy_redo(monkeypatch)
    case = make_ffn(20, 24, 70, DENSITIES, torch.float32, DEVICE, seed=3, gated=False)
    off, on = _both(case, False, 0.0, False, squared=True)
    assert not redo
    for name in NAMES:
        torch.testing.assert_close(on[name], off[name], rtol=0, atol=0)


GRAD_CASES = [
    ("gated-relu-bias", torch.float32),
    ("gated-drelu", torch.float32),
    ("gated-fatrelu-bias", torch.float32),
    ("plain-relu-bias", torch.float32),
    ("gated-relu-bias", torch.float16),
]


@pytest.mark.parametrize("layout", [(32, 4)], indirect=True, ids=["t32s4"])
@pytest.mark.parametrize("variant,dtype", GRAD_CASES, ids=_ids(GRAD_CASES))
def test_every_gradient_matches_dense_autograd(variant, dtype, layout):
    """train_forward + train_backward with the switch on (test_backward's check: M=13, K=24, N=70,
    width 16: empty, sparse, past-width and dense rows, tiles of 32 with 4 slots overflowing)."""
    gated, biases, threshold, drelu, squared = VARIANTS[variant]
    case = make_ffn(13, 24, 70, [0.0, 0.1, 1.0, 0.05, 0.3, 0.02], dtype, DEVICE, seed=3, biases=biases, gated=gated)
    _check_grads(case, gated, dtype, threshold, drelu, squared, forward_pack=True)


@pytest.mark.parametrize("layout", [(32, 8)], indirect=True, ids=["t32s8"])
def test_hot_neurons_with_the_switch(layout, monkeypatch):
    """train_hot with the switch: the hot columns hidden from the pack too; outputs as without it,
    gradients as float64 dense autograd's."""
    redo = _spy_redo(monkeypatch)
    case = make_ffn(40, 24, 64, [0.05, 0.1, 0.02], torch.float32, DEVICE, seed=5, biases=True)
    backward.forget_train_layers()
    off, on = _both(case, True, 0.0, False, hot=16)
    backward.forget_train_layers()
    assert redo and len(redo[0]) < 40
    for name in ("ids", "counts", "nonzero", "hot_ids"):
        assert torch.equal(on[name], off[name]), name
    for name in ("gate", "up", "hot_gate", "hot_up"):
        torch.testing.assert_close(on[name], off[name], rtol=2e-7, atol=1e-30)
    assert rel_err(on["y"], off["y"]) <= 1e-5 and rel_err(on["l1"], off["l1"]) <= 1e-5
    leaves = _leaves(case)
    y = _train_op(leaves, True, hot=16, forward_pack=True)[0]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    y.backward(dy)
    ref_leaves = _leaves(case, torch.float64)
    gated_ref(ref_leaves).backward(dy.double())
    for name, leaf in leaves.items():
        if leaf is not None:
            assert rel_err(leaf.grad, ref_leaves[name].grad) <= 1e-4, name
    backward.forget_train_layers()


def test_up_down_stores_u_in_entry_order():
    """launch_up_down's up_out: each row of the main kernel stores its first U entries' u (before the
    activation, rounded; entry order = the kept neurons in order), nothing past U (not in the next row,
    not past the buffer), heavy rows' nothing; y bit for bit as without up_out."""
    from twell.kernels.gate import launch_pack_dense
    from twell.kernels.updown import launch_up_down

    case = make_ffn(12, 24, 64, [0.1, 0.15, 0.6], torch.float32, DEVICE, seed=4, biases=True)
    x, wg, bg, wu, bu = (case[n] for n in ("x", "gate_weight", "gate_bias", "up_weight", "up_bias"))
    wd = case["down_weight"].t()
    pre = F.linear(x, wg, bg)
    words, tiles = launch_pack_dense(pre, 0.0, 32, 16)
    u_width = 4
    buffer = torch.full((13 * u_width,), float("nan"))
    up_out = buffer[: 12 * u_width].view(12, u_width)
    args = (x, words, tiles, wg, bg, wu, bu, wd, None)
    y = launch_up_down(*args, tile_n=32, threshold=0.0, drelu=True, up_out=up_out)[0]
    assert torch.equal(y, launch_up_down(*args, tile_n=32, threshold=0.0, drelu=True)[0])
    u = F.linear(x, wu, bu)
    kept = ~(pre <= 0)
    main = (tiles <= 16).all(1)  # row width 2 * 16 = 32 >= every row's total here
    assert main.any() and (~main).any() and (kept.sum(1)[main] > u_width).any()
    for m in range(12):
        stored = min(int(kept[m].sum()), u_width) if main[m] else 0
        torch.testing.assert_close(up_out[m, :stored], u[m, kept[m]][:stored], rtol=1e-6, atol=1e-6)
        assert torch.isnan(up_out[m, stored:]).all()
    assert torch.isnan(buffer[12 * u_width :]).all()


def test_switch_is_checked():
    assert not twell.LayerConfig(train_forward_pack=False).train_forward_pack
    assert twell.LayerConfig().train_forward_pack  # on: measured faster on uniform, skewed and hot-neuron layers
    with pytest.raises(ValueError, match="train_forward_pack must be a bool, got 1"):
        twell.LayerConfig(train_forward_pack=1)
    case = make_ffn(4, 16, 32, [0.1], torch.float32, DEVICE)
    weights = (case["gate_weight"], None, case["up_weight"], None, case["down_weight"].t(), None)
    with pytest.raises(ValueError, match="forward_pack must be a bool, got 'yes'"):
        backward.train_forward(
            case["x"], *weights, threshold=0.0, drelu=False, square=False, width=16, forward_pack="yes"
        )


SM90_COMPILE = """
import subprocess
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from twell.kernels import backward, updown

cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
INT = {"ids_ptr", "cnt_ptr", "tcnt_ptr", "nz_ptr", "words_ptr", "heavy_ptr", "n_ptr", "redo_ptr", "rows_ptr"}
TYPES = {"order_ptr": "*i64", "l1_ptr": "*fp32", "g_ptr": "*fp32"}
UPDOWN = dict(HAS_ORDER=True, HAS_UP=True, HAS_UP_BIAS=False, HAS_DOWN_BIAS=False, DRELU=False, TILE_N=128,
              SLOTS=16, TILES_PAD=64, WIDTH=256, CHUNK=16, STORE_U=True, U_WIDTH=256, STAGES=3)
entries = backward._row_entries(backward.REDO_ENTRIES, 2048)
for kernel, consts, warps in [
    (backward._pack_record_kernel, dict(HAS_UP=True, DRELU=False, TILE_N=128, SLOTS=16, WIDTH=512, LIMIT=256,
                                        TILES_PAD=128, BLOCK_M=backward.PACK_BLOCK_M, CHUNK=64), 4),
    # the autotuner's configs that do not spill without STORE_U (4096 at 4 warps and 8192 do)
    (updown._twell_up_down_kernel.fn, {**UPDOWN, "BLOCK_K": 2048}, 4),
    (updown._twell_up_down_kernel.fn, {**UPDOWN, "BLOCK_K": 4096}, 8),
    (backward._train_forward_kernel, dict(HAS_UP=True, HAS_UP_BIAS=True, HAS_DOWN_BIAS=True, DRELU=False,
                                          SQUARE=False, WIDTH=256, SCAN=backward.SCAN, CHUNK=256, BLOCK_K=2048,
                                          ENTRIES=entries, LISTED=True), backward._row_warps(2048, entries=entries)),
]:
    def typ(n):
        if n in consts:
            return "constexpr"
        if not n.endswith("_ptr"):
            return "fp32" if n == "threshold" else "i32"
        return "*i32" if n in INT else TYPES.get(n, "*bf16")
    signature = {n: typ(n) for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if signature[n] != "constexpr" and (n.endswith("_ptr") or n.startswith("stride"))}
    out = compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                  options={"num_warps": warps})
    Path("k.cubin").write_bytes(out.asm["cubin"])
    usage = subprocess.run([str(cuobjdump), "-res-usage", "k.cubin"], capture_output=True, text=True).stdout
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, (kernel.__name__, usage)  # no spills
"""


def test_kernels_compile_for_hopper_without_spills(tmp_path):
    """The record kernel (N=14336 at tile 128: 112 tiles), the up+down kernel storing u and the row
    kernel over the listed rows (K=2048, REDO_ENTRIES a step) build for sm_90 with no register spills."""
    compile_for_hopper(SM90_COMPILE, tmp_path)


@pytest.mark.gpu
def test_gpu_real_shape_bf16_switch_on_and_off():
    """bf16, K=2048, N=5632, 4096 tokens at ~2% skewed (13 rows past the width of 256, overflowing tiles): the
    record as without the switch (ids, gate, counts exactly; up within bf16 rounding), y and sum |h|
    within bf16 rounding, and the gradients of both against float64 dense autograd."""
    from benchmarks.ffn import make_inputs

    x, block = make_inputs(4096, 2048, 5632, 0.02, "skewed", seed=0)
    mlp = twell.sparsify(block.train()).mlp
    wg, bg, wu, wd = mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.down_proj.weight
    params = [x, wg, bg, wu, wd]
    width = twell.kernels.policy.train_width(5632)
    outs, grads = [], []
    for forward_pack in (False, True):
        leaves = [p.detach().clone().requires_grad_() for p in params]
        y, *record = torch.ops.twell.ffn_train(
            leaves[0], leaves[1], leaves[3], leaves[4], leaves[2], None, None, 0.0, False, False, width, 1, None, 0,
            forward_pack,
        )  # fmt: skip
        dy = torch.randn(y.shape, generator=torch.Generator(y.device).manual_seed(1), device=y.device, dtype=y.dtype)
        (y * dy).float().sum().add(record[-2] * 1e-3).backward()
        outs.append(dict(zip(NAMES, [y.detach(), *record], strict=True)))
        grads.append([leaf.grad for leaf in leaves])
    off, on = outs
    assert (off["counts"] > width).any()
    for name in ("ids", "counts", "nonzero"):
        assert torch.equal(on[name], off[name]), name
    assert torch.equal(on["gate"], off["gate"])
    torch.testing.assert_close(on["up"], off["up"], rtol=1e-2, atol=1e-2)
    assert rel_err(on["y"], off["y"]) <= 1e-2 and rel_err(on["l1"], off["l1"]) <= 1e-3
    ref_leaves = [p.detach().double().requires_grad_() for p in params]
    xr, rwg, rbg, rwu, rwd = ref_leaves
    h = F.relu(F.linear(xr, rwg, rbg)) * F.linear(xr, rwu)
    ref = F.linear(h, rwd)
    (ref * dy.double()).sum().add(h.abs().sum() * 1e-3).backward()
    for got_on, got_off, want in zip(grads[1], grads[0], ref_leaves, strict=True):
        assert rel_err(got_on, want.grad) <= 2e-2 and rel_err(got_on, got_off) <= 2e-2
