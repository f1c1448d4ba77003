"""The host side of a prefill call: inputs checked once at the op boundary (the dispatcher's launchers do
not check again; the public launchers still do), kernel configs chosen once per key (TunedLaunch), the
one launch that builds the row order and the density probe's total, and the prefill threshold of calls
captured into CUDA graphs."""

import pytest
import torch
import triton
from conftest import DEVICE, rel_err
from ffn_cases import GatedBlock, gated_ref, make_ffn

import twell
from twell.kernels import checks, common, decode, dispatch, gate, policy, updown
from twell.kernels.policy import LayerConfig

# every check the launchers' modules call on their inputs
CHECKS = ("check_input", "check_operand", "check_bias", "check_threshold", "check_tile", "check_pos")


def _counted(words, counts):
    """The words inside each count (slots past it are unspecified)."""
    valid = torch.arange(words.shape[-1], device=words.device) < counts.clamp(max=words.shape[-1]).unsqueeze(-1)
    return torch.where(valid, words, 0)


def test_dtypes_and_threshold_rule_are_defined_once():
    assert common.FLOAT_DTYPES is checks.FLOAT_DTYPES
    assert common.check_threshold is checks.check_threshold


@pytest.mark.parametrize("threshold", [float("inf"), float("nan"), True, "0.1", None], ids=repr)
def test_one_threshold_rule_at_every_entry_point(threshold):
    """The op boundary and each public launcher refuse the same thresholds, with the same message."""
    case = make_ffn(4, 16, 64, [0.1], torch.float32, DEVICE, seed=1)
    x, wg, wu, wd = case["x"], case["gate_weight"], case["up_weight"], case["down_weight"]
    words, counts = gate.pack_dense(x @ wg.T, 0.0, 32, 8)
    calls = [
        lambda: checks.check_gated(x, wg, wu, wd, None, None, None, threshold),
        lambda: checks.check_plain(x, wu, wd, None, None, threshold),
        lambda: gate.pack_dense(x @ wg.T, threshold, 32, 8),
        lambda: gate.gate_twell(x, wg, None, threshold, 32, 8),
        lambda: updown.twell_up_down(
            x, words, counts, wg, None, wu, None, wd.t(), None, tile_n=32, threshold=threshold
        ),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="threshold must be a finite float"):
            call()
    for good in (0, -1, 0.25):
        checks.check_threshold(good)


@pytest.mark.parametrize("route,fused", [("prefill", False), ("prefill", True), ("decode", False)])
def test_the_dispatched_paths_check_their_inputs_once(route, fused, monkeypatch):
    """dispatch's prefill and decode launchers run none of the launchers' checks (the op boundary ran its
    own); the public launchers, called directly, still check."""
    config = LayerConfig(fused_gate=fused, hot_rate=None).replace(route=route)
    case = make_ffn(40, 24, 64, [0.05, 0.1], torch.float32, DEVICE, seed=5, biases=True)
    args = [case[c] for c in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
    checked = []
    for module in (gate, updown, decode):
        for name in CHECKS:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda *a, _n=name, **k: checked.append(_n))
    dispatch.forget_layers()
    y = dispatch.gated_ffn_cuda(case["x"], *args, 0.0, False, config)
    assert checked == []
    assert rel_err(y, gated_ref(case)) <= 1e-5
    words, counts = gate.pack_dense(case["x"] @ args[0].T, 0.0, 32, 8)
    updown.twell_up_down(
        case["x"], words, counts, args[0], None, args[1], None, args[2].t(), None, tile_n=32, threshold=0.0
    )
    assert {"check_input", "check_threshold", "check_tile"} <= set(checked)
    checked.clear()
    decode.decode_ffn(case["x"][:2], args[0], None, args[1], None, args[2].t(), None, 0.0)
    assert {"check_input", "check_threshold", "check_operand"} <= set(checked)


