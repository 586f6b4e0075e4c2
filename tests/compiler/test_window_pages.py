"""Window components in a page space of their own (Note [Window pages] in runtime/indices.py):
what decode's prefix cache does to them (`on_prefix_hit`), from spec to layout."""

from __future__ import annotations

import pytest
from pdc.compiler.diagnostics import SpecErrors
from pdc.compiler.frontend import load_spec, parse_spec_text
from pdc.compiler.layout import build_layout

from .planning import ROOT

SWA = ROOT / "specs" / "sglang-swa.yaml"
MINI = ROOT / "tests" / "compiler" / "good_specs" / "mini.yaml"


def _window(on_prefix_hit: str = "") -> str:
    """mini.yaml with a window component of the attention layers."""
    extra = f"    on_prefix_hit: {on_prefix_hit}\n" if on_prefix_hit else ""
    return MINI.read_text().replace("components:\n", (
        "components:\n"
        "  win:\n"
        "    layers: {kind: attn}\n"
        "    index: {window: 24}\n"
        f"{extra}"
        "    item: {shape: [page_size, kv_heads, head_dim], dtype: bfloat16}\n"
        "    tp: {shard: kv_heads}\n"), 1)


def test_a_window_is_sent_whole_unless_the_spec_says_skip():
    assert build_layout(parse_spec_text(_window(), "w.yaml")).component("win").on_prefix_hit \
        == "send"
    for policy in ("skip", "send"):
        layout = build_layout(parse_spec_text(_window(policy), "w.yaml"))
        assert layout.component("win").on_prefix_hit == policy
    # page state keeps its default
    assert build_layout(parse_spec_text(_window(), "w.yaml")).component("kv").on_prefix_hit \
        == "skip"


def test_the_sglang_swa_spec_declares_the_sliding_layers_window():
    layout = build_layout(load_spec(SWA))
    swa, kv = layout.component("swa_kv"), layout.component("kv")
    assert (swa.index, swa.window_tokens, swa.layer_ids, swa.tensors, swa.on_prefix_hit,
            swa.send) == ("window", 32, (0, 2), ("k", "v"), "skip", "last_chunk")
    assert (kv.index, kv.layer_ids, kv.on_prefix_hit) == ("page", (1, 3), "skip")
    assert swa.item_bytes == kv.item_bytes == 16 * 2 * 16 * 2


def test_on_prefix_hit_on_slot_state_is_still_an_error():
    text = _window().replace("    index: slot\n", "    index: slot\n    on_prefix_hit: skip\n", 1)
    with pytest.raises(SpecErrors) as e:
        parse_spec_text(text, "w.yaml")
    assert [d.message for d in e.value.diagnostics] == [
        "component 'conv' sets `on_prefix_hit` but is indexed by slot"]
