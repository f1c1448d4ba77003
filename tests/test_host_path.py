"""The host side of a prefill call: inputs checked once at the op boundary (the dispatcher's launchers do
not check again; the public launchers still do), kernel configs chosen once per key (TunedLaunch), and
the one launch that builds the row order and the density probe's total."""

import pytest
import torch
import triton
from conftest import DEVICE, rel_err
from ffn_cases import gated_ref, make_ffn

from twell.kernels import checks, common, dispatch, gate, updown
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
