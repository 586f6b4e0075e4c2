"""Two spec-language extensions made for real model families (docs/spec-language.md):

- `dtypes`: dtype names of a spec's own (`model: float32`), overridable per run like params
  (a model served in float32 or bfloat16 keeps its float32 SSM state);
- `unit` as a list: one shard-unit size per sub-block (Mamba2's conv channels [x | B | C]
  are sharded by head in x and by group, of another size, in B and C).
"""

from __future__ import annotations

import numpy as np
import pytest
from pdc.compiler.coverage import prove
from pdc.compiler.diagnostics import SpecErrors
from pdc.compiler.frontend import load_spec, parse_spec_text
from pdc.compiler.layout import build_layout
from pdc.runtime.labels import project
from pdc.runtime.plan_types import Segment

from .planning import ROOT, plan_for

QWEN3 = ROOT / "specs" / "hf-qwen3-next.yaml"
MAMBA2 = ROOT / "specs" / "hf-mamba2.yaml"


# ~~~ dtypes ~~~


def test_a_dtype_override_changes_the_items_that_follow_it():
    f32 = build_layout(load_spec(QWEN3))
    bf16 = build_layout(load_spec(QWEN3, dtypes={"model": "bfloat16"}))
    assert [(c.name, c.dtype, c.item_bytes) for c in f32.components] == [
        ("kv", "float32", 4 * 2 * 16 * 4), ("gdn_conv", "float32", 128 * 4 * 4),
        ("gdn_ssm", "float32", 4 * 16 * 16 * 4)]
    assert [(c.name, c.dtype, c.item_bytes) for c in bf16.components] == [
        ("kv", "bfloat16", 4 * 2 * 16 * 2), ("gdn_conv", "bfloat16", 128 * 4 * 2),
        ("gdn_ssm", "float32", 4 * 16 * 16 * 4)]
    assert bf16.component("gdn_conv").shard.inner_bytes == 4 * 2


def test_overriding_an_undeclared_dtype_name_is_an_error():
    with pytest.raises(SpecErrors) as info:
        load_spec(ROOT / "specs" / "qwen38.yaml", dtypes={"model": "bfloat16"})
    assert "cannot override dtype 'model': the spec does not declare it in `dtypes`" \
        in str(info.value)


def test_the_generated_layout_names_the_dtype_as_written():
    text = (ROOT / "generated" / "hf_qwen3_next" / "layout.py").read_text()
    assert "# item: [conv_dim, conv_kernel] = [128, 4] model = float32, 2048 bytes" in text
    assert "# item: [lin_v_heads, head_k_dim, head_v_dim] = [4, 16, 16] float32, 4096 bytes" \
        in text


# ~~~ one unit size per sub-block ~~~


def test_mamba2_conv_geometry():
    s = build_layout(load_spec(MAMBA2)).component("conv").shard
    assert (s.group_units, s.unit_elems, s.unit_sizes, s.axis_elems) == \
        ((4, 1, 1), (32, 16, 16), (32, 16, 16), 160)
    # TP2: two heads of x, and B and C whole (one group: replicated)
    assert s.local_units(2, 1) == ((0, 2), (0, 3), (1, 0), (2, 0))
    assert [s.unit_offset(g, u) for g, u in s.local_units(2, 1)] == [64, 96, 128, 144]
    assert s.local_axis(2) == 96


def test_mamba2_conv_segments_tp2_to_tp1():
    _, plan = plan_for(MAMBA2, {"tp": 2}, {"tp": 1})
    row = 4 * 4  # one channel: conv_kernel float32 columns
    segs = {lk.prefill.tp: e.segments for lk in plan.links for e in lk.entries
            if e.component == "conv" and e.layer_id == 0}
    # rank 0: x heads 0-1, then B and C as the elected source; rank 1: x heads 2-3 only
    assert segs == {0: (Segment(0, 0, 64 * row), Segment(64 * row, 128 * row, 32 * row)),
                    1: (Segment(0, 64 * row, 64 * row),)}


@pytest.mark.parametrize("p,d", [(1, 1), (2, 1), (1, 2), (4, 1), (1, 4), (2, 4), (4, 2)])
def test_per_sub_block_units_are_proven(p, d):
    for spec in (MAMBA2, QWEN3):
        layout, plan = plan_for(spec, {"tp": p}, {"tp": d})
        assert prove(layout, plan) == []


REAL_MAMBA2 = """
family: mamba2-2p7b
params: {heads: 80, head_dim: 64, d_state: 128, n_groups: 1, conv_dim: 5376}
layers: {count: 1, pattern: [ssm]}
components:
  conv:
    layers: all
    index: slot
    item: {shape: [conv_dim, 3], dtype: bfloat16}
    tp: {shard: conv_dim, groups: [heads * head_dim, n_groups * d_state, n_groups * d_state],
         unit: UNIT}
"""


def test_one_unit_size_cannot_express_real_mamba2():
    """mamba2-2.7b: head_dim 64, d_state 128, n_groups 1. With one unit (64, their gcd) B
    and C would be 2 units each and TP2 would split them between ranks; per sub-block they
    are 1 unit each and TP2 replicates them, as engines do."""
    def conv(unit: str):
        spec = parse_spec_text(REAL_MAMBA2.replace("UNIT", unit), "<mamba2-2p7b>")
        return build_layout(spec).component("conv")

    gcd, per_block = conv("64"), conv("[head_dim, d_state, d_state]")
    assert gcd.shard.group_units == (80, 2, 2) and per_block.shard.group_units == (80, 1, 1)
    full = np.arange(per_block.item_bytes)
    row = 3 * 2
    b_block = full[5120 * row:5248 * row]
    assert project(per_block, full, 2, 1)[-256 * row:-128 * row].tolist() == b_block.tolist()
    assert project(gcd, full, 2, 1)[-128 * row:-64 * row].tolist() == \
        b_block[64 * row:].tolist()  # rank 1 would hold only the second half of B

