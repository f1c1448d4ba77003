"""Sparse training path (twell::ffn_train and its backward) against float64 dense autograd of
twell.kernels.reference (CPU: Triton's interpreter, fp32/fp16; GPU: bf16 at a real shape too)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, compile_for_hopper, rel_err, slow_unless
from ffn_cases import gated_ref, make_ffn, plain_ref
from torch.utils.checkpoint import checkpoint

import twell
import twell.ops
from twell.kernels import backward, policy, reference

# empty rows, sparse rows, rows past the record width (0.3 of 70 > 16 slots) and fully dense rows
DENSITIES = [0.0, 0.1, 1.0, 0.05, 0.3, 0.02]
GRAD_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every buffer the kernels allocate starts as NaN / -1, so an element they fail to write shows."""
    alloc = backward._alloc

    def poisoned(shape, dtype, device):
        t = alloc(shape, dtype, device)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(backward, "_alloc", poisoned)


def _leaves(case, dtype=None):
    return {
        name: (t.to(dtype) if dtype else t).clone().requires_grad_() if t is not None else None
        for name, t in case.items()
    }


def _train_op(
    leaves, gated, threshold=0.0, drelu=False, squared=False, width=16, entries=1, dense_above=None, hot=0,
    forward_pack=False,
):  # fmt: skip
    if gated:
        args = (leaves["gate_weight"], leaves["up_weight"], leaves["down_weight"], leaves["gate_bias"])
        args += (leaves["up_bias"], leaves["down_bias"])
    else:
        args = (leaves["up_weight"], None, leaves["down_weight"], leaves["up_bias"], None, leaves["down_bias"])
    train = (width, entries, dense_above, hot, forward_pack)
    return torch.ops.twell.ffn_train(leaves["x"], *args, threshold, drelu, squared, *train)


def _check_grads(
    case, gated, dtype, threshold=0.0, drelu=False, squared=False, width=16, entries=1, forward_pack=False
):
    """Output and every gradient of the training op against float64 dense autograd."""
    leaves = _leaves(case)
    y = _train_op(leaves, gated, threshold, drelu, squared, width, entries, forward_pack=forward_pack)[0]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y.backward(dy.to(DEVICE))
    ref_leaves = _leaves(case, torch.float64)
    ref = gated_ref(ref_leaves, threshold, drelu) if gated else plain_ref(ref_leaves, threshold, squared)
    ref.backward(dy.double().to(DEVICE))
    tol = GRAD_TOL[dtype]
    assert rel_err(y, ref) <= tol, "y"
    for name, leaf in leaves.items():
        if leaf is not None:
            assert rel_err(leaf.grad, ref_leaves[name].grad) <= tol, name
    return leaves


VARIANTS = {
    # id: (gated, biases, threshold, drelu, squared)
    "gated-relu-bias": (True, True, 0.0, False, False),
    "gated-relu": (True, False, 0.0, False, False),
    "gated-fatrelu-bias": (True, True, 0.05, False, False),
    "gated-drelu": (True, False, 0.0, True, False),
    "plain-relu-bias": (False, True, 0.0, False, False),
    "plain-relu2": (False, False, 0.0, False, True),
    "plain-fatrelu-relu2-bias": (False, True, 0.05, False, True),
}
CASES = [(v, torch.float32) for v in VARIANTS] + [("gated-relu-bias", torch.float16), ("plain-relu2", torch.float16)]


# dense-backup rows: the dense pass takes ceil(13 / share) of the heaviest rows, the overflow kernel the
# rest: share 1 sends every one to the dense pass; 10**6 sends one there and the others to the kernel
SHARES = [1, 10**6]
SHARE_IDS = {1: "dense-pass", 10**6: "overflow-kernel"}


def _case_id(variant, dtype, share):
    return f"{variant}-{str(dtype)[6:]}-{SHARE_IDS[share]}"


# The default run keeps, through each backup path, the variants that between them take every branch of
# its kernels (a gated ReLU with biases, dReLU without, a plain ReLU, relu²) and one fp16 case; every
# variant runs at least once. Slow: the other combinations.
GRAD_KEPT = {
    ("gated-fatrelu-bias", torch.float32, 1),
    ("gated-drelu", torch.float32, 1),
    ("plain-relu-bias", torch.float32, 1),
    ("plain-relu2", torch.float16, 1),
    ("gated-relu-bias", torch.float16, 10**6),
    ("gated-relu", torch.float32, 10**6),
    ("gated-drelu", torch.float32, 10**6),
    ("plain-relu-bias", torch.float32, 10**6),
    ("plain-fatrelu-relu2-bias", torch.float32, 10**6),
}


@pytest.mark.parametrize(
    "variant,dtype,share",
    [slow_unless((v, d, s) in GRAD_KEPT, v, d, s, id=_case_id(v, d, s)) for v, d in CASES for s in SHARES],
)
def test_every_gradient_matches_dense_autograd(variant, dtype, share, monkeypatch):
    """M=13, K=24, N=70 (no multiple of any block), width 16: empty, sparse, past-width and dense rows."""
    monkeypatch.setattr(backward, "BACKUP_SHARE", share)
    gated, biases, threshold, drelu, squared = VARIANTS[variant]
    case = make_ffn(13, 24, 70, DENSITIES, dtype, DEVICE, seed=3, biases=biases, gated=gated)
    _check_grads(case, gated, dtype, threshold, drelu, squared)


# The default run keeps each step with a gated and a plain FFN. Slow: gated-bias at 8, drelu at 2.
@pytest.mark.parametrize(
    "variant,dtype,entries",
    [
        slow_unless((name, e) not in {("gated-bias", 8), ("drelu", 2)}, v, d, e, id=f"{name}-{e}")
        for (v, d), name in zip(CASES[:1] + CASES[3:4] + CASES[-1:], ["gated-bias", "drelu", "relu2-f16"], strict=True)
        for e in (2, 8)
    ],
)
def test_row_kernels_with_entries_a_step(variant, dtype, entries):
    """LayerConfig.train_entries: the forward and dx row kernels gather 2 / 8 record entries a step
    (rows of 0-16 entries at width 16: partial last steps, empty rows, dense-backup rows' chunks)."""
    gated, biases, threshold, drelu, squared = VARIANTS[variant]
    case = make_ffn(13, 24, 70, DENSITIES, dtype, DEVICE, seed=4, biases=biases, gated=gated)
    _check_grads(case, gated, dtype, threshold, drelu, squared, entries=entries)


