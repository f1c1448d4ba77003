"""LayerConfig.train_forward_pack: the sparse training forward through the prefill kernels
(backward._pack_forward: pack pass, up+down kernel, the record from the TwELL words, the heaviest rows
they cannot serve by cuBLAS: backward._dense_rows, FORWARD_DENSE_ROWS) against the row kernel it replaces
and float64 references (CPU: Triton's interpreter, fp32/fp16; GPU: bf16 at a real shape). Every buffer
the training path allocates starts poisoned (test_backward's fixture)."""

import math

import pytest
import torch
import torch.nn.functional as F
import triton
from conftest import DEVICE, compile_for_hopper, rel_err, slow_unless
from ffn_cases import gated_ref, make_ffn, plain_ref
from test_backward import VARIANTS, _check_grads, _leaves, _train_op, poisoned_buffers  # noqa: F401

import twell
from twell.format import pack
from twell.kernels import backward, reference

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
        redo, unserved = pack_forward(*args)
        calls.append(redo[1 : 1 + int(redo[0])].sort().values)
        return redo, unserved

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


def _pack_counts(case, gated, tile_n, slots, threshold=0.0, hot_ids=None):
    """The TwELL tile counts [M, T] of the case's dense gate (the pack the forward makes: hot_ids' columns
    hidden)."""
    gate_w, gate_b = (case["gate_weight"], case["gate_bias"]) if gated else (case["up_weight"], case["up_bias"])
    pre = F.linear(case["x"], gate_w, gate_b)
    if hot_ids is not None:
        pre[:, hot_ids] = float("-inf")
    return pack(pre, tile_n=tile_n, slots=slots, threshold=threshold).counts


def _split_listed(redo, tiles, slots, limit, dense_rows):
    """The rows the packed forward cannot serve (an overflowing tile, more entries than limit: the width,
    or the up+down kernel's row width where less), split into the dense pass's (returned, bool [M]) and the
    row kernel's list redo (sorted): the dense pass takes the `dense_rows` heaviest of them (ties either
    way), each listed row goes one way only."""
    totals = tiles.sum(1)
    listed = (tiles > slots).any(1) | (totals > limit)
    redo = redo.long()
    assert torch.equal(redo.unique(), redo) and listed[redo].all()
    covered = listed.clone()
    covered[redo] = False
    assert int(covered.sum()) == min(dense_rows, int(listed.sum()))
    if covered.any() and len(redo):
        assert totals[covered].min() >= totals[redo].max()
    return covered


