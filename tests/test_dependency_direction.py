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


# ~~~ no import circles between modules ~~~
# Beyond the stages, no two modules may import each other, directly or around a longer loop,
# at any level: function-level and TYPE_CHECKING imports count too (a circle for the type
# checker is still two modules that cannot be understood one without the other).

# folder -> its package, for every folder of product code (the command line and its rooms
# included: pdc/ covers pdc/verify/, pdc/serving/ and pdc/commands/).
PACKAGES = {"runtime": "pdc.runtime", "generated": "pdc.generated", "compiler": "pdc.compiler",
            "integrations": "pdc.integrations", "pdc": "pdc"}


def module_sources(root: Path, packages: dict[str, str]) -> dict[str, tuple[str, bool, str]]:
    """module name -> (source, is_package, path relative to `root`) of every .py file."""
    out = {}
    for folder, package in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("")
            is_package = rel.name == "__init__"
            module = ".".join([package, *(rel.parts[:-1] if is_package else rel.parts)])
            out[module] = (path.read_text(), is_package, path.relative_to(root).as_posix())
    return out


def import_graph(sources: dict[str, tuple[str, bool, str]]) -> dict[str, set[str]]:
    """module -> the modules of `sources` it imports. `from X import name` names the module
    X.name when there is one (a submodule), else X."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, (source, is_package, _) in sources.items():
        here = module.split(".") if is_package else module.split(".")[:-1]
        for node in ast.walk(ast.parse(source)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base
                           for a in node.names]
                if node.module is None:  # `from . import x` reads x off the package itself
                    targets.append(base)
            graph[module].update(t for t in targets if t in sources and t != module)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other around a loop (the strongly connected
    components of more than one module, Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    members.append(m)
                    if m == node:
                        break
                if len(members) > 1:
                    circles.append(sorted(members))
    return sorted(circles)


def circle_report(root: Path, packages: dict[str, str]) -> list[str]:
    """One line per circle: its modules, each with the file it lives in."""
    sources = module_sources(root, packages)
    return [" <-> ".join(f"{m} ({sources[m][2]})" for m in circle)
            for circle in import_circles(import_graph(sources))]


def test_no_module_imports_itself_around_a_loop():
    assert circle_report(REPO, PACKAGES) == []


def test_a_planted_circle_is_found(tmp_path):
    """Three modules in a loop (one import at function level, one under TYPE_CHECKING) and
    a pair of modules, beside modules that only point one way."""
    pkg = tmp_path / "runtime"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pdc.runtime.sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import A\n")
    (pkg / "d.py").write_text("from . import e\n")
    (pkg / "e.py").write_text("import pdc.runtime.d\nfrom . import leaf\n")
    (pkg / "leaf.py").write_text("import os\n")
    assert circle_report(tmp_path, {"runtime": "pdc.runtime"}) == [
        "pdc.runtime.a (runtime/a.py) <-> pdc.runtime.b (runtime/b.py) <-> "
        "pdc.runtime.sub.c (runtime/sub/c.py)",
        "pdc.runtime.d (runtime/d.py) <-> pdc.runtime.e (runtime/e.py)",
    ]
