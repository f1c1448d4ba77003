"""Rich tables for reports, shared by the command line and twell.report(): a table keeps its detail
columns only when the console is wide enough for them, and long texts become numbered notes under it."""

from __future__ import annotations

from dataclasses import dataclass

# Wide enough for any table: measuring at this width gives a table's natural width.
_UNBOUNDED = 10_000


@dataclass
class Column:
    """A table column. level 0: always shown; level L > 0: shown only when the table with every column
    up to level L fits the console."""

    header: str
    level: int = 0
    justify: str = "left"


class Notes:
    """Numbered notes for texts too long for a table cell. mark(text) gives the cell's marker, "(1)";
    the same text always gets the same number. Renders as the list of notes."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._numbers)

    def mark(self, text: str) -> str:
        return f"({self._numbers.setdefault(text, len(self._numbers) + 1)})"

    def __rich__(self):
        from rich.table import Table
        from rich.text import Text

        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True)
        grid.add_column()
        for text, number in self._numbers.items():
            grid.add_row(f"({number})", Text(text))
        return grid


def phase_speedups(decision: dict | None, missing: str = "—") -> str:
    """A decision's predicted speedups as "prefill/decode" (decision: Decision.to_dict() or None),
    `missing` for a phase it has none for."""
    from twell.calibrate import PHASES

    speedups = (decision or {}).get("predicted_speedup") or {}
    return "/".join(f"{speedups[p]:.2f}x" if p in speedups else missing for p in PHASES)


def note_for(reason: str, decision: dict | None) -> str:
    """The note for an FFN left as it is: one text for every FFN held back for the same cause (each
    one's numbers are table columns, and in the JSON). decision: Decision.to_dict() or None."""
    if decision and decision["predicted_speedup"] and decision["min_speedup"] is not None:
        return f"predicted speedup below the {decision['min_speedup']:.2f}x threshold"
    if decision and decision["density"] is not None and decision["tile_n"] is None:
        return "too dense for TwELL: at every tile layout more rows overflow than max_overflow allows"
    return reason


def fitted_table(console, width: int, columns: list[Column], rows: list[list], **table_options):
    """The rich Table of `rows` with the most detail that fits `width` columns of `console`: the highest
    level whose columns all fit, else level 0. No cell is ever cut short: if even level 0 is too wide, the
    widest cells (often a module path) fold onto further lines rather than end in an ellipsis."""
    from rich.table import Table

    levels = sorted({c.level for c in columns}, reverse=True)
    for level in levels:
        shown = [i for i, c in enumerate(columns) if c.level <= level]
        table = Table(**table_options)
        for i in shown:
            table.add_column(columns[i].header, justify=columns[i].justify, overflow="fold")
        for row in rows:
            table.add_row(*(row[i] for i in shown))
        natural = console.measure(table, options=console.options.update_width(_UNBOUNDED)).maximum
        if natural <= width:
            break
    return table


__all__ = ["Column", "Notes", "fitted_table", "note_for"]
