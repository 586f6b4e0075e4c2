"""Where pdc's threads compute: knob `endpoint_cpus`.

Note [Endpoint CPUs]: a serving engine binds its processes to cores (SGLang binds a TP-1
server's OpenMP thread; pdc's demos give each server role a core, Note [Server cores] in
pdc/serving/sglang_harness.py), and every thread a process starts inherits the mask of the
thread that starts it. pdc's threads (the hub, the transfer worker, the engine's completion and
peer threads, Mooncake's transport threads, ZeroMQ's I/O thread) are started by the thread that
makes the engine or opens an endpoint, so by default they compute on the serving engine's
cores, beside its forward. With `endpoint_cpus` set, the integrations make the engine inside
`on_endpoint_cpus()` (the calling thread moves to those CPUs while it starts the engine's
threads, then moves back) and open endpoints on a thread placed there for good
(`place_this_thread`), so every thread pdc starts computes on those CPUs and the serving
engine's cores keep its own work. Linux only; elsewhere, or where the mask is refused (a
cgroup that does not allow the CPUs), the threads stay where they are and a warning says so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from . import knobs


def parse_cpus(text: str) -> set[int]:
    """"0,2-3" -> {0, 2, 3}; "" -> set(). ValueError names the bad part."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"endpoint_cpus: {part!r} is not a CPU number or range (e.g. "
                             "'1' or '2-3')") from None
        if first < 0 or last < first:
            raise ValueError(f"endpoint_cpus: {part!r} is not a range of CPU numbers")
        cpus.update(range(first, last + 1))
    return cpus


def endpoint_cpus() -> set[int]:
    return parse_cpus(knobs.get("endpoint_cpus"))


def _set(cpus: set[int]) -> bool:
    try:
        os.sched_setaffinity(0, cpus)  # 0: the calling thread (Linux masks are per thread)
        return True
    except (OSError, ValueError) as exc:
        print(f"pdc: endpoint_cpus {sorted(cpus)} refused ({exc}); pdc's threads stay on "
              f"CPUs {sorted(os.sched_getaffinity(0))}", file=sys.stderr)
        return False


def place_this_thread() -> None:
    """Moves the calling thread, and every thread it starts from now on, to the knob's CPUs
    (Note [Endpoint CPUs]); nothing when the knob is empty."""
    cpus = endpoint_cpus()
    if cpus and hasattr(os, "sched_setaffinity"):
        _set(cpus)


@contextmanager
def on_endpoint_cpus() -> Iterator[None]:
    """The calling thread on the knob's CPUs for the block (threads it starts there keep
    them), on its own CPUs again after."""
    cpus = endpoint_cpus()
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    moved = _set(cpus)
    try:
        yield
    finally:
        if moved:
            os.sched_setaffinity(0, before)

