"""The batched decode (9-256 tokens a call: cuBLAS gate, the union's W_u / W_d rows) against float64
references, its routing by LayerConfig.batched_max_m, and calibration's setting of it."""

import copy

import pytest
import torch
import triton
from conftest import DEVICE, HAS_CUDA, compile_for_hopper, rel_err
from ffn_cases import TOL, decode_args, gated_ref, make_ffn, plain_ref

import twell
from twell.calibrate import Decision
from twell.kernels import decode, dispatch, policy
from twell.kernels.decode import batched_decode_ffn, decode_ffn
from twell.kernels.policy import LayerConfig

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
MIXED = [0.0, 0.03, 0.1, 0.02, 0.05, 0.01, 0.04, 0.0, 0.03, 1.0]


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty / empty_like return NaN (floats) or 1 (ints: a valid neuron id and a nonzero arrival
    counter): any element a kernel reads before writing it, or fails to write, shows in the result."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan") if t.is_floating_point() else 1)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


BATCHED_CASES = {
    # m, k, n, densities, up_config, down_config (None: the launcher's table)
    "m9-empty-union": (9, 40, 100, [0.0], None, None),
    "m16-full-union": (16, 24, 70, [1.0], None, None),
    "m16-many-splits": (16, 40, 200, MIXED, (16, 16, 16, 4, 1), (16, 16, 16, 1, 4, 1)),
    "m33-token-blocks": (33, 130, 300, MIXED, (16, 32, 32, 4, 1), (16, 32, 32, 3, 4, 1)),
    "m70-one-split": (70, 24, 100, [0.02], None, (32, 16, 64, 2, 4, 1)),
    "m1": (1, 16, 64, [0.03], None, None),
    "m257-defaults": (257, 40, 150, [0.01, 0.0], None, None),
    "m300-defaults": (300, 24, 100, MIXED, None, None),
}


STREAM_CASES = {
    # m, k, n, densities, up_config (BLOCK_M, BLOCK_N, BLOCK_K, CH, warps, stages, K_SPLITS), down_config
    # (BLOCK_K, GROUP, CHUNK, warps, ARRIVE) (None: the launcher's table)
    "m9-empty-union": (9, 40, 100, [0.0], None, None),
    "m16-full-union": (16, 24, 70, [1.0], None, None),
    "m16-arrivals": (16, 40, 200, MIXED, (16, 32, 16, 16, 4, 1, 1), (16, 1, 16, 4, True)),
    "m16-sum-kernel": (16, 40, 200, MIXED, (16, 32, 16, 16, 4, 1, 1), (16, 2, 16, 4, False)),
    "m16-k-splits": (16, 70, 200, MIXED, (16, 32, 16, 16, 4, 1, 3), (16, 2, 32, 4, True)),
    "m33-token-blocks": (33, 130, 300, MIXED, (16, 64, 32, 16, 4, 1, 1), (32, 4, 16, 4, False)),
    "m40-k-splits-blocks": (40, 130, 300, MIXED, (16, 64, 32, 16, 4, 1, 2), (32, 4, 16, 4, False)),
    "m70-one-split": (70, 24, 100, [0.02], None, (16, 4, 64, 4, True)),
    "m1": (1, 16, 64, [0.03], None, None),
    "m257-defaults": (257, 40, 150, [0.01, 0.0], None, None),
    "m300-defaults": (300, 24, 100, MIXED, None, None),
}

ROWS_CASES = {
    # m, k, n, densities, up_config (BLOCK_M, BLOCK_N, CH, UP_K, DOWN_K, SPLITS, warps, stages), down_config (ROWS,
    # BLOCK_K, warps) (None: the launcher's tables)
    "m9-empty-union": (9, 40, 100, [0.0], None, None),
    "m16-full-union": (16, 24, 70, [1.0], None, None),
    "m16-chunks-k-steps": (16, 40, 200, MIXED, (16, 32, 16, 16, 16, 0, 4, 1), None),
    "m16-one-k-split": (16, 24, 100, MIXED, (16, 32, 16, 16, 32, 0, 4, 1), None),
    "m16-two-k-splits": (16, 70, 100, MIXED, (16, 32, 16, 16, 16, 2, 4, 1), None),
    "m33-token-blocks": (33, 130, 300, MIXED, (16, 64, 16, 32, 32, 0, 4, 1), (4, 32, 4)),
    "m70-sum-steps": (70, 24, 100, [0.02, 0.3], (16, 16, 16, 16, 16, 0, 4, 1), (4, 16, 4)),
    "m1": (1, 16, 64, [0.03], None, None),
    "m257-defaults": (257, 40, 150, [0.01, 0.0], None, None),
    "m300-defaults": (300, 24, 100, MIXED, None, None),
}


