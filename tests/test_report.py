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