@pytest.mark.parametrize(
    "block_k,pairs,warps,maxnreg",
    [(16, 128, 4, 0), (64, 32, 8, 80), (16, 32, 4, 64)],
    ids=["k16-p128", "k64-p32-maxnreg80", "k16-p32-maxnreg64"],
)
def test_dw_kernel_shapes_the_benchmark_varies(block_k, pairs, warps, maxnreg, monkeypatch):
    """The dW kernel at the K blocks / pairs a step / register caps that benchmarks/train.py
    --backward-constant tries (K=24: two K blocks of 16, or one block past K)."""
    settings = {"DW_BLOCK_K": block_k, "DW_PAIRS": pairs, "DW_WARPS": warps, "DW_MAXNREG": maxnreg}
    for name, value in settings.items():
        monkeypatch.setattr(backward, name, value)
    case = make_ffn(13, 24, 70, DENSITIES, torch.float32, DEVICE, seed=6, biases=True)
    _check_grads(case, True, torch.float32)


def test_single_token_and_width_past_n():
    case = make_ffn(1, 24, 70, [0.2], torch.float32, DEVICE, biases=True)
    _check_grads(case, True, torch.float32, width=128)


def test_neuron_active_in_every_token_spans_many_dw_steps(monkeypatch):
    """73 tokens share neuron 5: its pairs take several of the dW kernel's steps (32 pairs a step here),
    with its group's other neurons' pairs in the same steps (each pair must land in its own neuron's
    row); leading dims kept."""
    monkeypatch.setattr(backward, "DW_PAIRS", 32)
    case = make_ffn(73, 16, 40, [0.0, 0.05, 0.1], torch.float32, DEVICE, seed=5, biases=True)
    with torch.no_grad():
        case["gate_weight"][5] = 0.0
        case["gate_bias"][5] = 2.0
    assert 73 > 2 * backward.DW_PAIRS  # neuron 5's pairs span several steps
    case["x"] = case["x"].reshape(73, 1, 16)
    leaves = _check_grads(case, True, torch.float32, width=8)
    assert leaves["x"].grad.shape == (73, 1, 16)


def test_record_holds_the_kept_entries():
    """Rows within the width list their kept neurons in order with the dtype-rounded gate and up
    values; counts are the true counts, also past the width; sum |h| and the nonzeros of h."""
    case = make_ffn(13, 24, 70, DENSITIES, torch.float16, DEVICE, seed=3)
    with torch.no_grad():
        _, ids, gate, up, counts, *_, l1, nonzero = _train_op(case, True)
    pre = F.linear(case["x"], case["gate_weight"])
    kept = ~(pre <= 0)
    assert torch.equal(counts.long(), kept.sum(1))
    h = reference.hidden(case["x"], case["gate_weight"], case["up_weight"])
    assert rel_err(l1, h.abs().double().sum()) <= 1e-3
    assert nonzero.item() == torch.count_nonzero(h).item()
    u = F.linear(case["x"], case["up_weight"])
    for m in range(13):
        c = int(counts[m])
        if c <= 16:
            cols = kept[m].nonzero().flatten()
            assert torch.equal(ids[m, :c].long(), cols)
            assert torch.equal(gate[m, :c], pre[m, cols])
            assert rel_err(up[m, :c], u[m, cols]) <= 1e-3


@pytest.mark.parametrize("gated,biases,drelu,squared", [(True, True, True, False), (False, False, False, True)])
@pytest.mark.parametrize(
    "share,entries", [(SHARES[0], 1), (SHARES[1], 1), (SHARES[0], 4)], ids=["dense-pass", "overflow-kernel", "entries4"]
)
def test_l1_penalty_gradient(gated, biases, drelu, squared, share, entries, monkeypatch):
    """loss = <y, dy> + lam * sum |h|: the L1 term's gradient flows through the record (and through the
    recomputed dense-backup rows) as dense autograd's through |h|."""
    monkeypatch.setattr(backward, "BACKUP_SHARE", share)
    case = make_ffn(13, 24, 70, DENSITIES, torch.float32, DEVICE, seed=4, biases=biases, gated=gated)
    leaves = _leaves(case)
    y, *_, l1, _ = _train_op(leaves, gated, drelu=drelu, squared=squared, entries=entries)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    lam = 3.0  # large, so the L1 term's share of every gradient is far above the tolerance
    ((y * dy).sum() + lam * l1).backward()
    ref_leaves = _leaves(case, torch.float64)
    x, wd, bd = ref_leaves["x"], ref_leaves["down_weight"], ref_leaves["down_bias"]
    wu, bu = ref_leaves["up_weight"], ref_leaves["up_bias"]
    wg, bg = (ref_leaves["gate_weight"], ref_leaves["gate_bias"]) if gated else (wu, bu)
    if not gated:  # the plain FFN's only projection plays the gate's part
        wu, bu = None, None
    h = reference.hidden(x, wg, wu, bg, bu, 0.0, drelu, squared)
    ((F.linear(h, wd, bd) * dy.double()).sum() + lam * h.abs().sum()).backward()
    assert rel_err(l1, h.abs().sum()) <= 1e-5
    for name, leaf in leaves.items():
        if leaf is not None:
            assert rel_err(leaf.grad, ref_leaves[name].grad) <= 1e-4, name


def _measured_calls(monkeypatch, cases, gated, dense_above, dtype=torch.float32, hot=0):
    """One training call of the op per case, all on the same weight tensors (one layer's state) with
    `dense_above`: each call's loss <y, dy> + 3 sum |h| and every gradient against float64 dense
    autograd; returns per call whether it trained dense (its record marks every row past the width),
    after checking that exactly those calls' backward ran dense, each on the g, u and h its forward kept
    (dense autograd's products, none recomputed)."""
    backward.forget_train_layers()
    dense_backward, backward_modes = backward._dense_backward, []

    def spy(*args, **kwargs):
        assert kwargs["saved"] is not None, "a dense-mode backward recomputed its forward's activations"
        backward_modes[-1] = True
        return dense_backward(*args, **kwargs)

    monkeypatch.setattr(backward, "_dense_backward", spy)
    weights = {name: t.to(dtype).clone().requires_grad_() if t is not None else None for name, t in cases[0].items()}
    modes = []
    for i, case in enumerate(cases):
        for w in weights.values():
            if w is not None:
                w.grad = None
        leaves = {**weights, "x": case["x"].to(dtype).clone().requires_grad_()}
        y, _, _, _, counts, *_, l1, nonzero = _train_op(leaves, gated, dense_above=dense_above, hot=hot)
        modes.append(bool((counts == 17).all()))
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(i)).to(DEVICE, dtype)
        backward_modes.append(False)
        ((y * dy).sum() + 3.0 * l1).backward()
        ref = {name: t.double().detach().requires_grad_() if t is not None else None for name, t in leaves.items()}
        wg, bg, wu, bu = ref["up_weight"], ref["up_bias"], None, None  # a plain FFN's projection plays the gate
        if gated:
            wg, bg, wu, bu = ref["gate_weight"], ref["gate_bias"], wg, bg
        h = reference.hidden(ref["x"], wg, wu, bg, bu)
        ((F.linear(h, ref["down_weight"], ref["down_bias"]) * dy.double()).sum() + 3.0 * h.abs().sum()).backward()
        assert rel_err(y, F.linear(h, ref["down_weight"], ref["down_bias"])) <= GRAD_TOL[dtype], (i, "y")
        assert rel_err(l1, h.abs().sum()) <= GRAD_TOL[dtype], (i, "l1")
        assert nonzero.item() == torch.count_nonzero(h).item(), (i, "nonzero")
        for name, leaf in leaves.items():
            if leaf is not None:
                assert rel_err(leaf.grad, ref[name].grad) <= GRAD_TOL[dtype], (i, name)
    assert backward_modes == modes
    return modes


