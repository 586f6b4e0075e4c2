"""The runtime's `Family` built from a spec, and the one spec -> plan call.

A spec evaluated as written is compiled under generated/ and loads at run time with
`pdc.runtime.family.Family.load`; a spec evaluated with overrides (another page size or
dtype, as `pdc plan` and `pdc parity` allow) has no generated module, so the harnesses build
the same object here. Either way the plan comes from the one lowering in the runtime.
"""

from __future__ import annotations

from pdc.runtime.family import Family
from pdc.runtime.plan_types import Plan, Topology

from .deployments import is_declared_page
from .emit.header import spec_fingerprint, spec_sha256
from .layout import build_layout
from .model import Spec
from .topology import side_from_spec


def family_of(spec: Spec) -> Family:
    return Family(build_layout(spec), spec_sha256(spec), spec_fingerprint(spec), spec.backends)


def plan_spec(spec: Spec, prefill: str, decode: str, backend: str) -> tuple[Family, Plan]:
    """The family of `spec` and its plan for `--prefill`/`--decode`/`--backend` style sides;
    raises SpecErrors naming the flag or the spec rule a side breaks."""
    family = family_of(spec)
    return family, family.plan_for(prefill, decode, backend)


def declared_as(spec: Spec, family: Family, topology: Topology) -> str:
    """Which of the spec's deployments `topology` is, "deployment I at FILE:LINE:COL", so
    generated/<family>/plans.py carries its plan; "" for a topology engines lower at start."""
    for i, d in enumerate(spec.deployments):
        if not is_declared_page(spec, d):
            continue
        pside, e1 = side_from_spec(family.layout, d.prefill, "prefill")
        dside, e2 = side_from_spec(family.layout, d.decode, "decode")
        if not (e1 or e2) and Topology(pside, dside, d.backend) == topology:
            return f"deployment {i} at {d.loc}"
    return ""
