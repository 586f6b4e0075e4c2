"""Per-layer streaming on the prefill endpoint, in one process (tiny family: layers 0 and 2
carry conv slots, 1 and 3 KV pages, the aux row is request-wide).

The events here are test doubles of a CUDA event (`query()` only). `pdc demo --stream` runs
streaming over Mooncake and NIXL in separate processes (tests/runtime/test_e2e.py).
"""

from __future__ import annotations

import time

from pdc.runtime.endpoints import KVPoll

from .failure_tools import fill, values, wait_for


class Event:
    """What the endpoint needs of a CUDA event: query() -> has the GPU passed it?"""

    def __init__(self, error: Exception | None = None):
        self.done = False
        self.error = error

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.done


def _start(pair, room: int):
    fill(pair.ppools, [1, 2], 1, 9)
    fill(pair.dpools, [1, 2], 1, 0)
    rv = pair.dec.receiver(room)
    rv.init([1, 2], 0, slot=1, aux_row=1)
    s = pair.pre.sender(room)
    s.send([1, 2], 0, True, 8, slot=1, aux_row=1, stream=True)
    return s, rv


def _settle() -> None:
    time.sleep(0.15)  # many worker rounds (poll_sleep_s is 1 ms)


def test_layers_leave_once_their_events_complete_in_forward_order(pair):
    s, rv = _start(pair, 40)
    e0, e1, e2, e_end = Event(), Event(), Event(), Event()
    pair.pre.layer_done(0, e0)
    _settle()
    assert pair.peng.submitted == 0  # the GPU has not finished layer 0
    e0.done = True
    wait_for(lambda: pair.peng.submitted == 1, what="layer 0's write")
    pair.pre.layer_done(1, e1)
    pair.pre.layer_done(2, e2)
    e2.done = True  # layer 2 is done, but an earlier layer's event is not: wait for it
    _settle()
    assert pair.peng.submitted == 1
    e1.done = True
    wait_for(lambda: pair.peng.submitted >= 2 and s.stats.bytes > 0, what="layers 1 and 2")
    pair.pre.layer_done(3)
    pair.pre.forward_done(e_end)
    _settle()
    assert rv.poll() != KVPoll.Success  # the request-wide aux row waits for forward_done
    e_end.done = True
    wait_for(lambda: rv.poll() == KVPoll.Success, what="Success after forward_done")
    assert values(pair.dpools, [1, 2], 1) == {9}


def test_a_failing_event_fails_the_requests_it_covers(pair):
    s, rv = _start(pair, 41)
    pair.pre.layer_done(0, Event(RuntimeError("CUDA error: an illegal memory access")))
    wait_for(lambda: rv.poll() == KVPoll.Failed, what="the failure")
    assert s.reason == ("the forward's event for this layer failed: RuntimeError('CUDA "
                        "error: an illegal memory access')")
    assert pair.peng.submitted == 0
    assert values(pair.dpools, [1, 2], 1) == {0}
