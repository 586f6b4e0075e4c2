"""pdc's threads inside a serving engine's process, and the cores they may run on.

Note [pdc threads' cores]
~~~~~~~~~~~~~~~~~~~~~~~~~
A CPU serving engine binds its compute to cores: vLLM's CPU worker applies
VLLM_CPU_OMP_THREADS_BIND to the process's main thread (GOMP_CPU_AFFINITY), and a thread
inherits the CPU mask of the thread that starts it. So every thread pdc starts from the
engine's thread (hub, transfer worker, Mooncake's and UCX's native threads) would share the
engine's one core with the engine's own loop, which spins while requests wait for their KV;
measured in `pdc vllm-demo --compare` on the 2-core box alone, pdc's write of 32-229 KB took
0.5-179 ms and a control message up to 96 ms (BENCHMARKS.md (n)). pdc's threads set their own
mask when they start, and engine libraries are made with it (`own_cores`), from the knob
`thread_cpus`: "all" (default: every CPU the process's cpuset allows; the kernel places the
mostly idle transfer threads where a core is free), "inherit" (the starter's mask, as before
2026-12-05), or a CPU list such as "2-3,6" (a core an operator set aside for transfers).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

from . import knobs


def pdc_cpus() -> set[int] | None:
    """The CPUs of the `thread_cpus` knob; None: leave each thread's inherited mask."""
    spec = str(knobs.get("thread_cpus")).strip()
    if spec == "inherit" or not hasattr(os, "sched_setaffinity"):
        return None
    if spec == "all":
        return set(range(os.cpu_count() or 1))
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        cpus = set()
    if not cpus or min(cpus) < 0:
        raise ValueError(f"PDC_THREAD_CPUS={spec!r} is not 'all', 'inherit' or a CPU list; "
                         "hint: e.g. PDC_THREAD_CPUS=2-3,6")
    return cpus


def _apply(cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(0, cpus)  # the kernel keeps the cpuset's part of them
    except OSError:
        pass  # none of them is allowed here: the inherited mask stays


def thread(target, name: str, args: tuple = ()) -> threading.Thread:
    """A daemon thread (not started) that runs on pdc's CPUs (Note [pdc threads' cores])."""
    cpus = pdc_cpus()

    def run(*a):
        if cpus:
            _apply(cpus)
        target(*a)

    return threading.Thread(target=run, args=args, name=name, daemon=True)


@contextmanager
def own_cores():
    """Native threads a library starts inside this block run on pdc's CPUs; the calling
    thread's own mask is restored after it."""
    cpus = pdc_cpus()
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    _apply(cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
