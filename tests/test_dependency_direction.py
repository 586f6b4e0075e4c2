"""Imports point one way (docs/architecture.md, Dependency direction), read from the source.

Every import statement of every module, function-level ones included, is resolved to the
`pdc.*` package it names; each folder may name only the packages below. In particular the
runtime, the compiler, the generated code and the serving-engine integrations never import
`pdc.verify`, the verification harnesses, nor the command line. (tests/runtime/test_family.py
holds the same line at run time: a fresh interpreter with the compiler and pdc.verify blocked
imports the runtime and every family.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# folder -> (its package, the pdc packages its modules may import). "pdc.__version__" is
# `from pdc import __version__`, the one name the compiler takes from the top package.
ALLOWED = {
    "runtime": ("pdc.runtime", {"pdc.runtime"}),
    "generated": ("pdc.generated", {"pdc.generated", "pdc.runtime"}),
    "compiler": ("pdc.compiler", {"pdc.compiler", "pdc.runtime", "pdc.__version__"}),
    "integrations": ("pdc.integrations", {"pdc.integrations", "pdc.runtime"}),
    "pdc/verify": ("pdc.verify", {"pdc.verify", "pdc.runtime", "pdc.compiler", "pdc.generated",
                                  "pdc.console"}),
    "pdc/serving": ("pdc.serving", {"pdc.serving", "pdc.runtime", "pdc.integrations",
                                    "pdc.console"}),
}


def imported_packages(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, package) of every pdc package the module's imports name: the first two
    components of each imported name, relative imports resolved against `module`."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    names: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            names += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, ".".join(n.split(".")[:2])) for line, n in names
            if n == "pdc" or n.startswith("pdc.")]


def violations(folder: str) -> list[str]:
    package, allowed = ALLOWED[folder]
    found = []
    for path in sorted((REPO / folder).rglob("*.py")):
        rel = path.relative_to(REPO / folder).with_suffix("")
        is_package = rel.name == "__init__"
        module = ".".join([package, *(rel.parts[:-1] if is_package else rel.parts)])
        for line, name in imported_packages(path.read_text(), module, is_package):
            if name not in allowed:
                found.append(f"{path.relative_to(REPO).as_posix()}:{line} imports {name}")
    return found


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_one_way(folder):
    assert violations(folder) == []


@pytest.mark.parametrize("source, module, is_package, expected", [
    ("from ...verify import parity\n", "pdc.runtime.endpoints.x", False, [(1, "pdc.verify")]),
    ("from ..wire import encode\n", "pdc.runtime.endpoints.x", False, [(1, "pdc.runtime")]),
    ("def f():\n    from pdc.verify.ranks import Req\n", "pdc.runtime.x", False,
     [(2, "pdc.verify")]),
    ("from . import wire\nimport pdc.cli\n", "pdc.runtime", True,
     [(1, "pdc.runtime"), (2, "pdc.cli")]),
    ("from pdc import __version__, demo\n", "pdc.compiler.x", False,
     [(1, "pdc.__version__"), (1, "pdc.demo")]),
    ("import numpy\nfrom .layout import LAYOUT\n", "pdc.generated.f.kernels", False,
     [(2, "pdc.generated")]),
])
def test_every_import_form_is_resolved(source, module, is_package, expected):
    assert imported_packages(source, module, is_package) == expected
