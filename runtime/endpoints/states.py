"""The request state machines as data: pure functions of a request's state, no threads, no
locks, no I/O (Note [Request states]). The endpoints hold the state and call these under their
lock; tests/runtime/test_request_states.py checks them directly.

Note [Request states]: a request's state on one rank is a KVPoll, in progress order:
Bootstrapping < WaitingForInput < Transferring < Success, and Failed. `TRANSITIONS` lists where
each state may go: only forward, and from any state that is not terminal to Failed; Success and
Failed go nowhere. Every event that reports a state (a Status from a peer, a TransferRequest, the
first write) moves a request with `advanced`, so a late or repeated event never takes it back.
Whether its decode pages may be reused is a second, derived state (`page_state`), and what a
prefill sender reports is a view of its state that hides a failure until its writes drained
(`sender_poll`).
"""

from __future__ import annotations

from .common import KVPoll, PageState

B, W, T, S, F = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring,
                 KVPoll.Success, KVPoll.Failed)

# state -> the states it may move to (Note [Request states])
TRANSITIONS: dict[KVPoll, frozenset[KVPoll]] = {
    B: frozenset({W, T, S, F}),
    W: frozenset({T, S, F}),
    T: frozenset({S, F}),
    S: frozenset(),
    F: frozenset(),
}
TERMINAL = frozenset(s for s, to in TRANSITIONS.items() if not to)


def advanced(state: KVPoll, to: KVPoll) -> KVPoll:
    """The state after an event that says `to`: `to` where TRANSITIONS allows the move, else
    `state` unchanged (an older or repeated report, or a request already terminal)."""
    return to if to in TRANSITIONS[state] else state


def page_state(state: KVPoll, *, requested: bool, quarantined: bool, quiet: set,
               expected: set) -> PageState:
    """May a decode request's pages go to another request (Note [Failure semantics])?

    `requested`: its TransferRequests went out; `quiet`: the prefill ranks that will not write
    any more (Success, Failed, or a drained AbortAck); `expected`: every prefill rank it asked.
    """
    if state not in TERMINAL:
        return PageState.IN_USE
    if quarantined:
        return PageState.QUARANTINED
    if state == S or not requested or quiet >= expected:
        return PageState.REUSABLE
    return PageState.PENDING


def sender_poll(state: KVPoll, *, retired: bool, in_flight: bool, issued: bool) -> KVPoll:
    """What a prefill sender reports: a failed use that has not retired (its writes may still
    be in flight, or the drain not yet acknowledged) reads as not terminal, so the serving
    engine does not reuse the source pages early (Note [Failure semantics])."""
    if state == F and not retired:
        return T if in_flight or issued else W
    return state