def _check_record(on, off, covered, width, eps):
    """The record with the dense pass (on) against the row kernel's (off): every row's count; rows within
    the width (the dense pass's too) their entries (ids, gate bit for bit, up within rounding: cuBLAS's u
    against the kernels'), the dense pass's rows past the width zeros (unused), the row kernel's rows past
    it as that kernel left them."""
    assert torch.equal(on["counts"], off["counts"])
    same = (off["counts"] <= width) | ~covered
    assert torch.equal(on["ids"][same], off["ids"][same])
    torch.testing.assert_close(on["gate"][same], off["gate"][same], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(on["up"][same], off["up"][same], rtol=2 * eps, atol=eps, equal_nan=True)
    for name in ("ids", "gate", "up"):
        assert (on[name][~same] == 0).all(), name


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
# The default run keeps every variant once, and each layout with a gated FFN with biases, fp32 and fp16:
# t32s4 FATReLU with biases (fp32) and the plain FFN (fp16), t64s16 dReLU without biases (fp32) and
# gated-relu-bias (fp16). Slow: the other combinations (a variant's branches do not depend on the layout;
# gated-relu-bias in fp32 repeats fatrelu's).
FORWARD_KEPT = {
    ("gated-fatrelu-bias", torch.float32, "t32s4"),
    ("plain-relu-bias", torch.float16, "t32s4"),
    ("gated-relu-bias", torch.float16, "t64s16"),
    ("gated-drelu", torch.float32, "t64s16"),
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
    ulp), y against the row kernel and float64, sum |h| and nonzero h. The rows with an overflowing tile
    or past the width: the 3 heaviest (ceil(72 / BACKUP_SHARE)) by the dense pass, the others listed."""
    gated, biases, threshold, drelu, squared = VARIANTS[variant]
    case = make_ffn(72, 40, 80, DENSITIES, dtype, DEVICE, seed=7, biases=biases, gated=gated)
    redo = _spy_redo(monkeypatch)
    off, on = _both(case, gated, threshold, drelu)
    tile_n, slots = layout
    tiles = _pack_counts(case, gated, tile_n, slots, threshold)
    covered = _split_listed(redo[0], tiles, slots, 16, 3)
    assert covered.sum() == 3 and len(redo[0]) > 3  # more rows to serve than the dense pass takes
    assert ((tiles > slots).any(1) | (tiles.sum(1) > 16)).sum() < 36  # most rows packed
    if slots < 16:  # rows within the width overflowing a tile (16 slots hold any row within 16)
        assert ((tiles > slots).any(1) & (tiles.sum(1) <= 16)).any()
    _check_record(on, off, covered, 16, EPS[dtype])
    for name in ("nonzero", "hot_ids"):
        assert torch.equal(on[name], off[name]), name
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
    tiles = _pack_counts(case, True, 64, 16)
    past = (tiles.sum(1) > 16) & (tiles <= 16).all(1)
    assert past.any()
    _check_record(on, off, _split_listed(redo[0], tiles, 16, 16, 1), 16, EPS[torch.float32])
    assert torch.equal(on["nonzero"], off["nonzero"])
    assert rel_err(on["y"], off["y"]) <= 1e-5 and rel_err(on["l1"], off["l1"]) <= 1e-5


@pytest.mark.parametrize("layout", [(32, 8)], indirect=True, ids=["t32s8"])
def test_nan_in_x(layout, monkeypatch):
    """A NaN in x makes its row's gate NaN (all kept: past the width, the heaviest: the dense pass's, or
    redone with the switch off); the other rows packed."""
    redo = _spy_redo(monkeypatch)
    case = make_ffn(24, 24, 64, [0.05, 0.1, 0.0], torch.float16, DEVICE, seed=2, biases=True)
    case["x"][5, 3] = float("nan")
    off, on = _both(case, True, 0.0, False)
    covered = _split_listed(redo[0], _pack_counts(case, True, 32, 8), 8, 16, 1)
    assert covered.nonzero().flatten().tolist() == [5] and len(redo[0]) < 24
    _check_record(on, off, covered, 16, EPS[torch.float16])
    assert torch.equal(on["nonzero"], off["nonzero"])
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


# (rows the dense pass takes: fewer / exactly / more than the rows to serve, variant, dtype, layout, hot)
# at M=24, N=64, width 16. t32s4: rows of 9-16 entries overflow a tile (2 tiles of 4 slots hold 8), rows
# within 8 too; t32s16w8: up+down row width 8 (MAX_WIDTH), so rows of 9-16 entries are listed without an
# overflowing tile (K=4096's case: row width 256, record width 512)
DENSE_ROW_CASES = [
    ("fewer", "gated-relu-bias", torch.float32, "t32s16w8", 0),
    ("exact", "plain-relu-bias", torch.float16, "t32s4", 0),
    ("more", "gated-drelu", torch.float32, "t32s4", 16),
]
DENSE_LAYOUTS = {"t32s4": (32, 4, 256), "t32s16w8": (32, 16, 8)}


def _loss_and_grads(case, gated, threshold, drelu, hot):
    """The packed forward's outputs and every leaf's gradient of <y, dy> + 3 sum |h|."""
    leaves = _leaves(case)
    out = _train_op(leaves, gated, threshold, drelu, hot=hot, forward_pack=True)
    dy = torch.randn(out[0].shape, generator=torch.Generator().manual_seed(1)).to(out[0].dtype)
    ((out[0] * dy).float().sum() + 3.0 * out[8]).backward()
    outputs = dict(zip(NAMES, (t.detach() for t in out), strict=True))
    return outputs, {name: leaf.grad for name, leaf in leaves.items() if leaf is not None}, dy


@pytest.mark.parametrize(
    "share,variant,dtype,layout,hot",
    DENSE_ROW_CASES,
    ids=[f"{c[0]}-{c[1]}-{str(c[2])[6:]}-{c[3]}" for c in DENSE_ROW_CASES],
)
def test_dense_rows_against_the_row_kernel_and_float64(share, variant, dtype, layout, hot, monkeypatch):
    """FORWARD_DENSE_ROWS: the heaviest of the rows the pack path cannot serve (past the width, past the
    up+down row width, overflowing tiles) by cuBLAS, the rest by the row kernel, against the switch off
    (every such row by the row kernel) and float64 dense autograd: y, the record, sum |h|, nonzero h and
    every gradient of <y, dy> + 3 sum |h|; hot neurons hidden from both."""
    from twell.kernels import updown

    tile_n, slots, max_width = DENSE_LAYOUTS[layout]
    for module, name, value in ((backward, "PACK_TILE_N", tile_n), (backward, "PACK_SLOTS", slots)):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(updown, "MAX_WIDTH", max_width)
    gated, biases, threshold, drelu, _ = VARIANTS[variant]
    case = make_ffn(24, 24, 64, [0.0, 0.05, 0.4, 0.2, 0.12, 0.15], dtype, DEVICE, seed=8, biases=biases, gated=gated)
    redo = _spy_redo(monkeypatch)
    monkeypatch.setattr(backward, "FORWARD_DENSE_ROWS", False)
    backward.forget_train_layers()
    off, off_grads, dy = _loss_and_grads(case, gated, threshold, drelu, hot)
    tiles = _pack_counts(case, gated, tile_n, slots, threshold, off["hot_ids"])
    limit = min(16, 2 * slots, max_width)
    listed = int(((tiles > slots).any(1) | (tiles.sum(1) > limit)).sum())
    assert len(redo[0]) == listed  # the switch off: every row not served listed
    dense_rows = {"fewer": listed - 2, "exact": listed, "more": listed + 3}[share]
    monkeypatch.setattr(backward, "_share_rows", lambda _, m: dense_rows)
    monkeypatch.setattr(backward, "FORWARD_DENSE_ROWS", True)
    backward.forget_train_layers()
    on, on_grads, _ = _loss_and_grads(case, gated, threshold, drelu, hot)
    backward.forget_train_layers()
    assert torch.equal(on["hot_ids"], off["hot_ids"])
    covered = _split_listed(redo[1], tiles, slots, limit, dense_rows)
    counts = off["counts"]
    assert (covered & (counts > 16)).any() and (covered & (counts <= 16) & (counts > limit)).any()
    if layout == "t32s4":
        assert (covered & (counts <= limit)).any()  # a row within the row width, for an overflowing tile
    _check_record(on, off, covered, 16, EPS[dtype])
    assert torch.equal(on["nonzero"], off["nonzero"]) and rel_err(on["l1"], off["l1"]) <= 1e-5
    ref_leaves = _leaves(case, torch.float64)
    x, wd, bd = ref_leaves["x"], ref_leaves["down_weight"], ref_leaves["down_bias"]
    wu, bu = (ref_leaves["up_weight"], ref_leaves["up_bias"]) if gated else (None, None)
    wg, bg = (
        (ref_leaves["gate_weight"], ref_leaves["gate_bias"])
        if gated
        else (ref_leaves["up_weight"], ref_leaves["up_bias"])
    )
    h = reference.hidden(x, wg, wu, bg, bu, threshold, drelu, False)
    y = F.linear(h, wd, bd)
    ((y * dy.double()).sum() + 3.0 * h.abs().sum()).backward()
    tol = {torch.float32: 1e-5, torch.float16: 1e-2}[dtype]
    assert rel_err(on["y"], y) <= tol and rel_err(on["y"], off["y"]) <= tol
    assert rel_err(on["l1"], h.abs().sum()) <= tol
    grad_tol = {torch.float32: 1e-4, torch.float16: 1e-2}[dtype]
    for name, grad in on_grads.items():
        assert rel_err(grad, ref_leaves[name].grad) <= grad_tol and rel_err(grad, off_grads[name]) <= grad_tol, name


@pytest.mark.parametrize("layout", [(32, 4)], indirect=True, ids=["t32s4"])
def test_dense_rows_follow_the_layers_measurement(layout, monkeypatch):
    """Under train_dense_above (a _TrainState), the dense pass takes ceil(M / BACKUP_SHARE) rows on the
    layer's first call, then 1.25x the rows its last measured call could not serve as a power of two, at
    least BACKUP_MIN_ROWS (_TrainState.forward_rows; not the backward's rows past the width); y and the
    counts as float64 / torch count them."""
    case = make_ffn(40, 24, 64, [0.0, 0.05, 0.15, 0.02, 0.1, 0.05, 0.0, 0.3], torch.float32, DEVICE, seed=9)
    taken = []
    dense_rows = backward._dense_rows
    monkeypatch.setattr(backward, "_dense_rows", lambda top, *args: taken.append(len(top)) or dense_rows(top, *args))
    monkeypatch.setattr(backward, "BACKUP_MIN_ROWS", 4)
    tiles = _pack_counts(case, True, 32, 4)
    listed = int(((tiles > 4).any(1) | (tiles.sum(1) > 8)).sum())
    past = int((tiles.sum(1) > 16).sum())
    assert past == 5 and listed > 7  # 1 in 8 past the width (dense mode past that); 1.25 x 5 rows: 8
    backward.forget_train_layers()
    with torch.no_grad():
        for _ in range(2):
            out = _train_op(case, True, dense_above=1.0, forward_pack=True)
            assert rel_err(out[0], gated_ref(case)) <= 1e-5
            assert torch.equal(out[4].long(), tiles.sum(1))
    state = backward.train_state(case["gate_weight"])
    assert not state.dense and state.listed_share == listed / 40 and state.past_share == past / 40
    assert taken == [2, min(40, triton.next_power_of_2(math.ceil(1.25 * listed)))]  # ceil(40 / 32), measured
    state.listed_share = 0.0
    assert state.forward_rows(40) == 0  # a layer whose rows all fit: no dense pass
    backward.forget_train_layers()


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
TYPES = {"order_ptr": "*i64", "l1_ptr": "*fp32", "g_ptr": "*fp32", "acc_ptr": "*fp32"}
UPDOWN = dict(HAS_ORDER=True, HAS_UP=True, HAS_UP_BIAS=False, HAS_DOWN_BIAS=False, DRELU=False, TILE_N=128,
              SLOTS=16, TILES_PAD=64, WIDTH=256, CHUNK=16, STORE_U=True, U_WIDTH=256, GROUPS=1, GROUPS_PAD=1,
              FIRST=True, LAST=True)
# the neuron-group passes of three (no STORE_U): first, middle (loads and stores the fp32 carry) and last
GROUPED = [{**UPDOWN, "STORE_U": False, "U_WIDTH": 0, "GROUPS": 3, "GROUPS_PAD": 4, "FIRST": first, "LAST": last}
           for first, last in ((True, False), (False, False), (False, True))]
entries = backward._row_entries(backward.REDO_ENTRIES, 2048)
for kernel, consts, warps in [
    (backward._pack_record_kernel, dict(HAS_UP=True, DRELU=False, TILE_N=128, SLOTS=16, WIDTH=512, LIMIT=256,
                                        TILES_PAD=128, BLOCK_M=backward.PACK_BLOCK_M, CHUNK=64), 4),
    # the autotuner's configs that do not spill without STORE_U (4096 at 4 warps and 8192 do)
    *[(updown._twell_up_down_kernel.fn, {**c, "BLOCK_K": bk}, warps) for c in [UPDOWN, *GROUPED]
      for bk, warps in ((2048, 4), (4096, 8))],
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


@pytest.mark.slow  # a build for sm_90: `make test-all` (docs/testing.md)
def test_kernels_compile_for_hopper_without_spills(tmp_path):
    """The record kernel (N=14336 at tile 128: 112 tiles), the up+down kernel storing u and as each kind of
    neuron-group pass, and the row kernel over the listed rows (K=2048, REDO_ENTRIES a step) build for sm_90
    with no register spills."""
    compile_for_hopper(SM90_COMPILE, tmp_path)


# (K, N, tokens, density, pattern): K=2048 ~2% skewed (13 rows past the width of 256, overflowing tiles);
# K=4096 0.65% uniform (~4.5% of the rows past the up+down row width 256, more than the dense pass's
# ceil(8192 / 32) = 256 rows: the lightest of them listed)
GPU_SHAPES = [(2048, 5632, 4096, 0.02, "skewed"), (4096, 14336, 8192, 0.0065, "uniform")]


@pytest.mark.gpu
@pytest.mark.parametrize("dense_rows", [True, False], ids=["dense-rows", "no-dense-rows"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["k2048-skewed", "k4096-uniform"])
def test_gpu_real_shape_bf16_switch_on_and_off(shape, dense_rows, monkeypatch):
    """bf16 at real shapes, with and without FORWARD_DENSE_ROWS: the record as without the switch (counts
    exactly, rows within the width: ids, gate exactly, up within bf16 rounding), y and sum |h| within bf16
    rounding, and the gradients of both against float64 dense autograd."""
    from benchmarks.ffn import make_inputs

    monkeypatch.setattr(backward, "FORWARD_DENSE_ROWS", dense_rows)
    k, n, m, density, pattern = shape
    x, block = make_inputs(m, k, n, density, pattern, seed=0)
    mlp = twell.sparsify(block.train()).mlp
    wg, bg, wu, wd = mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.down_proj.weight
    params = [x, wg, bg, wu, wd]
    width = twell.kernels.policy.train_width(n)
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
    for name in ("counts", "nonzero"):
        assert torch.equal(on[name], off[name]), name
    within = off["counts"] <= width  # a row past the width: its record unused (zeros from the dense pass)
    assert torch.equal(on["ids"][within], off["ids"][within]) and torch.equal(on["gate"][within], off["gate"][within])
    torch.testing.assert_close(on["up"][within], off["up"][within], rtol=1e-2, atol=1e-2)
    assert rel_err(on["y"], off["y"]) <= 1e-2 and rel_err(on["l1"], off["l1"]) <= 1e-3
    ref_leaves = [p.detach().double().requires_grad_() for p in params]
    xr, rwg, rbg, rwu, rwd = ref_leaves
    h = F.relu(F.linear(xr, rwg, rbg)) * F.linear(xr, rwu)
    ref = F.linear(h, rwd)
    (ref * dy.double()).sum().add(h.abs().sum() * 1e-3).backward()
    for got_on, got_off, want in zip(grads[1], grads[0], ref_leaves, strict=True):
        assert rel_err(got_on, want.grad) <= 2e-2 and rel_err(got_on, got_off) <= 2e-2
