"""Lowering: mapping rules, static rules, and regressions named after real bugs.

Every test that builds a plan also runs the coverage proof, and the `broken_*` tests break
one mapping rule at a time and show that the proof catches it.
"""

from __future__ import annotations

import pytest
from pdc.compiler.coverage import prove
from pdc.compiler.diagnostics import SpecErrors
from pdc.runtime import lowering as lower_mod
from pdc.runtime.plan_types import RankId

from .planning import ROOT, plan_for

QWEN = ROOT / "specs" / "qwen38.yaml"
LLAMA = ROOT / "specs" / "llama3-70b.yaml"
GLM = ROOT / "specs" / "glm52.yaml"


def proven(layout, plan):
    problems = prove(layout, plan)
    assert problems == [], "\n".join(map(str, problems))
    return layout, plan


@pytest.mark.parametrize("p,d", [(1, 1), (4, 4), (4, 1), (1, 4), (8, 2), (2, 8)])
def test_attention_tp_mappings_are_proven(p, d):
    proven(*plan_for(QWEN, {"tp": p}, {"tp": d}))


def test_responses_expected_follow_tp_ratio():
    _, plan = plan_for(LLAMA, {"tp": 8}, {"tp": 2})
    assert [plan.responses_expected(RankId(0, t)) for t in range(2)] == [4, 4]
    _, plan = plan_for(LLAMA, {"tp": 2}, {"tp": 8})
    assert [plan.responses_expected(RankId(0, t)) for t in range(8)] == [1] * 8
    assert {lk.prefill.tp for lk in plan.links_to(RankId(0, 5))} == {1}


def test_gqa_replication_uses_division_not_modulo():
    # kv_heads = 8 on decode tp=16: rank r holds head r // 2. Rank 3 must read head 1.
    layout, plan = plan_for(LLAMA, {"tp": 1}, {"tp": 16}, backend="nixl")
    proven(layout, plan)
    (link,) = plan.links_to(RankId(0, 3))
    kv = next(e for e in link.entries if e.component == "kv")
    head_bytes = 128 * 2
    assert kv.segments[0].src_offset == 1 * head_bytes


def test_gqa_modulo_rule_is_caught(monkeypatch):
    def modulo_units(comp, tp, rank):
        units = comp.shard.group_units
        if units[0] < tp:
            return ((0, rank % units[0]),)
        return comp.shard.local_units(tp, rank)

    monkeypatch.setattr(lower_mod, "local_units", modulo_units)
    layout, plan = plan_for(LLAMA, {"tp": 1}, {"tp": 16}, backend="nixl")
    problems = prove(layout, plan)
    assert any("wrong value" in str(p) for p in problems)