def test_host_cdiv_and_next_power_of_2_are_tritons():
    """The launchers' host-side cdiv / next_power_of_2 (plain Python) give triton's values."""
    for a in [*range(70), 4095, 4096, 4097, (1 << 40) + 1]:
        assert common.next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 128):
            assert common.cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_a_token_bucket_tunes_once(monkeypatch):
    """The pack launcher asks the autotuner once per key (token bucket, shape, layout, dtype, hot), then
    launches its config directly, with the same results as that config launched by hand."""
    launch = common.TunedLaunch(gate._pack_dense_kernel)
    monkeypatch.setattr(gate, "_pack_dense_launch", launch)
    tuned = []
    run = gate._pack_dense_kernel.run
    monkeypatch.setattr(gate._pack_dense_kernel, "run", lambda *a, **k: tuned.append(a[0].shape[0]) or run(*a, **k))
    for m in (70, 100, 70, 200, 129):
        h = torch.randn(m, 96, device=DEVICE)
        words, counts = gate.launch_pack_dense(h, 0.5, 32, 8)
        config = launch.configs[(triton.next_power_of_2(m), 96, 32, 8, torch.float32, True)]
        assert launch.best_config is config
        row = (config.kwargs["BLOCK_M"], config.num_warps, config.num_stages)
        by_hand = gate.pack_dense(h, 0.5, 32, 8, config=row)
        assert torch.equal(counts, by_hand[1]) and torch.equal(_counted(words, counts), _counted(*by_hand))
    assert tuned == [70, 200]  # the first call of each token bucket
    assert len(launch.configs) == 2


def test_the_fused_gate_keeps_its_config_per_key(monkeypatch):
    """A kept config of the fused gate launches as that config launched by hand."""
    launch = common.TunedLaunch(gate._gate_twell_kernel)
    monkeypatch.setattr(gate, "_gate_twell_launch", launch)
    case = make_ffn(50, 32, 96, [0.1], torch.float16, DEVICE, seed=2, biases=True)  # fp32 fits no config on a GPU
    x, w, b = case["x"], case["gate_weight"], case["gate_bias"]
    if not gate.fused_gate_supported(x, w, 32):
        pytest.skip("no TMA gate on this device")
    first = gate.launch_gate_twell(x, w, b, 0.0, 32, 8)
    again = gate.launch_gate_twell(x, w, b, 0.0, 32, 8)
    (config,) = launch.configs.values()
    kw = config.kwargs
    row = (kw["BLOCK_M"], kw["BLOCK_K"], config.num_warps, config.num_stages)
    by_hand = gate.gate_twell(x, w, b, 0.0, 32, 8, config=row)
    for words, counts in (first, again):
        assert torch.equal(counts, by_hand[1]) and torch.equal(_counted(words, counts), _counted(*by_hand))


