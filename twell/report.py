"""Reports: Record / Report (what twell found in a model and did to it), the one table renderer that
twell.report, twell.compile_report and the `twell` command line print through, and the command
line's summary panel.

The table keeps its detail columns only when the console is wide enough for them (at 80 columns: the
FFN, its density and predicted speedup per phase, and the decision), and long texts become numbered
notes under it. Importing this module is light: rich loads on first rendering.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass

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


def _pct(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}%}"


# The table's columns, most important at level 0 (see fitted_table).
COLUMNS = [
    Column("FFN"),
    Column("kind", level=1),
    Column("act", level=1),
    Column("N×K", level=1, justify="right"),
    Column("density\npre/decode", justify="right"),
    Column("nnz/row\nmean p50 p99 max", level=2, justify="right"),
    Column("dead", level=2, justify="right"),
    Column("tile/slots", level=2, justify="right"),
    Column("over-\nflow", level=2, justify="right"),
    Column("time\nshare", level=1, justify="right"),
    Column("speedup\npre/decode", justify="right"),
    Column("decision"),
]


def decision_cell(record: Record, notes: Notes) -> str:
    """rewrite / keep dense / not rewritable / not analysed / not rewritten, with a note for any reason
    the other columns do not show (a measured layer's predicted speedup, held against the threshold, is
    its reason)."""
    from rich.markup import escape

    decision = record.decision or {}
    if record.rewritten:
        return "[green]rewrite[/green]"
    if not record.matched:
        return f"[red]not analysed[/red] {escape(notes.mark(record.reason))}"
    if decision.get("predicted_speedup"):
        return "[yellow]keep dense[/yellow]"
    if not record.rewritable:
        return f"[red]not rewritable[/red] {escape(notes.mark(record.reason))}"
    if not record.reason:  # found, rewritable, and no decision yet: a model that is not sparsified
        return "not rewritten"
    return f"[yellow]keep dense[/yellow] {escape(notes.mark(note_for(record.reason, record.decision)))}"


def record_row(record: Record, notes: Notes) -> list[str]:
    """The table cells of one record, in COLUMNS' order (rich markup)."""
    from rich.markup import escape

    from twell.calibrate import PHASES

    decision = record.decision or {}
    stats = decision.get("stats") or {}
    main = stats.get("prefill") or stats.get("decode")
    nnz = main["nnz_per_row"] if main else None
    dead = "—"
    if decision.get("dead_neurons") is not None:
        dead = f"{decision['dead_neurons']} ({decision['dead_neurons'] / record.hidden_size:.0%})"
    shape = f"{record.hidden_size}×{record.model_size}" if record.hidden_size else "—"
    tile_n = decision.get("tile_n")
    return [
        escape(record.path or "<model>"),  # inline FFNs' paths hold brackets: "layers.0[fc1,fc2]"
        record.kind or "—",
        escape(record.activation or "—"),
        shape,
        "/".join(_pct(stats.get(p, {}).get("density")) for p in PHASES),
        "—" if nnz is None else f"{nnz['mean']:.1f} {nnz['p50']} {nnz['p99']} {nnz['max']}",
        dead,
        "—" if tile_n is None else f"{tile_n}/{decision['slots']}",
        _pct(decision.get("overflow_rows"), 1),
        _pct((decision.get("time_share") or {}).get("prefill"), 0),
        phase_speedups(decision),
        decision_cell(record, notes),
    ]