def _call(case, gated, variant, **configs):
    return batched_decode_ffn(*decode_args(case, gated), drelu=variant == "drelu", square=variant == "relu2", **configs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["gated", "drelu", "plain", "relu2", "nobias"])
@pytest.mark.parametrize("case_id", list(BATCHED_CASES))
def test_batched_decode_matches_reference(case_id, dtype, variant, poisoned_empty):
    """1-300 tokens, one and several token blocks in each kernel, one split and many (partials summed by
    the last arrival), empty and full unions, awkward K and N; every output and scratch element
    poisoned before the kernels run."""
    m, k, n, densities, up_config, down_config = BATCHED_CASES[case_id]
    gated = variant in ("gated", "drelu", "nobias")
    case = make_ffn(m, k, n, densities, dtype, DEVICE, seed=m + k, biases=variant != "nobias", gated=gated)
    y = _call(case, gated, variant, up_config=up_config, down_config=down_config)
    ref = gated_ref(case, drelu=variant == "drelu") if gated else plain_ref(case, squared=variant == "relu2")
    assert y.dtype == dtype and y.shape == (m, k)
    assert rel_err(y, ref) <= TOL[dtype] * (4 if variant == "relu2" else 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["gated", "drelu", "plain", "relu2", "nobias"])
@pytest.mark.parametrize("case_id", list(STREAM_CASES))
def test_stream_design_matches_reference(case_id, dtype, variant, poisoned_empty):
    """The stream design at 1-300 tokens: one and several token blocks, CH groups and chunks, one split,
    many (summed by the last arrival or by the sum kernel), empty and full unions, awkward K and N;
    every output and scratch element poisoned before the kernels run."""
    m, k, n, densities, up_config, down_config = STREAM_CASES[case_id]
    gated = variant in ("gated", "drelu", "nobias")
    case = make_ffn(m, k, n, densities, dtype, DEVICE, seed=m + k, biases=variant != "nobias", gated=gated)
    y = _call(case, gated, variant, design="stream", up_config=up_config, down_config=down_config)
    ref = gated_ref(case, drelu=variant == "drelu") if gated else plain_ref(case, squared=variant == "relu2")
    assert y.dtype == dtype and y.shape == (m, k)
    assert rel_err(y, ref) <= TOL[dtype] * (4 if variant == "relu2" else 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["gated", "drelu", "plain", "relu2", "nobias"])
@pytest.mark.parametrize("case_id", list(ROWS_CASES))
def test_rows_design_matches_reference(case_id, dtype, variant, poisoned_empty):
    """The rows design at 1-300 tokens: one and several token blocks, chunks of active neurons past one
    (each adding to the block's rows), K steps of the up and splits of the down (one and several, K not
    a multiple), sum steps past one, empty and full unions; every output and scratch element poisoned
    before the kernels run."""
    m, k, n, densities, up_config, down_config = ROWS_CASES[case_id]
    gated = variant in ("gated", "drelu", "nobias")
    case = make_ffn(m, k, n, densities, dtype, DEVICE, seed=m + k, biases=variant != "nobias", gated=gated)
    y = _call(case, gated, variant, design="rows", up_config=up_config, down_config=down_config)
    ref = gated_ref(case, drelu=variant == "drelu") if gated else plain_ref(case, squared=variant == "relu2")
    assert y.dtype == dtype and y.shape == (m, k)
    assert rel_err(y, ref) <= TOL[dtype] * (4 if variant == "relu2" else 1)


