"""Helpers shared by the lowering tests: load a spec (cached), lower a topology string."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from pdc.compiler.frontend import load_spec
from pdc.compiler.layout import build_layout
from pdc.runtime.diagnostics import Location
from pdc.runtime.lowering import lower
from pdc.runtime.plan_types import Topology
from pdc.runtime.topology import resolve_side

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))


@cache
def spec_and_layout(path: str, page_size: int | None = None):
    spec = load_spec(path, {"page_size": page_size} if page_size else None)
    return spec, build_layout(spec)


def side(layout, **kw):
    s, errs = resolve_side(layout, **kw, what="side", loc=Location("<test>"))
    assert not errs, errs
    return s


def plan_for(path, prefill: dict, decode: dict, backend="mooncake", page_size=None):
    spec, layout = spec_and_layout(str(path), page_size)
    topo = Topology(side(layout, **prefill), side(layout, **decode), backend)
    return layout, lower(layout, topo, spec.backends)
