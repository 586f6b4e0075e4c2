"""Exact index lengths through the endpoints (Note [Exact page coverage]): a request whose pages
do not cover the prompt, or whose slot is missing, fails with both counts; other requests are
untouched and the next one succeeds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pdc.runtime import knobs
from pdc.runtime.endpoints import KVPoll

from .failure_tools import Family, Pair, fill, tight_knobs, values, wait_for

PAGE = 4


def _failed_with(s, rv, reason_part: str) -> None:
    wait_for(lambda: s.poll() == KVPoll.Failed, what="prefill failure")
    wait_for(lambda: rv.poll() == KVPoll.Failed, what="decode failure")
    assert reason_part in s.reason, s.reason
    assert reason_part in rv.reason, rv.reason


def _healthy_request(pair, room: int) -> None:
    pages, slot = [9, 10], 3
    fill(pair.ppools, pages, slot, 0x77)
    fill(pair.dpools, pages, slot, 0)
    rv = pair.dec.receiver(room, 0)
    rv.init(pages, 0, slot=slot, aux_row=slot)
    pair.pre.sender(room).send(pages, 0, True, 2 * PAGE, slot=slot, aux_row=slot)
    wait_for(lambda: rv.poll() == KVPoll.Success, what="the next request")
    assert values(pair.dpools, pages, slot) == {0x77}


def test_decode_allocated_more_pages_than_the_prompt(pair):
    fill(pair.ppools, range(5), 0, 0x21)
    fill(pair.dpools, range(7), 0, 0)
    rv = pair.dec.receiver(1, 0)
    rv.init(list(range(7)), 0, slot=0, aux_row=0)
    s = pair.pre.sender(1)
    s.send(list(range(5)), 0, True, 5 * PAGE, slot=0, aux_row=0)
    _failed_with(s, rv, "bad index: the prompt has 5 pages (20 tokens) but decode allocated 7")
    _healthy_request(pair, 2)


def test_chunks_that_skip_pages_0_to_2(pair):
    rv = pair.dec.receiver(3, 0)
    rv.init(list(range(5)), 0, slot=0, aux_row=0)
    s = pair.pre.sender(3)
    s.send([3, 4], 3, True, 5 * PAGE, slot=0, aux_row=0)
    _failed_with(s, rv, "bad index: prefill sent 2 of the 5 pages decode needs (positions 0..4); missing 0-2")
    _healthy_request(pair, 4)


def test_a_chunk_in_the_middle_never_sent(pair):
    rv = pair.dec.receiver(5, 0)
    rv.init(list(range(4)), 0, slot=0, aux_row=0)
    s = pair.pre.sender(5)
    s.send([0], 0, False, PAGE)
    s.send([2, 3], 2, True, 4 * PAGE, slot=0, aux_row=0)
    _failed_with(s, rv, "missing 1")


def test_pages_below_the_decode_prefix_are_not_needed_and_not_touched(pair):
    # Decode holds 8 tokens (pages 0-1); prefill sends the whole prompt, pages 2-3 are written.
    fill(pair.ppools, range(4), 0, 0x42)
    fill(pair.dpools, range(4), 0, 0)
    fill(pair.dpools, [0, 1], 0, 0x99)  # decode's own prefix pages
    rv = pair.dec.receiver(6, 0)
    rv.init(list(range(4)), 2 * PAGE, slot=0, aux_row=0)
    pair.pre.sender(6).send(list(range(4)), 0, True, 4 * PAGE, slot=0, aux_row=0)
    wait_for(lambda: rv.poll() == KVPoll.Success, what="success")
    kv0 = {int(x) for pos in range(len(pair.dpools.buffers["kv"]))
           for x in set(pair.dpools.view("kv", pos)[[0, 1]].ravel().tolist())}
    kv1 = {int(x) for pos in range(len(pair.dpools.buffers["kv"]))
           for x in set(pair.dpools.view("kv", pos)[[2, 3]].ravel().tolist())}
    assert kv0 == {0x99} and kv1 == {0x42}


def test_prefill_learns_the_decode_prefix_and_sends_only_the_rest(pair):
    # The SGLang way (Note [SGLang decode prefix] in pdc.integrations.sglang.conn): decode
    # holds pages 0-1 (8 tokens), prefill reads that off the sender once decode's request
    # arrived and sends pages 2-3 only, at their absolute positions.
    fill(pair.ppools, range(4), 0, 0x43)
    fill(pair.dpools, range(6), 0, 0)
    rv = pair.dec.receiver(8, 0)
    s = pair.pre.sender(8)
    assert s.decode_prefix_tokens == 0  # nothing from decode yet
    rv.init([0, 0, 4, 5], 2 * PAGE, slot=0, aux_row=0)  # page 0 stands at the prefix positions
    wait_for(lambda: s.poll() == KVPoll.WaitingForInput, what="decode's request")
    assert s.decode_prefix_tokens == 2 * PAGE
    s.send([2, 3], 2, True, 4 * PAGE, slot=0, aux_row=0)
    wait_for(lambda: rv.poll() == KVPoll.Success, what="success")
    def kv(pages):
        return {int(x) for pos in range(len(pair.dpools.buffers["kv"]))
                for x in set(pair.dpools.view("kv", pos)[pages].ravel().tolist())}

    assert (kv([4, 5]), kv([0])) == ({0x43}, {0})  # the stand-in page 0 was not written


def test_state_sent_whole_on_a_prefix_hit():
    """`on_prefix_hit: send` (draft-style KV): every page of it is written, the paged KV
    below the prefix is not."""
    fam = Family(spec_path=str(Path(__file__).parent / "specs" / "tiny_prefix.yaml"))
    tight_knobs()
    pair = Pair(fam)
    try:
        pages = list(range(4))
        fill(pair.ppools, pages, 0, 0x42)
        fill(pair.dpools, pages, 0, 0)
        for comp in ("kv", "draft_kv"):
            for pos in range(len(pair.dpools.buffers[comp])):
                pair.ppools.view(comp, pos)[pages] = 0x42
                pair.dpools.view(comp, pos)[pages] = 0
                pair.dpools.view(comp, pos)[[0, 1]] = 0x99  # decode's prefix pages
        rv = pair.dec.receiver(1, 0)
        rv.init(pages, 2 * PAGE, slot=0, aux_row=0)
        pair.pre.sender(1).send(pages, 0, True, 4 * PAGE, slot=0, aux_row=0)
        wait_for(lambda: rv.poll() == KVPoll.Success, what="success")

        def held(comp, ids):
            return {int(x) for pos in range(len(pair.dpools.buffers[comp]))
                    for x in set(pair.dpools.view(comp, pos)[ids].ravel().tolist())}

        assert held("kv", [0, 1]) == {0x99} and held("kv", [2, 3]) == {0x42}
        assert held("draft_kv", [0, 1, 2, 3]) == {0x42}
        # The chunks must now cover page 0 on: skipping the prefix fails the request.
        rv = pair.dec.receiver(2, 0)
        rv.init(pages, 2 * PAGE, slot=0, aux_row=0)
        s = pair.pre.sender(2)
        s.send([2, 3], 2, True, 4 * PAGE, slot=0, aux_row=0)
        _failed_with(s, rv, "prefill sent 2 of the 4 pages decode needs (positions 0..3); missing 0-1")
    finally:
        pair.close()
        knobs.reset()


def test_missing_slot_fails_with_its_reason(pair):
    rv = pair.dec.receiver(7, 0)
    rv.init([0, 1], 0, slot=0, aux_row=0)
    s = pair.pre.sender(7)
    s.send([0, 1], 0, True, 2 * PAGE, aux_row=0)
    _failed_with(s, rv, "bad index: component 'conv' needs a slot on both sides")
    _healthy_request(pair, 8)


# ~~~ slot-valued state (Note [Slot-valued state]) ~~~


def test_remap_kv_slots_maps_token_positions_and_keeps_padding():
    from pdc.runtime.indices import remap_kv_slots

    src = np.array([7, 2, 9], np.int64)  # prefill pages of positions 0, 1, 2
    dst = np.array([4, 5, 0], np.int64)  # decode pages of the same positions
    got = remap_kv_slots(np.array([7 * 4 + 1, 9 * 4 + 3, -1, 2 * 4]), src, dst, 4, "'t'")
    assert got.tolist() == [4 * 4 + 1, 0 * 4 + 3, -1, 5 * 4]
    with pytest.raises(Exception) as e:
        remap_kv_slots(np.array([3 * 4]), src, dst, 4, "'t'")
    assert str(e.value) == ("'t' value 12 names prefill page 3, which is not one of the 3 pages "
                            "prefill sent for the request")


@pytest.mark.parametrize("stream", [False, True])
def test_topk_slots_arrive_as_decode_slots_and_prefill_row_is_restored(stream):
    fam = Family(spec_path=str(Path(__file__).parent / "specs" / "tiny_topk.yaml"))
    tight_knobs()
    pair = Pair(fam)
    try:
        src_pages, dst_pages, row = [6, 2, 9], [1, 8, 3], 1
        seed = np.array([6 * PAGE + 1, 9 * PAGE + 2, 2 * PAGE, -1, -1, 9 * PAGE, 6 * PAGE + 3,
                         -1], np.int32)
        pair.ppools.view("topk_seed", 0)[row] = seed.view(np.uint8)
        pair.dpools.view("topk_seed", 0)[row] = 0
        rv = pair.dec.receiver(1, 0)
        rv.init(dst_pages, 0, slot=row, aux_row=row)
        s = pair.pre.sender(1)
        s.send(src_pages, 0, True, 3 * PAGE, slot=row, aux_row=row, stream=stream)
        if stream:
            for layer in sorted(fam.layout.all_layer_ids):
                pair.pre.layer_done(layer)
            pair.pre.forward_done()
        wait_for(lambda: rv.poll() == KVPoll.Success, what="success")
        wait_for(lambda: s.poll() == KVPoll.Success, what="prefill success")
        got = pair.dpools.view("topk_seed", 0)[row].view(np.int32)
        assert got.tolist() == [1 * PAGE + 1, 3 * PAGE + 2, 8 * PAGE, -1, -1, 3 * PAGE,
                                1 * PAGE + 3, -1]
        wait_for(lambda: pair.ppools.view("topk_seed", 0)[row].view(np.int32).tolist()
                 == seed.tolist(), what="prefill's row restored")
        # A slot outside the request's pages fails that request with the value named.
        bad = seed.copy()
        bad[0] = 12 * PAGE
        pair.ppools.view("topk_seed", 0)[row] = bad.view(np.uint8)
        rv = pair.dec.receiver(2, 0)
        rv.init(dst_pages, 0, slot=row, aux_row=row)
        s = pair.pre.sender(2)
        s.send(src_pages, 0, True, 3 * PAGE, slot=row, aux_row=row)
        _failed_with(s, rv, "bad index: 'topk_seed' value 48 names prefill page 12, which is "
                            "not one of the 3 pages prefill sent for the request")
    finally:
        pair.close()
        knobs.reset()