@pytest.mark.parametrize("cap,block_n", [(7 * 16 * 40 * 4, 32), (0, 512), (1 << 30, 16)], ids=["fits", "cap", "none"])
def test_rows_design_widens_its_blocks_past_the_partials_cap(cap, block_n, monkeypatch):
    """The rows' bytes (n_blocks x M x K x 4) past max_parts_bytes double BLOCK_N, up to ROWS_MAX_BLOCK_N;
    the result stays exact and the same every call."""
    case = make_ffn(16, 40, 200, MIXED, torch.float32, DEVICE, seed=7, biases=True)
    shapes = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: shapes.append(tuple(a)) or empty(*a, **k))
    config = {"design": "rows", "up_config": (16, 16, 16, 16, 16, 0, 4, 1), "max_parts_bytes": cap}
    runs = [_call(case, True, "gated", **config) for _ in "ab"]
    assert (1, triton.cdiv(200, block_n), 16, 40) in shapes
    assert torch.equal(runs[0], runs[1])
    assert rel_err(runs[0], gated_ref(case)) <= TOL[torch.float32]


@pytest.mark.parametrize("arrive", [True, False], ids=["arrivals", "sum-kernel"])
def test_stream_design_is_deterministic_and_rerunnable(arrive):
    """Either way of summing the splits' partials gives the same bits every call (the arrival counters
    reset for the next call), and both ways agree with the walk design."""
    case = make_ffn(20, 40, 200, MIXED, torch.float32, DEVICE, seed=5, biases=True)
    config = {"design": "stream", "up_config": (16, 32, 16, 16, 4, 1, 2), "down_config": (16, 1, 16, 4, arrive)}
    runs = [_call(case, True, "gated", **config) for _ in "abc"]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])
    assert rel_err(runs[0], _call(case, True, "gated", design="walk")) <= 1e-5


@pytest.mark.parametrize("cap,splits", [(16 * 40 * 4 * 3, 2), (0, 0)], ids=["three-allowed", "one-allowed"])
def test_stream_design_caps_its_partials(cap, splits, monkeypatch):
    """Past max_parts_bytes of partials each split takes more neuron blocks: 7 blocks of 32 at GROUP 1
    are 7 splits; 3 allowed make GROUP 4 (a power of two), so 2 splits; 1 allowed makes GROUP 8, so one
    split and no partials."""
    case = make_ffn(16, 40, 200, MIXED, torch.float32, DEVICE, seed=6, biases=True)
    shapes = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: shapes.append(tuple(a)) or empty(*a, **k))
    config = {"design": "stream", "up_config": (16, 32, 16, 16, 4, 1, 1), "down_config": (16, 1, 16, 4, False)}
    y = _call(case, True, "gated", max_parts_bytes=cap, **config)
    assert (splits, 16, 40) in shapes
    assert rel_err(y, gated_ref(case)) <= TOL[torch.float32]


def test_batched_decode_is_deterministic_and_rerunnable():
    """Partials of several splits are summed in a fixed order, and the arrival counters are ready for the
    next call: the same bits every call."""
    case = make_ffn(20, 40, 200, MIXED, torch.float32, DEVICE, seed=5, biases=True)
    runs = [_call(case, True, "gated", down_config=(16, 16, 16, 1, 4, 1)) for _ in "abc"]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])


@pytest.mark.parametrize("cap,splits", [(16 * 40 * 4 * 2, 2), (0, 0)], ids=["two-splits", "one-split"])
def test_batched_decode_caps_its_partials(cap, splits, monkeypatch):
    """Past max_parts_bytes of partials the splits walk more steps instead (one split: no partials)."""
    case = make_ffn(16, 40, 200, MIXED, torch.float32, DEVICE, seed=6, biases=True)
    shapes = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: shapes.append(tuple(a)) or empty(*a, **k))
    y = _call(case, True, "gated", down_config=(16, 16, 16, 1, 4, 1), max_parts_bytes=cap)
    assert (splits, 16, 40) in shapes
    assert rel_err(y, gated_ref(case)) <= TOL[torch.float32]


def test_batched_and_one_token_decode_agree():
    """The two decode designs compute the same FFN (rounding apart) on the same call."""
    case = make_ffn(16, 40, 200, MIXED, torch.float32, DEVICE, seed=8, biases=True)
    args = (case["x"], case["gate_weight"], case["gate_bias"], case["up_weight"], case["up_bias"])
    args += (case["down_weight"].t(), case["down_bias"], 0.0)
    assert rel_err(batched_decode_ffn(*args), decode_ffn(*args)) <= 1e-5


