"""Note [Demo load]: the demos' `--load N`, N processes that keep the host's cores busy.

The latency a serving user sees depends on what else runs beside the engines: on the 2-core
box, pdc's TTFT lead over the engines' own connectors turned into a loss while other work
kept the cores busy (issue 29), and the first "loaded" rows of BENCHMARKS.md (n) ran beside
a CI suite, whose load comes in bursts of a minute or two (a server starting) that fall on
one backend's repetition and not the next. `--load N` runs N processes that compute without
pause from before the reference server starts until the table is printed, at the servers'
own priority, each bound to one core, round robin over the cores this process may use: every
core carries the same load, so every backend of a run, and every run with the same N, shares
its cores alike. Unbound, Linux's balancer put both of two such processes on the core the
servers left free: the plain server alone, on the last core (Note [Server cores]), ran
beside none of them most of the time (27 of 40 samples, 2026-12-07) while a PD pair, on
both cores, shared each with one. Each process ends itself once its parent is gone
(it checks every 0.2 s), so a demo killed mid-run leaves none behind."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

# Computes in 0.2 s slices and ends when the process that started it is gone (its parent
# then changes). The parent's pid comes as an argument: one killed while Python was still
# starting here would otherwise be read as the new parent.
_SPIN = """\
import os, sys, time
parent = int(sys.argv[1])
while os.getppid() == parent:
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        pass
"""

_busy = 0  # processes of the active `busy_cores`, for the tables' titles


@contextmanager
def busy_cores(processes: int):
    """Run `processes` busy processes, one core each round robin, for the duration of the
    block (0: none)."""
    global _busy
    cores = sorted(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid())],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(processes)]
    for k, p in enumerate(procs):
        os.sched_setaffinity(p.pid, {cores[k % len(cores)]})
    _busy = processes
    try:
        yield procs
    finally:
        _busy = 0
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def busy_text() -> str:
    """What a table's title adds after the load average while `busy_cores` runs."""
    return f", {_busy} busy process(es) beside (--load {_busy})" if _busy else ""
