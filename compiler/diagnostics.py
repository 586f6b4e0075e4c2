"""Errors are data: every user-facing problem is a `Diagnostic` with a location and a hint.

`Location`, `Diagnostic` and `SpecErrors` live in pdc.runtime.diagnostics (the runtime's
lowering rejects topologies with them); this module adds the collector a compiler stage
passes around. Nothing in the compiler uses `assert` for user errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdc.runtime.diagnostics import UNKNOWN, Diagnostic, Location, SpecErrors, render_all

__all__ = ["UNKNOWN", "Diagnostic", "Diagnostics", "Location", "SpecErrors", "render_all"]


@dataclass
class Diagnostics:
    """A collector passed through one stage; `raise_if_any()` ends the stage."""

    items: list[Diagnostic] = field(default_factory=list)

    def error(self, loc: Location, message: str, hint: str = "") -> None:
        self.items.append(Diagnostic(loc, message, hint))

    def extend(self, other: list[Diagnostic]) -> None:
        self.items.extend(other)

    def raise_if_any(self) -> None:
        if self.items:
            raise SpecErrors(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)
