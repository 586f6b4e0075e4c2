"""Tables and progress of the pdc commands, from rich (Note [Console output]).

Note [Console output]: every table of a command is a rich Table that fits TABLE_COLUMNS
columns: rich wraps a cell (a long family or transport name) rather than widen a row. On a
terminal it has rich's rules and colours; anywhere else (a pipe, a log file, a test's
capture) the same table is plain ASCII lines with no trailing blanks and no escape codes.
Progress goes to stderr: on a terminal a rich status line or bar redrawn in place; anywhere
else one plain line per step (at most about ten for a count), never a carriage return. With
--json stdout carries the JSON object only (Note [JSON output] in pdc/commands/common.py), so
the commands send their text to stderr.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence

TABLE_COLUMNS = 100  # every table fits a 100-column terminal or log

# A header underlined with dashes, no other rules: the log form of rich's SIMPLE_HEAD.
_LOG_BOX_LINES = "    \n    \n -  \n    \n    \n    \n    \n    \n"


def is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _console(out, width: int):
    from rich.console import Console

    terminal = is_terminal(out)
    if terminal:
        import shutil

        width = min(width, shutil.get_terminal_size().columns)
    return Console(file=out, width=width, highlight=False, force_terminal=terminal,
                   no_color=not terminal, emoji=False)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]], out=None, *,
                right: Sequence[int] = (), title: str | None = None, header: bool = True,
                indent: int = 2, width: int = TABLE_COLUMNS, markup: bool = False,
                min_widths: Sequence[int] = ()) -> None:
    """Print rows of text as a table within `width` columns, `indent` included; `right` are
    the indices of right-aligned columns, `title` a line above it; cells are rich markup
    when `markup`, else taken literally."""
    from rich import box
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    out = out if out is not None else sys.stdout
    terminal = is_terminal(out)
    table = Table(box=box.SIMPLE_HEAD if terminal else box.Box(_LOG_BOX_LINES, ascii=True),
                  show_header=header, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  header_style="bold" if terminal else "")
    for i, c in enumerate(columns):
        table.add_column(c, justify="right" if i in right else "left", overflow="fold",
                         min_width=min_widths[i] if i < len(min_widths) else None)
    for r in rows:
        table.add_row(*(c if markup else Text(c) for c in r))
    console = _console(out, width)
    if title:
        console.print(Text(title), soft_wrap=True)
    if terminal:
        console.print(Padding(table, (0, 0, 0, indent)))
        return
    with console.capture() as captured:
        console.print(Padding(table, (0, 0, 0, indent)))
    out.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def wrap(text: str, width: int = TABLE_COLUMNS, indent: str = "  ") -> str:
    """A message line broken at spaces to fit `width`, continuation lines indented."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent,
                                    break_long_words=False, break_on_hyphens=False))


def error(file: str, message: str, hint: str, line: int = 0, col: int = 0) -> dict:
    """An error of a run, in the shape of a located diagnostic (Note [JSON output])."""
    return {"file": file, "line": line, "col": col, "message": message, "hint": hint}


def phase_printer(command: str, err=None, last: str = "") -> Callable[[str], None]:
    """Progress of a long command by phases, on stderr, with seconds since start: on a
    terminal a rich status line that each phase replaces (stopped at a phase starting with
    `last`), elsewhere one plain line per phase."""
    err = err if err is not None else sys.stderr
    t0 = time.monotonic()
    if is_terminal(err):
        status = _console(err, TABLE_COLUMNS).status(f"pdc {command}: starting")
        status.start()

        def show(text: str) -> None:
            status.update(f"pdc {command}: {text} ({time.monotonic() - t0:.1f} s)")
            if last and text.startswith(last):
                status.stop()
        return show

    def plain(text: str) -> None:
        print(f"pdc {command}: {time.monotonic() - t0:6.1f} s  {text}", file=err, flush=True)
    return plain


class Counter:
    """Progress of `total` steps on stderr: a rich bar on a terminal; elsewhere a plain line
    whenever another tenth is done (and at the end). Thread-safe; `close` ends the bar."""

    def __init__(self, label: str, total: int, err=None):
        self.label, self.total, self.done, self.failed = label, max(total, 1), 0, 0
        self.err = err if err is not None else sys.stderr
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._bar = None
        if is_terminal(self.err):
            from rich.progress import Progress

            self._bar = Progress(console=_console(self.err, TABLE_COLUMNS), transient=False)
            self._task = self._bar.add_task(label, total=self.total)
            self._bar.start()

    def tick(self, steps: int = 1, failed: int = 0) -> None:
        with self._lock:
            before, self.done = self.done, self.done + steps
            self.failed += failed
            if self._bar is not None:
                note = f" ({self.failed} failed)" if self.failed else ""
                self._bar.update(self._task, advance=steps, description=self.label + note)
            elif self.done == self.total or 10 * self.done // self.total > \
                    10 * before // self.total:
                note = f", {self.failed} failed" if self.failed else ""
                print(f"  {self.label}: {self.done}/{self.total}{note} "
                      f"({time.monotonic() - self._t0:.1f} s)", file=self.err, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
