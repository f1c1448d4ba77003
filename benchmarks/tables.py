"""The figure tables of README.md and docs/performance.md, written from the result files.

    PYTHONPATH=. python benchmarks/tables.py       # after adding results to benchmarks/results/

Each table sits between markers (`<!-- tables:NAME -->` ... `<!-- /tables:NAME -->`) and is rewritten
whole; tests/test_tables.py fails when a committed page differs from what this script writes, so no
figure is copied by hand. Every row names the result file it comes from (each file records the commit
it measured). Which results count, newest first (file names carry the run's UTC time), of runs on the
card the figures are for (REFERENCE_GPU; a run on another card, e.g. an H100 when no H200 was lent,
stays in benchmarks/results/ and NOTES but not in these tables):

- ffn (benchmarks/ffn.py): per point (K, N, tokens, pattern, density), the newest run's module as a user
  calls it (twell.sparsify's, routed by its LayerConfig) against the faster of dense eager and dense
  compiled; only runs timed as today's benchmark times them (calls of up to 256 tokens as CUDA-graph
  replays over several layers: points that record `layers_per_graph`) and that record their commit.
- e2e (benchmarks/e2e.py): per (model, neuron profile, phase, batch, sequence), the newest full run
  (not --smoke) that measured a dense and a twell row there; the faster of each side, from one run.
- train (benchmarks/train.py): the newest run's points.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from twell.kernels import backward, policy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = ("README.md", "docs/performance.md")
RESULT_FILE = re.compile(r"^(?P<kind>[a-z0-9_-]+?)-(?P<stamp>\d{8}-\d{6})\.json$")
# The whole-model run the README quotes: the paper's 2B shape, neurons at 0.5% with skewed rates.
README_MODEL, README_PROFILE = "2b", "skewed"
# The card every table's figures are measured on (a result's "gpu" as torch names it).
REFERENCE_GPU = "NVIDIA H200"


def runs(results: Path, kind: str) -> list[tuple[str, dict]]:
    """(file name, contents) of every result file of `kind` measured on REFERENCE_GPU (or naming no card),
    newest first."""
    found = [(m["stamp"], p) for p in results.iterdir() if (m := RESULT_FILE.match(p.name)) and m["kind"] == kind]
    loaded = [(p.name, json.loads(p.read_text())) for _, p in sorted(found, reverse=True)]
    return [(name, run) for name, run in loaded if run.get("gpu", REFERENCE_GPU) == REFERENCE_GPU]


def source(name: str, run: dict) -> str:
    return f"`{name}` ({run.get('commit') or 'no commit'})"


def speedup(x: float) -> str:
    return f"{x:.2f}x"


def ms(x: float) -> str:
    return f"{x:.3g}"


def span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return speedup(low) if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def ffn_points(results: Path) -> list[dict]:
    """The newest measurement of each FFN point, with its file and commit (see the module doc)."""
    newest: dict[tuple, dict] = {}
    for name, run in runs(results, "ffn"):
        if not run.get("commit"):
            continue
        for p in run["points"]:
            key = (p["K"], p["N"], p["M"], p["pattern"], p["density"])
            if "layers_per_graph" in p and key not in newest:
                newest[key] = {**p, "source": source(name, run)}
    return sorted(newest.values(), key=lambda p: (p["K"], -p["M"], p["pattern"], p["density"]))


def e2e_points(results: Path) -> list[dict]:
    """Per (model, layers, profile, phase, batch, seq): the newest run's faster dense and faster twell row
    (a run of fewer layers is another point: the FFN's share of the step differs). Phase "decode steps":
    a generation point's decode steps alone (decode_tokens_per_s), from runs that split each timed call
    at the prompt (e2e.py's prompt_calls == calls; earlier runs timed the prompt apart and took a
    difference of medians, too noisy to report)."""
    newest: dict[tuple, dict] = {}
    for name, run in runs(results, "e2e"):
        if run.get("smoke"):
            continue
        for model in run["models"]:
            for phase in ("prefill", "generation", "decode steps"):
                sides: dict[tuple, dict] = {}
                for row in model["rows"]:
                    if row.get("error"):
                        continue
                    side = "dense" if row["row"].startswith("dense") else "twell"
                    profiles = [row["profile"]] if side == "twell" else list(model.get("profiles") or [None])
                    points = row.get(phase, [])
                    kind = phase
                    if phase == "generation" and run.get("args", {}).get("compiled_prompt"):
                        kind = "generation, compiled prompt"  # a variant: a point of its own
                    if phase == "decode steps":
                        points = [
                            {**g, "tokens_per_s": g["decode_tokens_per_s"]}
                            for g in row.get("generation", [])
                            if g.get("calls") and g.get("prompt_calls") == g["calls"] and g.get("decode_tokens_per_s")
                        ]
                    for point in points:
                        for profile in profiles:
                            layers = model["config"]["num_hidden_layers"]
                            key = (model["model"], layers, profile, kind, point["batch"], point.get("seq"))
                            entry = sides.setdefault(key, {"rows": {}})
                            entry["rows"][row["row"]] = {**point, "row": row["row"]}
                            best = entry.get(side)
                            if best is None or point["tokens_per_s"] > best["tokens_per_s"]:
                                entry[side] = entry["rows"][row["row"]]
                for key, both in sides.items():
                    if {"dense", "twell"} <= both.keys() and key not in newest:
                        newest[key] = {**both, "source": source(name, run)}
    order = {"prefill": 0, "generation": 1, "generation, compiled prompt": 2, "decode steps": 3}
    ranked = sorted(newest, key=lambda k: (k[0], -k[1], str(k[2]), order[k[3]], k[4], k[5] or 0))
    return [{"key": key, **newest[key]} for key in ranked]


def shipped_constants(run: dict) -> bool:
    """Whether a run's backward constants (train.py --backward-constant) are the shipped ones: those it
    recorded that backward still has (older runs lack newer ones; a constant since removed counts as
    shipped)."""
    return all(getattr(backward, name, value) == value for name, value in run.get("backward_constants", {}).items())


def train_points(results: Path) -> list[dict]:
    """Per point (shape, tokens, pattern, density), the newest training run that measured it at the
    shipped kernel settings (a run with another train_entries, train_hot, train_forward_pack or backward
    constant is a variant, not what users get)."""
    newest = {}
    for name, run in runs(results, "train"):
        if not shipped_constants(run):
            continue
        for p in run["points"]:
            if p.get("train_entries", policy.TRAIN_ENTRIES_DEFAULT) != policy.TRAIN_ENTRIES_DEFAULT:
                continue
            if p.get("train_hot", policy.TRAIN_HOT) != policy.TRAIN_HOT:
                continue
            # runs from before the field: the row kernel's forward
            if p.get("train_forward_pack", False) != policy.TRAIN_FORWARD_PACK:
                continue
            key = (p["K"], p["N"], p["M"], p["pattern"], p["density"])
            newest.setdefault(key, {**p, "source": source(name, run)})
    return [newest[key] for key in sorted(newest, key=lambda k: (k[0], k[2], k[3] != "uniform", k[4]))]


def model_train_points(results: Path) -> list[dict]:
    """Per (layers, batch, sequence), the newest whole-model training step (train.py --model) with a dense
    and a twell compiled row, trained on the batch its gate biases were set on (runs before that flag
    trained on other sequences, 3.5x denser than their profile: not the benchmark's point); the
    benchmark's default 16 x 2048 first."""
    newest = {}
    for name, run in runs(results, "train-model"):
        rows = run["rows"]
        if run.get("fresh_ids") is False and {"dense-compiled", "twell-compiled"} <= rows.keys():
            key = (run["config"]["num_hidden_layers"], run["batch"], run["seq"])
            newest.setdefault(key, {**run, "source": source(name, run)})
    return [newest[key] for key in sorted(newest, key=lambda k: (k[1] * k[2] != 16 * 2048, k))]


def shape(e: dict) -> str:
    model, layers, profile, phase, batch, seq = e["key"]
    if phase == "prefill":
        return f"prefill, {batch} x {seq} tokens"
    if phase == "decode steps":
        return f"decode steps alone, batch {batch} (CUDA-graph replays)"
    prompt = f"{e['twell']['prompt']}-token {'compiled ' if phase == 'generation, compiled prompt' else ''}prompt"
    return f"generation, batch {batch} ({prompt}, {e['twell']['new_tokens']} new tokens)"


def fired(p: dict) -> str:
    """A point's density as labelled, and in brackets the share of neurons its input fired (nnz_mean / N):
    until 2026-12-05 ffn.py's uniform / skewed / topics inputs fired more than their label."""
    share = f" ({p['nnz_mean'] / p['N']:.2%})" if p.get("nnz_mean") is not None else ""
    return f"{p['density']:.1%}{share}"


def ffn_table(points: list[dict]) -> str:
    rows = [
        "| K x N | tokens | pattern | density (fired) | dense ms | twell ms | speedup | path | source |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        dense = min(p["dense_eager_ms"], p["dense_compiled_ms"])
        hot = f", {p['hot_neurons']} hot" if p.get("hot_neurons") else ""
        rows.append(
            f"| {p['K']}x{p['N']} | {p['M']} | {p['pattern']} | {fired(p)} | {ms(dense)} | {ms(p['twell_ms'])} "
            f"| {speedup(p['speedup'])} | {p['path']}{hot} | {p['source']} |"
        )
    return "\n".join(rows)


def e2e_table(points: list[dict]) -> str:
    rows = [
        "| model | neurons | measured | dense tokens/s | twell tokens/s | speedup | source |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in points:
        dense, twell = e["dense"], e["twell"]
        rows.append(
            f"| {e['key'][0]} ({e['key'][1]} layers) | {e['key'][2]} | {shape(e)} | {dense['tokens_per_s']:.0f} "
            f"({dense['row']}) | {twell['tokens_per_s']:.0f} ({twell['row']}) "
            f"| {speedup(twell['tokens_per_s'] / dense['tokens_per_s'])} | {e['source']} |"
        )
    return "\n".join(rows)


def train_table(points: list[dict]) -> str:
    rows = [
        "| K x N | tokens | pattern | density | dense ms | twell ms | speedup | path "
        "| peak memory twell / dense | source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        dense = min(p["dense_eager_ms"], p["dense_compiled_ms"])
        path = "dense mode (train_dense_above)" if p.get("fwd_sparse_ms", 1) == 0 else "sparse"
        rows.append(
            f"| {p['K']}x{p['N']} | {p['M']} | {p['pattern']} | {p['density']:.1%} | {ms(dense)} | {ms(p['twell_ms'])} "
            f"| {speedup(dense / p['twell_ms'])} | {path} | {p['memory_ratio']:.0%} | {p['source']} |"
        )
    return "\n".join(rows)


def summary_table(ffn: list[dict], e2e: list[dict], train: list[dict], models: list[dict]) -> str:
    """What a user gets: whole-model prefill and generation at the paper's 2B shape (the sparsified model
    compiled), a training step, and the FFN block's range per path, at 0.5% density (the paper's
    ReLU models trained with the L1 penalty keep about 29 of 5632 neurons a token: 0.5%)."""
    rows = ["| what | measured | dense | twell | speedup | source |", "|---|---|---|---|---|---|"]
    for e in e2e:
        # the way docs/usage.md recommends running a sparsified model: compiled (that row, faster or not)
        if (e["key"][0], e["key"][2]) != (README_MODEL, README_PROFILE) or "twell-compiled" not in e["rows"]:
            continue
        dense, twell = e["dense"], e["rows"]["twell-compiled"]
        rows.append(
            f"| whole model, {e['key'][0].upper()} shape ({e['key'][1]} layers, 0.5% {README_PROFILE}) | {shape(e)} "
            f"| {dense['tokens_per_s']:.0f} tokens/s ({dense['row']}) | {twell['tokens_per_s']:.0f} tokens/s "
            f"({twell['row']}) | {speedup(twell['tokens_per_s'] / dense['tokens_per_s'])} | {e['source']} |"
        )
    for model in models:
        dense, twell = model["rows"]["dense-compiled"], model["rows"]["twell-compiled"]
        layers = model["config"]["num_hidden_layers"]
        chosen = sorted(set((model.get("calibration") or {}).get("train_hot", {}).values()))
        if model.get("train_hot", policy.TRAIN_HOT) is None and chosen:  # calibration's choice, per layer
            hot = f", train_hot by calibration: {'/'.join(map(str, chosen))}"
        elif model.get("train_hot", policy.TRAIN_HOT) != policy.TRAIN_HOT:  # one size for every layer: a variant
            hot = f", train_hot {model['train_hot']}"
        else:
            hot = ""
        rows.append(
            f"| a whole model's training step, 2B shape ({layers} layers, 0.5% skewed, AdamW, L1 penalty) "
            f"| {model['batch']} x {model['seq']} tokens | {dense['tokens_per_s']:.0f} tokens/s, "
            f"{dense['peak_gb']:.1f} GB (dense-compiled) | {twell['tokens_per_s']:.0f} tokens/s, "
            f"{twell['peak_gb']:.1f} GB (twell-compiled, sparse training path{hot}) "
            f"| {speedup(twell['tokens_per_s'] / dense['tokens_per_s'])} "
            f"| {model['source']} |"
        )
    step = [p for p in train if p["density"] == 0.005]
    step = [p for p in step if p["M"] == max(q["M"] for q in step)]  # the paper's shape: the most tokens
    if step:
        dense = [min(p["dense_eager_ms"], p["dense_compiled_ms"]) for p in step]
        twell = [p["twell_ms"] for p in step]
        rows.append(
            f"| a training step, one FFN layer (forward + backward, L1 penalty) | {step[0]['M']} tokens, 0.5%, "
            f"K={'/'.join(sorted({str(p['K']) for p in step}))} | {min(dense):.3g}-{max(dense):.3g} ms "
            f"| {min(twell):.3g}-{max(twell):.3g} ms, {min(p['memory_ratio'] for p in step):.0%}-"
            f"{max(p['memory_ratio'] for p in step):.0%} of dense's peak memory "
            f"| {span([d / t for d, t in zip(dense, twell, strict=True)])} | {step[0]['source']} |"
        )
    for path, what in (("decode", "decode kernels"), ("prefill", "prefill kernels"), ("dense", "dense route")):
        points = [p for p in ffn if p["path"] == path and p["density"] == 0.005]
        if not points:
            continue
        tokens = "/".join(map(str, sorted({p["M"] for p in points})))
        tokens += " token" if tokens == "1" else " tokens"
        files = sorted({p["source"] for p in points})
        rows.append(
            f"| the FFN block alone, {what} | {tokens} a call, 0.5%, K=2048 and 4096 | the faster of eager "
            f"and compiled | twell.sparsify's module | {span([p['speedup'] for p in points])} "
            f"| {len(files)} file{'s' if len(files) > 1 else ''}, newest {files[-1]} |"
        )
    return "\n".join(rows)


def tables(results: Path = RESULTS) -> dict[str, str]:
    """{marker name: markdown table} of every generated table."""
    ffn, e2e, train = ffn_points(results), e2e_points(results), train_points(results)
    return {
        "summary": summary_table(ffn, e2e, train, model_train_points(results)),
        "ffn": ffn_table(ffn),
        "e2e": e2e_table(e2e),
        "train": train_table(train),
    }


def with_tables(text: str, generated: dict[str, str]) -> str:
    """`text` with every marked table replaced by its generated one (unknown markers raise)."""

    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in generated:
            raise ValueError(f"unknown table marker {name!r}; known: {sorted(generated)}")
        return f"<!-- tables:{name} -->\n{generated[name]}\n<!-- /tables:{name} -->"

    return re.sub(r"<!-- tables:(?P<name>[a-z0-9_]+) -->.*?<!-- /tables:(?P=name) -->", replace, text, flags=re.S)


def main() -> int:
    generated = tables()
    for page in PAGES:
        path = ROOT / page
        path.write_text(with_tables(path.read_text(), generated))
        print(f"wrote the tables of {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
