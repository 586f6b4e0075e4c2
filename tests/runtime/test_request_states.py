"""The request state machines and the peer-liveness model as pure data (runtime/endpoints/
states.py, Note [Request states]; runtime/endpoints/liveness.py, Note [Peer liveness]), checked
directly: no endpoint, no thread, no clock."""

from __future__ import annotations

import pytest
from pdc.runtime.endpoints import KVPoll, PageState
from pdc.runtime.endpoints.liveness import Liveness
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


def test_a_silent_peer_dies_once_and_revives_when_heard():
    lv = Liveness()
    lv.add("a", 0.0)
    lv.add("b", 0.0)
    assert lv.tick(0.5, 1.0) == (False, [])
    lv.heard("b", 1.2)
    assert lv.tick(1.4, 1.0) == (False, ["a"])
    assert lv.tick(1.8, 1.0) == (False, [])  # dead already: reported once
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
    assert lv.tick(5.6, 1.0) == (False, [])
    assert lv.tick(6.2, 1.0) == (False, ["a"])  # now it has really been silent


def test_a_forgotten_or_unknown_peer_is_not_tracked():
    lv = Liveness()
    lv.add("old", 0.0)
    lv.forget("old")
    assert lv.heard("old", 1.0) is False and lv.heard("never", 1.0) is False
    assert lv.tick(10.0, 1.0) == (False, []) and lv.last_heard == {}
