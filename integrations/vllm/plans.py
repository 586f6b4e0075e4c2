"""The transfer plan for the live topology (prefill TP, decode TP, engine)."""

from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def make_plan(layout, prefill_tp: int, decode_tp: int, backend: str):
    # The family's spec is lowered here, in the serving process, for the topology vLLM was
    # started with (the compiler proves the same lowering for every declared deployment).
    from pdc.compiler.diagnostics import Location
    from pdc.compiler.frontend import load_spec
    from pdc.compiler.layout import build_layout
    from pdc.compiler.lower import lower
    from pdc.compiler.topology import resolve_side
    from pdc.runtime.plan_types import Topology

    root = Path(__file__).resolve().parents[2]
    spec = load_spec(str(root / layout.spec_path))
    full = build_layout(spec)
    sides = []
    for what, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        side, errs = resolve_side(full, tp=tp, what=what, loc=Location("<vllm>"))
        if errs:
            raise ValueError("; ".join(str(e) for e in errs))
        sides.append(side)
    return lower(full, Topology(sides[0], sides[1], backend), spec.backends)
