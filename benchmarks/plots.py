"""Figures for the README from benchmark results (matplotlib: `pip install -e .[bench]`).

    PYTHONPATH=. python benchmarks/plots.py [RESULT.json ...] [--out docs/images]

Without files: the latest ffn-*.json and e2e-*.json in benchmarks/results/ (by the timestamp in their
names). Files named on the command line replace that choice for their kind; several ffn files are
merged (a later file's point replaces an earlier one's at the same shape, tokens, density and pattern).
Writes, for the kinds present:
- ffn-speedup.png: the FFN block's speedup against the faster dense baseline (eager or compiled),
  against density, per kernel path forced (decode, prefill) and tokens per call, one panel per shape;
  the `--pattern` inputs (default uniform).
- e2e-throughput.png: prefill and generation tokens/s per row, per model.
- e2e-breakdown.png: the prefill forward's time split into attention, FFN and the rest, eager rows.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KIND = re.compile(r"^(?P<kind>ffn|e2e)-(?P<stamp>\d{8}-\d{6})\.json$")
PATHS = {"decode_ms": "decode", "prefill_ms": "prefill"}
ROW_COLORS = {
    "dense-eager": "#9e9e9e",
    "dense-compiled": "#616161",
    "twell-eager": "#64b5f6",
    "twell-compiled": "#1565c0",
}
PART_COLORS = {"attention": "#ffb74d", "ffn": "#1e88e5", "rest": "#bdbdbd"}
DPI = 100


def pick_files(named: list[str]) -> dict[str, list[Path]]:
    """{kind: files}: the named files by kind, else the latest of each kind in benchmarks/results/."""
    chosen: dict[str, list[Path]] = defaultdict(list)
    for name in named:
        match = KIND.match(Path(name).name)
        if match is None:
            raise SystemExit(f"{name}: not a result file name (ffn-<timestamp>.json or e2e-<timestamp>.json)")
        chosen[match["kind"]].append(Path(name))
    for kind in ("ffn", "e2e"):
        if kind not in chosen:
            found = sorted((p for p in RESULTS.glob(f"{kind}-*.json") if KIND.match(p.name)), key=lambda p: p.name)
            if found:
                chosen[kind].append(found[-1])
    return {kind: sorted(files, key=lambda p: KIND.match(p.name)["stamp"]) for kind, files in chosen.items()}


def source_note(fig, files: list[Path], data: list[dict]) -> None:
    gpus = sorted({d.get("gpu", "?") for d in data})
    commits = sorted({d.get("commit", "?") for d in data})
    fig.text(
        0.01, 0.005, f"{', '.join(p.name for p in files)}; {', '.join(gpus)}; commit {', '.join(commits)}",
        fontsize=7, color="#555555",
    )  # fmt: skip


def ffn_figure(files: list[Path], pattern: str, out: Path) -> Path:
    data = [json.loads(p.read_text()) for p in files]
    points = {}
    for d in data:  # in time order: later files replace earlier points
        for p in d["points"]:
            points[(p["K"], p["N"], p["M"], p["density"], p["pattern"])] = p
    shapes = sorted({(k, n) for k, n, _, _, pat in points if pat == pattern})
    if not shapes:
        raise SystemExit(f"no {pattern!r} points in {', '.join(map(str, files))}")
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.2 * len(shapes), 3.8), squeeze=False, sharey=True)
    for ax, (k, n) in zip(axes[0], shapes, strict=True):
        lines = defaultdict(list)
        for (pk, pn, m, density, pat), p in sorted(points.items()):
            if (pk, pn, pat) != (k, n, pattern):
                continue
            dense = min(p["dense_eager_ms"], p["dense_compiled_ms"])
            for key, path in PATHS.items():
                if key in p:
                    lines[(path, m)].append((100 * density, dense / p[key]))
        for (path, m), xy in sorted(lines.items()):
            xs, ys = zip(*sorted(xy), strict=True)
            style = "-o" if path == "prefill" else "--s"
            ax.plot(xs, ys, style, label=f"{path}, {m} tokens", markersize=4)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"K={k}, N={n} ({pattern})", fontsize=10)
        ax.set_xlabel("density of the FFN activations (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("speedup against the faster dense FFN")
    source_note(fig, files, data)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return save(fig, out / "ffn-speedup.png")


def row_label(row: dict) -> str:
    return row["row"] + (f" ({row['profile']})" if row.get("profile") else "")


def e2e_figures(file: Path, out: Path) -> list[Path]:
    data = json.loads(file.read_text())
    models = [m for m in data["models"] if m.get("rows")]
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.4 * len(models)), squeeze=False)
    for ax_row, model in zip(axes, models, strict=True):
        for ax, kind in zip(ax_row, ("prefill", "generation"), strict=True):
            rows = [r for r in model["rows"] if "error" not in r]
            groups = [
                f"{m['batch']} x {m['seq']}" if kind == "prefill" else f"batch {m['batch']}" for m in rows[0][kind]
            ]
            width = 0.8 / len(rows)
            for i, row in enumerate(rows):
                xs = [g + (i - (len(rows) - 1) / 2) * width for g in range(len(groups))]
                ys = [m["tokens_per_s"] for m in row[kind]]
                hatch = "//" if row.get("profile") == "demo" else None
                bars = ax.bar(xs, ys, width, label=row_label(row), color=ROW_COLORS.get(row["row"]), hatch=hatch)
                if row["row"].startswith("twell"):
                    labels = [f"{m['speedup']:.2f}x" if "speedup" in m else "" for m in row[kind]]
                    ax.bar_label(bars, labels, fontsize=6, rotation=90, padding=2)
            ax.set_xticks(range(len(groups)), groups, fontsize=8)
            ax.set_yscale("log" if kind == "generation" else "linear")
            ax.margins(y=0.15)
            layers = model["config"]["num_hidden_layers"]
            ax.set_title(f"{model['model']} ({layers} layers): {kind}", fontsize=10)
            ax.set_ylabel("tokens/s")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower left")
    source_note(fig, [file], [data])
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    written = [save(fig, out / "e2e-throughput.png")]

    fig, axes = plt.subplots(len(models), 1, figsize=(8, 0.5 + 2.8 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models, strict=True):
        labels, y = [], 0
        for row in model["rows"]:
            for m in row["prefill"]:
                parts = m.get("breakdown_ms")
                if parts is None:
                    continue
                left = 0.0
                for part, color in PART_COLORS.items():
                    ax.barh(y, parts[part], left=left, color=color, label=part if y == 0 else None)
                    left += parts[part]
                labels.append(f"{row_label(row)}, {m['batch']} x {m['seq']}")
                y += 1
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms per prefill forward")
        ax.set_title(f"{model['model']} ({model['config']['num_hidden_layers']} layers): prefill time", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    source_note(fig, [file], [data])
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    written.append(save(fig, out / "e2e-breakdown.png"))
    return written


def save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="*", help="result files (default: the latest of each kind)")
    parser.add_argument("--out", default="docs/images")
    parser.add_argument("--pattern", default="uniform", help="input pattern of the FFN figure")
    args = parser.parse_args()
    files = pick_files(args.files)
    out = Path(args.out)
    written = []
    if "ffn" in files:
        written.append(ffn_figure(files["ffn"], args.pattern, out))
    if "e2e" in files:
        written += e2e_figures(files["e2e"][-1], out)
    for path in written:
        print(f"wrote {path} ({path.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
