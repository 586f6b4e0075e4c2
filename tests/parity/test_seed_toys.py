"""The seed toys (pdc/verify) in one process: their cache is the spec's state, it survives
the placement rules (items, every TP share, merge) bit for bit, a decode from a rebuilt cache
continues exactly, and every state tensor changes the logits when it is corrupted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pdc.compiler.family import family_of  # noqa: E402
from pdc.compiler.frontend import load_spec  # noqa: E402
from pdc.runtime.labels import merge, project  # noqa: E402

from pdc.verify import models  # noqa: E402
from pdc.verify.hf_adapter import (  # noqa: E402
    bound_entries,
    check_binding,
    from_items,
    positions,
    to_items,
)
from pdc.verify.recipe import parity_specs  # noqa: E402

SPECS = Path(__file__).resolve().parents[2] / "specs"
BINDINGS = {f: b for f, b in parity_specs(SPECS).items() if b.kind == "toy"}
SEEDS = sorted(BINDINGS)
TORCH_THREADS = 1  # set per test by conftest.py


def _toy(family: str):
    b = BINDINGS[family]
    spec = load_spec(SPECS / f"{family}.yaml", dict(b.params), deployments=False)
    layout = family_of(spec).layout
    return b, layout, models.build(b, layout, spec.env, "float32")


def _prefill(model, n: int, chunk: int):
    prompt = torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(1))
    bounds = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]
    *_, (cache, logits) = model.chunked_prefill(prompt, bounds)
    return cache, logits


def _page(layout) -> int:
    return next(c.shape[0] for c in layout.components if c.name in ("kv", "mla_kv"))


@pytest.mark.parametrize("family", SEEDS)
def test_toy_state_is_the_specs_state(family):
    b, layout, model = _toy(family)
    page = _page(layout)
    for n in (page + 3, 2 * page + 1):
        cache, _ = _prefill(model, n, page)
        rows = model.describe_state(model.export_state(cache))
        assert check_binding(layout, b, rows, n, page) == []


@pytest.mark.parametrize("family", SEEDS)
def test_toy_state_round_trips_through_every_tp_share(family):
    b, layout, model = _toy(family)
    page = _page(layout)
    n = 2 * page + 3
    state = model.export_state(_prefill(model, n, page)[0])
    for comp, _, _, key in bound_entries(layout, b):
        full = to_items(comp, state[key], n, page)
        assert full.shape == (len(positions(comp, n, page)), comp.item_bytes)
        for tp in (1, 2, 4):
            parts = [np.stack([project(comp, row, tp, r) for row in full]) for r in range(tp)]
            merged, disagree = merge(comp, parts, tp)
            assert disagree == []
            back = from_items(comp, merged, n, page)
            assert back.dtype == state[key].dtype and torch.equal(back, state[key]), (key, tp)


@pytest.mark.parametrize("family", SEEDS)
def test_decode_from_a_rebuilt_cache_continues_exactly(family):
    _, layout, model = _toy(family)
    page = _page(layout)
    n = 2 * page + 3
    cache, logits = _prefill(model, n, page)
    rebuilt = model.import_state(model.export_state(cache), n)
    first = model.token_of(logits)
    t1, l1 = model.greedy_decode(cache, first, 4)
    t2, l2 = model.greedy_decode(rebuilt, first, 4)
    assert torch.equal(t1, t2) and torch.equal(l1.view(torch.int32), l2.view(torch.int32))


@pytest.mark.parametrize("family", SEEDS)
def test_every_state_tensor_changes_the_first_decode_step(family):
    """Poison one tensor at a time (0xA5, as decode's pools before a transfer): the first
    decode step's logits (target | draft) differ from the intact cache's, for every tensor
    of every layer and every request-wide row."""
    _, layout, model = _toy(family)
    page = _page(layout)
    n = 2 * page + 3
    cache, _ = _prefill(model, n, page)
    state = model.export_state(cache)
    _, want = model.greedy_decode(model.import_state(state, n), 0, 1)
    same = []
    for key, x in state.items():
        bad = dict(state)
        bad[key] = x.clone()
        bad[key].view(torch.uint8).fill_(0xA5)
        _, got = model.greedy_decode(model.import_state(bad, n), 0, 1)
        if torch.equal(got.view(torch.int32), want.view(torch.int32)):
            same.append(key)
    assert same == []