@pytest.mark.parametrize("m,k,n", [(12, 8, 0), (0, 8, 64), (3, 0, 64)], ids=["no-neurons", "no-tokens", "no-width"])
def test_batched_decode_of_an_empty_call_is_the_down_bias(m, k, n, poisoned_empty):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    bias = torch.randn(k, generator=g).to(DEVICE)
    assert torch.equal(batched_decode_ffn(x, w, None, w, None, w, bias, 0.0), bias.expand(m, k))
    assert torch.equal(batched_decode_ffn(x, w, None, w, None, w, None, 0.0), torch.zeros(m, k, device=DEVICE))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"x": "3d"}, r"x must be a 2-dim tensor \[M, K\], got \[1, 12, 16\]"),
        ({"up_weight": "half"}, r"up_weight must be \[64, 16\] torch.float32"),
        ({"down_config": (16, 16, 16, 0, 4, 1)}, r"down_config needs STEPS >= 1, got \(16, 16, 16, 0, 4, 1\)"),
        ({"design": "tree"}, r"design must be one of \('walk', 'stream', 'rows'\), got 'tree'"),
        ({"design": "stream", "down_config": (16, 3, 16, 4, True)}, r"needs a power-of-two GROUP, got \(16, 3,"),
        ({"design": "stream", "up_config": (16, 32, 16, 16, 4, 1, 0)}, r"needs K_SPLITS >= 1, got \(16, 32,"),
    ],
    ids=["x-3d", "up-dtype", "no-steps", "design", "group", "k-splits"],
)
def test_batched_decode_checks_its_inputs(change, match):
    case = make_ffn(12, 16, 64, [0.1], torch.float32, DEVICE)
    x = case["x"][None] if change.get("x") == "3d" else case["x"]
    up = case["up_weight"].half() if change.get("up_weight") == "half" else case["up_weight"]
    with pytest.raises(ValueError, match=match):
        batched_decode_ffn(
            x, case["gate_weight"], None, up, None, case["down_weight"].t(), None, 0.0,
            design=change.get("design"), up_config=change.get("up_config"), down_config=change.get("down_config"),
        )  # fmt: skip


def test_route_of_batched_max_m():
    """Calls above decode_max_m and up to batched_max_m take the batched decode, before the density-gated
    decode; off (0) by default, so today's routes stand until it is measured."""
    assert policy.DEFAULT.batched_max_m == 0 and decode.BATCHED_DESIGN == "walk"  # the stream design: unmeasured
    assert [policy.route(m, 2048, policy.DEFAULT, density=0.005) for m in (8, 16, 64)] == ["decode", "decode", "dense"]
    config = LayerConfig(batched_max_m=64)
    assert [policy.route(m, 2048, config, density=0.005) for m in (8, 9, 64, 65)] == [
        "decode",
        "batched",
        "batched",
        "dense",
    ]
    assert policy.route(64, policy.MAX_K + 1, config) == "dense"
    forced = policy.DEFAULT.replace(route="batched")
    assert [policy.route(m, 2048, forced) for m in (1, 300, 1 << 20)] == ["batched"] * 3
    assert policy.DEFAULT.replace(route="dense").batched_max_m == 0
    assert config.op_args()[policy.OP_FIELDS.index("batched_max_m")] == 64
    assert policy.from_op_args(*config.op_args()) == config
    with pytest.raises(ValueError, match="batched_max_m must be a non-negative int, got -1"):
        LayerConfig(batched_max_m=-1)


def test_calibrated_batched_max_m_from_a_crossover_table():
    table = ((0.006, 256), (0.012, 64), (0.05, 16))
    assert [policy.calibrated_batched_max_m(d, table) for d in (0.005, 0.006, 0.01, 0.03, 0.2, None)] == [
        256,
        256,
        64,
        16,
        0,
        0,
    ]
    assert policy.calibrated_batched_max_m(0.001) == 0  # no measured crossover yet: off


