"""What the ``tnt-snapshot`` commands print: tables, lines and JSON, with everything that comes from a
snapshot escaped (:func:`safe`), and the statuses ``ls`` and ``verify`` show."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Iterable, Optional

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

#: Bumped when a key of the ``--json`` output changes meaning or goes away (keys may be added).
JSON_VERSION = 1


STATUS_COMPLETE = "complete"
STATUS_DAMAGED = "damaged"
STATUS_INCOMPLETE = "incomplete"
STATUS_STAGING = "staging leftover"
STATUS_FOREIGN = "foreign"
STATUS_LOCK = "lock"
STATUS_STYLE = {
    STATUS_LOCK: "cyan",
    STATUS_COMPLETE: "green",
    STATUS_DAMAGED: "bold red",
    STATUS_INCOMPLETE: "yellow",
    STATUS_STAGING: "yellow",
    STATUS_FOREIGN: "dim",
}


def console(err: bool = False) -> Console:
    stream = sys.stderr if err else sys.stdout
    tty = stream.isatty()
    # markup and emoji off: text from a snapshot is printed as it is (escaped by ``safe``)
    return Console(file=stream, highlight=False, markup=False, emoji=False,
                   width=None if tty else 200, soft_wrap=not tty)


#: Characters never printed as they are: C0 and C1 controls, DEL, and the bidirectional
#: overrides and isolates that reorder what a terminal shows.
_UNSAFE = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_UNSAFE.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def safe(text: Any) -> str:
    """``text`` as one printable line: control characters (a snapshot's keys and names may hold
    escape sequences) written as ``\\xNN``."""
    text = str(text)
    return text if text.isprintable() else text.translate(_UNSAFE)


class Rows:
    """Rows of cells printed as aligned columns, every cell escaped by :func:`safe` when printed.
    On a terminal a cell may be a rich ``Text`` (a coloured status); elsewhere, and for many
    rows, plain text without trailing spaces."""

    def __init__(self, *columns: str, right: Iterable[str] = ()) -> None:
        self.columns = columns
        self.right = set(right)
        self.rows: list[tuple[Any, ...]] = []

    def add_row(self, *cells: Any) -> None:
        self.rows.append(tuple(c if isinstance(c, Text) else str(c) for c in cells))

    def extend(self, rows: Iterable[tuple[str, ...]]) -> None:
        """Add rows of str cells (many at once)."""
        self.rows.extend(rows)


def new_table(*columns: str, right: Iterable[str] = ()) -> Rows:
    return Rows(*columns, right=right)


def print_table(out: Console, table: Rows) -> None:
    """Print ``table``: rich's table on a terminal (up to 2,000 rows), else plain aligned text."""
    if out.is_terminal and len(table.rows) <= 2000:
        rich_table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
        for col in table.columns:
            rich_table.add_column(col, justify="right" if col in table.right else "left", no_wrap=True)
        for row in table.rows:
            rich_table.add_row(*(c if isinstance(c, Text) else Text(safe(c)) for c in row))
        out.print(rich_table)
        return
    rows = [table.columns, *(
        [c.plain if isinstance(c, Text) else c for c in row] if any(type(c) is not str for c in row) else row
        for row in table.rows
    )]
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    line = "  ".join(
        f"{{:{'>' if col in table.right else '<'}{w}}}" for col, w in zip(table.columns, widths, strict=True)
    ).format
    text = [line(*row) for row in rows]
    for i, printed in enumerate(text):  # one check a row; a row with a control character escaped
        if not printed.isprintable():
            text[i] = line(*map(safe, rows[i]))
    out.file.write("".join([printed.rstrip() + "\n" for printed in text]))


def say(out: Console, text: Any, style: Optional[str] = None) -> None:
    """Print one line (escaped by :func:`safe`)."""
    out.print(Text(safe(text), style=style or ""))


def when(ts: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts is not None else "-"


def num(v: Any) -> str:
    return "-" if v is None else str(v)


def emit_json(payload: dict[str, Any]) -> None:
    click.echo(json.dumps({"version": JSON_VERSION, **payload}, indent=2, sort_keys=False))


class Progress:
    """A transient progress bar on stderr (terminals only); yields ``advance(nbytes)``.
    ``label``: what it shows beside the bar; ``total``: the bytes expected (None: unknown)."""

    def __init__(self, console: Console, *, enabled: bool, label: str = "verifying", total: Optional[int] = None) -> None:
        self.enabled = enabled
        self.console = console
        self.label = label
        self.total = total
        self.bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Optional[Callable[[int], None]]:
        if not self.enabled:
            return None
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            console=self.console, transient=True)
        self.bar.start()
        task = self._task = self.bar.add_task(self.label, total=self.total)
        return lambda n: self.bar.advance(task, n)

    def stage(self, label: str, total: Optional[int]) -> None:
        """Show ``label`` and count ``total`` bytes from zero (a next stage of the work)."""
        if self.bar is not None:
            self.bar.reset(self._task, total=total, description=label)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
