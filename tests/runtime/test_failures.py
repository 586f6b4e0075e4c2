"""Failure semantics, in one process: abort with drain-ack, quarantine, generations, late
senders, deadlines, caps, peer death and restart, checksums and hostile input.

A manual engine holds writes in flight until the test releases them, so every race of the
abort protocol can be set up on purpose (see failure_tools). Note [Failure semantics] in
runtime/endpoints/__init__.py states what is checked here.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from pdc.runtime import knobs
from pdc.runtime import wire as W
from pdc.runtime.control import BootstrapServer
from pdc.runtime.endpoints import REG_ROOM, Faults, KVPoll, PageState
from pdc.runtime.hub import Hub

from .failure_tools import (
    R0,
    Family,
    Gate,
    ManualEngine,
    Pair,
    fill,
    send_all,
    tight_knobs,
    values,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]


def start(pair, room, pages, slot, value, gen=0, dpages=None, dslot=None):
    """A request: prefill items hold `value`, decode items hold 0; returns (sender, receiver)."""
    dpages = pages if dpages is None else dpages
    dslot = slot if dslot is None else dslot
    fill(pair.ppools, pages, slot, value)
    fill(pair.dpools, dpages, dslot, 0)
    rv = pair.dec.receiver(room, gen)
    rv.init(dpages, 0, slot=dslot, aux_row=dslot)
    s = pair.pre.sender(room, gen)
    return s, rv


# ~~~ abort ~~~


def test_abort_acks_only_after_in_flight_writes_drained(pair):
    pair.peng.hold = True
    s, rv = start(pair, 10, [1, 2], 1, 7)
    s.send([1], 0, False, 4)
    wait_for(lambda: pair.peng.held, what="a write in flight")
    assert rv.abort(wait=False) is False
    assert (rv.poll(), rv.reason, rv.page_state) == (KVPoll.Failed, "aborted by decode",
                                                     PageState.PENDING)
    wait_for(lambda: pair.pre.rooms[10].state == KVPoll.Failed, what="prefill saw the abort")
    s.send([2], 1, True, 8, slot=1, aux_row=1)  # the last chunk, after the abort: dropped
    time.sleep(0.3)
    assert rv.page_state == PageState.PENDING  # no ack while the write is in flight
    assert s.poll() == KVPoll.Transferring  # not terminal: the source page is still read
    assert pair.peng.release() == 1
    wait_for(lambda: rv.page_state == PageState.REUSABLE, what="the drain ack")
    assert (s.poll(), s.reason) == (KVPoll.Failed, "aborted by decode")
    assert pair.peng.submitted == 1  # nothing was issued after the abort
    assert np.all(pair.dpools.view("kv", 0)[1] == 7)  # the held write landed, before the ack
    stats = pair.pre.stats()
    assert stats["aborts_with_writes_in_flight"] == 1 and stats["chunks_dropped"] == 1


def test_the_early_ack_fault_acks_an_abort_while_writes_are_in_flight(pair):
    """Note [Fault hooks]: the fault the reliability harness's sabotage run commits, set on the
    endpoint instead of patched into it; without it (above) the ack waits for the drain."""
    pair.pre.faults = Faults(ack_abort_before_drain=True)
    pair.peng.hold = True
    s, rv = start(pair, 11, [1, 2], 1, 7)
    s.send([1], 0, False, 4)
    wait_for(lambda: pair.peng.held, what="a write in flight")
    rv.abort(wait=False)  # (the early ack may already be back when it returns)
    wait_for(lambda: rv.page_state == PageState.REUSABLE, what="the early ack")
    assert len(pair.peng.held) == 1  # acked although its write is still in flight
    assert s.poll() == KVPoll.Transferring  # prefill carries on: nothing ended its use
    assert pair.pre.stats().get("aborts", 0) == 0
    pair.peng.release()


def test_abort_without_ack_quarantines_the_pages(pair):
    pair.peng.hold = True
    s, rv = start(pair, 11, [3], 1, 7)
    send_all(s, [3], 1)
    wait_for(lambda: pair.peng.held, what="a write in flight")
    t0 = time.monotonic()
    assert rv.abort() is False  # waits abort_ack_timeout_s (0.6 s), then quarantines
    assert 0.5 < time.monotonic() - t0 < 10.0  # the 0.6 s ack timeout (slack for a busy box)
    assert rv.quarantined and rv.page_state == PageState.QUARANTINED
    pair.peng.release()  # the write lands at last and prefill acks: too late, still quarantined
    wait_for(lambda: s.poll() == KVPoll.Failed, what="prefill drained")
    time.sleep(0.1)
    assert rv.page_state == PageState.QUARANTINED
    assert pair.dec.stats()["quarantined"] == 1


def test_stuck_writes_are_acked_not_drained_and_decode_quarantines_at_once(pair):
    knobs.override(drain_timeout_s=0.2, abort_ack_timeout_s=30.0)
    pair.peng.hold = True
    s, rv = start(pair, 12, [4], 1, 7)
    send_all(s, [4], 1)
    wait_for(lambda: pair.peng.held, what="a write in flight")
    t0 = time.monotonic()
    assert rv.abort() is False
    assert time.monotonic() - t0 < 10.0  # AbortAck(drained=False), not the 30 s ack timeout
    assert rv.page_state == PageState.QUARANTINED
    assert pair.pre.stats()["drain_timeouts"] == 1
    pair.peng.release()


def test_success_racing_an_abort(pair):
    gate = Gate(pair.dec.hub)  # decode does not see prefill's Success yet
    s, rv = start(pair, 13, [5], 1, 7)
    send_all(s, [5], 1)
    wait_for(lambda: s.poll() == KVPoll.Success, what="prefill Success")
    assert rv.abort(wait=False) is False  # decode aborts, its Success still on the way
    gate.open()
    wait_for(lambda: rv.page_state == PageState.REUSABLE, what="the ack")
    assert (rv.poll(), rv.reason) == (KVPoll.Failed, "aborted by decode")
    assert s.poll() == KVPoll.Success  # prefill's outcome stands; the abort only got an ack
    assert pair.pre.stats().get("failed", 0) == 0


def test_decode_abort_before_prefill_starts_fails_the_late_sender(pair):
    fill(pair.dpools, [6], 2, 0)
    rv = pair.dec.receiver(14, 0)
    rv.init([6], 0, slot=2, aux_row=2)
    assert rv.abort() is True  # prefill has nothing in flight: acked at once
    s = pair.pre.sender(14, 0)  # prefill's scheduler gets to the request only now
    assert (s.poll(), s.reason) == (KVPoll.Failed, "aborted by decode")
    send_all(s, [6], 2)  # dropped
    time.sleep(0.05)
    assert pair.peng.submitted == 0
    assert pair.pre.stats()["late_senders"] == 1


def test_decode_cancel_before_init_frees_the_prefill_room_at_once(pair):
    """A decode request that ended before it named its pages (vLLM: aborted while waiting to
    be scheduled) tells prefill, whose sender ends now instead of at its room timeout."""
    s = pair.pre.sender(15, 0)
    send_all(s, [3], 1)  # prefill has the KV and waits for decode's request
    rv = pair.dec.receiver(15, 0)
    rv.cancel()
    assert (rv.poll(), rv.reason, rv.page_state) == (KVPoll.Failed, "cancelled by decode",
                                                     PageState.REUSABLE)
    rv.release()
    wait_for(lambda: s.poll() == KVPoll.Failed, what="the cancelled sender")
    assert s.reason == "aborted by decode"
    assert pair.peng.submitted == 0
    late = pair.dec.receiver(16, 0)
    late.init([4], 0, slot=1, aux_row=1)
    with pytest.raises(ValueError, match="room 16: cancel\\(\\) after init\\(\\); use abort\\(\\)"):
        late.cancel()
    late.abort()


# ~~~ generations ~~~


def test_room_reused_with_next_generation_gets_nothing_of_the_old_one(pair):
    pair.peng.hold = True
    s0, rv0 = start(pair, 15, [1], 1, 0x11)
    send_all(s0, [1], 1)
    wait_for(lambda: pair.peng.held, what="generation 0 in flight")
    rv0.abort(wait=False)
    # Decode reuses the room at once, with other pages; prefill's next use waits for the drain.
    s1, rv1 = start(pair, 15, [2, 3], 2, 0x22, gen=1)
    send_all(s1, [2, 3], 2)
    time.sleep(0.2)
    assert rv1.poll() == KVPoll.WaitingForInput and rv0.page_state == PageState.PENDING
    pair.peng.hold = False
    pair.peng.release()
    wait_for(lambda: rv1.poll() == KVPoll.Success, what="generation 1 Success")
    assert rv0.page_state == PageState.REUSABLE and rv0.poll() == KVPoll.Failed
    assert values(pair.dpools, [2, 3], 2) == {0x22}
    assert values(pair.dpools, [1], 1) == {0x11}
    assert rv1.bytes == (2 * 4 * 128 + 2 * 288 + 64)  # generation 1's bytes only
    assert (s0.poll(), s1.poll()) == (KVPoll.Failed, KVPoll.Success)


def test_stale_generation_messages_are_ignored(pair, fam):
    s, rv = start(pair, 16, [1], 1, 7, gen=3)
    name = "prefill.dp0.pp0.tp0"
    for gen, state in ((2, KVPoll.Success), (4, KVPoll.Failed)):
        reason = "" if state == KVPoll.Success else "not yours"
        pair.dec._on_message(name, fam.wire.encode(W.Status(
            room=16, generation=gen, prefill_rank=R0, state=state, reason=reason)))
    pair.dec._on_message(name, fam.wire.encode(W.AbortAck(room=16, generation=2,
                                                          prefill_rank=R0, drained=True)))
    assert rv.poll() == KVPoll.WaitingForInput
    assert pair.dec.stats()["stale_messages"] == 3
    send_all(s, [1], 1)
    wait_for(lambda: rv.poll() == KVPoll.Success, what="Success")


def test_an_answer_before_the_request_is_ignored(pair, fam):
    """Prefill may fail a room before decode asked (its own deadline, an abort); a status
    that reaches a receiver before init() must not end it: the request gets the outcome."""
    knobs.override(prefill_room_timeout_s=0.2)
    s = pair.pre.sender(18, 0)
    wait_for(lambda: s.poll() == KVPoll.Failed, what="the prefill deadline")
    rv = pair.dec.receiver(18, 0)
    pair.dec._on_message("prefill.dp0.pp0.tp0", fam.wire.encode(W.Status(
        room=18, generation=0, prefill_rank=R0, state=KVPoll.Failed, reason="early")))
    assert rv.poll() == KVPoll.Bootstrapping
    rv.init([1], 0, slot=1, aux_row=1)
    wait_for(lambda: rv.poll() == KVPoll.Failed, what="the recorded outcome")
    assert rv.reason == ("prefill.dp0.pp0.tp0: no transfer request from decode rank(s) pp0.tp0 "
                         "within 0.2 s")
    assert rv.page_state == PageState.REUSABLE


def test_a_sender_of_an_older_generation_is_told_so(pair):
    fill(pair.dpools, [1], 1, 0)
    rv = pair.dec.receiver(17, 2)
    rv.init([1], 0, slot=1, aux_row=1)
    wait_for(lambda: 17 in pair.pre.rooms, what="the request")
    s = pair.pre.sender(17, 1)
    assert (s.poll(), s.reason) == (KVPoll.Failed, "superseded by generation 2")


# ~~~ deadlines and caps ~~~


def test_rooms_never_requested_or_never_sent_expire_with_a_reason(pair):
    knobs.override(prefill_room_timeout_s=0.3)
    s = pair.pre.sender(20, 0)
    send_all(s, [1], 1)
    wait_for(lambda: s.poll() == KVPoll.Failed, what="the prefill deadline")
    assert s.reason == "no transfer request from decode rank(s) pp0.tp0 within 0.3 s"
    fill(pair.dpools, [2], 2, 0)
    rv = pair.dec.receiver(21, 0)
    rv.init([2], 0, slot=2, aux_row=2)
    wait_for(lambda: rv.poll() == KVPoll.Failed, what="the Failed status")
    assert rv.reason == ("prefill.dp0.pp0.tp0: prefill did not send the last chunk within "
                         "0.3 s")
    assert rv.page_state == PageState.REUSABLE
    assert pair.pre.stats()["rooms"] == 0


def test_decode_deadline_aborts_and_frees_after_the_ack(pair):
    knobs.override(transfer_timeout_s=0.3)
    rv = pair.dec.receiver(22, 0)
    rv.init([1], 0, slot=1, aux_row=1)
    wait_for(lambda: rv.poll() == KVPoll.Failed, what="the decode deadline")
    assert rv.reason == "timed out after 0.3 s waiting for prefill.dp0.pp0.tp0"
    wait_for(lambda: rv.page_state == PageState.REUSABLE, what="the ack")


def test_pending_room_caps_refuse_with_reasons(pair):
    knobs.override(max_pending_rooms_per_peer=3)
    rvs = [pair.dec.receiver(30 + i, 0) for i in range(5)]
    for rv in rvs:
        rv.init([1], 0, slot=1, aux_row=1)
    wait_for(lambda: sum(rv.poll() == KVPoll.Failed for rv in rvs) == 2, what="refusals")
    assert [rv.reason for rv in rvs[3:]] == [
        "prefill.dp0.pp0.tp0: too many pending rooms from decode.dp0.pp0.tp0 (limit 3)"] * 2
    knobs.override(max_pending_rooms=3, max_pending_rooms_per_peer=100)
    rv = pair.dec.receiver(40, 0)
    rv.init([1], 0, slot=1, aux_row=1)
    wait_for(lambda: rv.poll() == KVPoll.Failed, what="refusal")
    assert rv.reason == "prefill.dp0.pp0.tp0: too many pending rooms (limit 3)"
    for rv in rvs[:3]:
        assert rv.abort() is True
    assert pair.pre.stats()["rooms"] == 0


def test_finished_rooms_are_forgotten_beyond_the_cap(pair):
    knobs.override(max_finished_rooms=4)
    for room in range(50, 60):
        s, rv = start(pair, room, [1], 1, 7)
        send_all(s, [1], 1)
        wait_for(lambda rv=rv: rv.poll() == KVPoll.Success, what="Success")
        rv.release()
    assert pair.pre.stats()["finished"] == 4


# ~~~ integrity ~~~


def test_checksum_catches_a_corrupted_destination_byte(pair):
    knobs.override(checksum=1)
    s, rv = start(pair, 60, [1, 2], 1, 7)
    send_all(s, [1, 2], 1)
    wait_for(lambda: rv.poll() == KVPoll.Success, what="Success")
    gate = Gate(pair.dec.hub)
    s, rv = start(pair, 61, [3, 4], 2, 9)
    send_all(s, [3, 4], 2)
    wait_for(lambda: s.poll() == KVPoll.Success, what="prefill Success")
    pair.dpools.view("kv", 3)[4][17] ^= 0x40  # one bit of the second page, layer 3's v
    gate.open()
    wait_for(lambda: rv.poll() == KVPoll.Failed, what="the mismatch")
    assert rv.reason.startswith("checksum mismatch on the link from prefill.dp0.pp0.tp0: "
                                "prefill wrote 0x")
    assert rv.page_state == PageState.REUSABLE  # prefill is quiet: only the content is bad


def test_checksum_required_but_missing(pair):
    s, rv = start(pair, 62, [1], 1, 7)
    knobs.override(checksum=1)  # decode checks, prefill's room was made without
    send_all(s, [1], 1)
    wait_for(lambda: rv.poll() == KVPoll.Failed, what="the refusal")
    assert rv.reason == ("prefill.dp0.pp0.tp0 sent no checksum, and this decode rank requires "
                         "one (set the checksum knob on both sides)")


def test_link_digests_agree_across_heterogeneous_tp():
    """Prefill tp=2 -> decode tp=1: each prefill rank's digest over its head slices equals
    decode's digest over the same destination bytes; a swapped pair of pages does not."""
    from pdc.runtime import integrity
    from pdc.runtime.datapath import component_pairs
    from pdc.runtime.indices import DecodeTarget, PrefillChunk
    from pdc.runtime.labels import item_labels, project
    from pdc.runtime.plan_types import RankId

    fam = Family({"tp": 2}, {"tp": 1})
    dpools = fam.pools("decode")
    target = DecodeTarget(np.array([5, 9, 2]), 4, slot=1, aux_row=3)
    chunks = [PrefillChunk(0, np.array([0, 1]), False, 8),
              PrefillChunk(2, np.array([2]), True, 10, slot=0, aux_row=0)]
    for lk in fam.plan.links_to(R0):
        p = RankId(0, lk.prefill.tp)
        ppools = fam.pools("prefill", p)
        for pos, (t, lid) in enumerate(fam.plan.registration("prefill", p).entries("kv")):
            for page in range(3):
                full = item_labels(1, 60, fam.layout.component("kv"), t, lid, page)
                ppools.view("kv", pos)[page] = project(fam.layout.component("kv"), full, 2,
                                                       p.tp)
        for comp in ("conv", "aux_first_token"):
            v = ppools.view(comp, 0)
            v[0] = np.arange(v.shape[1]) % 251
        digest = 0
        for c in chunks:
            pairs = component_pairs(fam.layout, c, target, 4)
            digest = integrity.add(digest, integrity.link_digest(60, 0, lk, ppools.view, pairs,
                                                                 "src"))
            from pdc.runtime.datapath import LocalBuffer, RemoteBuffer, build_descriptors
            local = {n: [LocalBuffer(ppools.address(n, i), b.item_bytes, b.capacity)
                         for i, b in enumerate(bs)] for n, bs in ppools.buffers.items()}
            remote = {n: [RemoteBuffer(b.layer_id, 0, dpools.address(n, i), b.item_bytes,
                                       b.capacity) for i, b in enumerate(bs)]
                      for n, bs in dpools.buffers.items()}
            d = build_descriptors(lk, local, remote, pairs)
            for a, b, k in zip(d.src.tolist(), d.dst.tolist(), d.nbytes.tolist(), strict=True):
                dpools.arena[b - dpools.base:b - dpools.base + k] = \
                    ppools.arena[a - ppools.base:a - ppools.base + k]
        dst = integrity.destination_pairs(fam.layout, target, 4, 2, 1)
        assert integrity.link_digest(60, 0, lk, dpools.view, dst, "dst") == digest
        assert integrity.link_digest(60, 1, lk, dpools.view, dst, "dst") != digest
        kv = dpools.view("kv", 0)
        kv[[9, 2]] = kv[[2, 9]]
        assert integrity.link_digest(60, 0, lk, dpools.view, dst, "dst") != digest
        kv[[9, 2]] = kv[[2, 9]]


