"""benchmarks/e2e.py --smoke runs on the CPU and writes what benchmarks/plots.py draws."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent


def run(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    done = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def smoke_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    run(ROOT / "benchmarks" / "e2e.py", "--smoke", "--out", out, cwd=ROOT)
    (path,) = out.glob("e2e-*.json")
    return path


def test_e2e_smoke(smoke_result):
    result = json.loads(smoke_result.read_text())
    assert result["smoke"] and [m["model"] for m in result["models"]] == ["2b", "8b"]
    for model in result["models"]:
        assert set(model["profiles"]) == {"skewed", "demo"}
        rows = [(r["row"], r["profile"]) for r in model["rows"]]
        assert rows == [("dense-eager", None), ("twell-eager", "skewed"), ("twell-eager", "demo")]
        for row in model["rows"]:
            assert "error" not in row and row["logits_rel_err"] < 1e-5
            assert len(row["prefill"]) == 4 and all(
                set(m["breakdown_ms"]) == {"attention", "ffn", "rest"} for m in row["prefill"]
            )
            assert [g["batch"] for g in row["generation"]] == [1, 2]
            assert all(g["first_divergent_step"] is None and g["speedup"] > 0 for g in row["generation"])
        assert model["rows"][1]["report"]["rewritten"] == model["config"]["num_hidden_layers"]


def test_plots_from_smoke_result(smoke_result, tmp_path):
    pytest.importorskip("matplotlib")
    printed = run(ROOT / "benchmarks" / "plots.py", smoke_result, "--out", tmp_path, cwd=ROOT)
    for name in ("ffn-speedup.png", "e2e-throughput.png", "e2e-breakdown.png"):
        assert (tmp_path / name).stat().st_size > 10_000, printed
