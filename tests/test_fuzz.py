"""benchmarks/fuzz.py: its CPU smoke run passes through every path, its check fails wrong outputs, and on
a GPU a sweep of 50 cases finds no wrong result and no crash."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twell.kernels import reference

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fuzz", ROOT / "benchmarks" / "fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz"] = fuzz
_spec.loader.exec_module(fuzz)

# CPU cases (draw_case at these seeds): decode, the prefill path (gated and plain), dense
SMOKE_SEEDS = ["0", "4", "5", "3"]


def test_smoke_passes_every_path(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    argv = ["--smoke", "--out", str(tmp_path)]
    for seed in SMOKE_SEEDS:
        argv += ["--replay", seed]
    assert fuzz.main(argv) == 0
    (path,) = tmp_path.glob("fuzz-*.json")
    summary = json.loads(path.read_text())
    assert summary["cases"] == len(SMOKE_SEEDS) and summary["failed"] == 0
    assert {row["path"] for row in summary["by_path"]} == {"decode", "prefill", "dense"}
    for key in ("gpu", "torch", "triton", "commit", "failures"):
        assert key in summary
    records = [json.loads(line) for line in Path(summary["log"]).read_text().splitlines()]
    assert [r["seed"] for r in records] == [int(s) for s in SMOKE_SEEDS]
    assert all(r["active"] > 0 for r in records)  # no case passes on an all-zero hidden layer


def test_default_route_cases_run_their_widths_defaults():
    """A "default" case runs what sparsify installs at its width (policy.default_config)."""
    from twell.kernels import policy

    cases = [c for c in (fuzz.draw_case(seed, "cpu") for seed in range(40)) if c["route"] == "default"]
    assert cases
    for case in cases:
        changes = {key: case[key] for key in ("tile_n", "slots", "fused_gate", "hot_rate")}
        assert fuzz.config_of(case) == policy.default_config(case["k"]).replace(**changes)
        assert fuzz.config_of({**case, "k": 4096}).prefill_min_m == 8192


def _dense_wrong(threshold_shift=0.0, nan=False):
    """call_op in the case's dtype through the dense reference, with a shifted threshold or one NaN."""

    def call(case, t, x, config):
        x2 = x.reshape(-1, x.shape[-1])
        th = case["threshold"] + threshold_shift
        if case["kind"] in ("gated", "drelu"):
            w = (t["gate_weight"], t["up_weight"], t["down_weight"], t["gate_bias"], t["up_bias"], t["down_bias"])
            y = reference.gated_ffn_reference(x2, *w, th, case["kind"] == "drelu")
        else:
            w = (t["gate_weight"], t["down_weight"], t["gate_bias"], t["down_bias"])
            y = reference.ffn_reference(x2, *w, th, case["kind"] == "relu2")
        if nan:
            y[-1, -1] = math.nan
        return y.reshape(x.shape)

    return call


@pytest.mark.parametrize(
    "wrong, passes",
    [
        pytest.param({}, True, id="right"),
        pytest.param({"threshold_shift": 1.0}, False, id="wrong-threshold"),
        pytest.param({"nan": True}, False, id="one-nan"),
    ],
)
def test_check_fails_wrong_outputs(monkeypatch, wrong, passes):
    """The check itself, on outputs of the dense reference in the case's dtype: right ones pass, a shifted
    threshold or a single NaN fails (a fuzz that cannot fail is a defect)."""
    monkeypatch.setattr(fuzz, "call_op", _dense_wrong(**wrong))
    for seed in (4, 10, 11):
        record = fuzz.run_case(fuzz.draw_case(seed, "cpu"), "cpu")
        assert "error" not in record, record.get("traceback")
        assert record["ok"] is passes, record


def test_replay_draws_the_same_case():
    assert fuzz.draw_case(fuzz.case_seed(3, 7), "cuda") == fuzz.draw_case(fuzz.case_seed(3, 7), "cuda")
    a = fuzz.make_inputs(fuzz.draw_case(11, "cpu"), "cpu")
    b = fuzz.make_inputs(fuzz.draw_case(11, "cpu"), "cpu")
    assert all((a[k] is None and b[k] is None) or torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
def test_gpu_sweep(tmp_path):
    """50 random cases through the CUDA ops: no wrong result, no crash, all within the time limit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    command = [sys.executable, "benchmarks/fuzz.py", "--cases", "50", "--time-limit", "400", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    (path,) = tmp_path.glob("fuzz-*.json")
    summary = json.loads(path.read_text())
    assert summary["failed"] == 0 and not summary["unfinished"], done.stdout[-4000:]
    assert summary["cases"] == 50 and done.returncode == 0, done.stderr[-3000:]
    assert summary["poison_effective"]  # fresh buffers of the calls' sizes read as NaN


def test_row_scale_is_the_terms_magnitude():
    """A row whose terms cancel is judged against the size of its terms (the scale of a dot product's
    rounding), not its near-zero output; an error large against the terms still fails."""
    case = {"kind": "gated", "threshold": 0.0}
    d = {
        "gate_weight": torch.eye(2, dtype=torch.float64),
        "up_weight": torch.ones(2, 2, dtype=torch.float64),
        "down_weight": torch.tensor([[1.0, -1.0]], dtype=torch.float64),  # [K=1, N=2]: the neurons cancel
        "gate_bias": None,
        "up_bias": None,
        "down_bias": None,
    }
    xs = torch.tensor([[1.0, 1.0], [2.0, 1.0]], dtype=torch.float64)
    pre = torch.nn.functional.linear(xs, d["gate_weight"])
    mag = fuzz.magnitude(case, d, xs, pre)
    # row 0: h = (2, 2) cancels to 0; each neuron's terms |g||u| + |pre| |x||W_u| = 4, through |W_d| = 1
    assert mag[:, 0].tolist() == pytest.approx([8.0, 18.0])
    ref = torch.tensor([[0.0], [3.0]], dtype=torch.float64)
    rows = torch.arange(2)
    check = {"ref": ref, "allowance": torch.zeros(2, dtype=torch.float64), "magnitude": mag.norm(dim=1)}
    off = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    assert fuzz.compare(ref + 2e-5 * off, rows, check, 1e-5)["ok"]  # a quarter of tol on row 0's terms
    assert not fuzz.compare(ref + 2e-3 * off, rows, check, 1e-5)["ok"]


def test_time_limit_counts_from_the_call(tmp_path, monkeypatch):
    """A sweep called long after the module was imported (as in a test suite) still gets its whole
    --time-limit: the smoke ran no case in a full suite when the limit counted from the import."""
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(fuzz, "STARTED", fuzz.STARTED - 10_000)
    assert fuzz.main(["--smoke", "--out", str(tmp_path), "--replay", SMOKE_SEEDS[0], "--time-limit", "60"]) == 0
    (path,) = tmp_path.glob("fuzz-*.json")
    assert json.loads(path.read_text())["cases"] == 1
