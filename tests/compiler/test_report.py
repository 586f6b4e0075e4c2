"""`pdc plan`'s plain table (compiler/report.py) fits 100 columns, elected writers included."""

from __future__ import annotations

import pytest
from pdc.compiler.coverage import prove
from pdc.compiler.frontend import load_spec
from pdc.compiler.layout import build_layout
from pdc.compiler.lower import lower
from pdc.compiler.report import TABLE_COLUMNS, plan_report, render_table
from pdc.compiler.topology import topology_from_args

from .test_bad_specs import REPO


@pytest.mark.parametrize(("spec", "prefill", "decode"), [
    ("qwen38.yaml", "tp=4", "tp=1"), ("glm52.yaml", "tp=8,pp=2", "tp=4"),
    ("deepseek-v32.yaml", "tp=8", "tp=1"), ("llama3-70b.yaml", "tp=2", "tp=8,pp=2"),
])
def test_the_plan_table_fits_100_columns(spec, prefill, decode):
    s = load_spec(REPO / "specs" / spec)
    layout = build_layout(s)
    topo, errors = topology_from_args(layout, prefill, decode, "mooncake")
    assert not errors
    plan = lower(layout, topo, s.backends)
    text = render_table(plan_report(layout, plan, 8192, prove(layout, plan)))
    assert max(len(line) for line in text.splitlines()) <= TABLE_COLUMNS
    elected = {c for lk in plan.links for c in lk.elected_for}
    assert all(c in text for c in elected)  # listed, wrapped, under the table
    assert text.splitlines()[-1].startswith("coverage: proven")
