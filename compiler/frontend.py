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


def parse_spec_text(text: str, path: str, overrides: dict[str, int] | None = None,
                    dtypes: dict[str, str] | None = None) -> Spec:
    """`overrides` replaces param values (e.g. a deployment's page_size) before modelling;
    `dtypes` replaces the dtype of names declared in the spec's `dtypes` (e.g. `model`)."""
    doc, errors = load_located(text, path)
    if doc is None or errors:
        raise SpecErrors(errors)
    for key, what, given in (("params", "param", overrides), ("dtypes", "dtype", dtypes)):
        if not given or not isinstance(doc.data, dict):
            continue
        declared = doc.data.get(key)
        for name, value in given.items():
            if not isinstance(declared, dict) or name not in declared:
                raise SpecErrors([Diagnostic(doc.loc((key,) if key in doc.data else ()),
                                             f"cannot override {what} '{name}': the spec does "
                                             f"not declare it in `{key}`",
                                             f"override only names declared in `{key}`")])
            declared[name] = value
    shape = validate_shape(doc)
    if shape:
        raise SpecErrors(shape)
    diags = Diagnostics()
    spec = build_spec(doc, diags)
    diags.raise_if_any()
    check_spec(spec, diags)
    diags.raise_if_any()
    return spec


def load_spec(path: str | Path, overrides: dict[str, int] | None = None,
              dtypes: dict[str, str] | None = None) -> Spec:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecErrors([Diagnostic(Location(str(path)), f"cannot read spec: {e.strerror}",
                                     "check the path")]) from None
    return parse_spec_text(text, str(path), overrides, dtypes)
