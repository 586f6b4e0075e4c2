"""The transfer plan for the live topology (prefill TP, decode TP, engine), made in the
serving process by the runtime's own lowering (pdc.runtime.family), never the compiler."""

from __future__ import annotations

from functools import cache

from pdc.runtime.family import Family


@cache
def make_plan(layout, prefill_tp: int, decode_tp: int, backend: str):
    return Family.load(layout.py_name).plan_for(f"tp={prefill_tp}", f"tp={decode_tp}", backend)