@pytest.mark.parametrize(
    "m,n_tiles,groups",
    [(1, 1, 1), (37, 3, 1), (300, 44, 1), (37, 5, 3), (300, 44, 4)],
    ids=["m1", "m37", "m300-programs3", "m37-passes3", "m300-passes4"],
)
def test_row_totals_give_the_order_keys_the_probe_total_and_zeroed_counters(m, n_tiles, groups):
    """Keys: a row's total clamped to 255, or with passes one key a pass (its entries in the pass's tiles)."""
    counts = torch.randint(0, 40, (m, n_tiles), dtype=torch.int32, device=DEVICE)
    counts[::7, 0] = 300  # rows past 255 entries: key 255
    keys = torch.full((groups, m), 0xAB, dtype=torch.uint8, device=DEVICE)
    tiles_pad = max(triton.next_power_of_2(n_tiles), 2)
    block_m = max(16, 8192 // tiles_pad)
    parts = triton.cdiv(m, block_m)
    kept = torch.full((parts,), -7, dtype=torch.int64, device=DEVICE)
    capacity = max(1, m - 3)
    heavy = torch.full((1 + m + capacity,), 9, dtype=torch.int32, device=DEVICE)
    updown._row_totals_kernel[(parts,)](
        counts, keys, kept, heavy, heavy[1 + m :], m, n_tiles, capacity, ORDER=True, BLOCK_M=block_m,
        TILES_PAD=tiles_pad, GROUPS=groups,
    )  # fmt: skip
    assert int(kept.sum()) == int(counts.sum())
    bounds = [n_tiles * g // groups for g in range(groups + 1)]
    in_passes = torch.stack([counts[:, lo:hi].sum(1) for lo, hi in zip(bounds, bounds[1:], strict=False)])
    assert torch.equal(keys, in_passes.clamp(max=255).to(torch.uint8))
    assert int(heavy[0]) == 0 and not heavy[1 + m :].any()  # the heavy list's length and arrival counts
    assert (heavy[1 : 1 + m] == 9).all()  # the ids are written by the main kernel only


def test_the_up_down_launch_returns_the_probe_total(monkeypatch):
    """Its buffers come uninitialised (no zero fill): the row totals' launch zeroes the heavy counters."""
    empty = torch.empty
    monkeypatch.setattr(updown.torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-1))
    case = make_ffn(30, 24, 96, [0.05, 0.2, 1.0], torch.float32, DEVICE, seed=8)  # dense rows: heavy ones
    x, wg, wu, wd = case["x"], case["gate_weight"], case["up_weight"], case["down_weight"]
    words, counts = gate.pack_dense(x @ wg.T, 0.0, 32, 8)
    y, kept = updown.launch_up_down(x, words, counts, wg, None, wu, None, wd.t(), None, tile_n=32, threshold=0.0)
    assert kept.dtype == torch.int64 and int(kept.sum()) == int(counts.sum())
    assert rel_err(y, gated_ref(case)) <= 1e-5


# --- the captured-call threshold ---


class _Tuner:
    """An autotuner's surface as TunedLaunch reads it."""

    def __init__(self, configs, prune=None):
        self.configs, self.early_config_prune = configs, prune
        self.arg_names = ["h", "rows"]
        self.fn = self
        self.best_config = None
        self.runs, self.fn_runs = [], []

    def __getitem__(self, grid):  # the autotuner (self) and the kernel under it (self.fn) alike
        return lambda *a, **k: (self.fn_runs if "BLOCK_M" in k else self.runs).append((a, k))


def test_a_key_first_seen_under_capture_launches_the_first_kept_config_untuned(monkeypatch):
    configs = [triton.Config({"BLOCK_M": bm}, num_warps=4, num_stages=1) for bm in (32, 16, 8)]
    tuner = _Tuner(configs, prune=lambda cs, nargs, **k: [c for c in cs if c.kwargs["BLOCK_M"] <= nargs["rows"]])
    launch = common.TunedLaunch(tuner)
    monkeypatch.setattr(common, "_capturing", lambda: True)
    launch(("key",), (1,), "h", 16, FLAG=True)
    assert tuner.runs == [] and launch.configs == {} and launch.untuned_captures == 1  # no autotuning
    launched = {"FLAG": True, "BLOCK_M": 16, "num_warps": 4, "num_stages": 1, **_rest(configs[1])}
    assert tuner.fn_runs == [(("h", 16), launched)]  # the first config the pruning keeps
    monkeypatch.setattr(common, "_capturing", lambda: False)
    tuner.best_config = configs[2]
    launch(("key",), (1,), "h", 16, FLAG=True)  # outside the capture: the autotuner
    assert len(tuner.runs) == 1 and launch.configs == {("key",): configs[2]}


def _rest(config):
    """A config's launch options past num_warps / num_stages (Triton versions differ in them)."""
    return {k: v for k, v in config.all_kwargs().items() if k not in ("BLOCK_M", "num_warps", "num_stages")}


def test_the_pack_launcher_under_capture_tunes_nothing(monkeypatch):
    """The real pack kernel, its key never tuned, under a (pretended) capture: the autotuner never runs,
    the result is the first config's, and the next call outside a capture tunes."""
    launch = common.TunedLaunch(gate._pack_dense_kernel)
    monkeypatch.setattr(gate, "_pack_dense_launch", launch)
    monkeypatch.setattr(common, "_capturing", lambda: True)
    tuned = []
    run = gate._pack_dense_kernel.run
    monkeypatch.setattr(gate._pack_dense_kernel, "run", lambda *a, **k: tuned.append(1) or run(*a, **k))
    h = torch.randn(70, 96, device=DEVICE)
    words, counts = gate.launch_pack_dense(h, 0.5, 32, 8)
    assert tuned == [] and launch.configs == {} and launch.untuned_captures == 1
    first = gate._pack_dense_kernel.configs[0]
    by_hand = gate.pack_dense(h, 0.5, 32, 8, config=(first.kwargs["BLOCK_M"], first.num_warps, first.num_stages))
    assert torch.equal(counts, by_hand[1]) and torch.equal(_counted(words, counts), _counted(*by_hand))
    monkeypatch.setattr(common, "_capturing", lambda: False)
    gate.launch_pack_dense(h, 0.5, 32, 8)
    assert tuned == [1] and len(launch.configs) == 1


def test_captured_calls_have_a_prefill_threshold_of_their_own():
    config = LayerConfig(prefill_min_m_captured=8192)
    assert policy.route(8192, 2048, config) == "dense"
    assert policy.route(8192, 2048, config, capturing=True) == "prefill"
    assert policy.route(8191, 2048, config, capturing=True) == "dense"
    assert policy.route(16384, 2048, config) == policy.route(16384, 2048, config, capturing=True) == "prefill"
    default = LayerConfig()
    assert default.prefill_min_m_captured == 8192  # measured: 1.205x of dense's GPU time at 8192 tokens
    assert policy.route(8192, 2048, default, capturing=True) == "prefill" != policy.route(8192, 2048, default)
    for m in (4096, 16384):
        assert policy.route(m, 2048, default, capturing=True) == policy.route(m, 2048, default)
    for route in policy.ROUTES:  # a forced route holds inside captures too
        forced = config.replace(route=route)
        assert policy.route(8192, 2048, forced, capturing=True) == policy.route(8192, 2048, forced)
    assert policy.from_op_args(*config.op_args()) == config
    for bad in (-1, 1.5, True, "8192"):
        with pytest.raises(ValueError, match="prefill_min_m_captured must be a non-negative int or None"):
            LayerConfig(prefill_min_m_captured=bad)


def _choose(case, m, config, capturing):
    x2 = case["x"][:m]
    return dispatch._choose(x2, case["gate_weight"], case["down_weight"].t(), config, capturing)[0]


def test_a_captured_call_prefills_only_after_an_eager_one_tuned_its_bucket():
    """Below prefill_min_m a capture prefills only where an eager call of the token bucket ran the
    kernels (tuned and compiled them); the first eager call in the captured range does, later ones
    run dense."""
    case = make_ffn(300, 16, 64, [0.1], torch.float32, DEVICE, seed=3)
    config = LayerConfig(prefill_min_m=policy.EVERY, prefill_min_m_captured=64, hot_rate=None)
    dispatch.forget_layers()
    assert _choose(case, 80, config, True) == "dense"  # nothing ran at bucket 128 yet
    assert _choose(case, 80, config, False) == "prefill"  # the warm-up call (torch.compile's CUDA graphs run one)
    assert _choose(case, 100, config, False) == "dense"  # the same bucket
    assert _choose(case, 90, config, True) == "prefill"
    assert _choose(case, 200, config, True) == "dense"  # bucket 256
    assert _choose(case, 40, config, False) == _choose(case, 40, config, True) == "dense"  # below both
    dispatch.forget_layers()
    for no_prefill in (LayerConfig(prefill_min_m=None, hot_rate=None), config.replace(prefill_min_m=None)):
        assert [_choose(case, 80, no_prefill, c) for c in (False, True, False)] == ["dense"] * 3
    at_64 = LayerConfig(prefill_min_m=64, prefill_min_m_captured=None, hot_rate=None)
    assert _choose(case, 80, at_64, True) == "prefill"  # at prefill_min_m captures need no eager call first
    above = LayerConfig(prefill_min_m=64, prefill_min_m_captured=128, hot_rate=None)
    assert _choose(case, 80, above, True) == "prefill"  # the lower of the two thresholds holds


def test_the_warm_up_call_is_exact():
    case = make_ffn(80, 24, 64, [0.05, 0.2], torch.float32, DEVICE, seed=6, biases=True)
    config = LayerConfig(prefill_min_m=policy.EVERY, prefill_min_m_captured=64, hot_rate=None)
    args = [case[c] for c in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
    dispatch.forget_layers()
    for _ in range(2):  # prefill, then dense
        y = dispatch.gated_ffn_cuda(case["x"], *args, 0.0, False, config)
        assert rel_err(y, gated_ref(case)) <= 1e-5
    assert dispatch.layer_state(args[0], 80).prefilled


def _block_8192() -> GatedBlock:
    """K=2048 N=5632 in bf16 on the GPU, ~0.5% of its neurons firing on random inputs."""
    torch.manual_seed(0)
    block = GatedBlock(2048, 5632).to("cuda", torch.bfloat16).eval()
    torch.nn.init.constant_(block.mlp.gate_proj.bias, -1.49)  # pre-activations ~N(0, 0.58): 2.58 sigma
    return block


def _counting(monkeypatch, kernel, calls: list) -> None:
    """Record each run of `kernel` (an autotuner or a JITFunction): whether a capture was under way."""
    run = kernel.run
    monkeypatch.setattr(
        kernel, "run", lambda *a, **k: calls.append(torch.cuda.is_current_stream_capturing()) or run(*a, **k)
    )


def _fresh_launchers(monkeypatch) -> None:
    """The prefill launchers with no key tuned (the autotuners' own caches are bypassed by them)."""
    monkeypatch.setattr(gate, "_pack_dense_launch", common.TunedLaunch(gate._pack_dense_kernel))
    monkeypatch.setattr(updown, "_up_down_launch", common.TunedLaunch(updown._twell_up_down_kernel))


def _watched_prefill(monkeypatch) -> tuple[list, list]:
    """Fresh prefill launchers; returns the autotuner runs (each: whether inside a capture) and the
    prefill calls, appended as they happen."""
    _fresh_launchers(monkeypatch)
    tuning, paths = [], []
    _counting(monkeypatch, gate._pack_dense_kernel, tuning)
    _counting(monkeypatch, updown._twell_up_down_kernel, tuning)
    launch_up_down = dispatch.launch_up_down
    monkeypatch.setattr(dispatch, "launch_up_down", lambda *a, **k: paths.append("prefill") or launch_up_down(*a, **k))
    return tuning, paths


@pytest.mark.gpu
def test_a_captured_8192_token_call_prefills_after_an_eager_one(monkeypatch):
    """prefill_min_m_captured=8192: a capture of a layer never run at that size runs dense (no crash,
    nothing tuned inside it, the bits of a captured dense call); after one eager call (which prefills
    and tunes), the capture prefills, tunes nothing, and its replay gives the eager prefill call's bits."""
    tuning, paths = _watched_prefill(monkeypatch)
    block = _block_8192()
    # no captured threshold while the dense reference runs: with one, that first eager call would prefill
    twell.sparsify(block, layer_config={"hot_rate": None, "prefill_min_m_captured": None})
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)

    def captured():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = block(x)
        graph.replay()
        torch.cuda.synchronize()
        return y

    with torch.no_grad():
        dispatch.forget_layers()
        dense = block(x)  # the dense route's kernels compile outside the captures
        with twell.configure(block, route="dense"):
            captured_dense = captured()  # cuBLAS may choose other kernels inside a capture than outside
        twell.configure(block, prefill_min_m_captured=8192)
        dispatch.forget_layers()
        assert torch.equal(captured(), captured_dense) and paths == [] and tuning == []
        warm = block(x)  # the first eager call at this size: prefill, tuned
        torch.cuda.synchronize()
        assert paths == ["prefill"] and tuning == [False, False]
        assert torch.equal(block(x), dense) and paths == ["prefill"]  # later eager calls: dense
        y = captured()
        assert paths == ["prefill"] * 2 and tuning == [False, False]
        assert torch.equal(y, warm)
        assert rel_err(warm, dense) <= 2e-2


@pytest.mark.gpu
def test_torch_compile_cuda_graphs_prefill_8192_tokens(monkeypatch):
    """torch.compile(mode="reduce-overhead"): its warm-up call runs eagerly (here: the prefill kernels,
    tuned), its recording captures the prefill path without tuning, the replays match."""
    tuning, paths = _watched_prefill(monkeypatch)
    block = _block_8192()
    twell.sparsify(block, layer_config={"hot_rate": None, "prefill_min_m_captured": 8192})
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    dispatch.forget_layers()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        outs = [compiled(x).clone() for _ in range(4)]
        torch.cuda.synchronize()
        with twell.configure(block, route="prefill"):
            ref = block(x)
    assert paths.count("prefill") >= 2 and True not in tuning
    for out in outs:
        assert rel_err(out, ref) <= 1e-2


@pytest.mark.gpu
def test_an_untuned_key_under_a_real_capture_launches_its_first_config(monkeypatch):
    """The pack launcher's key never tuned, inside torch.cuda.graph: no autotuning, the first config
    that the pruning keeps (its binary loaded by an eager launch of the same config first: a capture
    cannot load one), and the replay gives that launch's bits."""
    launch = common.TunedLaunch(gate._pack_dense_kernel)
    monkeypatch.setattr(gate, "_pack_dense_launch", launch)
    tuning = []
    _counting(monkeypatch, gate._pack_dense_kernel, tuning)
    h = torch.randn(8192, 5632, device="cuda", dtype=torch.bfloat16) - 2.58
    monkeypatch.setattr(common, "_capturing", lambda: True)
    eager = gate.launch_pack_dense(h, 0.0, 128, 16)  # as under a capture: the first config, eagerly
    monkeypatch.undo()
    monkeypatch.setattr(gate, "_pack_dense_launch", launch)
    _counting(monkeypatch, gate._pack_dense_kernel, tuning)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        words, counts = gate.launch_pack_dense(h, 0.0, 128, 16)
    graph.replay()
    torch.cuda.synchronize()
    assert tuning == [] and launch.configs == {} and launch.untuned_captures == 2
    assert torch.equal(counts, eager[1]) and torch.equal(_counted(words, counts), _counted(*eager))
