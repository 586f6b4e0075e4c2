"""Prove a spec's `deployments`: each is accepted or rejected exactly as the spec says.

An accepted deployment is lowered (static rules: backend matrix, page sizes, divisibility)
and, when `prove` is set, its plan goes through the coverage proof. A deployment marked
`expect: rejected` must be rejected, with a message containing its `error` text when given.
A side's page_size other than the spec's re-evaluates the spec with that page size, since
item shapes depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdc.runtime.layout_types import FamilyLayout
from pdc.runtime.plan_types import Plan, Topology

from .coverage import prove as prove_coverage
from .diagnostics import Diagnostic, SpecErrors
from .layout import build_layout
from .limits import MAX_PROOF_BYTES
from .lower import lower
from .model import Deployment, Spec
from .topology import side_from_spec


def describe(d: Deployment) -> str:
    def one(s) -> str:
        parts = [f"tp={s.tp}"] + [f"pp={s.pp}"] * (s.pp > 1) + [f"dp={s.dp}"] * (s.dp > 1)
        parts += [f"page_size={s.page_size}"] * (s.page_size is not None)
        return ",".join(parts)

    return f"prefill {one(d.prefill)} -> decode {one(d.decode)} over {d.backend}"


def proof_bytes(layout, plan) -> int:
    """Bytes of the items the coverage proof labels for `plan` (one int64 label per byte)."""
    d_tp = plan.topology.decode.tp
    by_name = {c.name: c for c in layout.components}
    return sum(len(entries) * by_name[name].item_bytes_at(d_tp)
               for reg in plan.decode for name, entries, _ in reg.components)


# (deployment index, deployment, plan): an accepted deployment at the spec's own page size,
# the plans generated/<family>/plans.py carries (compiler/emit/plans_module.py).
DeclaredPlan = tuple[int, Deployment, Plan]


@dataclass(frozen=True, slots=True)
class CheckedDeployments:
    diagnostics: list[Diagnostic]
    declared: tuple[DeclaredPlan, ...]  # lowered here once; the emitter writes them


def is_declared_page(spec: Spec, d: Deployment) -> bool:
    return not d.expect_rejected and d.prefill.page_size in (None, spec.env.get("page_size"))


def check_deployments(spec: Spec, reparse, prove: bool) -> CheckedDeployments:
    """`reparse(overrides)` returns the spec evaluated with param overrides."""
    out: list[Diagnostic] = []
    declared: list[DeclaredPlan] = []
    layouts: dict[int | None, FamilyLayout] = {}
    for i, d in enumerate(spec.deployments):
        page = d.prefill.page_size
        what = f"deployment {i} ({describe(d)})"
        try:
            if page not in layouts:
                s = spec if page is None or page == spec.env.get("page_size") else \
                    reparse({"page_size": page})
                layouts[page] = build_layout(s)
            layout = layouts[page]
            pside, e1 = side_from_spec(layout, d.prefill, "prefill")
            dside, e2 = side_from_spec(layout, d.decode, "decode")
            if e1 or e2:
                raise SpecErrors(e1 + e2)
            plan = lower(layout, Topology(pside, dside, d.backend), spec.backends, d.loc)
        except SpecErrors as e:
            inner = e.diagnostics[0]  # located at the rule it breaks, when it has one
            first = inner.message + (f" at {inner.loc}" if inner.loc.line else "")
            if not d.expect_rejected:
                out.append(Diagnostic(d.loc, f"{what} is rejected: {first}",
                                      "fix the spec or the deployment, or mark it "
                                      "`expect: rejected`"))
            elif d.error and not any(d.error in x.message for x in e.diagnostics):
                out.append(Diagnostic(d.loc, f"{what} is rejected, but no error mentions "
                                      f"'{d.error}': {first}",
                                      "update `error` to a phrase of the actual rejection"))
            continue
        if d.expect_rejected:
            out.append(Diagnostic(d.loc, f"{what} is accepted, but the spec expects it to be "
                                  "rejected", "remove `expect: rejected`, or fix the rule that "
                                  "should reject it"))
            continue
        if is_declared_page(spec, d):
            declared.append((i, d, plan))
        if prove:
            checked = proof_bytes(layout, plan)
            if checked > MAX_PROOF_BYTES:
                out.append(Diagnostic(d.loc, f"{what}: its coverage proof would label "
                                      f"{checked} bytes, more than the limit of "
                                      f"{MAX_PROOF_BYTES}", "prove a smaller deployment (fewer "
                                      "decode ranks); Note [Spec limits] in compiler/limits.py"))
                continue
            problems = prove_coverage(layout, plan, limit=3)
            if problems:
                out.append(Diagnostic(d.loc, f"{what} fails the coverage proof: {problems[0]}",
                                      "this is a lowering bug: please report it"))
    return CheckedDeployments(out, tuple(declared))
