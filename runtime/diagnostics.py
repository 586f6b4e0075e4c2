"""Errors are data: every user-facing problem is a `Diagnostic` with a location and a hint.

Shared by the compiler (spec errors) and the runtime (a topology the family's lowering
rejects), so they live in the runtime, which never imports the compiler. Stages gather
diagnostics into a list and print them all at once, sorted by location, as
`file:line:col: error: message` followed by the source line, a caret and an optional
`hint:` line. Nothing uses `assert` for user errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from .limits import MAX_SPEC_BYTES


@dataclass(frozen=True, slots=True, order=True)
class Location:
    """A point in a spec file; line and col are 1-based (col 0 means 'whole line')."""

    file: str
    line: int = 0
    col: int = 0

    def __str__(self) -> str:
        if self.line == 0:
            return self.file
        return f"{self.file}:{self.line}:{self.col}"


UNKNOWN = Location("<unknown>")


@dataclass(frozen=True, slots=True)
class Diagnostic:
    loc: Location
    message: str
    hint: str = ""

    def render(self, source_lines: dict[str, list[str]] | None = None) -> str:
        out = [f"{self.loc}: error: {self.message}"]
        lines = (source_lines or {}).get(self.loc.file)
        if lines and 1 <= self.loc.line <= len(lines):
            text, col = _window(lines[self.loc.line - 1].rstrip("\n"), self.loc.col)
            out.append(f"  {text}")
            if col >= 1:
                out.append("  " + " " * (col - 1) + "^")
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)


SHOWN_LINE_CHARS = 200


def _window(text: str, col: int) -> tuple[str, int]:
    """At most SHOWN_LINE_CHARS of a source line, around `col` (and the caret's new column):
    a machine-written spec may hold a line of a megabyte."""
    if len(text) <= SHOWN_LINE_CHARS:
        return text, col
    start = max(0, min(col - 1 - SHOWN_LINE_CHARS // 2, len(text) - SHOWN_LINE_CHARS))
    shown = text[start:start + SHOWN_LINE_CHARS]
    head, tail = ("..." if start else ""), ("..." if start + SHOWN_LINE_CHARS < len(text) else "")
    return head + shown + tail, (col - start + len(head) if col >= 1 else col)


class SpecErrors(Exception):
    """Raised at a stage boundary when diagnostics were gathered; carries all of them."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = sorted(diagnostics, key=lambda d: (d.loc, d.message))
        super().__init__(render_all(self.diagnostics))


def _source_lines(files: set[str]) -> dict[str, list[str]]:
    out = {}
    for name in files:
        try:
            with open(name, "rb") as f:
                raw = f.read(MAX_SPEC_BYTES + 1)
        except OSError:
            continue
        if len(raw) <= MAX_SPEC_BYTES:  # a file too large to be a spec is not shown
            out[name] = raw.decode("utf-8", errors="replace").splitlines()
    return out


def render_all(diagnostics: list[Diagnostic]) -> str:
    lines = _source_lines({d.loc.file for d in diagnostics})
    body = "\n".join(d.render(lines) for d in diagnostics)
    n = len(diagnostics)
    return f"{body}\n{n} error{'s' if n != 1 else ''}"