def test_calibration_sets_batched_max_m_from_the_decode_density(monkeypatch):
    """A decision's LayerConfig takes batched_max_m from its decode calls' density (the mean over all
    calls where decode was not seen); a decode phase calibrated dense turns it off."""
    real = policy.calibrated_batched_max_m
    monkeypatch.setattr(policy, "calibrated_batched_max_m", lambda d: real(d, ((0.006, 256), (0.012, 64))))
    decision = Decision(path="mlp", rewrite=True, reason="", density=0.02, stats={"decode": {"density": 0.01}})
    assert decision.layer_config().batched_max_m == 64
    assert Decision(path="mlp", rewrite=True, reason="", density=0.005).layer_config().batched_max_m == 256
    decision.dense_phases = ["decode"]
    assert decision.layer_config().batched_max_m == 0


def test_calibration_sends_9_to_16_token_calls_to_the_batched_decode_where_its_crossover_holds(monkeypatch):
    """A layer whose calibrated density has a batched crossover row takes the batched decode from
    decode_max_m + 1 tokens (9-16 included: the decode kernels keep 1-8), from calibration alone; a layer
    past every row keeps the calibrated decode route up to 16 tokens and no batched route."""
    real = policy.calibrated_batched_max_m
    monkeypatch.setattr(policy, "calibrated_batched_max_m", lambda d: real(d, ((0.006, 64),)))
    sparse = Decision(path="mlp", rewrite=True, reason="", density=0.02, stats={"decode": {"density": 0.005}})
    config = sparse.layer_config()
    assert (config.decode_max_m, config.batched_max_m) == (policy.DECODE_MAX_M, 64)
    assert [policy.route(m, 2048, config) for m in (8, 9, 16, 64, 65)] == ["decode"] + ["batched"] * 3 + ["dense"]
    denser = Decision(path="mlp", rewrite=True, reason="", density=0.005, stats={"decode": {"density": 0.008}})
    config = denser.layer_config()
    assert (config.decode_max_m, config.batched_max_m) == (policy.DECODE_SPARSE_MAX_M, 0)
    assert [policy.route(m, 2048, config) for m in (16, 17)] == ["decode", "dense"]


def test_calibration_sends_9_to_16_token_calls_of_a_sparse_layer_to_the_decode_kernels():
    """A layer calibrated at most DECODE_SPARSE_DENSITY dense takes the decode kernels up to
    decode_sparse_max_m tokens from its first call (no prefill needs to have measured it); a denser or
    unmeasured layer up to decode_max_m; a decode phase calibrated dense never."""
    sparse = Decision(path="mlp", rewrite=True, reason="", density=0.02, stats={"decode": {"density": 0.005}})
    assert sparse.layer_config().decode_max_m == policy.DECODE_SPARSE_MAX_M == 16
    assert policy.route(16, 2048, sparse.layer_config()) == "decode"
    dense = Decision(path="mlp", rewrite=True, reason="", density=0.005, stats={"decode": {"density": 0.03}})
    assert dense.layer_config().decode_max_m == policy.DECODE_MAX_M == 8
    assert policy.route(16, 2048, dense.layer_config()) == "dense"
    assert Decision(path="mlp", rewrite=True, reason="").layer_config().decode_max_m == 8
    assert Decision(path="mlp", rewrite=True, reason="", density=0.01).layer_config().decode_max_m == 16
    sparse.dense_phases = ["decode"]
    assert sparse.layer_config().decode_max_m == 0