# ~~~ peers ~~~


def test_dead_prefill_fails_its_requests_with_a_reason_then_quarantines(fam):
    tight_knobs()
    p = Pair(fam)
    try:
        p.peng.hold = True
        s, rv = start(p, 70, [1], 1, 7)
        send_all(s, [1], 1)
        wait_for(lambda: p.peng.held, what="a write in flight")
        p.pre.close()  # its control plane stops: no heartbeat, no ack
        wait_for(lambda: rv.poll() == KVPoll.Failed, what="failure detection")
        # the liveness window failed it (its reason says so), not a request deadline; no
        # wall-clock bound here: a loaded box only makes the wait longer
        assert rv.reason == "prefill peer prefill.dp0.pp0.tp0 silent for 0.6 s"
        wait_for(lambda: rv.page_state == PageState.QUARANTINED, what="quarantine")
    finally:
        p.dec.close()
        p.boot.close()
        knobs.reset()


def test_dead_decode_fails_prefill_rooms_and_a_restarted_rank_registers_again(fam):
    tight_knobs()
    p = Pair(fam)
    try:
        s, rv = start(p, 80, [1], 1, 7)
        wait_for(lambda: 80 in p.pre.rooms and p.pre.rooms[80].targets, what="the request")
        p.dec.close()
        wait_for(lambda: s.poll() == KVPoll.Failed, what="failure detection")
        assert s.reason == "decode peer decode.dp0.pp0.tp0 silent for 0.6 s"
        # A new decode process for the same rank: it replaces the old one and is served.
        p.dec = p.decode_endpoint(fam.pools("decode"))
        p.dpools = p.dec.pools
        s, rv = start(p, 81, [2], 2, 9)
        send_all(s, [2], 2)
        wait_for(lambda: rv.poll() == KVPoll.Success, what="Success after the restart")
        assert values(p.dpools, [2], 2) == {9}
        assert p.pre.stats()["reregistrations"] == 1
    finally:
        p.close()
        knobs.reset()


