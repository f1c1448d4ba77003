"""The `twell` command line: conversion reports and plans for local checkpoints.

    twell report [MODEL] [--data FILE] [--samples N] [--seq-len L] [--json OUT]
    twell convert MODEL --out PLAN.json [same options]

MODEL is a local Hugging Face checkpoint directory, a hub id already in the local cache, or the
built-in demo model (the default). Nothing is downloaded. The work is done by the Python API
(twell.loading, twell.passes.find_ffns, twell.calibrate) and the rendering by twell.report; this module
parses, prints and turns every failure into a one-line error with a non-zero exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import twell

EXIT_ERROR = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad command-line arguments (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the usage block and exits; a one-line error is easier to read and to test.
    def error(self, message: str):
        raise UsageError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from twell.loading import DEMO_MODEL

    parser = _Parser(
        prog="twell",
        description="Activation-sparse FFNs: conversion reports and plans.",
        epilog="MODEL: a local Hugging Face checkpoint directory, a hub id already in the local cache, or "
        f"{DEMO_MODEL} (the built-in demo). Nothing is downloaded.",
    )
    parser.add_argument("--version", action="version", version=f"twell {twell.__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    common = _Parser(add_help=False)
    common.add_argument("--data", metavar="FILE", help="calibration text: a text file or JSONL of texts")
    common.add_argument("--samples", type=_positive_int, default=16, metavar="N", help="sequences (default 16)")
    common.add_argument("--seq-len", type=_positive_int, default=128, metavar="L", help="tokens each (default 128)")
    common.add_argument("--batch-size", type=_positive_int, default=4, metavar="B", help="per batch (default 4)")
    common.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: the GPU if any")
    common.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT ('-': stdout only)")

    report = sub.add_parser("report", parents=[common], help="measure a model's FFN sparsity and predict the gain")
    model_help = f"checkpoint directory, cached hub id, or {DEMO_MODEL}"
    report.add_argument("model", nargs="?", metavar="MODEL", help=f"{model_help} (default: {DEMO_MODEL})")
    convert = sub.add_parser("convert", parents=[common], help="calibrate a model and write its plan")
    convert.add_argument("model", metavar="MODEL", help=model_help)
    convert.add_argument("--out", required=True, metavar="PLAN.json", help="where to write the plan")
    return parser


@dataclass
class Analysis:
    """Everything a report shows: the loaded model, its FFN candidates and the calibration decisions."""

    loaded: object
    candidates: list
    unmatched: list  # modules shaped like an FFN that could not be analysed (twell.passes.Unmatched)
    decisions: dict
    data_note: str
    cost_model: str | None


def analyse(args: argparse.Namespace) -> Analysis:
    import torch

    from twell.calibrate import calibrate
    from twell.inputs import calibration_config, check_batches
    from twell.loading import LoadError, calibration_batches, load_model
    from twell.passes import scan

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise LoadError("--device cuda: no CUDA GPU is available")
    loaded = load_model(args.model, device=device)
    batches, note = calibration_batches(
        loaded, data=args.data, samples=args.samples, seq_len=args.seq_len, batch_size=args.batch_size
    )
    candidates, unmatched = scan(loaded.model)
    model = loaded.model
    decisions = calibrate(model, candidates, check_batches(model, batches), config=calibration_config(model, None))
    cost = next((d.cost_model for d in decisions.values() if d.cost_model), None)
    return Analysis(loaded, candidates, unmatched, decisions, note, cost)


def analysis_report(analysis: Analysis, title: str | None = None):
    """twell.report.Report of the calibration's decisions, where "rewritten" means decided to rewrite."""
    from twell.report import Report, build_records

    decided = {path for path, d in analysis.decisions.items() if d.rewrite}
    return Report(build_records(analysis.candidates, analysis.unmatched, analysis.decisions, decided), title)