@pytest.mark.parametrize("m,path", [(8, "decode"), (24, "batched"), (65, "dense")])
def test_dispatch_sends_batched_calls_to_the_batched_kernels(m, path, monkeypatch):
    dispatch.forget_layers()
    calls = []
    for name, fn in (("decode_ffn", decode_ffn), ("batched_decode_ffn", batched_decode_ffn)):
        monkeypatch.setattr(dispatch, name, lambda *a, _n=name, _f=fn, **k: calls.append(_n) or _f(*a, **k))
    case = make_ffn(m, 24, 96, MIXED, torch.float32, DEVICE, seed=m, biases=True)
    args = [case[k] for k in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
    y = dispatch.gated_ffn_cuda(case["x"], *args, 0.0, False, LayerConfig(batched_max_m=64, prefill_min_m=None))
    assert calls == {"decode": ["decode_ffn"], "batched": ["batched_decode_ffn"], "dense": []}[path]
    assert rel_err(y, gated_ref(case)) <= 1e-5


BATCHED_SM90_COMPILE = """
import subprocess
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from twell.kernels import decode

def arg_type(name):
    if not name.endswith("_ptr"):
        return "fp32" if name == "threshold" else "i32"
    types = {"ids_ptr": "*i32", "cnt_ptr": "*i32", "sem_ptr": "*i32", "part_ptr": "*fp32", "rows_ptr": "*fp32"}
    return types.get(name, "*bf16")

flags = dict(HAS_UP=True, HAS_UP_BIAS=True, HAS_DOWN_BIAS=True, DRELU=False, SQUARE=False, DOT_PRECISION="tf32",
             SEM_BLOCK=256, NB=32, SPLIT_MIN=0)
cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
builds = []
for bucket in decode.BATCHED_UP_CONFIG:
    bm, bn, bk, warps, stages = decode.BATCHED_UP_CONFIG[bucket]
    dm, dk, walk, _, down_warps, down_stages = decode.BATCHED_DOWN_CONFIG[bucket]
    builds += [
        (decode._batched_up_kernel, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), dict(num_warps=warps, num_stages=stages)),
        (decode._batched_down_kernel, dict(BLOCK_M=dm, BLOCK_K=dk, WALK=walk),
         dict(num_warps=down_warps, num_stages=down_stages)),
    ]
for bucket in decode.STREAM_UP_CONFIG:  # the stream design: its up kernel, the list down kernel both ways
    bm, bn, bk, ch, warps, stages, k_splits = decode.STREAM_UP_CONFIG[bucket]
    dk, group, chunk, down_warps, arrive = decode.STREAM_DOWN_CONFIG[bucket]
    up = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CH=ch, SPLIT_UP=k_splits > 1)
    builds.append((decode._stream_up_kernel, up, dict(num_warps=warps, num_stages=stages)))
    down = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=dk, SUPER=group, CHUNK=chunk, UP_SPLITS=k_splits if k_splits > 1 else 0)
    builds += [(decode._decode_down_kernel, {**down, "ARRIVE": a}, dict(num_warps=down_warps)) for a in (True, False)]
for bucket, (bm, bn, ch, up_k, down_k, _, warps, stages) in decode.ROWS_CONFIG.items():  # the rows design
    for block_n in (bn, decode.ROWS_MAX_BLOCK_N):  # as configured, and as widest past the partials cap
        rows = dict(BLOCK_M=bm, BLOCK_N=block_n, CH=ch, UP_K=up_k, DOWN_K=down_k)
        builds.append((decode._rows_up_down_kernel, rows, dict(num_warps=warps, num_stages=stages)))
for kernel, consts, options in builds:
    consts = {**{n: v for n, v in flags.items() if n in kernel.arg_names}, **consts}
    # unit strides are specialised to 1 by the launcher (contiguous rows), the rest divisible by 16
    consts.update({n: 1 for n in ("stride_xk", "stride_uk", "stride_dk", "stride_yk") if n in kernel.arg_names})
    signature = {n: "constexpr" if n in consts else arg_type(n) for n in kernel.arg_names}
    # k_span (a multiple of BLOCK_K) too: Triton specialises integer arguments divisible by 16
    aligned = ("K", "N", "k_span")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if signature[n] != "constexpr" and (n.endswith("_ptr") or n.startswith("stride") or n in aligned)}
    out = compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    Path("k.cubin").write_bytes(out.asm["cubin"])
    usage = subprocess.run([str(cuobjdump), "-res-usage", "k.cubin"], capture_output=True, text=True).stdout
    assert "STACK:0 " in usage and "LOCAL:0 " in usage, (kernel.__name__, consts, usage)  # no spills
    assert "cp.async" in out.asm["ptx"], (kernel.__name__, consts)  # the walk / K loop is pipelined
out = compile(ASTSource(decode._sum_parts_kernel, {"part_ptr": "*fp32", "bd_ptr": "*bf16", "y_ptr": "*bf16",
              "splits": "i32", "M": "i32", "K": "i32", "stride_ym": "i32", "stride_yk": "constexpr",
              "HAS_DOWN_BIAS": "constexpr", "SPLITS": "constexpr", "BLOCK": "constexpr"},
              dict(stride_yk=1, HAS_DOWN_BIAS=True, SPLITS=32, BLOCK=256)), target=GPUTarget("cuda", 90, 32))
Path("k.cubin").write_bytes(out.asm["cubin"])
usage = subprocess.run([str(cuobjdump), "-res-usage", "k.cubin"], capture_output=True, text=True).stdout
assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
rows, block_k, warps = decode.ROWS_SUM_CONFIG
out = compile(ASTSource(decode._sum_rows_kernel, {"rows_ptr": "*fp32", "cnt_ptr": "*i32", "bd_ptr": "*bf16",
              "y_ptr": "*bf16", "M": "i32", "K": "i32", "n_blocks": "i32", "stride_ym": "i32",
              "stride_yk": "constexpr", "HAS_DOWN_BIAS": "constexpr", "BLOCK_M": "constexpr", "ROWS": "constexpr",
              "BLOCK_K": "constexpr"}, dict(stride_yk=1, HAS_DOWN_BIAS=True, BLOCK_M=16, ROWS=rows, BLOCK_K=block_k)),
              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
Path("k.cubin").write_bytes(out.asm["cubin"])
usage = subprocess.run([str(cuobjdump), "-res-usage", "k.cubin"], capture_output=True, text=True).stdout
assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
"""


def test_batched_kernels_compile_for_hopper_without_spills(tmp_path):
    """Triton's compiler and ptxas build the batched designs' kernels for sm_90 (no GPU needed) at every
    token bucket's config: no register spills, and their loops pipelined (asynchronous copies)."""
    compile_for_hopper(BATCHED_SM90_COMPILE, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,k,n", [(9, 2048, 5632), (16, 2048, 5632), (64, 2048, 5632), (128, 2048, 5632), (256, 2048, 5632),
              (16, 4096, 14336), (256, 4096, 14336)],
)  # fmt: skip
@pytest.mark.parametrize("design", decode.BATCHED_DESIGNS)
def test_batched_decode_on_the_gpu_at_model_shapes(m, k, n, design):
    """bf16 at the benchmark shapes with the launcher's configs (the interpreter has no bf16), each
    design: the float64 reference, and the same bits replayed from a CUDA graph."""
    case = make_ffn(m, k, n, [0.005, 0.02, 0.0, 0.3], torch.bfloat16, "cuda", seed=m, biases=True)
    args = (case["x"], case["gate_weight"], case["gate_bias"], case["up_weight"], case["up_bias"])
    args += (case["down_weight"].t().contiguous(), case["down_bias"], 0.0)
    y = batched_decode_ffn(*args, design=design)
    assert rel_err(y, gated_ref(case)) <= TOL[torch.bfloat16]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = batched_decode_ffn(*args, design=design)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, y)