def test_registration_of_a_new_incarnation_fails_the_old_ones_requests(pair, fam):
    pair.peng.hold = True
    s, rv = start(pair, 90, [1], 1, 7)
    send_all(s, [1], 1)
    wait_for(lambda: pair.peng.held, what="a write in flight")
    new = pair.decode_endpoint(fam.pools("decode"))  # same rank, new process and pools
    pair.peng.release()
    wait_for(lambda: s.poll() == KVPoll.Failed, what="the old incarnation's request failed")
    assert s.reason == ("decode rank decode.dp0.pp0.tp0 registered again (restarted); "
                        "requests of its previous incarnation fail")
    new.close()


def test_decode_reconnects_to_a_restarted_prefill_rank(fam):
    tight_knobs()
    boot = BootstrapServer(1)
    p = Pair(fam, boot)
    try:
        p.pre.close()
        p.pre = type(p.pre)(fam.layout, fam.wire, fam.plan, R0, 0, p.peng, p.ppools,
                            boot.address)  # a new process for the same prefill rank
        wait_for(lambda: p.dec.stats().get("reconnects") == 1, timeout=5, what="reconnect")
        wait_for(lambda: p.pre.stats()["peers"] == 1, what="registration")
        time.sleep(0.1)
        s, rv = start(p, 101, [2], 2, 9)
        send_all(s, [2], 2)
        wait_for(lambda: rv.poll() == KVPoll.Success, what="Success with the new prefill")
    finally:
        p.close()
        knobs.reset()


