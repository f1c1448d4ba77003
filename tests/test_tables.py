"""The README's and docs/performance.md's figure tables are written from the result files by
benchmarks/tables.py: no figure copied by hand, none stale, and the newest run of each point counts."""

import importlib.util
import json
from pathlib import Path

import pytest

from twell.kernels import backward, policy

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("benchmark_tables", ROOT / "benchmarks" / "tables.py")
tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tables)

MARKERS = {"README.md": ["summary"], "docs/performance.md": ["ffn", "e2e", "train"]}


@pytest.mark.parametrize("page", tables.PAGES)
def test_committed_tables_are_what_tables_py_writes(page):
    text = (ROOT / page).read_text()
    for name in MARKERS[page]:
        assert f"<!-- tables:{name} -->" in text and f"<!-- /tables:{name} -->" in text, f"{page}: no {name} table"
    assert text == tables.with_tables(text, tables.tables()), (
        f"{page}: its tables differ from the result files; run PYTHONPATH=. python benchmarks/tables.py"
    )


def ffn_point(m, speedup, **extra):
    dense = 1.0
    return {
        "K": 2048,
        "N": 5632,
        "M": m,
        "pattern": "uniform",
        "density": 0.005,
        "dense_eager_ms": dense * 1.5,
        "dense_compiled_ms": dense,
        "twell_ms": dense / speedup,
        "speedup": speedup,
        "path": "decode" if m == 1 else "prefill",
        "layers_per_graph": 8,
        "memory_ratio": 0.4,
        **extra,
    }


def e2e_run(commit, tokens_per_s, smoke=False):
    def rows(side, profile, rate):
        return {
            "row": side,
            "profile": profile,
            "prefill": [{"batch": 16, "seq": 2048, "tokens_per_s": rate}],
            "generation": [{"batch": 1, "prompt": 16, "new_tokens": 64, "tokens_per_s": rate / 100}],
        }

    model = {
        "model": "2b",
        "config": {"num_hidden_layers": 38},
        "profiles": {"skewed": {}},
        "rows": [
            rows("dense-eager", None, 900.0),
            rows("dense-compiled", None, 1000.0),
            rows("twell-compiled", "skewed", tokens_per_s),
            {"row": "twell-eager", "profile": "skewed", "error": "failed"},
        ],
    }
    return {"commit": commit, "smoke": smoke, "models": [model]}


def write(folder, name, data):
    (folder / name).write_text(json.dumps(data))


def test_the_newest_run_of_each_point_counts(tmp_path):
    write(tmp_path, "ffn-20260101-000000.json", {"commit": "old", "points": [ffn_point(1, 1.5), ffn_point(32768, 1.2)]})
    write(tmp_path, "ffn-20260102-000000.json", {"commit": "new", "points": [ffn_point(1, 2.5)]})
    # newer still, but not usable: no commit recorded, or timed the old way (no layers_per_graph)
    write(tmp_path, "ffn-20260103-000000.json", {"commit": "", "points": [ffn_point(1, 9.0)]})
    old_way = ffn_point(32768, 9.0)
    del old_way["layers_per_graph"]
    write(tmp_path, "ffn-20260104-000000.json", {"commit": "c4", "points": [old_way]})
    # newer, but on another card than the tables' (an H100 when no H200 was lent)
    other_card = {"commit": "c5", "gpu": "NVIDIA H100 80GB HBM3", "points": [ffn_point(1, 9.0), ffn_point(32768, 9.0)]}
    write(tmp_path, "ffn-20260105-000000.json", other_card)
    write(tmp_path, "e2e-20260101-000000.json", e2e_run("e1", 1100.0))
    write(tmp_path, "e2e-20260102-000000.json", e2e_run("e2", 1200.0))
    write(tmp_path, "e2e-20260103-000000.json", e2e_run("e3", 5000.0, smoke=True))
    fewer = e2e_run("e4", 7000.0)  # newer, of fewer layers: a point of its own, beside the 38-layer one
    fewer["models"][0]["config"]["num_hidden_layers"] = 12
    write(tmp_path, "e2e-20260104-000000.json", fewer)
    shipped = {"train_forward_pack": policy.TRAIN_FORWARD_PACK}  # the training forward users get
    write(tmp_path, "train-20260101-000000.json", {"commit": "t1", "points": [{**ffn_point(32768, 0.5), **shipped}]})
    write(tmp_path, "train-20260102-000000.json", {"commit": "t2", "points": [{**ffn_point(32768, 1.05), **shipped}]})
    # newer, but a variant of the kernels' settings (not what users get)
    variant = {**ffn_point(32768, 3.0), "train_entries": 4}
    write(tmp_path, "train-20260103-000000.json", {"commit": "t3", "points": [variant]})
    hot = {**ffn_point(32768, 4.0), "train_hot": 256}  # the hot-neuron hybrid, off by default: a variant too
    write(tmp_path, "train-20260104-000000.json", {"commit": "t4", "points": [hot]})
    other = {**ffn_point(32768, 5.0), "train_forward_pack": not policy.TRAIN_FORWARD_PACK}  # the other forward
    write(tmp_path, "train-20260105-000000.json", {"commit": "t5", "points": [other]})
    if policy.TRAIN_FORWARD_PACK:  # a run from before the field measured the row kernel's forward: a variant now
        write(tmp_path, "train-20260106-000000.json", {"commit": "t6", "points": [ffn_point(32768, 6.0)]})
    # --backward-constant: a variant; a constant backward no longer has counts as shipped
    constants = {"DW_BLOCK_K": backward.DW_BLOCK_K + 1, "GONE_SINCE": 3}
    write(tmp_path, "train-20260107-000000.json", {"commit": "t7", "backward_constants": constants,
                                                    "points": [{**ffn_point(32768, 7.0), **shipped}]})  # fmt: skip

    points = {p["M"]: p for p in tables.ffn_points(tmp_path)}
    assert (points[1]["speedup"], points[1]["source"]) == (2.5, "`ffn-20260102-000000.json` (new)")
    assert (points[32768]["speedup"], points[32768]["source"]) == (1.2, "`ffn-20260101-000000.json` (old)")

    e2e = {e["key"][1:4]: e for e in tables.e2e_points(tmp_path)}
    assert e2e[12, "skewed", "prefill"]["source"].endswith("(e4)")
    prefill = e2e[38, "skewed", "prefill"]
    assert prefill["key"] == ("2b", 38, "skewed", "prefill", 16, 2048) and prefill["source"].endswith("(e2)")
    assert (prefill["dense"]["row"], prefill["twell"]["row"]) == ("dense-compiled", "twell-compiled")
    assert prefill["twell"]["tokens_per_s"] == 1200.0

    generated = tables.tables(tmp_path)
    assert "| 1.20x | `e2e-20260102-000000.json` (e2) |" in generated["summary"]
    assert "| 1.05x | sparse | 40% | `train-20260102-000000.json` (t2) |" in generated["train"]
    assert "| 2.50x | decode | `ffn-20260102-000000.json` (new) |" in generated["ffn"]


