"""Orchestration behind the CLI: find specs, load them all, render them all.

Everything here gathers: every spec is loaded even when an earlier one failed, and the
result carries every diagnostic of every spec together with the source text it was read
from, so the CLI can print file:line:col, the line and a caret whatever the working
directory.

Note [Spec paths]: a spec inside the repository is named by its path relative to the
repository root (`specs/qwen38.yaml`), however it was given on the command line. That name
is what diagnostics print and what generated code records (headers, component locations),
so generated files never depend on the working directory and never hold an absolute path.
A spec outside the repository keeps the path it was given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .deployments import DeclaredPlan, check_deployments
from .diagnostics import Diagnostic, SpecErrors
from .emit import OutputSet, compile_specs
from .frontend import parse_spec_text, read_spec_text
from .model import Spec

REPO_ROOT = Path(__file__).resolve().parent.parent
SPECS_DIR = REPO_ROOT / "specs"
DEFAULT_OUT = REPO_ROOT / "generated"


def spec_display_path(path: str | Path) -> str:
    """The name a spec goes by in messages and generated code (Note [Spec paths])."""
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except (ValueError, OSError):
        return str(path)


def display_path(path: Path) -> str:
    """A filesystem path as messages print it: relative to the working directory when it is
    below it, else absolute."""
    resolved = Path(os.path.abspath(path))
    try:
        return resolved.relative_to(Path.cwd()).as_posix() or "."
    except ValueError:
        return str(resolved)


def all_spec_paths() -> list[Path]:
    """Every spec of the repository: specs/*.yaml, sorted by name."""
    return sorted(SPECS_DIR.glob("*.yaml"))


@dataclass
class Build:
    """What loading (and rendering) a list of specs produced."""

    specs: list[Spec] = field(default_factory=list)  # the ones that loaded cleanly
    diagnostics: list[Diagnostic] = field(default_factory=list)  # of all specs, in order
    sources: dict[str, list[str]] = field(default_factory=dict)  # display path -> lines
    failed: list[str] = field(default_factory=list)  # display paths with at least one error
    output: OutputSet | None = None  # the rendered files, when every spec was fine

    @property
    def ok(self) -> bool:
        return not self.diagnostics

    def render_diagnostics(self) -> str:
        """Every diagnostic, rendered with its source line and caret; no summary line."""
        return "\n".join(d.render(self.sources) for d in self.diagnostics)


def _unique(paths: list[str | Path]) -> list[str | Path]:
    seen, out = set(), []
    for p in paths:
        key = os.path.abspath(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def build(paths: list[str | Path], deployments: str = "lower") -> Build:
    """Load, check and render `paths`; never raises for a problem in a spec.

    `deployments`: "skip", "lower" (each spec deployment is accepted or rejected as the spec
    says) or "prove" (accepted ones also pass the coverage proof)."""
    b = Build()
    declared: dict[str, tuple[DeclaredPlan, ...]] = {}
    for path in _unique(paths):
        name = spec_display_path(path)
        text = read_spec_text(path, name)
        if isinstance(text, Diagnostic):
            b.diagnostics.append(text)
            b.failed.append(name)
            continue
        b.sources[name] = text.splitlines()
        try:
            spec = parse_spec_text(text, name)
        except SpecErrors as e:
            b.diagnostics.extend(e.diagnostics)
            b.failed.append(name)
            continue
        b.specs.append(spec)
        if deployments != "skip":
            checked = check_deployments(
                spec, lambda o, text=text, name=name: parse_spec_text(text, name, o),
                prove=deployments == "prove")
            declared[spec.path] = checked.declared
            if checked.diagnostics:
                b.diagnostics.extend(checked.diagnostics)
                b.failed.append(name)
    # Render the specs that loaded, even when others did not, to report emit-time errors
    # (name clashes) of every spec at once; the output is kept only when all is clean.
    try:
        output = compile_specs(b.specs, declared)
    except SpecErrors as e:
        b.diagnostics.extend(e.diagnostics)
        b.failed.extend(f for f in dict.fromkeys(d.loc.file for d in e.diagnostics)
                        if f not in b.failed)
        return b
    if b.ok:
        b.output = output
    return b
