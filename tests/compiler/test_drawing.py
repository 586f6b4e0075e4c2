"""The plan drawing (compiler/drawing.py): what it shows is read back from the SVG itself."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from pdc.compiler.coverage import prove
from pdc.compiler.drawing import broadcasts, draw_plan, drawable, link_path
from pdc.compiler.frontend import load_spec
from pdc.compiler.layout import build_layout
from pdc.compiler.lower import lower
from pdc.compiler.report import plan_report
from pdc.compiler.topology import topology_from_args

from .test_bad_specs import REPO

SVG = "{http://www.w3.org/2000/svg}"


def _draw(spec: str, prefill: str, decode: str):
    s = load_spec(REPO / "specs" / spec)
    layout = build_layout(s)
    topo, errors = topology_from_args(layout, prefill, decode, "mooncake")
    assert not errors
    plan = lower(layout, topo, s.backends)
    report = plan_report(layout, plan, 8192, prove(layout, plan))
    root = ET.fromstring(draw_plan(layout, plan, report))
    return layout, plan, report, root


def _groups(root, cls: str) -> list:
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == cls]


def _texts(el) -> list[str]:
    return ["".join(t.itertext()) for t in el.iter(f"{SVG}text")]


def test_qwen38_tp4_to_tp1():
    layout, plan, report, root = _draw("qwen38.yaml", "tp=4", "tp=1")
    assert root.get("data-family") == "qwen38"
    assert _texts(root)[0] == ("qwen38: prefill tp=4,pp=1,page_size=64 -> decode "
                               "tp=1,pp=1,page_size=64 over mooncake")
    prefill = _groups(root, "rank prefill")
    decode = _groups(root, "rank decode")
    assert [g.get("data-rank") for g in prefill] == ["pp0.tp0", "pp0.tp1", "pp0.tp2", "pp0.tp3"]
    assert [g.get("data-rank") for g in decode] == ["pp0.tp0"]
    # P > D: rank 0 is the elected writer of every replicated component, and says so.
    assert [g.get("data-elected") for g in prefill] == ["true", "false", "false", "false"]
    assert "★ elected" in _texts(prefill[0]) and "★ elected" not in _texts(prefill[1])
    stages = _groups(root, "stage prefill") + _groups(root, "stage decode")
    assert [_texts(g)[0] for g in stages] == ["stage 0: layers 0-47 + draft 48"] * 2

    links = _groups(root, "link")
    assert [(g.get("data-prefill"), g.get("data-decode")) for g in links] == [
        ("pp0.tp0", "pp0.tp0"), ("pp0.tp1", "pp0.tp0"), ("pp0.tp2", "pp0.tp0"),
        ("pp0.tp3", "pp0.tp0")]
    by_link = {(lk["prefill"], lk["decode"]): lk for lk in report["links"]}
    for g, lk in zip(links, plan.links, strict=True):
        st = by_link[(str(lk.prefill), str(lk.decode))]
        d = st["descriptors"]
        assert int(g.get("data-bytes")) == st["bytes"]
        assert g.get("data-descriptors") == (f"{d['direct_contiguous']},"
                                             f"{d['direct_fragmented']},{d['staged_fragmented']}")
        assert g.get("data-path") == link_path(lk)
    # Rank 0 sends its head slices staged and the replicated state whole (mixed); the others
    # hold only slices.
    assert [g.get("data-path") for g in links] == ["mixed", "staged", "staged", "staged"]
    assert links[0].get("data-elected") == ("qsa_compressed,qsa_pending,qsa_rope,ple_short_conv,"
                                            "ple_ngram,aux_first_token,aux_draft_hidden")
    title = "".join(links[0].find(f"{SVG}title").itertext())
    assert title.startswith("link 1: pp0.tp0 -> pp0.tp0, 127 entries, 146.48 MiB per request, "
                            "descriptors 213165 contiguous / 214689 fragmented / 1554 staged")
    rows = [_texts(r) for r in _groups(root, "link-row")]
    assert rows[1] == ["2", "pp0.tp1 -> pp0.tp0", "staged", "72", "18.42", "144", "144", "1",
                       "-"]
    assert "305.74 MiB over 4 links; coverage: proven" in _texts(root)[1]


def test_glm52_tp8_pp2_to_tp4():
    layout, plan, report, root = _draw("glm52.yaml", "tp=8,pp=2", "tp=4")
    prefill = _groups(root, "rank prefill")
    assert len(prefill) == 16 and len(_groups(root, "rank decode")) == 4
    stages = _groups(root, "stage prefill")
    assert [(g.get("data-stage"), g.get("data-layers")) for g in stages] == [
        ("0", "0-38"), ("1", "39-77")]
    assert _texts(stages[1])[0] == "stage 1: layers 39-77 + draft 78"
    # Replicated MLA state, P > D: every second prefill rank is the elected writer of its
    # pair and the only one with a link; the other draws as idle.
    elected = [g.get("data-rank") for g in prefill if g.get("data-elected") == "true"]
    assert elected == [f"pp{s}.tp{t}" for s in (0, 1) for t in (0, 2, 4, 6)]
    idle = [g for g in prefill if g.get("data-bytes") == "0"]
    assert len(idle) == 8 and all("no link (a replica writes)" in _texts(g) for g in idle)
    links = _groups(root, "link")
    assert len(links) == 8 and {g.get("data-path") for g in links} == {"direct"}
    assert [(g.get("data-prefill"), g.get("data-decode")) for g in links[4:]] == [
        ("pp1.tp0", "pp0.tp0"), ("pp1.tp2", "pp0.tp1"), ("pp1.tp4", "pp0.tp2"),
        ("pp1.tp6", "pp0.tp3")]
    assert links[4].get("data-elected") == ("mla_kv,draft_mla_kv,dsa_index_k,aux_first_token,"
                                            "aux_draft_hidden,aux_dsa_topk")
    assert len(_groups(root, "badge")) == 8 and len(_groups(root, "link-row")) == 8
    decode = _groups(root, "rank decode")
    assert all("receives 792.49 MiB" in _texts(g) for g in decode)


def test_a_broadcast_is_tagged_on_the_prefill_rank():
    """P < D: each prefill rank writes the replicated state to several decode ranks."""
    layout, plan, _, root = _draw("llama3-70b.yaml", "tp=2", "tp=8")
    casts = broadcasts(layout, plan)
    assert sorted(map(str, casts)) == ["pp0.tp0", "pp0.tp1"]
    prefill = _groups(root, "rank prefill")
    assert all(g.get("data-broadcast") == ",".join(casts[r]) and "⇉ broadcast" in _texts(g)
               for g, r in zip(prefill, sorted(casts), strict=True))


@pytest.mark.parametrize(("prefill", "decode", "why"), [
    ("tp=128", "tp=1", "prefill has 128 ranks; a drawing shows at most 64 per side"),
])
def test_a_plan_too_large_to_read_is_refused(prefill, decode, why):
    s = load_spec(REPO / "specs" / "llama3-70b.yaml")
    layout = build_layout(s)
    topo, errors = topology_from_args(layout, prefill, decode, "mooncake")
    assert not errors
    # drawable() reads the topology only; a plan without links stands in for the lowering.
    from pdc.runtime.plan_types import Plan

    assert drawable(Plan(layout.family, topo, (), (), (), ())) == why