@pytest.mark.parametrize("gated,dtype", [(True, torch.float32), (False, torch.float32), (True, torch.float16)])
def test_dense_above_trains_a_measured_dense_layer_dense(gated, dtype, monkeypatch):
    """LayerConfig.train_dense_above: the first call of a layer trains sparse and is measured; a layer
    measured denser than dense_above trains its next calls dense (cuBLAS), measured too, and back
    sparse once a call measures sparse again; every call's gradients exact. The weights are the same
    tensors throughout (make_ffn draws them before the rows' offsets)."""
    dense = make_ffn(13, 24, 70, [0.3, 1.0, 0.5], torch.float64, DEVICE, seed=7, biases=True, gated=gated)
    sparse = make_ffn(13, 24, 70, [0.0, 0.05, 0.02], torch.float64, DEVICE, seed=7, biases=True, gated=gated)
    assert torch.equal(dense["up_weight"], sparse["up_weight"])
    modes = _measured_calls(monkeypatch, [dense, dense, sparse, sparse], gated, 0.1, dtype)
    assert modes == [False, True, True, False]  # the third call, dense still, measures the sparse rows


def test_dense_above_counts_rows_past_the_width(monkeypatch):
    """Below dense_above, a layer with more than BACKUP_MAX_SHARE of its rows past the record width
    trains dense too; one with fewer stays sparse, its backward's dense pass sized by the rows it
    measured past the width (1.25x as a power of two, at least BACKUP_MIN_ROWS) instead of 1 in
    BACKUP_SHARE, so none of them walks."""
    case = make_ffn(13, 24, 70, [0.3, 0.0], torch.float64, DEVICE, seed=8, biases=True)  # 7 rows past 16
    assert _measured_calls(monkeypatch, [case] * 2, True, 1.0) == [False, True]
    passes, dense_backup = [], backward._dense_backup
    monkeypatch.setattr(
        backward, "_dense_backup", lambda top, *a, **kw: passes.append(len(top)) or dense_backup(top, *a, **kw)
    )
    case = make_ffn(40, 24, 70, [0.3] + [0.05] * 12, torch.float64, DEVICE, seed=9, biases=True)  # 4 rows past 16
    assert _measured_calls(monkeypatch, [case] * 2, True, 1.0) == [False, False]
    assert passes == [2, 16]  # ceil(40 / 32), then max(16, 5 -> 8)


def _dense_mode_layer(gated=True, dtype=torch.float32):
    """A layer whose first (sparse) call measured it dense: its next calls train dense."""
    backward.forget_train_layers()
    case = make_ffn(13, 24, 70, [0.3, 1.0, 0.5], dtype, DEVICE, seed=7, biases=True, gated=gated)
    leaves = _leaves(case)
    _train_op(leaves, gated, dense_above=0.1)[0].sum().backward()
    return case, leaves


def test_dense_mode_keeps_its_activations_only_while_its_record_lives():
    """A dense-mode forward's g, u, h are kept for its backward while the record's counts live: a
    forward whose backward never runs leaves nothing behind once its outputs go, and a backward run
    twice (retain_graph) finds them both times."""
    case, leaves = _dense_mode_layer()
    assert not backward._dense_saved  # the first call's record is gone with its graph
    out = _train_op(leaves, True, dense_above=0.1)
    assert (out[4] == 17).all() and len(backward._dense_saved) == 1
    del out
    assert not backward._dense_saved
    y, _, _, _, counts, *_ = _train_op(leaves, True, dense_above=0.1)
    (saved,) = backward._dense_saved.values()
    assert saved[0]() is counts
    g, u = saved[1:3]
    ref = _leaves(case, torch.float64)
    assert torch.equal(g, F.linear(leaves["x"], leaves["gate_weight"], leaves["gate_bias"]).detach())
    assert torch.equal(u, F.linear(leaves["x"], leaves["up_weight"], leaves["up_bias"]).detach())
    for w in leaves.values():
        w.grad = None
    y.sum().backward(retain_graph=True)
    first = {name: leaf.grad.clone() for name, leaf in leaves.items()}
    y.sum().backward()
    gated_ref(ref, 0.0, False).sum().backward()
    for name, leaf in leaves.items():
        assert torch.allclose(leaf.grad, 2 * first[name], rtol=1e-5, atol=1e-6), name
        assert rel_err(first[name], ref[name].grad) <= 1e-4, name
    del y, counts, saved
    assert not backward._dense_saved


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_dense_mode_without_its_activations_recomputes_them(gated, monkeypatch):
    """A dense-mode record whose kept activations are not found (dropped here) is still trained exactly:
    the backward recomputes g and u from x (two more products)."""
    case, leaves = _dense_mode_layer(gated)
    y = _train_op(leaves, gated, dense_above=0.1)[0]
    backward._dense_saved.clear()
    for w in leaves.values():
        if w is not None:
            w.grad = None
    y.square().sum().backward()
    ref = _leaves(case, torch.float64)
    (gated_ref(ref, 0.0, False) if gated else plain_ref(ref, 0.0, False)).square().sum().backward()
    for name, leaf in leaves.items():
        if leaf is not None:
            assert rel_err(leaf.grad, ref[name].grad) <= 1e-4, name


def test_dense_mode_under_checkpoint_and_compile(monkeypatch):
    """Activation checkpointing recomputes a dense-mode forward (its first forward's activations go
    with its record) and torch.compile (Inductor) traces it: both give the eager gradients, each
    backward on its forward's kept activations (the compiled graph hands the op's record through as
    it came), nothing left kept."""
    _, leaves = _dense_mode_layer()
    dense_backward, found = backward._dense_backward, []
    monkeypatch.setattr(
        backward, "_dense_backward", lambda *a, **kw: found.append(kw["saved"] is not None) or dense_backward(*a, **kw)
    )

    def loss(leaves):
        return _train_op(leaves, True, dense_above=0.1)[0].square().sum()

    grads = []
    for run in (loss, lambda ls: checkpoint(loss, ls, use_reentrant=False), torch.compile(loss, fullgraph=True)):
        for leaf in leaves.values():
            leaf.grad = None
        run(leaves).backward()
        assert backward.train_state(leaves["gate_weight"]).forward_dense
        grads.append({name: leaf.grad for name, leaf in leaves.items()})
    for name, eager in grads[0].items():
        assert torch.allclose(grads[1][name], eager, rtol=1e-5, atol=1e-6), name
        assert torch.allclose(grads[2][name], eager, rtol=1e-5, atol=1e-6), name
    assert found == [True, True, True] and not backward._dense_saved