class RefusingEngine(ManualEngine):
    """An engine whose first connects fail, as a transfer engine's handshake with a peer
    that is still starting (or a loaded host's timeout) does."""

    refusals = 1

    def connect(self, agent_info: bytes) -> str:
        if self.refusals > 0:
            self.refusals -= 1
            raise RuntimeError("handshake timed out")
        return super().connect(agent_info)


def test_decode_registers_again_when_a_restarted_prefill_refused_it_once(fam):
    """The restarted prefill rank answers decode's registration with a refusal (its engine
    could not reach decode's yet). The refusal must not be final, or the pair would stay
    unregistered for good, the prefill rank waiting for a decode rank that never comes: an
    unregistered decode rank hears nothing more from it (no heartbeats), so decode's silence
    verdict sends the registration again."""
    tight_knobs()
    boot = BootstrapServer(1)
    p = Pair(fam, boot)
    try:
        p.pre.close()
        p.pre = type(p.pre)(fam.layout, fam.wire, fam.plan, R0, 0, RefusingEngine(), p.ppools,
                            boot.address)
        wait_for(lambda: p.pre.stats().get("rejected_register") == 1, what="the refusal")
        wait_for(lambda: p.pre.stats()["peers"] == 1, what="registration after the refusal")
        assert p.pre.stats()["rejected_register"] == 1
        s, rv = start(p, 102, [2], 2, 9)
        send_all(s, [2], 2)
        wait_for(lambda: rv.poll() == KVPoll.Success, what="Success with the new prefill")
        assert values(p.dpools, [2], 2) == {9}
    finally:
        p.close()
        knobs.reset()


