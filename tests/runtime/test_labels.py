"""runtime.labels.merge is the inverse of project for every component of every spec, and it
names the rank whose copy of replicated bytes disagrees."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from pdc.runtime.labels import merge, project

from ..compiler.planning import SPECS

LAYOUTS = [importlib.import_module(f"pdc.generated.{p.stem.replace('-', '_')}.layout").LAYOUT
           for p in SPECS]
CASES = [(layout, comp) for layout in LAYOUTS for comp in layout.components]


@pytest.mark.parametrize("layout,comp", CASES,
                         ids=[f"{lay.family}-{c.name}" for lay, c in CASES])
def test_merge_inverts_project(layout, comp):
    rng = np.random.default_rng(0)
    full = rng.integers(0, 256, (3, comp.item_bytes), dtype=np.uint8)
    for tp in (1, 2, 4, 8):
        if comp.shard is not None and not comp.shard.divisible(tp):
            continue
        parts = [np.stack([project(comp, row, tp, r) for row in full]) for r in range(tp)]
        merged, disagree = merge(comp, parts, tp)
        assert disagree == [] and np.array_equal(merged, full), tp


def _mamba2_conv():
    layout = importlib.import_module("pdc.generated.hf_mamba2.layout").LAYOUT
    return layout.component("conv")


def test_a_disagreeing_replica_is_named():
    """At TP2 both ranks hold mamba2's B and C (one group): a wrong byte in rank 1's copy is
    reported, rank 0's is kept."""
    comp = _mamba2_conv()
    full = np.random.default_rng(1).integers(0, 256, (1, comp.item_bytes), dtype=np.uint8)
    parts = [np.stack([project(comp, full[0], 2, r)]) for r in range(2)]
    parts[1][0, -1] ^= 0xFF  # the last byte of rank 1's C
    merged, disagree = merge(comp, parts, 2)
    assert disagree == [1]
    assert np.array_equal(merged, full)


def test_a_replicated_component_has_a_copy_per_rank():
    layout = importlib.import_module("pdc.generated.hf_deepseek_v3.layout").LAYOUT
    comp = layout.component("kv_nope")
    full = np.arange(comp.item_bytes, dtype=np.uint8)[None]
    parts = [full.copy() for _ in range(4)]
    parts[2][0, 5] += 1
    assert merge(comp, parts, 4)[1] == [2]


def test_merge_checks_what_it_is_given():
    comp = _mamba2_conv()
    with pytest.raises(ValueError, match="needs 2 ranks' bytes, got 1"):
        merge(comp, [np.zeros((1, comp.item_bytes_at(2)), np.uint8)], 2)
    with pytest.raises(ValueError, match="rank 1 holds"):
        merge(comp, [np.zeros((1, comp.item_bytes_at(2)), np.uint8),
                     np.zeros((1, 7), np.uint8)], 2)