RELU_CASES = [(v, d) for v, d in CASES if VARIANTS[v][2:] == (0.0, False, False)]
# The default run keeps, through each backup path, a gated FFN with and without biases and a plain one
# (one fp16 case among them). Slow: gated-relu-bias through the other path in each dtype.
HOT_GRAD_KEPT = {
    ("gated-relu-bias", torch.float32, 1),
    ("gated-relu", torch.float32, 1),
    ("plain-relu-bias", torch.float32, 1),
    ("gated-relu-bias", torch.float16, 10**6),
    ("gated-relu", torch.float32, 10**6),
    ("plain-relu-bias", torch.float32, 10**6),
}


@pytest.mark.parametrize(
    "variant,dtype,share",
    [slow_unless((v, d, s) in HOT_GRAD_KEPT, v, d, s, id=_case_id(v, d, s)) for v, d in RELU_CASES for s in SHARES],
)
def test_hot_neurons_every_gradient_matches_dense_autograd(variant, dtype, share, monkeypatch):
    """LayerConfig.train_hot: 16 of the 70 neurons by dense products, the record the rest; three calls
    on one layer (hot neurons of its own gate, then of the previous call's counts), each with the L1
    term, on empty, sparse, past-width and dense rows (through the dense pass and the overflow
    kernel, which must leave the hot neurons to the hot products): y, sum |h|, the nonzero count and
    every gradient against float64."""
    monkeypatch.setattr(backward, "BACKUP_SHARE", share)
    gated, biases = VARIANTS[variant][:2]
    cases = [make_ffn(13, 24, 70, DENSITIES, dtype, DEVICE, seed=s, biases=biases, gated=gated) for s in (3, 3, 5)]
    assert _measured_calls(monkeypatch, cases, gated, None, dtype, hot=16) == [False, False, False]


@pytest.mark.parametrize("variant", ["gated-fatrelu-bias", "gated-drelu", "plain-relu2", "plain-fatrelu-relu2-bias"])
def test_hot_neurons_relu2_and_thresholds(variant):
    """The hot products' activations (relu², a threshold, dReLU) as the record kernels take them."""
    gated, biases, threshold, drelu, squared = VARIANTS[variant]
    case = make_ffn(13, 24, 70, DENSITIES, torch.float32, DEVICE, seed=3, biases=biases, gated=gated)
    backward.forget_train_layers()
    leaves = _leaves(case)
    y = _train_op(leaves, gated, threshold, drelu, squared, hot=32)[0]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    y.backward(dy.to(DEVICE))
    ref_leaves = _leaves(case, torch.float64)
    ref = gated_ref(ref_leaves, threshold, drelu) if gated else plain_ref(ref_leaves, threshold, squared)
    ref.backward(dy.double().to(DEVICE))
    assert rel_err(y, ref) <= 1e-4, "y"
    for name, leaf in leaves.items():
        if leaf is not None:
            assert rel_err(leaf.grad, ref_leaves[name].grad) <= 1e-4, name


def test_hot_neurons_are_the_most_frequent_of_the_previous_call(monkeypatch):
    """The first call's hot neurons are the most frequent in its own gate, the next call's those of
    the first call (record pairs plus the hot columns' kept entries), kept on the device; the record
    holds no hot neuron, and dense mode (train_dense_above) keeps the hot record too."""
    case = make_ffn(13, 24, 70, [0.1, 0.05, 0.2, 0.0], torch.float32, DEVICE, seed=11, biases=True)
    backward.forget_train_layers()
    leaves = _leaves(case)
    kept = F.linear(case["x"], case["gate_weight"], case["gate_bias"]) > 0
    assert (kept.sum(1) <= 16).all()  # no row past the width: every pair is counted
    frequency = kept.sum(0)
    y, ids, _, _, counts, hot_ids, hot_gate, _, _, _ = _train_op(leaves, True, hot=16)
    assert frequency[hot_ids].min() >= frequency[~torch.isin(torch.arange(70), hot_ids)].max()
    valid = torch.arange(16)[None, :] < counts[:, None]
    assert not torch.isin(ids[valid], hot_ids).any()
    assert torch.equal(hot_gate, F.linear(leaves["x"], leaves["gate_weight"], leaves["gate_bias"])[:, hot_ids].detach())
    state = backward.train_state(leaves["gate_weight"])
    state.hot.copy_(torch.arange(16))  # the backward replaces it in place with the call's most frequent
    y.sum().backward()
    assert set(state.hot.tolist()) == set(hot_ids.tolist())
    state.hot.copy_(torch.arange(16, 32))
    second = _train_op(leaves, True, hot=16)
    assert set(second[5].tolist()) == set(range(16, 32))  # the layer's, not the call's own most frequent
    second[0].sum().backward()
    assert set(state.hot.tolist()) == set(hot_ids.tolist())


# the hot columns' elementwise kernels: (gated, threshold, drelu, squared) of VARIANTS' kinds
HOT_KINDS = {
    "gated-relu": (True, 0.0, False, False),
    "gated-fatrelu": (True, 0.05, False, False),
    "gated-drelu": (True, 0.0, True, False),
    "plain-relu": (False, 0.0, False, False),
    "plain-fatrelu-relu2": (False, 0.05, False, True),
}
HOT_SHAPES = [(45, 16), (70, 48), (33, 64)]  # M past a multiple of BACKUP_BLOCK_T, H from 16 to 64


def _hot_columns_case(m, n_hot, dtype, seed):
    """Gate g and up u [M, H] (a third of g kept, some of u negative, exact zeros in both), dhp [M, H]."""
    gen = torch.Generator().manual_seed(seed)
    g, u, dhp = (torch.randn(m, n_hot, generator=gen) for _ in range(3))
    g[:, ::5] = 0.0
    u[::7] = 0.0
    g -= 0.4
    return g.to(DEVICE, dtype), u.to(DEVICE, dtype), dhp.to(DEVICE, dtype)