def test_markers_are_replaced_whole_and_unknown_ones_refused():
    text = "a\n<!-- tables:ffn -->\nstale\n<!-- /tables:ffn -->\nb\n"
    assert tables.with_tables(text, {"ffn": "| new |"}) == "a\n<!-- tables:ffn -->\n| new |\n<!-- /tables:ffn -->\nb\n"
    with pytest.raises(ValueError, match="unknown table marker 'nope'"):
        tables.with_tables("<!-- tables:nope -->\n<!-- /tables:nope -->", {"ffn": ""})


def test_decode_steps_only_from_split_timing_and_the_summary_keeps_the_compiled_row(tmp_path):
    """A generation point timed with the prompt split off each call (prompt_calls == calls) also gives a
    "decode steps" point; one timed the old way (the prompt measured apart) does not. The README's
    summary shows the twell-compiled row even where a calibrated row was faster."""
    run = e2e_run("s1", 1100.0)
    run["models"][0]["config"]["num_hidden_layers"] = 12
    rows = run["models"][0]["rows"]
    for row, steps in zip(rows[:3], (1000.0, 1100.0, 1300.0), strict=True):
        row["generation"][0].update(calls=10, prompt_calls=10, decode_tokens_per_s=steps)
    faster = {**rows[2], "row": "twell-calibrated-compiled"}
    faster["generation"] = [{**rows[2]["generation"][0], "tokens_per_s": 50.0, "decode_tokens_per_s": 2000.0}]
    rows.append(faster)
    old_way = e2e_run("s0", 1100.0)  # the prompt timed apart: its own count of calls
    for row in old_way["models"][0]["rows"][:3]:
        row["generation"][0].update(calls=10, prompt_calls=30, decode_tokens_per_s=9e9)
    write(tmp_path, "e2e-20260101-000000.json", old_way)
    write(tmp_path, "e2e-20260102-000000.json", run)
    points = {e["key"][1:5]: e for e in tables.e2e_points(tmp_path)}
    steps = points[12, "skewed", "decode steps", 1]
    assert (steps["dense"]["tokens_per_s"], steps["twell"]["tokens_per_s"]) == (1100.0, 2000.0)
    assert (38, "skewed", "decode steps", 1) not in points
    assert points[12, "skewed", "generation", 1]["twell"]["row"] == "twell-calibrated-compiled"
    summary = tables.summary_table([], tables.e2e_points(tmp_path), [], [])
    steps_row = "| decode steps alone, batch 1 (CUDA-graph replays) | 1100 tokens/s (dense-compiled) | 1300 tokens/s"
    assert f"{steps_row} (twell-compiled) | 1.18x |" in summary
    assert (
        "| 10 tokens/s (dense-compiled) | 11 tokens/s (twell-compiled) | 1.10x |" in summary
    )  # not the 50 of the faster row


def test_a_compiled_prompt_run_is_a_generation_point_of_its_own(tmp_path):
    write(tmp_path, "e2e-20260101-000000.json", e2e_run("p0", 1100.0))
    compiled = {**e2e_run("p1", 3000.0), "args": {"compiled_prompt": True}}  # newer, the variant
    write(tmp_path, "e2e-20260102-000000.json", compiled)
    points = {e["key"][3]: e for e in tables.e2e_points(tmp_path) if e["key"][3] != "prefill"}
    assert points["generation"]["source"].endswith("(p0)")
    assert points["generation, compiled prompt"]["source"].endswith("(p1)")
    assert tables.shape(points["generation, compiled prompt"]).startswith(
        "generation, batch 1 (16-token compiled prompt"
    )
