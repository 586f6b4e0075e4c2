"""`deployments` are proven by validate (lowering) and compile (lowering + coverage)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pdc.compiler.driver import build

MINI = (Path(__file__).parent / "good_specs" / "mini.yaml").read_text()


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the spec is named by the path given (Note [Spec paths])


def _errors(tmp_path, deployments: str, mode="lower") -> list[str]:
    text = MINI[:MINI.index("deployments:")] + "deployments:\n" + deployments
    (tmp_path / "mini.yaml").write_text(text)
    return [f"{d.loc.line}: {d.message}" for d in build(["mini.yaml"], deployments=mode).diagnostics]


def test_declared_deployments_are_proven(tmp_path):
    assert _errors(tmp_path, MINI[MINI.index("deployments:") + 13:], mode="prove") == []


def test_expected_accepted_but_rejected(tmp_path):
    assert _errors(tmp_path, "  - {prefill: {tp: 2}, decode: {tp: 1}, backend: nixl}\n") == [
        "42: deployment 0 (prefill tp=2 -> decode tp=1 over nixl) is rejected: backend 'nixl' "
        "does not support heterogeneous attention TP (prefill tp=2, decode tp=1): rule "
        "`hetero_attention_tp: false` at mini.yaml:40:3"]


def test_expected_rejected_but_accepted(tmp_path):
    assert _errors(tmp_path, "  - {prefill: {tp: 2}, decode: {tp: 2}, backend: nixl, "
                             "expect: rejected}\n") == [
        "42: deployment 0 (prefill tp=2 -> decode tp=2 over nixl) is accepted, but the spec "
        "expects it to be rejected"]


def test_rejected_for_another_reason(tmp_path):
    assert _errors(tmp_path, "  - {prefill: {tp: 3}, decode: {tp: 3}, backend: mooncake, "
                             "expect: rejected, error: max_pp}\n") == [
        "42: deployment 0 (prefill tp=3 -> decode tp=3 over mooncake) is rejected, but no "
        "error mentions 'max_pp': component 'kv' cannot be sharded over decode tp=3: its "
        "sub-blocks hold 2 units at mini.yaml:17:3"]


def test_page_size_of_a_deployment_reevaluates_the_spec(tmp_path):
    assert _errors(tmp_path, "  - {prefill: {tp: 1, page_size: 32}, decode: {tp: 1, "
                             "page_size: 32}}\n", mode="prove") == []
    assert _errors(tmp_path, "  - {prefill: {tp: 1, page_size: 6}, decode: {tp: 1, "
                             "page_size: 6}}\n")[0].startswith("42: deployment 0 (prefill tp=1,"
                                                               "page_size=6 -> decode tp=1,"
                                                               "page_size=6 over mooncake) is "
                                                               "rejected: constraint")
