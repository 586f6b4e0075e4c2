"""Declared deployments' plans: the compact codec, the generated plans.py, and the runtime
loading them instead of lowering (Note [Compact plans] in runtime/plan_codec.py)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from pdc.runtime import family as family_module
from pdc.runtime import plan_codec
from pdc.runtime.family import Family
from pdc.runtime.lowering import lower

REPO = Path(__file__).resolve().parents[2]
WITH_PLANS = sorted(p.parent.name for p in (REPO / "generated").glob("*/plans.py"))


def test_every_family_with_deployments_has_plans():
    # Every spec in specs/ declares deployments; each family's accepted ones are generated.
    assert WITH_PLANS == sorted(p.name for p in (REPO / "generated").iterdir()
                                if (p / "layout.py").exists())


@pytest.mark.parametrize("py_name", WITH_PLANS)
def test_declared_plans_are_what_lowering_makes_at_start(py_name):
    family = Family.load(py_name)
    plans = importlib.import_module(f"pdc.generated.{py_name}.plans").PLANS
    assert plans and len(family.declared) == len(plans)
    for digest, data in plans:
        topology = plan_codec.topology_of(data)
        assert family.is_declared(topology)
        loaded = family.plan(topology)
        lowered = lower(family.layout, topology, family.backends)
        assert loaded == lowered, topology.describe()
        assert loaded.digest() == lowered.digest() == digest


def test_a_declared_topology_is_loaded_without_lowering(monkeypatch):
    family = Family.load("llama3_70b")
    declared = family.topology("tp=8", "tp=2", "mooncake")
    expected = family.plan(declared).digest()

    def no_lowering(*args, **kwargs):
        raise AssertionError("lowered at start")

    monkeypatch.setattr(family_module, "lower", no_lowering)
    assert family.is_declared(declared)
    assert family.plan(declared).digest() == expected
    # A topology the spec does not declare still lowers at start.
    other = family.topology("tp=4", "tp=2", "mooncake")
    assert not family.is_declared(other)
    with pytest.raises(AssertionError, match="lowered at start"):
        family.plan(other)


def test_a_bound_family_lowers_every_topology():
    # Declared plans were lowered at the spec's example values; a family bound to a served
    # model lowers for its own values, even at a declared topology.
    family = Family.load("vllm_llama")
    topology = family.topology("tp=2", "tp=1", "mooncake")
    assert family.is_declared(topology)
    config = dict(num_hidden_layers=3, hidden_size=512, num_attention_heads=8,
                  num_key_value_heads=8)
    bound = family.bind(config, {"page_size": 64, "kv_dtype": "bfloat16"})
    topology = bound.topology("tp=2", "tp=1", "mooncake")
    assert not bound.is_declared(topology)
    assert bound.plan(topology) == lower(bound.layout, topology, bound.backends)


@pytest.mark.parametrize("py_name,prefill,decode", [
    ("qwen38", "tp=2", "tp=1"), ("glm52", "tp=2,pp=2", "tp=1,dp=2"),
    ("llama3_70b", "tp=2,pp=2", "tp=8"), ("hf_qwen3_next", "tp=2", "tp=2")])
def test_the_codec_round_trips_plans_not_declared(py_name, prefill, decode):
    plan = Family.load(py_name).plan_for(prefill, decode, "mooncake")
    data = plan_codec.encode(plan)
    assert plan_codec.decode(data) == plan
    assert plan_codec.decode(data).digest() == plan.digest()


def test_runs_keep_constant_steps_together():
    rows = [(0, 1), (0, 2), (0, 3), (5, 0), (7, 7), (9, 14), (1, 1)]
    encoded = plan_codec.runs(rows)
    assert encoded == [[0, 1, 3, 0, 1], [5, 0, 3, 2, 7], [1, 1, 1, 0, 0]]
    assert plan_codec.expand(encoded, 2) == rows
    assert plan_codec.runs([]) == []


def test_a_plan_of_another_codec_version_is_refused():
    data = dict(plan_codec.encode(Family.load("vllm_llama").plan_for("tp=1", "tp=1",
                                                                      "mooncake")))
    with pytest.raises(plan_codec.PlanCodecError) as e:
        plan_codec.decode(dict(data, version=2))
    assert str(e.value) == ("compact plan version 2; this pdc reads 1: run `pdc compile` to "
                            "regenerate it")
    data["links"] = [[0, 0, 0, 0, [], [[9, 0, 0, 0, 0, 16384, 16384, 0, 1, 0, 0, 0, 0, 0, 0,
                                        0, 0]]]]
    with pytest.raises(plan_codec.PlanCodecError) as e:
        plan_codec.decode(data)
    assert str(e.value) == ("compact plan of 'vllm-llama' does not decode: IndexError: list "
                            "index out of range; run `pdc compile` to regenerate it")