def render_records(records: list[Record], title: str, width: int, console):
    """The renderables of a report: the table of `records` with the columns that fit `width`, then the
    numbered notes; a line saying so when there are no records."""
    from rich import box
    from rich.markup import escape

    if not records:
        yield f"[bold]{escape(title)}[/bold]: no feed-forward blocks found"
        return
    notes = Notes()
    rows = [record_row(r, notes) for r in records]
    yield fitted_table(
        console,
        width,
        COLUMNS,
        rows,
        title=escape(title),
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    if notes:
        yield notes


def summary_lines(data: dict) -> list[tuple[str, str]]:
    """(label, text) lines of the command line's summary panel (data: twell.cli.report_dict's); texts
    are rich markup."""
    from rich.markup import escape

    summary = data["summary"]
    lines = [("data", escape(data["data"]))]
    if data["cost_model"]:
        lines.append(("cost model", escape(data["cost_model"])))
    if any((r["decision"] or {}).get("predicted_speedup") for r in data["records"]) and not data["device"].startswith(
        "cuda"
    ):
        lines.append(
            (
                f"on {data['device']}",
                "no CUDA GPU: the rewritten model runs the dense path here, and the speedups are predicted "
                "for the GPU the cost model names",
            )
        )
    if summary["min_speedup"] is not None:
        lines.append(
            ("threshold", f"an FFN is rewritten when its predicted speedup is at least {summary['min_speedup']:.2f}x")
        )
    found = f"{summary['candidates']} found, {summary['rewritable']} rewritable, {summary['rewritten']} rewritten"
    if summary["unmatched"]:
        found += f"; {summary['unmatched']} FFN-shaped modules not analysed"
    lines.append(("FFNs", found))
    for phase in ("prefill", "decode"):
        s = summary[phase]
        if not s["timed_ffns"]:
            lines.append((phase, "FFN share of model time not measured: no model speedup predicted"))
            continue
        untimed = summary["rewritable"] - s["timed_ffns"]
        note = f", {untimed} FFNs not timed" if untimed else ""
        lines.append(
            (
                phase,
                f"FFNs take {s['ffn_time_share']:.0%} of model time on {data['device']} (rewritten: "
                f"{s['rewritten_time_share']:.0%}{note}); predicted model speedup [bold]{s['speedup']:.2f}x[/bold]",
            )
        )
    return lines


def summary_panel(data: dict):
    """The command line's summary under the table: the data, the cost model, the threshold, the FFNs
    found and rewritten, and per phase the predicted model speedup (data: twell.cli.report_dict's)."""
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for label, text in summary_lines(data):
        grid.add_row(escape(label), text)
    return Panel(grid, title="summary", title_align="left", expand=False)


@dataclass
class Record:
    """One row of the report: one candidate FFN (or a module that could not be analysed).

    decision: after calibration or a plan, the decision's fields (density, predicted speedup, ...).
    """

    path: str
    kind: str  # "gated", "plain", or "" when unmatched
    matched: bool
    activation: str
    rewritable: bool
    rewritten: bool
    reason: str
    hidden_size: int | None = None
    model_size: int | None = None
    threshold: float | None = None
    decision: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class Report:
    """What sparsify found and did, one Record per candidate. print() renders the table (render_records)
    under `title` (default: how many FFNs were rewritten)."""

    def __init__(self, records: list[Record], title: str | None = None):
        self.records = records
        self._title = title

    @property
    def title(self) -> str:
        if self._title is not None:
            return self._title
        summary = self.summary()
        title = f"twell: {summary['rewritten']} of {summary['candidates']} FFNs rewritten"
        if summary["unmatched"]:
            title += f", {summary['unmatched']} FFN-shaped modules not analysed"
        return title

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, path: str) -> Record:
        for record in self.records:
            if record.path == path:
                return record
        raise KeyError(path)

    def summary(self) -> dict:
        return {
            "candidates": sum(r.matched for r in self.records),
            "rewritable": sum(r.rewritable for r in self.records),
            "rewritten": sum(r.rewritten for r in self.records),
            "unmatched": sum(not r.matched for r in self.records),
        }

    def to_dict(self) -> dict:
        """JSON-serialisable: {"records": [...], "summary": {...}}."""
        return {"records": [r.to_dict() for r in self.records], "summary": self.summary()}

    def __rich_console__(self, console, options):
        yield from render_records(self.records, self.title, options.max_width, console)

    def __str__(self) -> str:
        return plain_text(self, width=80)

    def __repr__(self) -> str:
        return f"Report({self.summary()})"


def plain_text(renderable, width: int) -> str:
    """What a rich renderable prints on a plain console `width` columns wide, trailing spaces trimmed."""
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=width, force_terminal=False, color_system=None).print(renderable)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def candidate_record(candidate, rewritten: bool, reason: str, decision: dict | None = None) -> Record:
    """The record of a candidate FFN (twell.passes.Candidate): matched, its kind, activation and shape."""
    return Record(
        path=candidate.path,
        kind=candidate.kind,
        matched=True,
        activation=candidate.activation,
        rewritable=candidate.rewritable,
        rewritten=rewritten,
        reason=reason,
        hidden_size=candidate.hidden_size,
        model_size=candidate.model_size,
        threshold=candidate.threshold,
        decision=decision,
    )


def build_records(candidates, unmatched, decisions: dict | None, rewritten: set[str]) -> list[Record]:
    """The report's records: one per candidate (module order), then one per module not analysed.

    decisions: {path: twell.calibrate.Decision} or None; rewritten: the paths that are (or, for a report
    of calibration alone, would be) rewritten. twell.report and `twell report --json` share these."""
    records = []
    for c in candidates:
        decision = decisions.get(c.path) if decisions is not None else None
        reason = c.reason
        if not reason and decision is not None and not decision.rewrite:
            reason = decision.reason
        records.append(
            candidate_record(c, c.path in rewritten, reason, decision.to_dict() if decision is not None else None)
        )
    for u in unmatched:
        records.append(Record(u.path, "", False, "", False, False, u.reason))
    return records


__all__ = [
    "COLUMNS",
    "Column",
    "Notes",
    "Record",
    "Report",
    "build_records",
    "candidate_record",
    "decision_cell",
    "fitted_table",
    "note_for",
    "phase_speedups",
    "plain_text",
    "record_row",
    "render_records",
    "summary_lines",
    "summary_panel",
]
