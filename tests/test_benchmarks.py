"""benchmarks/e2e.py --smoke runs on the CPU and writes what benchmarks/plots.py draws; benchmarks/ffn.py's
inputs fire the density of their label."""

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
        assert rows == [
            ("dense-eager", None), ("twell-eager", "skewed"), ("twell-eager", "demo"),
            ("twell-calibrated-eager", "skewed"), ("twell-calibrated-eager", "demo"),
        ]  # fmt: skip
        for row in model["rows"]:
            assert "error" not in row and row["logits_rel_err"] < 1e-5
            assert len(row["prefill"]) == 4 and all(
                set(m["breakdown_ms"]) == {"attention", "ffn", "rest"} for m in row["prefill"]
            )
            assert [g["batch"] for g in row["generation"]] == [1, 2]
            assert all(g["first_divergent_step"] is None and g["speedup"] > 0 for g in row["generation"])
            for g in row["generation"]:  # the same calls split: the prompt, then the decode steps
                assert 0 < g["prompt_ms"] < g["ms"] and g["prompt_calls"] == g["calls"] >= 3
                steps = g["new_tokens"] - 1
                assert 0 < g["decode_ms_per_step"] * steps < g["ms"]
                if g["decode_ms_per_step"] > 0:
                    assert g["decode_tokens_per_s"] == pytest.approx(g["batch"] / g["decode_ms_per_step"] * 1e3)
        assert model["rows"][1]["report"]["rewritten"] == model["config"]["num_hidden_layers"]
        for row in model["rows"][3:]:  # calibrated on the generation prompts: what each layer's config routes where
            calibration = row["calibration"]
            assert len(calibration["layer_configs"]) == calibration["rewritten"] == row["report"]["rewritten"]
            assert set(calibration["routes"]) == {"1", "2"}
            assert all(sum(r.values()) == calibration["rewritten"] for r in calibration["routes"].values())
            assert set(calibration["decisions"]) >= set(calibration["layer_configs"])
            assert all("decode" in d["predicted_speedup"] for d in calibration["decisions"].values())


def test_plots_from_smoke_result(smoke_result, tmp_path):
    pytest.importorskip("matplotlib")
    printed = run(ROOT / "benchmarks" / "plots.py", smoke_result, "--out", tmp_path, cwd=ROOT)
    for name in ("ffn-speedup.png", "e2e-throughput.png", "e2e-breakdown.png"):
        assert (tmp_path / name).stat().st_size > 10_000, printed


def test_reuse_statistics_of_a_known_activity_matrix():
    """benchmarks/reuse.py's block statistics: 2 blocks of 2 tokens over 4 neurons."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from reuse import block_stats

    active = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    stats = block_stats(active, 2)
    # block 0: neuron 0 in 2 tokens, neuron 1 in 1; block 1: neurons 2 and 3 once each
    assert stats["pairs_per_token"] == 5 / 4 and stats["union_per_token"] == 4 / 4
    assert stats["reuse"] == 5 / 4 and stats["pairs_in_2plus"] == 2 / 5 and stats["pairs_in_4plus"] == 0
    assert stats["union_share_of_n"] == 4 / 8


@pytest.mark.parametrize("pattern", ["uniform", "skewed", "topics", "topics-mixed"])
def test_ffn_inputs_fire_their_labelled_density(pattern):
    """benchmarks/ffn.py's inputs scale x's rows; their gate biases are set for the scaled rows, so a
    0.5% input fires 0.5% of its neurons (set for unscaled rows, uniform fired 0.65%)."""
    import torch

    from benchmarks.ffn import make_inputs

    x, block = make_inputs(8192, 64, 1024, 0.005, pattern, seed=3, dtype=torch.float32, device="cpu")
    mlp = block.mlp
    fired = (torch.nn.functional.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias) > 0).float().mean().item()
    assert abs(fired - 0.005) <= 0.0004, fired


def test_ffn_topics_come_in_runs_and_mixed_topics_do_not():
    """Tokens of "topics" share a topic in runs of TOPIC_RUN; "topics-mixed" draws each token's alone."""
    import torch

    from benchmarks.ffn import TOPIC_RUN, TOPICS, make_inputs

    changes = {}
    for pattern in ("topics", "topics-mixed"):
        x, _ = make_inputs(2048, 64, 256, 0.005, pattern, seed=1, dtype=torch.float32, device="cpu")
        topic = x[:, -TOPICS:].argmax(1)
        changes[pattern] = (topic[1:] != topic[:-1]).float().mean().item()
    assert changes["topics"] <= 1 / TOPIC_RUN
    assert changes["topics-mixed"] > 0.8  # 15 of 16 draws change topic
    with pytest.raises(ValueError, match="pattern must be one of"):
        make_inputs(64, 64, 256, 0.005, "topic", device="cpu")