def _hot_h(g, u, threshold, drelu, squared):
    """h of the hot columns as torch computes it in g's dtype (the torch ops the kernels replace), and
    the kept mask."""
    kept = ~(g <= threshold)
    gf = g.float()
    if u is not None:
        h = gf * (torch.relu(u.float()) if drelu else u.float())
    else:
        h = gf * gf if squared else gf
    return torch.where(kept, h, 0.0).to(g.dtype), kept


@pytest.mark.parametrize("m,n_hot", HOT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("kind", HOT_KINDS)
def test_hot_forward_kernel_matches_the_torch_ops(kind, dtype, m, n_hot):
    """backward._hot_hidden (one kernel): the hot columns' h bit for bit as the torch ops gave it, sum
    |h| against float64 and the nonzero count exact (outputs NaN-poisoned)."""
    gated, threshold, drelu, squared = HOT_KINDS[kind]
    g, u, _ = _hot_columns_case(m, n_hot, dtype, seed=m + n_hot)
    u = u if gated else None
    h, l1, nonzero = backward._hot_hidden(g, u, threshold, drelu, squared)
    want, _ = _hot_h(g, u, threshold, drelu, squared)
    assert torch.equal(h, want)
    exact, _ = _hot_h(g.double(), u.double() if gated else None, threshold_of(threshold, dtype), drelu, squared)
    assert rel_err(l1, exact.abs().sum()) <= GRAD_TOL[dtype]
    assert nonzero.dtype == torch.int64 and nonzero.item() == torch.count_nonzero(want).item() > 0


def threshold_of(threshold, dtype):
    """The threshold as a `dtype` tensor's comparison takes it (rounded to the dtype)."""
    return torch.tensor(threshold, dtype=dtype).item()


@pytest.mark.parametrize("biases", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("m,n_hot", HOT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("kind", HOT_KINDS)
def test_hot_backward_kernel_matches_the_torch_ops(kind, dtype, m, n_hot, biases):
    """backward._hot_grads (one kernel): dg, du and h of the hot columns bit for bit as the torch ops
    gave them (dh = dhp + dl1 sign h, zero outside kept entries), their bias sums added at the hot
    neurons of the fp32 accumulators (the others untouched) against float64, and each hot column's
    kept count exact (outputs NaN-poisoned)."""
    gated, threshold, drelu, squared = HOT_KINDS[kind]
    g, u, dhp = _hot_columns_case(m, n_hot, dtype, seed=2 * m + n_hot)
    u = u if gated else None
    n = 3 * n_hot + 5
    hot_ids = torch.randperm(n, generator=torch.Generator().manual_seed(m))[:n_hot].to(DEVICE)
    start = torch.randn(2, n, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    acc_bg, acc_bu = start[0].clone(), start[1].clone()
    counts = torch.randint(0, 20, (m,), dtype=torch.int32).to(DEVICE)
    dl1 = torch.tensor([0.3], device=DEVICE)
    dg, du, h, kept = backward._hot_grads(
        g, u, dhp, counts, dl1, hot_ids, acc_bg if biases else None, acc_bu if biases and gated else None,
        threshold=threshold, drelu=drelu, square=squared,
    )  # fmt: skip
    want_h, mask = _hot_h(g, u, threshold, drelu, squared)
    dh = dhp.float() + dl1 * torch.sign(want_h.float())
    gf = g.float()
    if gated:
        uf = u.float()
        want_dg = dh * (torch.relu(uf) if drelu else uf)
        want_du = torch.where(uf > 0, dh * gf, 0.0) if drelu else dh * gf
        assert torch.equal(du, torch.where(mask, want_du, 0.0).to(dtype)), "du"
    else:
        want_dg = 2.0 * gf * dh if squared else dh
        assert du is dg
    want_dg = torch.where(mask, want_dg, 0.0)
    assert torch.equal(h, want_h), "h"
    assert torch.equal(dg, want_dg.to(dtype)), "dg"
    assert torch.equal(kept, mask.sum(0, dtype=torch.int32)), "kept counts"
    others = ~torch.isin(torch.arange(n, device=DEVICE), hot_ids)
    for acc, grad, on in ((acc_bg, dg, biases), (acc_bu, du, biases and gated)):
        want = start[0 if acc is acc_bg else 1].double().clone()
        if on:
            want[hot_ids] += grad.double().sum(0)
        assert rel_err(acc, want) <= GRAD_TOL[dtype] and torch.equal(acc[others], want[others].float())


def test_hot_neurons_with_dense_above(monkeypatch):
    """Hot neurons and measured dense mode together: sparse, dense, back to sparse, every gradient exact."""
    dense = make_ffn(13, 24, 70, [0.3, 1.0, 0.5], torch.float64, DEVICE, seed=7, biases=True)
    sparse = make_ffn(13, 24, 70, [0.0, 0.05, 0.02], torch.float64, DEVICE, seed=7, biases=True)
    modes = _measured_calls(monkeypatch, [dense, dense, sparse, sparse], True, 0.1, hot=16)
    assert modes == [False, True, True, False]


def test_without_dense_above_every_call_trains_sparse(monkeypatch):
    """A fully dense layer: its second call, after the first measured it, still trains sparse."""
    case = make_ffn(13, 24, 70, [1.0], torch.float64, DEVICE, seed=8, biases=True)
    assert _measured_calls(monkeypatch, [case] * 2, True, None) == [False, False]


def test_compile_fullgraph_and_checkpoint():
    """torch.compile traces forward and backward with no graph break; activation checkpointing
    recomputes the forward; both give the eager gradients."""
    case = make_ffn(6, 16, 40, [0.0, 0.2, 1.0], torch.float32, DEVICE, biases=True)

    def loss(leaves):
        return _train_op(leaves, True, width=8)[0].square().sum()

    eager = _leaves(case)
    loss(eager).backward()
    compiled = _leaves(case)
    torch.compile(loss, fullgraph=True, backend="aot_eager")(compiled).backward()
    ckpt = _leaves(case)
    checkpoint(loss, ckpt, use_reentrant=False).backward()
    for name, leaf in eager.items():
        assert torch.allclose(compiled[name].grad, leaf.grad, rtol=1e-5, atol=1e-6), name
        assert torch.allclose(ckpt[name].grad, leaf.grad, rtol=1e-5, atol=1e-6), name


def test_compile_dynamic_takes_the_settings_as_symbols():
    """torch.compile(dynamic=True) traces the op's int settings (hot) as symbols: the op specialises
    them instead of refusing them (benchmarks/train.py compiles so)."""
    case = make_ffn(6, 16, 40, [0.0, 0.2, 1.0], torch.float32, DEVICE, biases=True)

    def loss(leaves, hot):
        return _train_op(leaves, True, width=8, hot=hot)[0].square().sum()

    eager, compiled = _leaves(case), _leaves(case)
    loss(eager, 16).backward()
    torch.compile(loss, dynamic=True, backend="aot_eager")(compiled, 16).backward()
    for name, leaf in eager.items():
        assert torch.allclose(compiled[name].grad, leaf.grad, rtol=1e-5, atol=1e-6), name


# Slow: gated without hot neurons (the empty hot record is built alike for a gated and a plain FFN:
# plain-no-hot checks it; gated-hot checks the gated FFN's other outputs, which do not depend on hot)
@pytest.mark.parametrize(
    "gated,hot",
    [
        slow_unless(
            (gated, hot) != (True, 0), gated, hot, id=f"{'gated' if gated else 'plain'}-{'hot' if hot else 'no-hot'}"
        )
        for hot in (0, 16)
        for gated in (True, False)
    ],
)
def test_opcheck_fake_tensors_and_autograd_registration(gated, hot):
    """torch.library.opcheck: schemas, fake implementations (shapes, strides, dtypes) matching the real
    outputs, autograd registration, and the ops traced by AOT autograd with dynamic shapes."""
    case = make_ffn(6, 16, 40, [0.0, 0.2, 1.0], torch.float32, DEVICE, biases=True, gated=gated)
    leaves = _leaves(case)
    if gated:
        weights = (leaves["gate_weight"], leaves["up_weight"], leaves["down_weight"], leaves["gate_bias"])
        weights += (leaves["up_bias"], leaves["down_bias"])
    else:
        weights = (leaves["up_weight"], None, leaves["down_weight"], leaves["up_bias"], None, leaves["down_bias"])
    args = (leaves["x"], *weights, 0.0, False, not gated, 8, 1, None, hot)
    torch.library.opcheck(torch.ops.twell.ffn_train.default, args)
    with torch.no_grad():
        _, ids, gate, up, counts, *hot_record, _, _ = torch.ops.twell.ffn_train(*args)
    gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias = (
        t.detach() if t is not None else None for t in weights
    )
    dy, l1_grad = torch.randn_like(case["x"]), torch.tensor(0.5, device=DEVICE)
    backward_args = (dy, l1_grad, case["x"], gate_weight, up_weight, down_weight, gate_bias, up_bias)
    backward_args += (down_bias is not None, ids, gate, up, counts, *hot_record, 0.0, False, not gated)
    torch.library.opcheck(torch.ops.twell.ffn_train_backward.default, backward_args)


def test_routing_needs_cuda_grad_and_the_kernel_layout():
    case = make_ffn(4, 16, 40, [0.2], torch.float32, biases=True)
    args = (case["gate_weight"], case["up_weight"], case["down_weight"], (None, None, None))
    x = case["x"].requires_grad_()
    assert not twell.kernels.library.sparse_training(x, *args, 1)  # CPU: the dense reference's autograd
    assert not twell.kernels.library.sparse_training(case["x"].detach(), *args, 1)  # no grad needed
    assert policy.train_width(5632) == 256 and policy.train_width(14336) == 512 and policy.train_width(40) == 64


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"width": 0}, ValueError, "width must be >= 1, got 0"),
        ({"up_weight": None}, ValueError, "up_bias needs up_weight"),
        ({"x": torch.randn(3, 15)}, ValueError, r"x must have shape \[\.\.\., 16\]"),
    ],
    ids=["width", "up-bias-alone", "x-width"],
)
def test_bad_input_names_what_is_wrong(change, error, match):
    args = {"x": torch.randn(3, 16), "up_weight": torch.randn(40, 16), "width": 8}
    args.update(change)
    with pytest.raises(error, match=match):
        torch.ops.twell.ffn_train(
            args["x"], torch.randn(40, 16), args["up_weight"], torch.randn(16, 40), None, torch.randn(40), None,
            0.0, False, False, args["width"],
        )  # fmt: skip


