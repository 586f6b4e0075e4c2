"""The request state machines and the peer-liveness model as pure data (runtime/endpoints/
states.py, Note [Request states]; runtime/endpoints/liveness_model.py, Note [Peer liveness]), checked
directly: no endpoint, no thread, no clock."""

from __future__ import annotations

import pytest
from pdc.runtime.endpoints import KVPoll, PageState
from pdc.runtime.endpoints.liveness_model import LISTEN_SLACK_S, Liveness
from pdc.runtime.endpoints.states import (
    TERMINAL,
    TRANSITIONS,
    advanced,
    page_state,
    sender_poll,
)

B, W, T, S, F = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring,
                 KVPoll.Success, KVPoll.Failed)


def test_every_state_has_its_moves_and_only_success_and_failed_end():
    assert set(TRANSITIONS) == set(KVPoll)
    assert TERMINAL == {S, F}
    for state, to in TRANSITIONS.items():
        assert all(t > state for t in to if t != F)  # only forward ...
        assert (F in to) == (state not in TERMINAL)  # ... and anything open may fail


@pytest.mark.parametrize("state,to,want", [
    (B, W, W), (B, T, T), (W, T, T), (T, S, S), (W, F, F),
    (T, W, T),  # a late report never takes a request back
    (W, W, W),  # nor does a repeated one
    (S, F, S), (F, S, F), (F, W, F),  # terminal states stay
])
def test_advanced_moves_only_along_the_table(state, to, want):
    assert advanced(state, to) == want


def test_pages_are_in_use_until_the_request_ends():
    for state in (B, W, T):
        assert page_state(state, requested=True, quarantined=True, quiet=set(),
                          expected={"p0"}) == PageState.IN_USE


@pytest.mark.parametrize("state,requested,quarantined,quiet,want", [
    (S, True, False, set(), PageState.REUSABLE),
    (F, False, False, set(), PageState.REUSABLE),  # nothing was asked: nothing can land
    (F, True, False, {"p0"}, PageState.PENDING),  # p1 may still write
    (F, True, False, {"p0", "p1"}, PageState.REUSABLE),
    (F, True, True, {"p0", "p1"}, PageState.QUARANTINED),  # quarantine is for good
    (S, True, True, set(), PageState.QUARANTINED),
])
def test_page_state_of_an_ended_request(state, requested, quarantined, quiet, want):
    got = page_state(state, requested=requested, quarantined=quarantined, quiet=quiet,
                     expected={"p0", "p1"})
    assert got == want


@pytest.mark.parametrize("retired,in_flight,issued,want", [
    (False, True, True, T),  # writes in flight: the source pages are still read
    (False, False, True, T),  # issued, the drain not yet acknowledged
    (False, False, False, W),  # nothing issued yet
    (True, False, True, F),  # retired: drained, so Failed shows
])
def test_a_failed_sender_shows_failed_only_once_retired(retired, in_flight, issued, want):
    assert sender_poll(F, retired=retired, in_flight=in_flight, issued=issued) == want


def test_a_sender_that_did_not_fail_shows_its_state():
    for state in (B, W, T, S):
        assert sender_poll(state, retired=False, in_flight=True, issued=True) == state


def _ticks(lv, start: float, end: float, dead_after: float, step: float = 0.05) -> list:
    """Tick every `step` s from start to end (a control thread that runs); the peers that died."""
    died, n = [], 0
    while start + n * step <= end + 1e-9:
        stalled, now_dead = lv.tick(start + n * step, dead_after)
        assert not stalled
        died += now_dead
        n += 1
    return died


def test_a_silent_peer_dies_once_and_revives_when_heard():
    lv = Liveness()
    lv.add("a", 0.0)
    lv.add("b", 0.0)
    assert _ticks(lv, 0.05, 0.95, 1.0) == []
    lv.heard("b", 0.95)
    assert _ticks(lv, 1.0, 1.5, 1.0) == ["a"]  # silent for more than 1 s of listening
    assert _ticks(lv, 1.55, 1.8, 1.0) == []  # dead already: reported once
    assert lv.dead == {"a"}
    assert lv.heard("a", 1.9) is True  # revived
    assert lv.heard("a", 2.0) is False
    assert lv.dead == set()


def test_a_stall_of_this_process_gives_every_peer_a_fresh_window():
    lv = Liveness()
    lv.add("a", 0.0)
    assert lv.tick(0.1, 1.0) == (False, [])
    assert lv.tick(5.0, 1.0) == (True, [])  # 4.9 s without a tick: nobody could be heard
    assert lv.max_stall_s == pytest.approx(4.9)
    assert _ticks(lv, 5.05, 5.95, 1.0) == []
    assert _ticks(lv, 6.0, 6.1, 1.0) == ["a"]  # now it has really been silent


def test_a_held_control_thread_does_not_count_as_a_peer_s_silence():
    # Heard at 0, then the thread is held 4.5 s (under dead_after, so not a stall of the
    # process): the peer's messages of that time wait in the socket. Of the gap only
    # LISTEN_SLACK_S counts, so the peer is still 0.35 s from its 5 s of silence.
    lv = Liveness()
    lv.add("a", 0.0)
    assert _ticks(lv, 0.05, 0.5, 5.0) == []
    assert lv.tick(5.0, 5.0) == (False, [])  # wall time 5 s after it was last heard
    assert lv.last_heard["a"] == pytest.approx(5.0 - 0.5 - LISTEN_SLACK_S)
    lv.heard("a", 5.02)  # the queued heartbeats, read at the next poll
    assert _ticks(lv, 5.05, 9.9, 5.0) == []


def test_a_peer_is_found_dead_even_when_every_tick_is_late():
    # A thread held 0.5 s at every tick listens LISTEN_SLACK_S of each: a dead peer is found
    # after about dead_after / LISTEN_SLACK_S such ticks instead of never (the first tick has
    # no gap before it: 0.5 s, then 0.25 s per tick, past 5 s at the 20th tick).
    lv = Liveness()
    lv.add("a", 0.0)
    died_at = None
    for n in range(1, 100):
        _, died = lv.tick(n * 0.5, 5.0)
        if died:
            died_at = n * 0.5
            break
    assert died_at == pytest.approx(10.0)


def test_a_forgotten_or_unknown_peer_is_not_tracked():
    lv = Liveness()
    lv.add("old", 0.0)
    lv.forget("old")
    assert lv.heard("old", 1.0) is False and lv.heard("never", 1.0) is False
    assert lv.tick(10.0, 1.0) == (False, []) and lv.last_heard == {}
