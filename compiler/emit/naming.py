"""Every name that appears in generated code or in generated file paths comes from here.

Names are pure functions of the spec, so two compilers agree on them and a rename shows up
in `pdc check` as a diff. Clashes (two components that spell the same constant, or a
component that spells a module-level constant) are reported as spec diagnostics at the
component, because only a rename in the spec can fix them.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Iterable

from ..diagnostics import Diagnostic
from ..model import Spec

_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def upper_snake(name: str) -> str:
    """`gdn_conv` -> `GDN_CONV`, `gdnConv` -> `GDN_CONV`."""
    return _CAMEL_BOUNDARY.sub("_", name).upper()


def family_package(spec: Spec) -> str:
    """The family's package under generated/ (and under pdc.generated)."""
    name = spec.py_name
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"family {spec.family!r} gives no valid package name: {name!r}")
    return name


def family_module(spec: Spec, module: str) -> str:
    """Output path of one module of the family, relative to generated/: `qwen38/layout.py`."""
    return f"{family_package(spec)}/{module}.py"


def family_import(spec: Spec, module: str) -> str:
    """Import path of one module of the family: `pdc.generated.qwen38.layout`."""
    return f"pdc.generated.{family_package(spec)}.{module}"


def component_constants(spec: Spec, reserved: Iterable[str]) -> tuple[dict[str, str],
                                                                      list[Diagnostic]]:
    """UPPER_SNAKE constant per component (spec order), and a diagnostic per clash."""
    taken = {r: "" for r in reserved}
    names: dict[str, str] = {}
    errors = []
    for c in spec.components:
        const = upper_snake(c.name)
        if const in taken:
            other = taken[const]
            what = f"component '{other}'" if other else "a constant of the generated module"
            errors.append(Diagnostic(
                c.loc, f"component '{c.name}' would be generated as {const}, which is already "
                f"the name of {what}", "rename the component"))
            continue
        taken[const] = c.name
        names[c.name] = const
    return names, errors


# Module-level names of the generated module, bound to FamilyLayout fields where one exists.
MODULE_CONSTANTS = {
    "FAMILY": "family",
    "SPEC_SHA256": None,
    "FINGERPRINT": None,
    "NUM_LAYERS": "num_layers",
    "DRAFT_IDS": "draft_ids",
    "DEFAULT_PAGE_SIZE": "default_page_size",
    "LAYER_KINDS": "kind_of",
    "COMPONENTS": "components",
    "LAYOUT": None,
    "BACKENDS": None,
}
