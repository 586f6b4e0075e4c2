"""Note [State-change signal]: an endpoint calls `on_change` after each state change, so a
serving engine that waits on it (SGLang's idle wait) sees every change without polling. Each
test records the request's state at every call and finds the change among them."""

from __future__ import annotations

from pdc.runtime.endpoints import KVPoll

from .failure_tools import fill, send_all, wait_for


def recorder(poll):
    """An on_change that notes poll() at each call (on the endpoint's thread)."""
    seen: list[KVPoll] = []
    return seen, lambda: seen.append(poll())


def test_every_state_change_of_a_request_is_followed_by_a_signal(pair):
    fill(pair.ppools, [1, 2], 1, 9)
    fill(pair.dpools, [1, 2], 1, 0)
    rv = pair.dec.receiver(20, 0)
    s = pair.pre.sender(20, 0)
    at_prefill, pair.pre.on_change = recorder(s.poll)
    at_decode, pair.dec.on_change = recorder(rv.poll)
    rv.init([1, 2], 0, slot=1, aux_row=1)
    wait_for(lambda: KVPoll.WaitingForInput in at_prefill, what="decode's request, signalled")
    send_all(s, [1, 2], 1)
    wait_for(lambda: KVPoll.Success in at_prefill, what="prefill's Success, signalled")
    wait_for(lambda: KVPoll.Success in at_decode, what="decode's Success, signalled")
    assert rv.poll() == KVPoll.Success


def test_a_failure_is_signalled_on_both_sides(pair):
    rv = pair.dec.receiver(21, 0)
    s = pair.pre.sender(21, 0)
    at_prefill, pair.pre.on_change = recorder(s.poll)
    at_decode, pair.dec.on_change = recorder(rv.poll)
    rv.init([3], 0, slot=2, aux_row=2)
    s.abort()
    wait_for(lambda: KVPoll.Failed in at_prefill, what="prefill's failure, signalled")
    wait_for(lambda: KVPoll.Failed in at_decode, what="decode's failure, signalled")
    assert (rv.poll(), rv.reason) == (KVPoll.Failed, "prefill.dp0.pp0.tp0: aborted by prefill")
