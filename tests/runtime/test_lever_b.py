"""Cached-prefix early send (Note [Cached-prefix early send]) with streaming on: the pages prefill
holds from its prefix cache leave before the forward's first layer, the computed pages per
layer, and decode ends with every byte."""

from __future__ import annotations

import numpy as np
from pdc.runtime.endpoints import KVPoll

from .failure_tools import fill, values, wait_for

PAGE = 4


def test_cached_pages_leave_before_the_forward(pair):
    pages, slot = [3, 4, 5, 6, 7], 1
    fill(pair.ppools, pages, slot, 0x3C)
    fill(pair.dpools, pages, slot, 0)
    rv = pair.dec.receiver(11, 0)
    rv.init(pages, 0, slot=slot, aux_row=slot)
    s = pair.pre.sender(11)
    s.send_cached(pages[:3], 3 * PAGE)  # prefill's own prefix cache held 12 tokens
    s.send(pages[3:], 3, True, 5 * PAGE, slot=slot, aux_row=slot, stream=True)
    # Before any layer_done: the cached chunk is written, the streamed one waits.
    wait_for(lambda: s.stats.batches >= 1, what="the cached chunk's write")
    cached_written = pair.dpools.view("kv", 0)[pages[:3]].copy()
    assert set(np.unique(cached_written).tolist()) == {0x3C}
    assert set(np.unique(pair.dpools.view("kv", 0)[pages[3:]]).tolist()) == {0}
    assert rv.poll() != KVPoll.Success
    for layer in sorted(pair.fam.layout.all_layer_ids):
        pair.pre.layer_done(layer)
    pair.pre.forward_done()
    wait_for(lambda: rv.poll() == KVPoll.Success, what="success")
    assert values(pair.dpools, pages, slot) == {0x3C}
