"""The host side of a prefill call: inputs checked once at the op boundary (the dispatcher's launchers do
not check again; the public launchers still do), kernel configs chosen once per key (TunedLaunch), the
one launch that builds the row order and the density probe's total, compiled binaries launched directly
(common.Launch, LEAN_LAUNCH), and the prefill threshold of calls captured into CUDA graphs."""

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, rel_err
from ffn_cases import GatedBlock, gated_ref, make_ffn

import twell
from twell.kernels import checks, common, dispatch, gate, policy, updown
from twell.kernels.policy import LayerConfig

# every check the launchers' modules call on their inputs
CHECKS = ("check_input", "check_operand", "check_bias", "check_threshold", "check_tile", "check_pos", "check_hot")


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


@pytest.mark.parametrize("fused", [False, True], ids=["cublas-gate", "fused-gate"])
def test_the_prefill_path_checks_its_inputs_once(fused, monkeypatch):
    """dispatch's prefill launchers run none of the launchers' checks (the op boundary ran its own);
    the public launchers, called directly, still check."""
    config = LayerConfig(fused_gate=fused, hot_rate=None).replace(route="prefill")
    case = make_ffn(40, 24, 64, [0.05, 0.1], torch.float32, DEVICE, seed=5, biases=True)
    args = [case[c] for c in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
    checked = []
    for module in (gate, updown):
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


def test_a_token_bucket_tunes_once(monkeypatch):
    """The pack launcher asks the autotuner once per key (token bucket, shape, layout, dtype, hot, reuse rows), then
    launches its config directly, with the same results as that config launched by hand."""
    launch = common.TunedLaunch(gate._pack_dense_kernel)
    monkeypatch.setattr(gate, "_pack_dense_launch", launch)
    tuned = []
    run = gate._pack_dense_kernel.run
    monkeypatch.setattr(gate._pack_dense_kernel, "run", lambda *a, **k: tuned.append(a[0].shape[0]) or run(*a, **k))
    for m in (70, 100, 70, 200, 129):
        h = torch.randn(m, 96, device=DEVICE)
        words, counts = gate.launch_pack_dense(h, 0.5, 32, 8)
        config = launch.configs[(triton.next_power_of_2(m), 96, 32, 8, torch.float32, True, 0, False)]  # no reuse, scan
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


@pytest.mark.parametrize("m,n_tiles", [(1, 1), (37, 3), (300, 44)], ids=["m1", "m37", "m300-programs3"])
def test_row_totals_give_the_order_keys_the_probe_total_and_zeroed_counters(m, n_tiles):
    counts = torch.randint(0, 40, (m, n_tiles), dtype=torch.int32, device=DEVICE)
    counts[::7, 0] = 300  # rows past 255 entries: key 255
    keys = torch.full((m,), 0xAB, dtype=torch.uint8, device=DEVICE)
    tiles_pad = max(triton.next_power_of_2(n_tiles), 2)
    block_m = max(16, 8192 // tiles_pad)
    parts = triton.cdiv(m, block_m)
    kept = torch.full((parts,), -7, dtype=torch.int64, device=DEVICE)
    capacity = max(1, m - 3)
    heavy = torch.full((1 + m + capacity,), 9, dtype=torch.int32, device=DEVICE)
    updown._row_totals_kernel[(parts,)](
        counts, keys, kept, heavy, heavy[1 + m :], m, n_tiles, capacity, ORDER=True, BLOCK_M=block_m,
        TILES_PAD=tiles_pad,
    )  # fmt: skip
    assert int(kept.sum()) == int(counts.sum())
    assert torch.equal(keys, counts.sum(1).clamp(max=255).to(torch.uint8))
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


# --- the lean launch (common.Launch) and the captured-call threshold ---


def _toy_kernel(x_ptr, y_ptr, n, scale, flag, BLOCK: tl.constexpr, EVEN: tl.constexpr = False):  # noqa: ARG001
    """A kernel's signature (its body never runs: the tests below replace Triton's launch)."""


class _Binary:
    """What Triton's launch returns (a compiled kernel): binary.run(grid, stream, function, metadata,
    launch hooks, every argument) launches it."""

    function = packed_metadata = None

    def __init__(self, spec):
        self.spec, self.launches = spec, []

    def launch_metadata(self, grid, stream, *values):
        return ("metadata", stream)

    def run(self, grid_0, grid_1, grid_2, stream, function, packed_metadata, metadata, enter, leave, *values):
        assert stream == 7 and metadata == ("metadata", 7)
        self.launches.append(((grid_0, grid_1, grid_2), values))


@pytest.fixture
def toy(monkeypatch):
    """A Launch of _toy_kernel, LEAN_LAUNCH on, as on a GPU: Triton's launch records its arguments and
    returns a new binary (a fresh specialisation) each time."""
    from triton.runtime.jit import JITFunction

    kernel = JITFunction(_toy_kernel)
    normal = []

    def run(*args, grid, warmup, **kwargs):
        normal.append(_Binary((args, kwargs)))
        return normal[-1]

    monkeypatch.setattr(kernel, "run", run)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(common, "LEAN_LAUNCH", True)
    monkeypatch.setattr(common, "_current_device", lambda: 0)
    monkeypatch.setattr(common, "_current_stream", lambda device: 7)
    return common.Launch(kernel), normal


def test_lean_launch_reuses_a_binary_only_for_the_same_specialization(toy):
    launch, normal = toy
    x = torch.randn(64, dtype=torch.float16)
    y = torch.empty(64, dtype=torch.float16)
    launch((4,), x, y, 32, 0.5, True, BLOCK=16)
    assert len(normal) == 1
    launch((4,), x, y, 32, 0.5, True, BLOCK=16)  # the same call: the binary directly
    launch((2, 3), torch.randn(64, dtype=torch.float16), y, 48, -1.5, False, BLOCK=16)  # 48: divisible by 16 too
    assert len(normal) == 1
    grid, values = normal[0].launches[1]
    assert grid == (2, 3, 1) and values[2:] == (48, -1.5, False, 16, False)  # every argument, defaults too
    specialised_otherwise = [
        lambda: launch((4,), x[1:], y, 32, 0.5, True, BLOCK=16),  # x 2 bytes off 16-byte alignment
        lambda: launch((4,), x, y[3:], 32, 0.5, True, BLOCK=16),
        lambda: launch((4,), x.float(), y, 32, 0.5, True, BLOCK=16),  # dtype
        lambda: launch((4,), x, y, 1, 0.5, True, BLOCK=16),  # an int of 1 becomes a constant
        lambda: launch((4,), x, y, 33, 0.5, True, BLOCK=16),  # not divisible by 16
        lambda: launch((4,), x, y, 1 << 40, 0.5, True, BLOCK=16),  # i64
        lambda: launch((4,), x, y, 32, 0.5, True, BLOCK=32),  # a constexpr
        lambda: launch((4,), x, y, 32, 0.5, True, BLOCK=16, EVEN=True),
        lambda: launch((4,), x, y, 32, 0.5, True, BLOCK=16, num_warps=8),  # a launch option
        lambda: launch((4,), x, y, 32, 2, True, BLOCK=16),  # an int where a float was
    ]
    for i, call in enumerate(specialised_otherwise):
        call()
        assert len(normal) == 2 + i, i  # Triton's launch specialises for it
        call()
        assert len(normal) == 2 + i and len(normal[-1].launches) == 1, i  # then its own binary
    assert len(normal[0].launches) == 2


def test_lean_launch_passes_keywords_and_a_grid_of_the_arguments(toy):
    launch, normal = toy
    x = torch.randn(40)

    def grid(args):
        return (triton.cdiv(args["n"], args["BLOCK"]),)

    launch(grid, x, y_ptr=x, n=40, scale=1.0, flag=False, BLOCK=16)
    y = torch.randn(40)  # another tensor of the same kind: the same binary
    launch(grid, x, y_ptr=y, n=40, scale=1.0, flag=False, BLOCK=16)
    launch(grid, x, y_ptr=x[1:], n=40, scale=1.0, flag=False, BLOCK=16)  # keywords are keyed by kind too
    assert len(normal) == 2
    ((grid_used, values),) = normal[0].launches
    assert grid_used == (3, 1, 1) and values[0] is x and values[1] is y and values[2:] == (40, 1.0, False, 16, False)


def test_lean_launch_leaves_unkeyable_calls_and_the_interpreter_to_triton(toy, monkeypatch):
    launch, normal = toy
    x = torch.randn(64)
    descriptor = object()  # e.g. a TMA descriptor: specialised by its block shape
    for _ in range(3):
        launch((1,), descriptor, x, 32, 0.5, True, BLOCK=16)
    assert len(normal) == 3 and not any(b.launches for b in normal)
    for setting in ({"LEAN_LAUNCH": False}, {"env": "1"}):
        if "env" in setting:
            monkeypatch.setattr(common, "LEAN_LAUNCH", True)
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        else:
            monkeypatch.setattr(common, "LEAN_LAUNCH", False)
        before = len(normal)
        for _ in range(3):
            launch((1,), x, x, 32, 0.5, True, BLOCK=16)
        assert len(normal) == before + 3


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
    assert default.prefill_min_m_captured is None  # the same as prefill_min_m until measured
    for m in (4096, 8192, 16384):
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
    config = LayerConfig(prefill_min_m=None, prefill_min_m_captured=64, hot_rate=None)
    dispatch.forget_layers()
    assert _choose(case, 80, config, True) == "dense"  # nothing ran at bucket 128 yet
    assert _choose(case, 80, config, False) == "prefill"  # the warm-up call (torch.compile's CUDA graphs run one)
    assert _choose(case, 100, config, False) == "dense"  # the same bucket
    assert _choose(case, 90, config, True) == "prefill"
    assert _choose(case, 200, config, True) == "dense"  # bucket 256
    assert _choose(case, 40, config, False) == _choose(case, 40, config, True) == "dense"  # below both
    dispatch.forget_layers()
    default = LayerConfig(prefill_min_m=None, hot_rate=None)
    assert [_choose(case, 80, default, c) for c in (False, True, False)] == ["dense"] * 3
    at_64 = LayerConfig(prefill_min_m=64, hot_rate=None)
    assert _choose(case, 80, at_64, True) == "prefill"  # at prefill_min_m captures need no eager call first
    above = LayerConfig(prefill_min_m=64, prefill_min_m_captured=128, hot_rate=None)
    assert _choose(case, 80, above, True) == "dense"  # a captured threshold above the eager one holds


def test_the_warm_up_call_is_exact():
    case = make_ffn(80, 24, 64, [0.05, 0.2], torch.float32, DEVICE, seed=6, biases=True)
    config = LayerConfig(prefill_min_m=None, prefill_min_m_captured=64, hot_rate=None)
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


@pytest.mark.gpu
def test_lean_launch_matches_triton_launch_bit_for_bit(monkeypatch):
    """8192 tokens through the prefill path: the same bits with LEAN_LAUNCH on as off, for an aligned x
    and one 2 bytes off (Triton's launch specialises for it), and the lean calls after the first of
    each skip Triton's launch of the up+down kernel."""
    _fresh_launchers(monkeypatch)  # no binary kept from another test
    block = _block_8192()
    twell.sparsify(block)
    base = torch.randn(8192 * 2048 + 1, device="cuda", dtype=torch.bfloat16)
    xs = (base[:-1].view(8192, 2048), base[1:].view(8192, 2048))
    triton_runs = []
    _counting(monkeypatch, updown._twell_up_down_kernel.fn, triton_runs)
    results = {}
    with torch.no_grad(), twell.configure(block, route="prefill", hot_rate=None):
        for lean in (False, True):
            monkeypatch.setattr(common, "LEAN_LAUNCH", lean)
            results[lean], runs = [], []
            for x in xs:
                for _ in range(3):
                    before = len(triton_runs)
                    results[lean].append(block(x))
                    torch.cuda.synchronize()
                    runs.append(len(triton_runs) - before)
            if lean:
                assert runs[2] == runs[5] == 0 and runs[0] == runs[3] == 1
    assert updown._up_down_launch.launch.binaries and gate._pack_dense_launch.launch.binaries
    for off, on in zip(results[False], results[True], strict=True):
        assert torch.equal(off, on)
    assert not torch.equal(results[True][0], results[True][3])  # the two inputs differ


def _fresh_launchers(monkeypatch) -> None:
    """The prefill launchers with no key tuned (the autotuners' own caches are bypassed by them)."""
    monkeypatch.setattr(gate, "_pack_dense_launch", common.TunedLaunch(gate._pack_dense_kernel))
    monkeypatch.setattr(updown, "_up_down_launch", common.TunedLaunch(updown._twell_up_down_kernel))


@pytest.mark.gpu
@pytest.mark.parametrize("lean", [False, True], ids=["triton-launch", "lean"])
def test_a_captured_8192_token_call_prefills_after_an_eager_one(monkeypatch, lean):
    """prefill_min_m_captured=8192: a capture of a layer never run at that size runs dense (no crash,
    nothing tuned inside it); after one eager call (which prefills and tunes), the capture prefills,
    tunes nothing, and its replay gives the eager prefill call's bits."""
    monkeypatch.setattr(common, "LEAN_LAUNCH", lean)
    _fresh_launchers(monkeypatch)
    tuning, paths = [], []
    _counting(monkeypatch, gate._pack_dense_kernel, tuning)
    _counting(monkeypatch, updown._twell_up_down_kernel, tuning)
    launch_up_down = dispatch.launch_up_down
    monkeypatch.setattr(dispatch, "launch_up_down", lambda *a, **k: paths.append("prefill") or launch_up_down(*a, **k))
    block = _block_8192()
    twell.sparsify(block, layer_config={"hot_rate": None})
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
        twell.configure(block, prefill_min_m_captured=8192)
        dispatch.forget_layers()
        assert rel_err(captured(), dense) <= 1e-6 and paths == [] and tuning == []
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
    _fresh_launchers(monkeypatch)
    tuning, paths = [], []
    _counting(monkeypatch, gate._pack_dense_kernel, tuning)
    _counting(monkeypatch, updown._twell_up_down_kernel, tuning)
    launch_up_down = dispatch.launch_up_down
    monkeypatch.setattr(dispatch, "launch_up_down", lambda *a, **k: paths.append("prefill") or launch_up_down(*a, **k))
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
