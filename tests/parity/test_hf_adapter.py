"""pdc.verify.hf_adapter in one process: state tensors to pool items and back, TP shares cut with
runtime.labels.project and merged with runtime.labels.merge, and the binding check that
tells when a spec does not fit the model's cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from pdc.compiler.frontend import load_spec, parse_spec_text  # noqa: E402
from pdc.compiler.layout import build_layout  # noqa: E402
from pdc.runtime.labels import merge, project  # noqa: E402

from pdc.verify import hf_state as H  # noqa: E402
from pdc.verify.hf_adapter import (  # noqa: E402
    bound_entries,
    check_binding,
    from_items,
    positions,
    to_items,
)
from pdc.verify.recipe import family_recipe, parity_specs  # noqa: E402

SPECS = Path(__file__).resolve().parents[2] / "specs"
# The transformers families (the specs' `parity` blocks); the seed toys have
# tests/parity/test_seed_toys.py.
BINDINGS = {f: b for f, b in parity_specs(SPECS).items() if b.kind == "transformers"}
FAMILIES = sorted(BINDINGS)
PAGE = 4

TORCH_THREADS = 1  # set per test by conftest.py


def _layout(family: str, dtype: str = "float32", text: str | None = None):
    path = SPECS / f"{family}.yaml"
    if text is None:
        return build_layout(load_spec(path, dtypes={"model": dtype}))
    return build_layout(parse_spec_text(text, str(path), dtypes={"model": dtype}))


def _state(family: str, dtype: str, n: int):
    recipe = family_recipe(BINDINGS[family])
    model = H.build_model(recipe, getattr(torch, dtype))
    prompt = torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(1))
    state = H.export_state(recipe, model, H.prefill(model, prompt))
    rows = H.describe_state(recipe, model, state)
    return state, rows


@pytest.mark.parametrize("n", [20, 5, 9])
@pytest.mark.parametrize("family", FAMILIES)
def test_items_round_trip_through_every_tp_share(family, n):
    """state -> full items -> each rank's share -> merged -> state, bitwise, for TP 1, 2, 4."""
    layout = _layout(family)
    state, _ = _state(family, "float32", n)
    for comp, _, _, key in bound_entries(layout, BINDINGS[family]):
        full = to_items(comp, state[key], n, PAGE)
        assert full.shape == (len(positions(comp, n, PAGE)), comp.item_bytes)
        for tp in (1, 2, 4):
            parts = [np.stack([project(comp, row, tp, r) for row in full]) for r in range(tp)]
            assert all(p.shape[1] == comp.item_bytes_at(tp) for p in parts)
            merged, disagree = merge(comp, parts, tp)
            assert disagree == []
            back = from_items(comp, merged, n, PAGE)
            assert back.dtype == state[key].dtype and torch.equal(back, state[key]), (key, tp)


def test_page_rows_sit_at_absolute_positions():
    layout = _layout("hf-llama")
    state, _ = _state("hf-llama", "float32", 10)
    comp = layout.component("kv")
    items = to_items(comp, state["L1.k"], 10, PAGE)
    assert items.shape == (3, PAGE * 2 * 16 * 4)  # 10 tokens: pages 0, 1 and half of 2
    pages = torch.from_numpy(items).view(torch.float32).reshape(3, PAGE, 2, 16)
    for t in range(10):
        assert torch.equal(pages[t // PAGE, t % PAGE], state["L1.k"][t])
    assert not pages[2, 2:].any()  # the partial last page's tail is not state


def test_window_rows_sit_at_their_absolute_positions():
    """mistral keeps the last 7 tokens: after 20, positions 13..19, in the pages of
    positions 3 and 4 (tokens 12..19); row 0 of page 3 (token 12) is not state."""
    layout = _layout("hf-mistral-sw")
    comp = layout.component("kv")
    assert comp.window_tokens == 7
    state, _ = _state("hf-mistral-sw", "float32", 20)
    assert positions(comp, 20, PAGE) == [3, 4]
    items = torch.from_numpy(to_items(comp, state["L0.v"], 20, PAGE)).view(torch.float32)
    rows = items.reshape(2 * PAGE, 2, 16)
    assert not rows[0].any()
    assert torch.equal(rows[1:], state["L0.v"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_spec_fits_its_model(family, dtype):
    layout = _layout(family, dtype)
    for n in (20, 3):
        _, rows = _state(family, dtype, n)
        assert check_binding(layout, BINDINGS[family], rows, n, PAGE) == []


def _misfit(family: str, old: str, new: str, dtype: str = "float32") -> list[str]:
    text = (SPECS / f"{family}.yaml").read_text()
    assert old in text
    layout = _layout(family, dtype, text.replace(old, new))
    _, rows = _state(family, dtype, 20)
    return check_binding(layout, BINDINGS[family], rows, 20, PAGE)


def test_a_wrong_item_shape_is_named():
    errors = _misfit("hf-llama", "head_dim: 16 ", "head_dim: 8 ")
    assert errors[0] == ("component 'kv' tensor 'k' of layer 0 (L0.k): the model exports "
                         "[20, 2, 16], the spec's item is [4, 2, 8] (page-indexed, page_size 4, "
                         "20 tokens)")
    assert len(errors) == 4  # k and v of both layers


def test_one_unit_for_every_mamba2_conv_sub_block_is_named():
    """x is sharded by head (32 channels), B and C by group (16): one unit size of 16 would
    cut x into 8 units where a TP engine has 4 heads."""
    errors = _misfit("hf-mamba2", "unit: [head_dim, d_state, d_state]", "unit: d_state")
    assert errors == [
        f"component 'conv' tensor 'data' of layer {i} (L{i}.conv): the spec shards sub-blocks "
        "of 128 elements in 8 units, 16 elements in 1 units, 16 elements in 1 units; a TP "
        "engine shards 128 elements in 4 units, 16 elements in 1 units, 16 elements in 1 units"
        for i in (0, 1)]


def test_a_recurrent_state_following_the_model_dtype_is_named():
    errors = _misfit("hf-qwen3-next", "head_v_dim], dtype: float32}", "head_v_dim], dtype: model}",
                     "bfloat16")
    assert errors == [f"component 'gdn_ssm' tensor 'data' of layer {i} (L{i}.ssm): the spec "
                      "says bfloat16, the model exports float32" for i in (0, 1, 2)]


def test_a_replicated_latent_declared_sharded_is_named():
    errors = _misfit("hf-deepseek-v3", "item: {shape: [page_size, 1, rope_dim], dtype: model}\n"
                     "    tp: replicated",
                     "item: {shape: [page_size, 1, rope_dim], dtype: model}\n    tp: {shard: 2}")
    assert errors == [f"component 'k_rot' tensor 'data' of layer {i} (L{i}.k_rot): the spec says "
                      "sharded on axis 2, a TP engine keeps it replicated" for i in (0, 1)]


def test_state_no_component_carries_is_named():
    errors = _misfit("hf-qwen3-next", "layers: {kind: gdn}\n    index: slot\n    item: {shape: "
                     "[lin_v_heads", "layers: {ids: [0, 1]}\n    index: slot\n    item: {shape: "
                     "[lin_v_heads")
    assert errors == ["the model exports L2.ssm, which no bound component carries: decode "
                      "could not rebuild its cache"]