@pytest.mark.gpu
@pytest.mark.parametrize("design", decode.BATCHED_DESIGNS)
def test_batched_decode_generates_the_same_tokens_and_compiles_whole(design, monkeypatch):
    """Greedy generation of 16 sequences, every step (16 tokens a call) through the batched decode (each
    design): the same tokens as the untouched model; torch.compile(fullgraph=True) traces the step's FFN."""
    transformers = pytest.importorskip("transformers")
    dispatch.forget_layers()
    calls = []
    monkeypatch.setattr(
        dispatch,
        "batched_decode_ffn",
        lambda *a, **k: calls.append(a[0].shape[0]) or batched_decode_ffn(*a, design=design, **k),
    )
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, hidden_act="relu", mlp_bias=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    for layer in model.model.layers:  # a negative gate bias makes the ReLU gate sparse (~2% active)
        torch.nn.init.constant_(layer.mlp.gate_proj.bias, -0.65)
    model = model.to("cuda", torch.bfloat16)
    untouched = copy.deepcopy(model)
    twell.sparsify(model, layer_config={"batched_max_m": 64})
    prompt = torch.randint(0, 128, (16, 12), device="cuda")  # 192 tokens: dense
    kwargs = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        ref = untouched.generate(prompt, **kwargs)
        out = model.generate(prompt, **kwargs)
        mlp = model.model.layers[0].mlp
        x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
        compiled = torch.compile(mlp, fullgraph=True)(x)
        eager = mlp(x)
    assert calls and set(calls) == {16}
    assert torch.equal(out, ref)
    assert rel_err(compiled, eager) <= 1e-2
