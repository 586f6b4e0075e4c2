"""Note [Spinning scheduler]: SGLang's scheduler loop sleeps only when it is fully idle; while
a transfer of the PD backend is pending it turns without pause, polling the request's sender
(prefill) or receiver (decode) every turn. On a host where the scheduler shares its core with
the transfer's threads (the transfer engine's workers, pdc's control and transfer threads),
those threads then run only when the kernel preempts the loop, and a write that takes 0.6 ms
between two engines alone takes ~5 ms inside the servers (BENCHMARKS.md (n)).

So a poll of a pending transfer notices when the loop turns without work: a turn starts when
a transfer already polled in this turn is polled again, and a turn that began less than
TURN_S after the previous one is a spinning loop. Then the poll sleeps `sglang_spin_yield_us`
(knob), once per turn, which gives the core to the transfer's threads and costs a loop that
has nothing else to do only that delay; a loop that runs forwards turns slower than TURN_S
and never sleeps. 0 (the knob's default) never sleeps.
"""

from __future__ import annotations

import time

from pdc.runtime import knobs

TURN_S = 0.001  # a loop turning faster than this has no forward in it


class SpinGate:
    """One per KV manager (its scheduler's loop); the poll of a pending sender or receiver
    calls turn() with a key of its own."""

    def __init__(self) -> None:
        self.polled: set[int] = set()  # the senders or receivers polled in the current turn
        self.turn_started = 0.0
        self.slept = 0  # turns that slept

    def turn(self, key: int) -> None:
        yield_us = knobs.get("sglang_spin_yield_us")
        if yield_us <= 0:  # off (the default): no bookkeeping on the scheduler's loop
            return
        if key not in self.polled:
            self.polled.add(key)
            return
        spinning = time.monotonic() - self.turn_started < TURN_S
        self.polled = {key}
        if spinning:
            time.sleep(yield_us / 1e6)
            self.slept += 1
        self.turn_started = time.monotonic()
