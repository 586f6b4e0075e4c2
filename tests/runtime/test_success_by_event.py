"""Note [Success by event]: a prefill rank whose engine exports its writes' done event sends
it with a Transferring status once a room's writes are queued, and decode's poll ends the
request when that event completes, before prefill's Success arrives. Stand-ins: the prefill
engine holds its writes (its batches stay in flight until `release()`), and hands out one
handle per batch; decode opens a handle as an event whose completion the test decides."""

from __future__ import annotations

import pytest
from pdc.runtime.endpoints import KVPoll

from .failure_tools import ManualEngine, _copy, fill, send_all, wait_for


class EventEngine(ManualEngine):
    """Held writes; `written_event` names the batch; `land()` copies the held bytes while
    the batches stay in flight for prefill."""

    def written_event(self, batch) -> bytes:
        return f"ev{id(batch)}".encode() if batch.state == 0 else b""

    def land(self) -> None:
        for _, s, d, n in self.held:
            _copy(s, d, n)


class Event:
    def __init__(self) -> None:
        self.done = False
        self.error = False

    def query(self) -> bool:
        if self.error:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done


@pytest.fixture
def event_pair(make_pair):
    def make(**extra):
        p = make_pair(EventEngine, **extra)
        p.peng.hold = True
        opened: dict[bytes, Event] = {}
        p.deng.open_written_event = lambda h: opened.setdefault(bytes(h), Event())
        return p, opened

    return make


def request(pair, room: int):
    fill(pair.ppools, [1, 2], 1, 6)
    s = pair.pre.sender(room, 0)
    send_all(s, [1, 2], 1)
    rv = pair.dec.receiver(room, 0)
    rv.init([1, 2], 0, slot=1, aux_row=1)
    wait_for(lambda: pair.peng.held, what="the write submitted and held")
    return s, rv


def test_decode_ends_the_request_at_the_event_before_prefills_success(event_pair):
    pair, opened = event_pair()
    s, rv = request(pair, 40)
    wait_for(lambda: opened, what="decode opening the written event")
    assert (rv.poll(), s.poll()) == (KVPoll.Transferring, KVPoll.Transferring)
    pair.peng.land()
    (event,) = opened.values()
    event.done = True
    assert rv.poll() == KVPoll.Success
    assert s.poll() == KVPoll.Transferring  # prefill's own write has not ended yet
    assert pair.dpools.view("kv", 0)[[1, 2]].min() == 6
    written = rv.bytes
    assert written > 0
    pair.peng.release()
    wait_for(lambda: pair.dec.counters["sources_done_twice"] == 1,
             what="prefill's Success after the event, counted once")
    assert (s.poll(), rv.poll(), rv.bytes) == (KVPoll.Success, KVPoll.Success, written)
    assert pair.pre.counters["written_events_sent"] == 1
    assert pair.dec.counters["written_events_landed"] == 1


def test_an_event_that_raises_leaves_the_request_to_prefills_success(event_pair):
    pair, opened = event_pair()
    s, rv = request(pair, 41)
    wait_for(lambda: opened, what="decode opening the written event")
    next(iter(opened.values())).error = True
    assert rv.poll() == KVPoll.Transferring
    assert pair.dec.counters["written_events_failed"] == 1
    pair.peng.release()
    wait_for(lambda: rv.poll() == KVPoll.Success, what="decode's Success from prefill's")
    assert pair.dec.counters["sources_done_twice"] == 0


def test_an_event_decode_cannot_open_leaves_the_request_to_prefills_success(event_pair):
    pair, opened = event_pair()
    pair.deng.open_written_event = lambda h: None
    s, rv = request(pair, 42)
    wait_for(lambda: pair.dec.counters["written_events_unopened"] == 1,
             what="decode refusing the written event")
    assert rv.poll() == KVPoll.Transferring
    pair.peng.release()
    wait_for(lambda: rv.poll() == KVPoll.Success, what="decode's Success from prefill's")


def test_with_the_knob_off_only_prefills_success_ends_the_request(event_pair):
    pair, opened = event_pair(success_by_event=0)
    s, rv = request(pair, 43)
    assert rv.poll() == KVPoll.WaitingForInput  # no status before Success
    pair.peng.release()
    wait_for(lambda: rv.poll() == KVPoll.Success, what="decode's Success from prefill's")
    assert (opened, pair.pre.counters["written_events_sent"]) == ({}, 0)


def test_an_engine_without_events_sends_none(fam):
    # every engine but cuda_ipc: the base class has no written event
    assert ManualEngine().written_event(object()) == b""
    assert ManualEngine().open_written_event(b"x") is None


def test_a_watched_event_wakes_decodes_caller_when_it_completes(event_pair):
    # Note [Landed wake-up]: the engine calls back once the event completes; the callback
    # only signals, and the caller's poll then ends the request.
    pair, opened = event_pair()
    watched = []
    pair.deng.watch_written = lambda ev, source, cb: watched.append((ev, source, cb)) or True
    signals = []
    pair.dec.on_change = lambda: signals.append(1)
    s, rv = request(pair, 44)
    wait_for(lambda: watched, what="decode watching the written event")
    ((event, source, callback),) = watched
    assert (source, pair.dec.counters["written_events_watched"]) == \
        (f"{id(pair.dec):x}/prefill.dp0.pp0.tp0", 1)
    before = len(signals)
    pair.peng.land()
    event.done = True
    callback()
    assert len(signals) == before + 1
    assert rv.poll() == KVPoll.Success
    pair.peng.release()


def test_an_engine_that_cannot_watch_leaves_the_event_to_the_poll(event_pair):
    pair, opened = event_pair()
    s, rv = request(pair, 45)
    wait_for(lambda: opened, what="decode opening the written event")
    assert pair.dec.counters["written_events_watched"] == 0  # ManualEngine: the base's False
    pair.peng.land()
    next(iter(opened.values())).done = True
    assert rv.poll() == KVPoll.Success
    pair.peng.release()