# ~~~ hostile input ~~~


def _client(address: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 2000)
    s.connect(address)
    return s


def _reason(fam, sock) -> str:
    m = fam.wire.decode(sock.recv())
    assert isinstance(m, W.Status) and m.state == KVPoll.Failed, m
    return m.reason


@pytest.fixture
def small_messages_pair(fam):
    tight_knobs(max_message_bytes=1 << 16)  # read when the sockets are made
    p = Pair(fam)
    yield p
    p.close()
    knobs.reset()


def test_hostile_messages_are_refused_with_reasons(small_messages_pair, fam):
    pair = small_messages_pair
    addr = pair.pre.hub.address
    c = _client(addr)
    c.send(b"junk")
    assert _reason(fam, c) == "malformed message: header: truncated: 4 bytes, but a header " \
                              "alone is 24"
    hb = W.Heartbeat(side=W.PeerSide.DECODE, rank=R0, sequence=1, monotonic_ns=1)
    c.send(W.encode(hb, fam.wire.fingerprint ^ 1, fam.wire.wire_components))
    assert _reason(fam, c).startswith("malformed message: header.fingerprint: peer's spec "
                                      "fingerprint is ")
    good = fam.wire.encode(W.TransferRequest(room=7, generation=0, decode_rank=R0,
                                             dst_page_ids=np.arange(2), slot=0, aux_row=0))
    c.send(good[:-3])
    assert _reason(fam, c).startswith("malformed message: header.body_length: truncated")
    c.send(good)
    assert _reason(fam, c) == "room 7: this connection did not register as decode rank pp0.tp0"
    c.send(fam.wire.encode(W.Abort(room=7, generation=0, decode_rank=R0)))
    assert _reason(fam, c) == ("abort refused: room 7: this connection did not register as "
                               "decode rank pp0.tp0")
    c.send(fam.wire.encode(W.Status(room=1, generation=0, prefill_rank=R0,
                                    state=KVPoll.Success)))
    assert _reason(fam, c) == "unexpected message: a decode rank does not send Status"
    c.send(fam.wire.encode(W.TransferRequest(room=7, generation=0, decode_rank=W.RankId(0, 5),
                                             dst_page_ids=np.arange(2))))
    assert _reason(fam, c) == "decode rank pp0.tp5 has no link to prefill rank pp0.tp0"
    reg = fam.wire.decode(pair.dec._reg_payload)
    for change, why in (
            ({"dp_group": 9}, "decode dp group 9 does not exist (the plan has 1)"),
            ({"page_size": 8}, "page size differs: prefill 4, decode 8"),
            ({"side": W.PeerSide.PREFILL}, "only decode ranks register with a prefill rank"),
            ({"agent_info": b"other"}, None)):
        fields = {f: getattr(reg, f) for f in reg.__dataclass_fields__}
        fields.update(change)
        c.send(fam.wire.encode(W.Register(**fields)))
        m = fam.wire.decode(c.recv())
        assert m.room == REG_ROOM
        if why is not None:
            assert m.reason == why
    # The last one was a valid registration of the decode rank from another connection (and
    # engine peer): it replaced the real one. The real decode rank registers again below.
    big = _client(addr)
    big.send(b"\0" * ((1 << 16) + 1))  # over max_message_bytes: ZeroMQ drops the connection
    time.sleep(0.1)
    assert pair.pre.stats().get("rejected_malformed", 0) == 3
    big.close(0)
    c.close(0)
    pair.dec.close()
    pair.dec = pair.decode_endpoint(pair.fam.pools("decode"))
    pair.dpools = pair.dec.pools
    s, rv = start(pair, 8, [1], 1, 5)
    send_all(s, [1], 1)
    wait_for(lambda: rv.poll() == KVPoll.Success, what="service goes on")
    st = pair.pre.stats()
    assert st["handler_errors"] == 0 and st.get("worker_errors", 0) == 0