def test_kernel_rejects_strided_weight_rows():
    x = torch.randn(3, 16)
    w = torch.randn(16, 40).t()
    with pytest.raises(ValueError, match="gate_weight must have unit stride along K"):
        backward.train_forward(
            x, w, None, None, None, torch.randn(40, 16), None, threshold=0.0, drelu=False, square=False, width=8
        )


def _train_args(change=None):
    case = make_ffn(3, 16, 40, [0.2], torch.float32, biases=True)
    args = {
        "x": case["x"],
        "gate_weight": case["gate_weight"],
        "gate_bias": case["gate_bias"],
        "up_weight": case["up_weight"],
        "up_bias": case["up_bias"],
        "down_weight_t": case["down_weight"].t().contiguous(),
        "down_bias": case["down_bias"],
    }
    return {**args, **(change(args) if change else {})}


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {"x": a["x"].t().contiguous().t()}, "x must have unit stride along K"),
        (lambda a: {"x": a["x"].half()}, r"gate_weight must be \[40, 16\] torch.float16"),
        (lambda a: {"gate_bias": a["gate_bias"][:20]}, r"gate_bias must be \[40\]"),
        (lambda a: {"down_bias": a["gate_bias"]}, r"down_bias must be \[16\]"),
        (lambda a: {"up_weight": None}, "up_bias needs up_weight"),
    ],
    ids=["x-strided", "x-dtype", "gate-bias", "down-bias", "up-bias-alone"],
)
def test_train_forward_checks_its_inputs(change, match):
    a = _train_args(change)
    with pytest.raises(ValueError, match=match):
        backward.train_forward(**a, threshold=0.0, drelu=False, square=False, width=8)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda r: {"ids": r["ids"].long()}, r"ids must be \[3, 8\] torch.int32"),
        (lambda r: {"gate": r["gate"][:, :4]}, r"gate must be \[3, 8\] torch.float32"),
        (lambda r: {"counts": r["counts"][:2]}, r"counts must be \[3\] torch.int32"),
        (lambda r: {"up": r["up"].t().contiguous().t()}, "up must be contiguous"),
        (lambda r: {"l1_grad": r["l1_grad"].double()}, "l1_grad must be a one-element float32 tensor"),
    ],
    ids=["ids-dtype", "gate-width", "counts-rows", "up-strided", "l1-grad-dtype"],
)
def test_train_backward_checks_its_record(change, match):
    """The record is indexed as dense [M, W] rows: one of another size or type would be read past its end."""
    a = _train_args()
    _, ids, gate, up, counts, *_ = backward.train_forward(**a, threshold=0.0, drelu=False, square=False, width=8)
    record = {"ids": ids, "gate": gate, "up": up, "counts": counts, "l1_grad": torch.zeros((), dtype=torch.float32)}
    record.update(change(record))
    a.pop("down_bias")
    with pytest.raises(ValueError, match=match):
        backward.train_backward(
            torch.randn_like(a["x"]), record["l1_grad"], a["x"], a["gate_weight"], a["gate_bias"], a["up_weight"],
            a["up_bias"], a["down_weight_t"], True, record["ids"], record["gate"], record["up"], record["counts"],
            threshold=0.0, drelu=False, square=False,
        )  # fmt: skip


