"""Property tests of the coverage invariant over real and synthetic specs.

For every spec in specs/ and for generated synthetic specs, over attention TP in {1,2,4,8}
on each side, PP in {1,2,3,4} on each side and page sizes {1,16,64}: lowering either rejects
the topology with a diagnostic or yields a plan whose coverage proof is empty.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdc.compiler.coverage import prove
from pdc.compiler.diagnostics import SpecErrors
from pdc.compiler.frontend import parse_spec_text
from pdc.compiler.layout import build_layout
from pdc.compiler.lower import lower
from pdc.runtime.plan_types import Topology

from .planning import SPECS, side, spec_and_layout

TPS = st.sampled_from([1, 2, 4, 8])
PPS = st.sampled_from([1, 2, 3, 4])
PAGES = st.sampled_from([1, 16, 64])
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _prove_or_reject(spec, layout, ptp, dtp, ppp, dpp, page):
    if ppp > layout.num_layers or dpp > layout.num_layers:
        return
    topo = Topology(side(layout, tp=ptp, pp=ppp, page_size=page),
                    side(layout, tp=dtp, pp=dpp, page_size=page), "mooncake")
    try:
        plan = lower(layout, topo, spec.backends)
    except SpecErrors as e:
        # Only topology rules may reject; every message names a rule.
        assert all(d.hint for d in e.diagnostics)
        return
    problems = prove(layout, plan)
    assert problems == [], f"{topo.describe()}:\n" + "\n".join(map(str, problems))


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
@SETTINGS
@given(ptp=TPS, dtp=TPS, ppp=PPS, dpp=PPS, page=PAGES)
def test_every_spec_is_covered(path, ptp, dtp, ppp, dpp, page):
    try:
        spec, layout = spec_and_layout(str(path), page)
    except SpecErrors:
        return  # the family's constraints rule this page size out (e.g. DSA needs 64)
    _prove_or_reject(spec, layout, ptp, dtp, ppp, dpp, page)


@st.composite
def synthetic_spec(draw) -> str:
    """A random but valid spec: power-of-two heads so every TP in {1,2,4,8} divides."""
    kinds = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3))
    count = len(kinds) * draw(st.integers(1, 4))
    heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    lines = ["family: synth", "params:", "  page_size: 16", f"  heads: {heads}",
             "  dim: 3", "layers:", f"  count: {count}", f"  pattern: [{', '.join(kinds)}]"]
    draft = draw(st.integers(0, 2))
    if draft:
        lines.append(f"  draft: {{kind: mtp, count: {draft}}}")
    lines.append("components:")
    sentinel = 0xFFFFFFFF
    n = draw(st.integers(1, 4))
    for i in range(n):
        request = draw(st.booleans())
        index = draw(st.sampled_from(["page", "slot", "aux", "{ring: 3}"]))
        shard = draw(st.sampled_from(["replicated", "plain", "groups"]))
        lines.append(f"  c{i}:")
        if request:
            stages = draw(st.sampled_from(["all", "first", "last", f"{{with_kind: {kinds[0]}}}"]))
            lines += ["    layers: request", f"    sentinel: {sentinel}", f"    stages: {stages}"]
            sentinel -= 1
        else:
            sel = draw(st.sampled_from(sorted(set(kinds)) + (["mtp"] if draft else [])))
            lines.append(f"    layers: {{kind: {sel}}}")
            lines.append(f"    tensors: [{', '.join(['k', 'v'][:draw(st.integers(1, 2))])}]")
        lines.append(f"    index: {index}")
        if shard == "groups":
            lines += ["    item: {shape: [2, 3 * heads * dim], dtype: bfloat16}",
                      "    tp: {shard: 3 * heads * dim, groups: [heads * dim, 2 * heads * dim],"
                      " unit: dim}"]
        elif shard == "plain":
            lead = "page_size" if index == "page" else "2"
            lines += [f"    item: {{shape: [{lead}, heads, dim], dtype: float32}}",
                      "    tp: {shard: heads}"]
        else:
            lines += ["    item: {shape: [5, dim], dtype: int8}", "    tp: replicated"]
    return "\n".join(lines) + "\n"


@settings(SETTINGS, max_examples=60)
@given(text=synthetic_spec(), ptp=TPS, dtp=TPS, ppp=PPS, dpp=PPS, page=PAGES)
def test_synthetic_specs_are_covered(text, ptp, dtp, ppp, dpp, page):
    spec = parse_spec_text(text.replace("page_size: 16", f"page_size: {page}"), "<synthetic>")
    _prove_or_reject(spec, build_layout(spec), ptp, dtp, ppp, dpp, page)
