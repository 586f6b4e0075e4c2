"""Staging rings (Note [Staging ring] in runtime/staging_ring.py): a staged request whose
region does not fit decode's arena moves piece by piece through a few slots of it.

In one process with the tiny family, as tests/runtime/test_staged.py: prefill tp=1 -> decode
tp=2 (Split) and prefill tp=2 -> decode tp=1. The oracle is the direct path: the same request
moved both ways must leave the same bytes. tests/runtime/test_e2e.py runs rings over Mooncake
between processes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pdc.runtime import knobs, staging, staging_ring
from pdc.runtime import wire as W
from pdc.runtime.control import BootstrapServer
from pdc.runtime.endpoints import DecodeEndpoint, KVPoll, PageState, PrefillEndpoint
from pdc.runtime.plan_types import RankId

from .failure_tools import R0, Family, Gate, ManualEngine, tight_knobs, wait_for
from .test_staged import PAGE, POISON, Split, _done, _pools_param

# A request of 3 pages needs a 1056-byte region per link (Note [Staging layout]); a ring takes
# at most half of a 1024-byte arena: 4 slots of 128 (one item of two 64-byte kv blocks, or of
# two 48-byte conv blocks: 9 pieces per link for pages [0, 1] + [2] and the slot).
ARENA, SLOT = 1024, 128
PIECES = 9


def _ring_knobs(**extra) -> None:
    tight_knobs(staged_min_descriptors=0, checksum=1, **extra)
    knobs.override(peer_dead_after_s=30.0)  # gated hubs below hear no heartbeats a while


@pytest.fixture(scope="module")
def fam():
    return Family({"tp": 1}, {"tp": 2})


@pytest.fixture(params=[_pools_param(k) for k in ("host", "torch-cpu", "kernels-cpu", "cuda",
                                                  "cuda-torch", "cuda-one")])
def ring_split(fam, request):
    _ring_knobs(staging_ring_slot_bytes=SLOT)
    s = Split(fam, decode_arena_bytes=ARENA, devices=request.param)
    yield s
    s.close()
    knobs.reset()


def _same_as_direct(split, staged_pages, direct_pages, slots):
    for t in range(2):
        got = split.items(t, staged_pages, slots[0])
        want = split.items(t, direct_pages, slots[1])
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        assert not any(np.all(a == POISON) for a in got)


def _whole(*eps) -> bool:
    return all(ep.arena.whole() for ep in eps)


def test_a_request_larger_than_the_arena_moves_through_a_ring(ring_split):
    split = ring_split
    _, rvs = split.request(40, [9, 3, 11], 2)
    wait_for(lambda: _done(rvs), what="the ring request")
    assert [rv.links for rv in rvs] == [(1, 1), (1, 1)]
    for d in split.decs:
        st = d.stats()
        assert (st["staging_rings"], st.get("staging_full", 0)) == (1, 0)
        assert st.get("checksum_mismatches", 0) == 0
    assert split.pre.stats().get("stale_ring_messages", 0) == 0
    assert _whole(split.pre, *split.decs)
    # The pieces went through the copy kernels exactly where the staged path has them.
    for ep in (split.pre, *split.decs):
        assert (ep.launches is not None and len(ep.launches.pieces) > 0) == split.kernels
    # The oracle: the same request over the direct path.
    knobs.override(staged_min_descriptors=10**9)
    _, direct = split.request(41, [4, 12, 6], 3)
    wait_for(lambda: _done(direct), what="the direct request")
    _same_as_direct(split, [9, 3, 11], [4, 12, 6], (2, 3))


def test_pieces_wait_for_a_freed_slot_and_are_counted(fam):
    _ring_knobs(staging_ring_slot_bytes=SLOT, staging_ring_slots=1)
    split = Split(fam, decode_arena_bytes=ARENA)
    try:
        gates = [Gate(d.hub) for d in split.decs]  # RingFilled held: no slot comes back
        s, rvs = split.request(42, [9, 3, 11], 2)
        wait_for(lambda: split.pre.stats().get("staging_ring_waits", 0) == 2,
                 what="each link's second piece waiting")
        # Per link: the aux row (a whole item: direct path) and one piece in the only slot.
        assert split.peng.submitted == 4
        assert [rv.poll() for rv in rvs] == [KVPoll.WaitingForInput] * 2
        # Only a slot prefill announced and decode has not freed yet can come back.
        t = split.pre.rooms[42].targets[RankId(0, 0)]
        split.pre._on_ring_freed(t.identity, W.RingFreed(room=42, generation=0,
                                                         decode_rank=RankId(0, 0), slot=1))
        assert split.pre.stats()["stale_ring_messages"] == 1
        assert t.staged.ring.free == []
        for g in gates:
            g.open()
        wait_for(lambda: _done(rvs), what="the request")
        assert split.peng.submitted == 2 * (PIECES + 1)  # one write per piece, and the aux row
        assert split.pre.stats()["staging_ring_waits"] >= 2
        assert _whole(split.pre, *split.decs)
        for d in split.decs:
            assert d.stats().get("checksum_mismatches", 0) == 0
    finally:
        split.close()
        knobs.reset()


def test_an_abort_mid_ring_frees_the_rings_once_prefill_drained(fam):
    _ring_knobs(staging_ring_slot_bytes=SLOT, staging_ring_slots=1)
    split = Split(fam, decode_arena_bytes=ARENA)
    try:
        gates = [Gate(d.hub) for d in split.decs]
        s, rvs = split.request(43, [9, 3, 11], 2)
        wait_for(lambda: split.pre.stats().get("staging_ring_waits", 0) == 2,
                 what="both rings full")
        assert not _whole(split.pre, *split.decs)
        assert rvs[0].abort(wait=False) is False  # the AbortAck is held by the gate
        for g in gates:
            g.open()  # replays the RingFilled of the failed request: ignored, not scattered
        wait_for(lambda: all(rv.page_state == PageState.REUSABLE for rv in rvs),
                 what="the drain acks")
        assert rvs[0].reason == "aborted by decode"
        assert rvs[1].reason == "prefill.dp0.pp0.tp0: aborted by decode"
        for rv in rvs:
            rv.release()
        assert _whole(*split.decs)
        wait_for(lambda: _whole(split.pre), what="prefill's gather buffers freed")
        assert s.poll() == KVPoll.Failed
    finally:
        split.close()
        knobs.reset()


def test_a_decode_that_dies_mid_ring_frees_prefill_s_ring_buffers(fam):
    _ring_knobs(staging_ring_slot_bytes=SLOT, staging_ring_slots=1)
    knobs.override(peer_dead_after_s=0.6)
    split = Split(fam, decode_arena_bytes=ARENA)
    try:
        Gate(split.decs[0].hub)  # it never answers a piece
        s, rvs = split.request(44, [9, 3, 11], 2)
        wait_for(lambda: split.pre.stats().get("staging_ring_waits", 0) >= 1,
                 what="a ring full")
        assert not _whole(split.pre)
        dead, split.decs = split.decs[0], split.decs[1:]
        dead.close()  # dies: its heartbeats stop
        wait_for(lambda: s.poll() == KVPoll.Failed, what="prefill failing the room")
        assert s.reason == "decode peer decode.dp0.pp0.tp0 silent for 0.6 s"
        wait_for(lambda: rvs[1].page_state == PageState.REUSABLE, what="the live rank's end")
        rvs[1].release()
        assert _whole(*split.decs)
        wait_for(lambda: _whole(split.pre), what="prefill's gather buffers freed")
    finally:
        split.close()
        knobs.reset()


def test_requests_share_the_arena_and_one_with_no_room_left_goes_direct(fam):
    # Rings of 256, 128, 64 and 64 bytes fill a 512-byte arena (each takes at most half of
    # what is free); the fifth request at once finds nothing and goes direct.
    _ring_knobs(staging_ring_slot_bytes=SLOT)
    split = Split(fam, decode_arena_bytes=ARENA // 2)
    try:
        gates = [Gate(d.hub) for d in split.decs]
        reqs = [split.request(50 + i, [3 * i, 3 * i + 1, 3 * i + 2], i % 4) for i in range(5)]
        for g in gates:
            g.open()
        for _, rvs in reqs:
            wait_for(lambda rvs=rvs: _done(rvs), what="every request")
        assert [rv.links for _, rvs in reqs for rv in rvs] == [(1, 1)] * 8 + [(0, 1)] * 2
        for d in split.decs:
            st = d.stats()
            assert (st["staging_rings"], st["staging_full"]) == (4, 1)
            assert st.get("checksum_mismatches", 0) == 0
        assert _whole(split.pre, *split.decs)
    finally:
        split.close()
        knobs.reset()


def test_rings_off_keep_the_direct_fallback(fam):
    _ring_knobs(staging_ring_slots=0)
    split = Split(fam, decode_arena_bytes=ARENA)
    try:
        _, rvs = split.request(54, [1, 2, 3], 1)
        wait_for(lambda: _done(rvs), what="the request")
        assert [rv.links for rv in rvs] == [(0, 1), (0, 1)]
        assert [d.stats()["staging_full"] for d in split.decs] == [1, 1]
    finally:
        split.close()
        knobs.reset()


def test_a_request_that_fits_keeps_the_whole_region(fam):
    _ring_knobs(staging_ring_slot_bytes=SLOT)
    split = Split(fam, decode_arena_bytes=4096)
    try:
        _, rvs = split.request(55, [1, 2, 3], 1)
        wait_for(lambda: _done(rvs), what="the request")
        assert [rv.links for rv in rvs] == [(1, 1), (1, 1)]
        assert [d.stats().get("staging_rings", 0) for d in split.decs] == [0, 0]
        assert split.peng.submitted == 4  # one bulk write per chunk and link
    finally:
        split.close()
        knobs.reset()


def test_streamed_layers_move_through_the_ring(fam):
    _ring_knobs(staging_ring_slot_bytes=SLOT, staging_ring_slots=2)
    split = Split(fam, decode_arena_bytes=ARENA)
    try:
        rvs = [d.receiver(56) for d in split.decs]
        for rv in rvs:
            rv.init([5, 6, 7], 0, slot=1, aux_row=1)
        s = split.pre.sender(56)
        s.send([0, 1], 0, False, 2 * PAGE, stream=True)
        for layer in range(4):
            split.pre.layer_done(layer)
        split.pre.forward_done()
        s.send([2], 2, True, 3 * PAGE - 1, slot=0, aux_row=0, stream=True)
        for layer in range(4):
            split.pre.layer_done(layer)
        split.pre.forward_done()
        wait_for(lambda: _done(rvs), what="the streamed ring request")
        assert [d.stats()["staging_rings"] for d in split.decs] == [1, 1]
        assert _whole(split.pre, *split.decs)
        knobs.override(staged_min_descriptors=10**9)
        _, direct = split.request(57, [8, 9, 10], 2)
        wait_for(lambda: _done(direct), what="the direct request")
        _same_as_direct(split, [5, 6, 7], [8, 9, 10], (1, 2))
    finally:
        split.close()
        knobs.reset()


def test_two_prefill_ranks_fill_one_decode_rank_s_rings():
    """Prefill tp=2 -> decode tp=1: one ring per link, both in the one decode arena."""
    fam = Family({"tp": 2}, {"tp": 1})
    _ring_knobs(staging_ring_slot_bytes=SLOT, staging_ring_slots=2)
    boot = BootstrapServer(2)
    ranks = [RankId(0, t) for t in range(2)]
    pengs = [ManualEngine() for _ in ranks]
    ppools = [fam.pools("prefill", r) for r in ranks]
    pres = [PrefillEndpoint(fam.layout, fam.wire, fam.plan, r, 0, e, p, boot.address)
            for r, e, p in zip(ranks, pengs, ppools, strict=True)]
    knobs.override(staging_arena_bytes=ARENA)
    dpools = fam.pools("decode")
    dec = DecodeEndpoint(fam.layout, fam.wire, fam.plan, R0, 0, ManualEngine(), dpools,
                         boot.address)
    try:
        dec.wait_ready(5)
        rng = np.random.default_rng(9)
        for p in ppools:
            p.arena[:] = rng.integers(0, 256, p.nbytes, dtype=np.uint8)
        dpools.arena[:] = POISON

        def run(room, pages, slot):
            rv = dec.receiver(room)
            rv.init(pages, 0, slot=slot, aux_row=slot)
            for pre in pres:
                s = pre.sender(room)
                s.send([0, 1], 0, False, 2 * PAGE)
                s.send([2], 2, True, 3 * PAGE - 1, slot=0, aux_row=0)
            wait_for(lambda: rv.poll() == KVPoll.Success, what=f"room {room}")
            return rv

        rv = run(60, [1, 2, 3], 1)
        assert rv.links == (2, 2)
        assert dec.stats()["staging_rings"] == 2
        assert dec.arena.whole() and all(p.arena.whole() for p in pres)
        knobs.override(staged_min_descriptors=10**9)
        assert run(61, [4, 5, 6], 2).links == (0, 2)
        for name, bufs in dpools.buffers.items():
            for pos in range(len(bufs)):
                view = dpools.view(name, pos)
                got, want = (view[[1, 2, 3]], view[[4, 5, 6]]) if name == "kv" else \
                    (view[[1]], view[[2]])
                assert np.array_equal(got, want), name
                assert not np.all(got == POISON), name
    finally:
        dec.close()
        for pre in pres:
            pre.close()
        boot.close()
        knobs.reset()


# ~~~ the pieces and the ring's size, as functions ~~~


def _blocks(fam, pages: int = 3):
    from pdc.runtime.indices import DecodeTarget

    link = fam.plan.links[0]
    t = DecodeTarget(np.arange(pages), 0, 1, -1, 1, np.zeros(0, np.int64), ())
    blocks, need = staging.link_blocks(link, staging.request_items(fam.layout, t, PAGE))
    return link, blocks, need


def test_pieces_cover_every_staged_byte_once_and_fit_their_slot(fam):
    link, blocks, need = _blocks(fam, 5)
    for slot in (64, 128, 256, 4096):
        positions = {"kv": (np.arange(5), np.arange(5)), "conv": (np.array([1]), np.zeros(1, int))}
        ps = staging_ring.pieces(blocks, link, positions, None, slot)
        assert all(p.nbytes <= slot for p in ps)
        covered = sorted((bi, p.j0 + k) for p in ps for bi in p.blocks for k in range(p.n))
        assert covered == sorted((bi, j) for bi, b in enumerate(blocks) for j in range(b.items))
        assert sum(p.nbytes for p in ps) == need


def test_a_ring_is_never_smaller_than_one_item_and_says_why_not(fam):
    _, blocks, _ = _blocks(fam)
    assert staging_ring.min_slot_bytes(blocks) == 64
    arena = staging.Arena(1024)
    # At most half of the largest free stretch each, never below one 64-byte item.
    got = [staging_ring.reserve(arena, blocks, 4, 128) for _ in range(6)]
    assert got == [(0, 4, 128), (512, 4, 64), (768, 2, 64), (896, 1, 64), (960, 1, 64),
                   "staging_full"]
    assert staging_ring.reserve(staging.Arena(1024), blocks, 4, 1 << 20) == (0, 4, 128)
    big = (dataclasses.replace(blocks[0], segment=dataclasses.replace(
        blocks[0].segment, nbytes=4096, repeat=1)),)
    assert staging_ring.reserve(staging.Arena(1024), big, 4, 128) == "staging_too_small"