SM90_COMPILE = """
import subprocess, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from twell.kernels import backward

FP32 = ("dl1", "accg", "accu", "accd", "accbg", "accbu", "l1")
def arg_type(name):
    if not name.endswith("_ptr"):
        return "fp32" if name == "threshold" else "i32"
    base = name[: -len("_ptr")]
    return {"ids": "*i32", "cnt": "*i32", "nz": "*i32", "kept": "*i32", "rows": "*i64", "order": "*i64",
            "pair_rows": "*i32", "starts": "*i32", "cols": "*i64", "colcnt": "*i32", "write": "*i8"}.get(
                base, "*fp32" if base in FP32 else "*bf16")

cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
flags = dict(HAS_UP_BIAS=True, HAS_DOWN_BIAS=True, DRELU=False, SQUARE=False, HAS_GATE_BIAS=True,
             SCAN=backward.SCAN, CHUNK=256, ROWS=1, PRECISION="tf32", GROUP=backward.DW_GROUP,
             PAIRS=backward.DW_PAIRS, STAGES=backward.DW_STAGES, BLOCK_T=backward.BACKUP_BLOCK_T,
             BLOCK_N=backward.BACKUP_BLOCK_N, STORE_H=True, HOT=False, LISTED=False, STORE_KEPT=True,
             RECORD=False)
warps = backward._row_warps
for kernel, block_k, entries, options in [
    (backward._train_forward_kernel, 8192, 1, {"num_warps": warps(8192)}),
    (backward._train_dx_kernel, 2048, 1, {"num_warps": warps(2048)}),
    (backward._train_dx_kernel, 8192, 1, {"num_warps": warps(8192)}),
    *[(kernel, block_k, e, {"num_warps": warps(block_k, entries=e)})
      for kernel in (backward._train_forward_kernel, backward._train_dx_kernel)
      for block_k in (2048, 4096, 8192) for e in sorted({backward._row_entries(e, block_k) for e in (2, 4, 8)})],
    (backward._train_backup_kernel, 2048, 1, {"num_warps": warps(2048, True)}),
    (backward._train_backup_kernel, 4096, 1, {"num_warps": warps(4096, True)}),  # spills at 8192
    (backward._train_dw_kernel, backward.DW_BLOCK_K, 1, {"num_warps": backward.DW_WARPS}),
    (backward._backup_grads_kernel, 0, 1, {"num_warps": backward.BACKUP_WARPS}),
    (backward._backup_grads_kernel, -1, 1, {"num_warps": backward.BACKUP_WARPS}),  # HOT (_hot_grads)
    (backward._dense_hidden_kernel, 0, 1, {"num_warps": backward.BACKUP_WARPS}),
    (backward._dense_hidden_kernel, -2, 1, {"num_warps": backward.DENSE_ROW_WARPS}),  # RECORD (_dense_rows)
]:
    for has_up in (True, False):
        names = [p.name for p in kernel.params if p.is_constexpr]
        given = {**flags, "HAS_UP": has_up, "WIDTH": 512, "BLOCK_K": block_k, "ENTRIES": entries}
        if block_k == -1:
            given.update(HOT=True, WIDTH=-1)
        if block_k == -2:
            given.update(RECORD=True, STORE_KEPT=False)
        consts = {n: v for n, v in given.items() if n in names}
        signature = {n: "constexpr" if n in consts else arg_type(n) for n in kernel.arg_names}
        # pointers, strides and K divisible by 16, as the launcher specialises them (vectorised row loads)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                 if signature[n] != "constexpr" and (n.endswith("_ptr") or n.startswith("stride") or n == "K")}
        out = compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
        Path("k.cubin").write_bytes(out.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "-res-usage", "k.cubin"], capture_output=True, text=True).stdout
        assert "STACK:0 " in usage and "LOCAL:0 " in usage, (kernel.__name__, usage)  # no spills
        # the dW loop's x / dy gathers and coefficients, the dx loop's weight rows (at STAGES 3) load ahead
        if kernel in (backward._train_dw_kernel, backward._train_dx_kernel):
            copies = out.asm["ttgir"].count("async_copy_global_to_local")
            assert copies >= 5, (kernel.__name__, copies, "gathers not pipelined")
        print(kernel.__name__, block_k, entries, options["num_warps"], has_up,
              [f for line in usage.splitlines() if "REG:" in line for f in line.split() if f.startswith("REG:")])
"""


@pytest.mark.slow  # a build for sm_90: `make test-all` (docs/testing.md)
def test_kernels_compile_for_hopper_without_spills(tmp_path):
    """Triton's compiler and ptxas build every training kernel for sm_90 (no GPU needed), at the
    widest rows they take (K = policy.MAX_K = 8192; the dense-backup launch at 4096), with no register
    spills."""
    compile_for_hopper(SM90_COMPILE, tmp_path)


# ----------------------------------------------------------------------------------------------------
# GPU: real shapes, bf16, the user's path (sparsify), torch.compile and CUDA graphs


@pytest.fixture
def sparse_training_on():
    """The sparse training path is opt-in (LayerConfig.train_min_m is None by default): a config with
    it on, for a test."""
    return twell.LayerConfig(train_min_m=1)


def _layer(k, n, m, density, config, seed=0):
    """A ReLU-gated FFN module (down weight as sparsify stores it) firing at about `density`, its
    rewritten FFN running with `config`."""
    from benchmarks.ffn import make_inputs

    x, block = make_inputs(m, k, n, density, "skewed", seed=seed)
    names = ("train_min_m", "train_entries", "train_dense_above", "train_hot")
    layer_config = {name: getattr(config, name) for name in names}
    block = twell.sparsify(block.train(), layer_config=layer_config)
    return x, block


