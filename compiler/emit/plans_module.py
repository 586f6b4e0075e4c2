"""Emit `generated/<family>/plans.py`: the plans of the deployments the spec declares.

A spec's accepted `deployments` (at the spec's own page size) are written in compact form (Note [Compact plans] in pdc/runtime/plan_codec.py) with their
digests; pdc.runtime.family loads them instead of lowering at start, and lowers any other
topology as before. `pdc check` keeps the file fresh like every generated module. The plans
come from check_deployments, which lowered them already (FamilyContext.declared); only a
caller that skipped that check gets them lowered here. A deployment that does not lower is
left out: check_deployments reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdc.runtime import plan_codec
from pdc.runtime.plan_types import Topology

from ..deployments import DeclaredPlan, describe, is_declared_page
from ..diagnostics import SpecErrors
from ..lower import lower
from ..topology import side_from_spec
from .context import FamilyContext, GeneratedModule
from .naming import family_import
from .pysrc import comment_lines, py_str, py_value
from .templates import render

TEMPLATE = "plans.py.j2"
MODULE = "plans"


@dataclass(frozen=True, slots=True)
class PlanView:
    comment: tuple[str, ...]  # `# deployment i at file:line: ...` lines
    digest: str  # string literal
    data: str  # the compact plan as a Python literal


@dataclass(frozen=True, slots=True)
class PlansModuleView:
    family: str
    import_path: str
    plans: tuple[PlanView, ...]


def _literal(x: object) -> object:
    """Lists as tuples, recursively, so that py_value can write them."""
    if isinstance(x, list | tuple):
        return tuple(_literal(v) for v in x)
    if isinstance(x, dict):
        return {k: _literal(v) for k, v in x.items()}
    return x


def declared_plans(ctx: FamilyContext) -> tuple[DeclaredPlan, ...]:
    """Every accepted deployment at the spec's page size, with its plan."""
    if ctx.declared is not None:
        return ctx.declared
    return tuple(_lower_declared(ctx))


def _lower_declared(ctx: FamilyContext):
    spec, layout = ctx.spec, ctx.layout
    for i, d in enumerate(spec.deployments):
        if not is_declared_page(spec, d):
            continue
        pside, e1 = side_from_spec(layout, d.prefill, "prefill")
        dside, e2 = side_from_spec(layout, d.decode, "decode")
        if e1 or e2 or pside is None or dside is None:
            continue
        try:
            plan = lower(layout, Topology(pside, dside, d.backend), spec.backends, d.loc)
        except SpecErrors:
            continue
        yield i, d, plan


def plans_view(ctx: FamilyContext) -> PlansModuleView:
    plans = []
    for i, d, plan in declared_plans(ctx):
        comment = comment_lines(f"deployment {i} at {d.loc}: {describe(d)}", indent=1)
        plans.append(PlanView(comment, py_str(plan.digest()),
                              py_value(_literal(plan_codec.encode(plan)), indent=2)))
    return PlansModuleView(ctx.spec.family, family_import(ctx.spec, MODULE), tuple(plans))


def emit(ctx: FamilyContext) -> GeneratedModule | None:
    view = plans_view(ctx)
    return GeneratedModule(MODULE, render(TEMPLATE, view)) if view.plans else None