def test_a_reply_flood_does_not_stall_the_control_thread(pair, fam):
    """Thousands of bad messages, each answered: the hub must neither block on its own
    replies nor starve its timers, and real requests go on."""
    c = _client(pair.pre.hub.address)
    for _ in range(5000):
        c.send(b"x")
    s, rv = start(pair, 9, [1], 1, 5)
    send_all(s, [1], 1)
    wait_for(lambda: rv.poll() == KVPoll.Success, timeout=10, what="service during a flood")
    wait_for(lambda: pair.pre.stats().get("rejected_malformed", 0) == 5000, timeout=10,
             what="every bad message answered")
    c.close(0)


def test_hub_sends_from_its_own_thread_never_block(fam):
    """A handler answering on the hub thread never blocks on a full socket: 20000 answers
    with a queue depth of 1000 must not deadlock."""
    knobs.override(control_queue_depth=1000)
    got = []

    def handler(peer, payload):
        for _ in range(20):
            hub.send(peer, payload)
        got.append(1)

    hub = Hub(handler, bind=True)
    c = _client(hub.address)
    for _ in range(1000):
        c.send(b"ping")
    wait_for(lambda: len(got) == 1000, timeout=10, what="all handled")
    n = 0
    while True:
        try:
            c.recv(zmq.NOBLOCK)
            n += 1
        except zmq.Again:
            if n > 0:
                break
            time.sleep(0.05)
    assert n > 0
    hub.close()
    c.close(0)
    knobs.reset()


def test_knobs_doc_is_generated_from_the_declarations():
    assert (REPO / "docs" / "knobs.md").read_text() == knobs.markdown(), \
        "docs/knobs.md is stale: python -m pdc.runtime.knobs > docs/knobs.md"
    for k in knobs.KNOBS.values():
        assert k.doc and k.unit, k.name
