"""Report tables: detail columns only where they fit, names never cut short, reasons as shared notes."""

from rich.console import Console
from rich.markup import escape

from twell.report import Column, Notes, fitted_table

NAME = "model.decoder.layers.10[fc1,fc2]"
COLUMNS = [Column("module"), Column("detail", level=1), Column("speedup", justify="right")]


def render(width, rows):
    console = Console(width=width, record=True, color_system=None)
    console.print(fitted_table(console, width, COLUMNS, rows, box=None))
    return [line.rstrip() for line in console.export_text().splitlines()]


def test_detail_columns_only_where_they_fit():
    rows = [[escape(NAME), "x" * 30, "1.28x"]]
    assert "detail" in render(80, rows)[0]
    lines = render(60, rows)
    assert "detail" not in lines[0] and lines[1].split() == [NAME, "1.28x"]
    assert max(map(len, lines)) <= 60


def test_a_name_wider_than_the_console_folds_but_is_not_cut():
    lines = render(20, [[escape(NAME), "x", "1.28x"]])
    assert "…" not in "".join(lines)
    assert NAME in "".join(line.split()[0] for line in lines[1:])


def test_notes_number_each_distinct_text_once():
    notes = Notes()
    assert not notes
    assert [notes.mark("too dense"), notes.mark("not relu [silu]"), notes.mark("too dense")] == ["(1)", "(2)", "(1)"]
    console = Console(width=80, record=True, color_system=None)
    console.print(notes)
    assert [line.rstrip() for line in console.export_text().splitlines()] == ["(1) too dense", "(2) not relu [silu]"]


def records():
    from twell.report import Record

    decision = {
        "density": 0.004,
        "predicted_speedup": {"prefill": 1.3, "decode": 2.1},
        "stats": {"prefill": {"density": 0.004, "nnz_per_row": {"mean": 2.5, "p50": 2, "p99": 6, "max": 9}}},
        "dead_neurons": 3,
        "tile_n": 128,
        "slots": 16,
        "overflow_rows": 0.0,
        "time_share": {"prefill": 0.3},
        "min_speedup": 1.05,
    }
    return [
        Record("layers.0.mlp", "gated", True, "relu", True, True, "", 64, 32, 0.0, decision),
        Record("layers.1.mlp", "gated", True, "silu", False, False, "activation silu is not sparse", 64, 32),
        Record("layers.2.mlp", "gated", True, "relu", True, False, "", 64, 32),
        Record("layers.3", "", False, "", False, False, "no FFN pattern"),
    ]


def test_one_renderer_for_reports_and_the_command_line():
    """twell.report's table and the CLI's are one table: the detail columns where they fit, one word a
    decision, the reasons as notes."""
    from twell.report import Report

    def lines(width):
        console = Console(width=width, record=True, color_system=None)
        console.print(Report(records(), title="t"))
        return [line.rstrip() for line in console.export_text().splitlines()]

    wide, narrow = lines(200), lines(80)
    header = "\n".join(wide[:3])
    assert "nnz/row" in header and "tile/slots" in header and "128/16" in wide[4]
    assert "nnz/row" not in "".join(narrow) and max(map(len, narrow)) <= 80
    text = "\n".join(narrow)
    assert "0.40%" in text and "1.30x/2.10x" in text and "rewrite" in narrow[4]
    # not rewritable and not analysed: their reasons as notes; found but not sparsified: no note
    assert "not rewritable (1)" in text and "not analysed (2)" in text and "not rewritten" in text
    assert text.endswith("(1) activation silu is not sparse\n(2) no FFN pattern")
