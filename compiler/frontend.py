"""Spec front end: text → located YAML → schema → model → semantic checks.

`load_spec(path)` runs every stage and raises `SpecErrors` holding all diagnostics of the
first stage that found any (a spec with a shape error is not modelled further, because the
model would only repeat the same mistake in other words).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .check import check_spec
from .diagnostics import Diagnostic, Diagnostics, Location, SpecErrors
from .limits import MAX_SPEC_BYTES
from .model import Spec
from .model_build import build_spec
from .schema import validate_shape
from .yaml_loader import load_located


def read_spec_text(path: str | Path, name: str) -> str | Diagnostic:
    """The text of a spec file, or a diagnostic (named `name`) saying why there is none.

    At most MAX_SPEC_BYTES are read (Note [Spec limits]), so a huge file or a device that
    never ends costs no more than that."""
    try:
        # Opening a FIFO for reading blocks until a writer comes, and a device may never end:
        # only a regular file is opened (and O_NONBLOCK keeps a FIFO swapped in after the
        # stat from blocking the open).
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            return Diagnostic(Location(name), f"cannot read spec: it is {_file_kind(mode)}, "
                              "not a regular file", "name a YAML file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        return Diagnostic(Location(name), f"cannot read spec: {e.strerror or e}",
                                "check the path")
    if len(raw) > MAX_SPEC_BYTES:
        return Diagnostic(Location(name), f"the spec is larger than {MAX_SPEC_BYTES} "
                                "bytes", "a spec is a few kilobytes of YAML; is this the right "
                                "file?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1  # in bytes, 1-based
        return Diagnostic(Location(name, line, col), f"the spec is not UTF-8 text (byte "
                          f"{e.start}, 0x{raw[e.start]:02x}, is not)",
                          "save the spec as UTF-8; a spec is a YAML text file")
    if "\x00" in text:
        return Diagnostic(Location(name), f"the spec holds a NUL byte (at byte "
                                f"{raw.index(0)}): it looks like a binary file",
                                "a spec is a YAML text file; is this the right file?")
    return text


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a special file"


def parse_spec_text(text: str, path: str, overrides: dict[str, int] | None = None,
                    dtypes: dict[str, str] | None = None, deployments: bool = True) -> Spec:
    """`overrides` replaces param values (e.g. a deployment's page_size) before modelling;
    `dtypes` replaces the dtype of names declared in the spec's `dtypes` (e.g. `model`).
    `deployments=False` leaves the spec's `deployments` out: they name layer ids and sizes
    of the declared params, which a run with the model scaled down (`pdc parity`'s seed
    toys) does not have; such a run checks its own topology instead."""
    doc, errors = load_located(text, path)
    if doc is None or errors:
        raise SpecErrors(errors)
    if not deployments and isinstance(doc.data, dict):
        doc.data.pop("deployments", None)
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
            # a bound param keeps its `from` and takes the value as its example
            declared[name] = dict(declared[name], example=value) \
                if isinstance(declared[name], dict) else value
    shape = validate_shape(doc)
    if shape:
        raise SpecErrors(shape)
    diags = Diagnostics()
    spec = build_spec(doc, diags)
    if spec is None or diags:  # a None spec comes with its errors in diags
        raise SpecErrors(diags.items)
    check_spec(spec, diags)
    diags.raise_if_any()
    return spec


def load_spec(path: str | Path, overrides: dict[str, int] | None = None,
              dtypes: dict[str, str] | None = None, deployments: bool = True) -> Spec:
    text = read_spec_text(path, str(path))
    if isinstance(text, Diagnostic):
        raise SpecErrors([text])
    return parse_spec_text(text, str(path), overrides, dtypes, deployments)