@pytest.mark.gpu
@pytest.mark.parametrize(
    "k,n,entries,hot", [(2048, 5632, 1, 0), (2048, 5632, 4, 0), (4096, 14336, 4, 0), (2048, 5632, 1, 256)]
)
def test_gpu_real_shape_bf16_matches_dense_autograd(k, n, entries, hot, sparse_training_on):
    """bf16 at real shapes (4096 tokens, 1% skewed: rows past the record width too), the row kernels at
    1 and 4 entries a step."""
    m = 4096
    backward.forget_train_layers()
    x, block = _layer(k, n, m, 0.01, sparse_training_on.replace(train_entries=entries, train_hot=hot))
    mlp = block.mlp
    params = [mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.down_proj.weight]
    wg, bg, wu, wd = params
    xs = x.clone().requires_grad_()
    assert twell.kernels.library.sparse_training(xs, wg, wu, wd, (bg, None, None), 1)  # the sparse path runs
    y = block(xs)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_leaves = [x.double().requires_grad_()] + [p.detach().double().requires_grad_() for p in params]
    xr, rwg, rbg, rwu, rwd = ref_leaves
    ref = twell.kernels.reference.gated_ffn_reference(xr, rwg, rwu, rwd, rbg)
    ref.backward(dy.double())
    assert rel_err(y, ref) <= 1e-2
    for got, want in zip([xs.grad] + [p.grad for p in params], ref_leaves, strict=True):
        assert rel_err(got, want.grad) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dense_above,hot", [(None, 0), (0.005, 0), (None, 64)], ids=["sparse", "measured-dense", "hot"]
)
def test_gpu_compiled_training_step_and_cuda_graph(dense_above, hot, sparse_training_on):
    """Eager, compiled and CUDA-graph steps agree; with train_dense_above under the layer's ~1% density,
    the first step trains sparse and the later ones (compiled, captured) dense; with hot neurons, the
    replays re-derive them from the layer's device state."""
    backward.forget_train_layers()
    k, n, m = 512, 1408, 8192
    config = sparse_training_on.replace(train_dense_above=dense_above, train_hot=hot)
    x, block = _layer(k, n, m, 0.01, config, seed=1)
    params = list(block.parameters())

    def loss_fn(x):
        return block(x).float().square().mean()

    def step(x, loss_fn):
        return torch.autograd.grad(loss_fn(x), [x, *params])

    xs = x.clone().requires_grad_()
    eager = step(xs, loss_fn)
    torch.cuda.synchronize()  # the first call's measurement lands
    state = backward.train_state(block.mlp.gate_proj.weight)
    assert not state.forward_dense
    compiled = step(xs, torch.compile(loss_fn, fullgraph=True))
    assert state.forward_dense == (dense_above is not None)  # the compiled call reaches the layer's state
    for a, b in zip(compiled, eager, strict=True):
        assert rel_err(a, b) <= 1e-2
    # forward + backward captured in one CUDA graph: no host synchronisation inside the step
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(xs, loss_fn)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grads = step(xs, loss_fn)
    for _ in range(2):  # the second replay on the hot neurons the first one's backward left in the state
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(static_grads, eager, strict=True):
            assert rel_err(a, b) <= 1e-2
    assert (state.hot is not None and state.hot.shape == (hot,)) == bool(hot)


@pytest.mark.gpu
@pytest.mark.parametrize("squared", [False, True], ids=["relu", "relu2"])
def test_gpu_plain_ffn_and_l1_train_sparsely(squared, sparse_training_on):
    """twell.ops.ffn with return_l1 at a real shape in bf16: y, the L1 term and every gradient of
    <y, dy> + l1 against float64 dense autograd."""
    k, n, m = 2048, 8192, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g)
    w_up = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    b_up = torch.full((n,), -2.6, device="cuda")  # pre-activations ~ N(0, 1): about 0.5% fire
    w_down = (torch.randn(k, n, device="cuda", generator=g) / n**0.5).t().contiguous().t()
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (x, w_up, b_up, w_down)]
    xs, wu, bu, wd = leaves
    assert twell.kernels.library.sparse_training(xs, wu, None, wd, (bu, None), 1)
    y, l1, density = twell.ops.ffn(xs, wu, wd, up_bias=bu, squared=squared, return_l1=True, config=sparse_training_on)
    assert 0.002 < density.item() < 0.01
    dy = torch.randn_like(y)
    lam = 0.3 * m * n  # the L1 term's gradient per entry (lam / (M * N)) comparable to dh's
    ((y.float() * dy.float()).sum() + lam * l1).backward()
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rx, rwu, rbu, rwd = ref_leaves
    h = reference.hidden(rx, rwu, None, rbu, None, 0.0, squared=squared)
    ref_l1 = h.abs().mean()
    ((F.linear(h, rwd) * dy.double()).sum() + lam * ref_l1).backward()
    assert rel_err(y, F.linear(h, rwd)) <= 1e-2
    assert rel_err(l1, ref_l1) <= 1e-2
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert rel_err(got.grad, want.grad) <= 2e-2


def test_calibration_sets_train_min_m_from_a_crossover_table(monkeypatch):
    """A layer calibrated at most a crossover row's density (at a width of at least its K) trains sparsely
    from that row's tokens; a denser or unmeasured one trains dense; the default table (measured) turns
    it on at 0.5% from 16384 tokens at K >= 4096, from 32768 below."""
    from twell.calibrate.decisions import Decision

    table = ((4096, 0.006, 8192), (0, 0.006, 16384), (0, 0.012, 32768))
    got = [policy.calibrated_train_min_m(d, 2048, table) for d in (0.005, 0.006, 0.01, 0.03, None)]
    assert got == [16384, 16384, 32768, None, None]
    assert [policy.calibrated_train_min_m(d, 4096, table) for d in (0.005, 0.01)] == [8192, 32768]
    assert [policy.calibrated_train_min_m(d, 2048) for d in (0.001, 0.005, 0.0051, None)] == [32768, 32768, None, None]
    assert [policy.calibrated_train_min_m(0.005, k) for k in (0, 4095, 4096, 8192)] == [32768, 32768, 16384, 16384]
    mlp = {"path": "mlp", "rewrite": True, "reason": ""}
    assert Decision(**mlp, density=0.005, hidden_size=2048).layer_config().train_min_m == 32768
    assert Decision(**mlp, density=0.005, hidden_size=4096).layer_config().train_min_m == 16384
    assert Decision(**mlp, density=0.02, hidden_size=4096).layer_config().train_min_m is None
    real = policy.calibrated_train_min_m
    monkeypatch.setattr(policy, "calibrated_train_min_m", lambda d, k: real(d, k, table))
    decision = Decision(**mlp, density=0.01, hidden_size=2048, stats={"decode": {"density": 0.001}})
    assert decision.layer_config().train_min_m == 32768  # the layer's density, not its decode calls'
    assert decision.layer_config({"train_min_m": 1}).train_min_m == 1


def test_train_dense_above_is_checked():
    assert twell.LayerConfig(train_dense_above=0.01).train_dense_above == 0.01
    for bad in (-0.1, 1.5, True, "0.01"):
        with pytest.raises(ValueError, match="train_dense_above must be a number in \\[0, 1\\] or None"):
            twell.LayerConfig(train_dense_above=bad)
    case = make_ffn(4, 16, 40, [0.2], torch.float32, DEVICE, biases=True)
    with pytest.raises(ValueError, match="train_dense_above must be a number in \\[0, 1\\] or None, got 2.0"):
        _train_op(case, True, dense_above=2.0)
