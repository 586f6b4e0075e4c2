"""Spec front end: text → located YAML → schema → model → semantic checks.

`load_spec(path)` runs every stage and raises `SpecErrors` holding all diagnostics of the
first stage that found any (a spec with a shape error is not modelled further, because the
model would only repeat the same mistake in other words).
"""

from __future__ import annotations

from pathlib import Path

from .check import check_spec
from .diagnostics import Diagnostic, Diagnostics, Location, SpecErrors
from .model import Spec, build_spec
from .schema import validate_shape
from .yaml_loader import load_located


def parse_spec_text(text: str, path: str, overrides: dict[str, int] | None = None) -> Spec:
    """`overrides` replaces param values (e.g. a deployment's page_size) before modelling."""
    doc, errors = load_located(text, path)
    if doc is None or errors:
        raise SpecErrors(errors)
    if overrides and isinstance(doc.data, dict) and isinstance(doc.data.get("params"), dict):
        for name, value in overrides.items():
            if name not in doc.data["params"]:
                raise SpecErrors([Diagnostic(doc.loc(("params",)), f"cannot override param "
                                             f"'{name}': the spec does not declare it",
                                             "override only declared params")])
            doc.data["params"][name] = value
    shape = validate_shape(doc)
    if shape:
        raise SpecErrors(shape)
    diags = Diagnostics()
    spec = build_spec(doc, diags)
    diags.raise_if_any()
    check_spec(spec, diags)
    diags.raise_if_any()
    return spec


def load_spec(path: str | Path, overrides: dict[str, int] | None = None) -> Spec:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecErrors([Diagnostic(Location(str(path)), f"cannot read spec: {e.strerror}",
                                     "check the path")]) from None
    return parse_spec_text(text, str(path), overrides)
