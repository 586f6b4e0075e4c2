"""Knobs that list their values refuse others, and both endpoints refuse to start on any bad
knob (Note [Knobs checked at start])."""

from __future__ import annotations

import pytest
from pdc.runtime import knobs
from pdc.runtime.endpoints import DecodeEndpoint, PrefillEndpoint

from ..compiler.planning import plan_for
from .test_backend_check import LLAMA, refused_at_start


def test_choices_come_from_the_unit():
    assert knobs.choices(knobs.KNOBS["graph_input"]) == ("copy", "kernel", "mapped")
    assert knobs.choices(knobs.KNOBS["staging_graphs"]) == ("0", "1")
    assert knobs.choices(knobs.KNOBS["endpoint_cpus"]) == ()
    assert knobs.choices(knobs.KNOBS["transfer_timeout_s"]) == ()


def test_a_listed_value_passes_and_another_is_refused(monkeypatch):
    monkeypatch.setenv("PDC_GRAPH_INPUT", "mapped")
    assert knobs.get("graph_input") == "mapped"
    monkeypatch.setenv("PDC_GRAPH_INPUT", "kernal")
    with pytest.raises(ValueError) as e:
        knobs.get("graph_input")
    assert str(e.value) == ("PDC_GRAPH_INPUT='kernal' is not one of copy, kernel, mapped "
                            "(default kernel)")
    monkeypatch.setenv("PDC_STAGING_GRAPHS", "2")
    with pytest.raises(ValueError) as e:
        knobs.get("staging_graphs")
    assert str(e.value) == "PDC_STAGING_GRAPHS=2 is not one of 0, 1 (default 1)"


def test_an_override_is_checked_too():
    knobs.override(checksum=3)
    try:
        with pytest.raises(ValueError) as e:
            knobs.get("checksum")
    finally:
        knobs.reset("checksum")
    assert str(e.value) == "knobs.override(checksum=...)=3 is not one of 0, 1 (default 0)"


def test_errors_gathers_every_bad_knob(monkeypatch):
    assert knobs.errors() == []
    monkeypatch.setenv("PDC_GRAPH_INPUT", "kernal")
    monkeypatch.setenv("PDC_TRANSFER_TIMEOUT_S", "soon")
    assert knobs.errors() == [
        "PDC_TRANSFER_TIMEOUT_S='soon' is not a valid s value (default 60.0)",
        "PDC_GRAPH_INPUT='kernal' is not one of copy, kernel, mapped (default kernel)",
    ]


@pytest.mark.parametrize("endpoint", [PrefillEndpoint, DecodeEndpoint])
def test_an_endpoint_refuses_to_start_on_a_bad_knob(endpoint, monkeypatch):
    monkeypatch.setenv("PDC_GRAPH_INPUT", "kernal")
    monkeypatch.setenv("PDC_STAGING_COPIES", "numpy")
    layout, plan = plan_for(LLAMA, {"tp": 1}, {"tp": 1}, backend="local")
    assert refused_at_start(endpoint, layout, plan) == (
        "PDC_GRAPH_INPUT='kernal' is not one of copy, kernel, mapped (default kernel); "
        "PDC_STAGING_COPIES='numpy' is not one of auto, torch, kernels (default auto); "
        "hint: fix or unset these (docs/knobs.md lists each knob's values)")
