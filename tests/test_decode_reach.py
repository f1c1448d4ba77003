"""The decode kernels' reach from calibration: policy.DECODE_REACH against the GPU measurement it cites,
calibrated_decode_max_m by density and K, and a calibrated layer's LayerConfig (Decision.layer_config,
twell.layer_configs) and calls (policy.route, the dispatcher) taking it."""

import json
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, rel_err
from ffn_cases import gated_ref, make_ffn
from models import replanned_llama

import twell
from twell.calibrate import Decision
from twell.kernels import dispatch, policy
from twell.kernels.decode import launch_decode
from twell.kernels.policy import LayerConfig

MIXED = [0.0, 0.03, 0.1, 0.02, 0.05, 0.01, 0.04, 0.0, 0.03, 1.0]
MEASURED = Path(__file__).parents[1] / "benchmarks/results/gpu_check-batched-20261202-024931.json"


def measured_reach() -> dict:
    """{(K, density): tokens} from the cited run: the largest measured token count up to which every
    measured count's decode variant beats the installed (dense-route) module by >= 3%; 0 where none does."""
    rows = json.loads(MEASURED.read_text())["rows"]
    speed = {(r["K"], r["density"], r["M"], r["variant"]): r["speedup"] for r in rows}
    reach = {}
    for k, density in {(r["K"], r["density"]) for r in rows}:
        reach[k, density] = 0
        for m in sorted({r["M"] for r in rows}):
            if speed[k, density, m, "decode"] < 1.03 * speed[k, density, m, "installed"]:
                break
            reach[k, density] = m
    return reach


def test_decode_reach_is_the_measured_one():
    """Every measured (K, density) point gets the reach its measurement gives (the default decode_max_m
    where the decode kernels won at no count past it): K=2048 16 tokens at 0.5% and 1%, K=4096 32."""
    reach = measured_reach()
    assert reach == {
        (2048, 0.005): 16, (2048, 0.01): 16, (2048, 0.05): 0, (4096, 0.005): 32, (4096, 0.01): 32, (4096, 0.05): 16,
    }  # fmt: skip
    for (k, density), tokens in reach.items():
        assert policy.calibrated_decode_max_m(density, k) == max(tokens, policy.DECODE_MAX_M), (k, density)


@pytest.mark.parametrize(
    "density,k,tokens",
    [
        (0.005, 4096, 32), (0.012, 4096, 16), (0.05, 4096, 16), (0.051, 4096, 8), (0.005, 8192, 32),
        (0.005, 4095, 16), (0.01, 3072, 16), (0.011, 2048, 8), (0.05, 2048, 8), (0.005, 1024, 16), (0.0, 0, 16),
        (None, 4096, 8), (1.0, 4096, 8),
    ],
)  # fmt: skip
def test_calibrated_decode_max_m_by_density_and_width(density, k, tokens):
    """The first row of DECODE_REACH that holds; a K between the measured ones takes the narrower K's
    rows (conservative); an unmeasured density, or one past every row, the default decode_max_m."""
    assert policy.calibrated_decode_max_m(density, k) == tokens


def test_calibrated_decode_max_m_takes_a_table_and_never_lowers_the_configs():
    reach = ((100, 0.02, 64), (0, 0.02, 12))
    assert [policy.calibrated_decode_max_m(d, k, reach=reach) for d, k in ((0.02, 100), (0.02, 99), (0.03, 100))] == [
        64,
        12,
        8,
    ]
    wide = LayerConfig(decode_max_m=40)
    assert policy.calibrated_decode_max_m(0.005, 4096, wide) == 40
    assert policy.calibrated_decode_max_m(None, 4096, wide) == 40


def test_calibration_sets_the_decode_reach_from_density_and_width():
    """A decision's LayerConfig takes decode_max_m from its decode calls' density (the mean over all
    calls where decode was not seen) and its K (model_size; 0 in an old plan: the narrow rows); its calls
    of up to that many tokens take the decode kernels from the first one (no prefill needs to have
    measured the layer); a decode phase calibrated dense never does."""
    wide = Decision(
        path="mlp", rewrite=True, reason="", model_size=4096, density=0.02, stats={"decode": {"density": 0.005}}
    )
    assert wide.layer_config().decode_max_m == 32
    assert [policy.route(m, 4096, wide.layer_config()) for m in (32, 33)] == ["decode", "dense"]
    narrow = Decision(path="mlp", rewrite=True, reason="", model_size=2048, density=0.005)
    assert narrow.layer_config().decode_max_m == 16
    assert [policy.route(m, 2048, narrow.layer_config()) for m in (16, 17)] == ["decode", "dense"]
    denser = Decision(path="mlp", rewrite=True, reason="", model_size=4096, stats={"decode": {"density": 0.03}})
    assert denser.layer_config().decode_max_m == 16
    assert Decision(path="mlp", rewrite=True, reason="", model_size=2048, density=0.03).layer_config().decode_max_m == 8
    assert Decision(path="mlp", rewrite=True, reason="").layer_config().decode_max_m == 8  # never measured
    assert Decision(path="mlp", rewrite=True, reason="", density=0.01).layer_config().decode_max_m == 16
    assert wide.layer_config({"decode_max_m": 4}).decode_max_m == 4  # sparsify's changes come last
    wide.dense_phases = ["decode"]
    assert (wide.layer_config().decode_max_m, wide.layer_config().decode_sparse_max_m) == (0, 0)


def test_layer_configs_show_the_calibrated_reach(tmp_path):
    """A plan's decisions decide each rewritten layer's decode_max_m, as twell.layer_configs reports it."""
    configs = twell.layer_configs(replanned_llama(tmp_path, lambda d: d.update(density=0.005, stats={})))
    assert configs and {c.decode_max_m for c in configs.values()} == {16}  # K < 4096: the narrow rows


def test_replace_refuses_a_route_it_does_not_have():
    with pytest.raises(ValueError, match=r"route must be one of \('decode', 'prefill', 'dense'\), got 'batched'"):
        LayerConfig().replace(route="batched")


@pytest.mark.parametrize("m,path", [(8, "decode"), (24, "decode"), (32, "decode"), (33, "dense")])
def test_dispatch_sends_calls_within_the_reach_to_the_decode_kernels(m, path, monkeypatch):
    """A layer calibrated to 32 tokens: its 9-32-token calls take the decode kernels (exact), without a
    prefill call having measured its density; larger calls run dense."""
    dispatch.forget_layers()
    calls = []
    record = lambda *a, **k: calls.append(a[0].shape[0]) or launch_decode(*a, **k)  # noqa: E731
    monkeypatch.setattr(dispatch, "launch_decode", record)
    case = make_ffn(m, 24, 96, MIXED, torch.float32, DEVICE, seed=m, biases=True)
    args = [case[k] for k in ("gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")]
    config = Decision(path="mlp", rewrite=True, reason="", model_size=4096, density=0.005).layer_config()
    y = dispatch.gated_ffn_cuda(case["x"], *args, 0.0, False, config.replace(prefill_min_m=None))
    assert calls == ([m] if path == "decode" else [])
    assert rel_err(y, gated_ref(case)) <= 1e-5