def report_dict(analysis: Analysis) -> dict:
    """The report as JSON-serialisable data (what --json writes): the records and summary of
    twell.report(model).to_dict(), where "rewritten" means the calibration decided to rewrite, plus the
    model, the data and the predicted model speedups."""
    from twell.calibrate import predicted_model_speedup

    loaded = analysis.loaded
    report = analysis_report(analysis).to_dict()
    return {
        "twell_version": twell.__version__,
        "model": {"name": loaded.name, "path": str(loaded.path), "class": type(loaded.model).__name__},
        "data": analysis.data_note,
        "device": str(next(loaded.model.parameters()).device),
        "cost_model": analysis.cost_model,
        "summary": {
            **report["summary"],
            "min_speedup": next(
                (d.min_speedup for d in analysis.decisions.values() if d.min_speedup is not None), None
            ),
            **{phase: predicted_model_speedup(analysis.decisions, phase) for phase in ("prefill", "decode")},
        },
        "records": report["records"],
    }


def render(console, analysis: Analysis, plan_path: str | None = None) -> None:
    """Per-FFN table, notes on the reasons it does not show, and a summary panel (rich). The table keeps
    the columns that fit the console: at 80 columns the detail columns (in --json) are left out."""
    from rich.markup import escape

    from twell.report import summary_panel

    data = report_dict(analysis)
    console.print(analysis_report(analysis, f"twell report: {data['model']['name']} ({data['model']['class']})"))
    console.print(summary_panel(data))
    if plan_path:
        # Unwrapped, so that the path can be copied whole however long it is.
        console.print(f"plan written to {escape(plan_path)}", soft_wrap=True)
        console.print(f"apply it with twell.sparsify(model, plan={escape(repr(plan_path))})", soft_wrap=True)


def check_output_path(option: str, path: str) -> None:
    """Raise ValueError if `path` (given as `option`) cannot be written: checked before calibrating, which
    can take minutes."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file name")
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise ValueError(f"{option} {path}: {folder} {what}")
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise ValueError(f"{option} {path}: permission denied")


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from twell.calibrate import save_plan

    if args.command == "convert":
        check_output_path("--out", args.out)
    if args.json and args.json != "-":
        check_output_path("--json", args.json)
    analysis = analyse(args)
    plan_path = None
    if args.command == "convert":
        save_plan(analysis.decisions, analysis.candidates, args.out)
        plan_path = args.out
        if not any(d.rewrite for d in analysis.decisions.values()):
            found = f"all {len(analysis.decisions)} FFNs stay dense" if analysis.decisions else "no FFN found"
            print(f"twell: warning: the plan {args.out} rewrites nothing ({found}): see the report", file=sys.stderr)
    if args.json:
        text = json.dumps(report_dict(analysis), indent=1)
        if args.json == "-":
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            return 0
        with open(args.json, "w") as f:
            f.write(text + "\n")
    # Off a terminal rich lays out for 80 columns ($COLUMNS overrides).
    console = Console(highlight=False)
    # Rendered in full, then written and flushed here: a closed pipe surfaces as BrokenPipeError in
    # main() (rich would exit with status 1 on its own, and an unflushed buffer fails at exit).
    with console.capture() as captured:
        render(console, analysis, plan_path)
    sys.stdout.writelines(line.rstrip() + "\n" for line in captured.get().splitlines())
    sys.stdout.flush()
    return 0


def _quiet_libraries() -> None:
    """Offline, and no library chatter: the report is the output. Only ever called by main()."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `twell` script; returns the exit status."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:  # a command is required: say which, and fail as a usage error
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        _quiet_libraries()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run(args)
    except UsageError as e:
        print(f"twell: error: {_one_line(e)} (see twell --help)", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("twell: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader stopped reading (twell report | head): a normal end. Point stdout at /dev/null so
        # the interpreter's last flush of what is still buffered does not fail again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, TypeError, OSError) as e:
        print(f"twell: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # a bug or an unexpected library failure: still one line, with its type
        print(f"twell: error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