def test_gdn_conv_is_sliced_per_sub_block():
    layout, plan = proven(*plan_for(QWEN, {"tp": 1}, {"tp": 2}))
    conv = layout.component("gdn_conv")
    (link,) = plan.links_to(RankId(0, 1))
    e = next(e for e in link.entries if e.component == "gdn_conv")
    row = (4 - 1) * 2  # conv_kernel - 1 columns of bf16 per channel
    key_dim, value_dim = 2048, 4096
    # Decode rank 1 holds the second half of q, of k and of v: three segments, one per block.
    assert [(s.src_offset, s.nbytes) for s in e.segments] == [
        (key_dim // 2 * row, key_dim // 2 * row),
        ((key_dim + key_dim // 2) * row, key_dim // 2 * row),
        ((2 * key_dim + value_dim // 2) * row, value_dim // 2 * row),
    ]
    assert e.dst_item_bytes == conv.item_bytes // 2


def test_gdn_conv_sliced_across_sub_blocks_is_caught(monkeypatch):
    def ignore_groups(comp, tp, rank):
        total = sum(comp.shard.group_units)
        per = total // tp
        out, g0 = [], 0
        flat = [(g, u) for g, n in enumerate(comp.shard.group_units) for u in range(n)]
        for i in range(rank * per, (rank + 1) * per):
            out.append(flat[i])
        del g0
        return tuple(out)

    monkeypatch.setattr(lower_mod, "local_units", ignore_groups)
    problems = prove(*plan_for(QWEN, {"tp": 1}, {"tp": 2}))
    assert any(p.component == "gdn_conv" for p in problems)


def test_replicated_state_has_one_elected_writer():
    layout, plan = proven(*plan_for(QWEN, {"tp": 4}, {"tp": 1}))
    writers = [lk.prefill for lk in plan.links if "ple_ngram" in lk.elected_for]
    assert writers == [RankId(0, 0)]


def test_replicated_state_written_twice_is_caught(monkeypatch):
    monkeypatch.setattr(lower_mod, "replicated_writers", lower_mod.tp_sources)
    problems = prove(*plan_for(QWEN, {"tp": 4}, {"tp": 1}))
    assert any("written more than once" in str(p) for p in problems)


def test_replicated_state_broadcasts_to_more_decode_ranks():
    _, plan = proven(*plan_for(QWEN, {"tp": 1}, {"tp": 4}))
    for t in range(4):
        (link,) = plan.links_to(RankId(0, t))
        assert any(e.component == "qsa_rope" for e in link.entries)


def test_v_pointers_on_uneven_pp_split():
    # 80 layers split 20 / 40 / 20 on prefill, 2 even stages on decode: every V entry of
    # decode must come from the V entry with the same global layer id (SGLang #27740).
    stages = (tuple(range(20)), tuple(range(20, 60)), tuple(range(60, 80)))
    layout, plan = proven(*plan_for(LLAMA, {"tp": 2, "pp": 3, "stages": stages},
                                    {"tp": 2, "pp": 2}))
    for link in plan.links:
        src = plan.registration("prefill", link.prefill).entries("kv")
        dst = plan.registration("decode", link.decode).entries("kv")
        for e in link.entries:
            if e.component == "kv":
                assert src[e.src_pos] == dst[e.dst_pos] == (e.tensor, e.layer_id)


def test_positional_pp_pairing_is_caught(monkeypatch):
    monkeypatch.setattr(lower_mod, "source_position", lambda entries, key, dst_pos: dst_pos)
    stages = (tuple(range(20)), tuple(range(20, 60)), tuple(range(60, 80)))
    problems = prove(*plan_for(LLAMA, {"tp": 2, "pp": 3, "stages": stages}, {"tp": 2, "pp": 2}))
    assert problems


def test_empty_pp_stage_keeps_its_place_on_the_wire():
    stages = ((0, 1, 2), tuple(range(3, 48)))
    layout, plan = proven(*plan_for(QWEN, {"tp": 2, "pp": 2, "stages": stages}, {"tp": 1}))
    reg0 = plan.registration("prefill", RankId(0, 0))
    names = [name for name, _, _ in reg0.components]
    assert names == [c.name for c in layout.components]  # every component keeps its slot
    assert reg0.entries("kv") == () and reg0.entries("qsa_rope") == ()
    assert reg0.entries("gdn_conv") == (("data", 0), ("data", 1), ("data", 2))
    reg1 = plan.registration("prefill", RankId(1, 0))
    assert reg1.entries("qsa_rope") == (("data", 0xFFFFFFFE),)


def test_request_state_written_by_every_owning_stage_is_caught(monkeypatch):
    monkeypatch.setattr(lower_mod, "request_writer_stages", lambda owners: tuple(owners))
    problems = prove(*plan_for(QWEN, {"tp": 1, "pp": 4}, {"tp": 1}))
    assert any("more than once" in str(p) for p in problems)


def test_draft_layers_live_on_the_last_stage():
    layout, plan = proven(*plan_for(GLM, {"tp": 8, "pp": 2}, {"tp": 4}))
    last = plan.registration("prefill", RankId(1, 0))
    assert ("data", 78) in last.entries("draft_mla_kv")
    assert plan.registration("prefill", RankId(0, 0)).entries("draft_mla_kv") == ()


def test_tp_source_rule_broken_is_caught(monkeypatch):
    monkeypatch.setattr(lower_mod, "tp_sources", lambda p, d, r: (r % p,))
    problems = prove(*plan_for(LLAMA, {"tp": 2}, {"tp": 8}))
    assert any("never written" in str(p) for p in problems)


# ~~~ static rules ~~~


def _rejection(path, prefill, decode, backend, page_size=None):
    with pytest.raises(SpecErrors) as info:
        plan_for(path, prefill, decode, backend, page_size)
    return str(info.value)


def test_nixl_rejects_heterogeneous_tp_naming_the_rule():
    msg = _rejection(QWEN, {"tp": 4}, {"tp": 1}, "nixl")
    assert "backend 'nixl' does not support heterogeneous attention TP (prefill tp=4, " \
           "decode tp=1): rule `hetero_attention_tp: false`" in msg
    assert msg.startswith(f"{QWEN}:114:3: error: ")  # located at the rule


def test_mori_rejects_pp():
    msg = _rejection(QWEN, {"tp": 1, "pp": 2}, {"tp": 1}, "mori")
    assert "backend 'mori' supports pp <= 1 (prefill pp=2, decode pp=1): rule `max_pp: 1`" in msg


def test_page_size_mismatch_is_rejected():
    msg = _rejection(QWEN, {"tp": 1, "page_size": 64}, {"tp": 1, "page_size": 16}, "mooncake")
    assert "page size differs: prefill 64, decode 16" in msg


def test_indivisible_tp_is_rejected():
    msg = _rejection(LLAMA, {"tp": 3}, {"tp": 2}, "mooncake")
    assert "attention TP sizes 3 and 2 do not divide each other" in msg
    assert "component 'kv' cannot be sharded over prefill tp=3" in msg


def test_plan_digest_covers_dtypes_of_equal_size():
    """bfloat16 and float16 items have equal bytes; the handshake must still tell them apart."""
    from pdc.compiler.frontend import load_spec
    from pdc.compiler.layout import build_layout
    from pdc.compiler.lower import lower
    from pdc.compiler.topology import topology_from_args
    from pdc.runtime.plan_types import Plan

    plans = []
    for dtype in ("bfloat16", "float16"):
        spec = load_spec(ROOT / "specs" / "hf-llama.yaml", dtypes={"model": dtype})
        layout = build_layout(spec)
        topo, errs = topology_from_args(layout, "tp=1", "tp=1", "mooncake")
        assert errs == []
        plans.append(lower(layout, topo, spec.backends))
    bf16, fp16 = plans
    assert bf16.registration("decode", RankId(0, 0)).components == \
        fp16.registration("decode", RankId(0, 0)).components  # same names, entries, bytes
    assert dict(bf16.dtypes)["kv"] == "bfloat16" and dict(fp16.dtypes)["kv"] == "float16"
    assert bf16.digest() != fp16.digest()
    assert Plan.from_json(bf16.to_json()).digest() == bf16.digest()
