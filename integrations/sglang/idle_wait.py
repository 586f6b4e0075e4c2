"""A scheduler turn that ran nothing waits for the next event instead of turning again.

Note [SGLang idle wait]: SGLang's scheduler loop calls `on_idle` after a turn without a batch.
Fully idle it may sleep (`--sleep-on-idle`), but while a request of the PD backend waits for
its transfer (prefill's bootstrap or inflight queue, decode's prealloc or transfer queue) it
only yields (`time.sleep(0)`) and turns again, polling the request every turn. On a host
whose cores the scheduler shares with the transfer's threads and with the other server's
processes, that loop holds a core for as long as the transfer lasts: on a 2-core box
decode's loop spun through prefill's whole forward and slowed it (BENCHMARKS.md (n)).

So an AFTER hook on `Scheduler.on_idle`, on a server of the pdc backend whose turn was not
fully idle, waits until the first of: a message for the scheduler on its request sockets
(what SGLang's own idle sleeper waits for), a state change of one of pdc's requests on this
rank (the endpoints' signal, Note [State-change signal] in pdc.runtime.endpoints), or
`sglang_idle_wait_us` (knob; 0: never wait). Whatever the loop was polling for wakes it at
once; the bound only covers what signals neither (SGLang's own timers, a queue blocked on
memory that a finishing request frees, decode's staged scatter ended by a CUDA event), and
costs such an event at most that delay. A turn with a batch never calls on_idle, so a busy
server never waits. Only a scheduler that reads the request sockets waits (rank zero of its
attention-TP group); the other ranks follow it through SGLang's broadcast of the requests
and its all-reduce of the polls. With DP attention every DP group's scheduler syncs with the
others each turn, so a group that waits can hold back another group's next turn by at most
the bound (only when no group had a batch: one that has one gives the others an idle batch).
"""

from __future__ import annotations

import os
from collections import Counter

import zmq
from pdc.runtime import knobs

HOOKED = "sglang.srt.managers.scheduler.Scheduler.on_idle"
_ATTR = "_pdc_idle_wait"  # the scheduler's IdleWait, or None where it does not wait


class Signal:
    """An eventfd that any thread sets and a poller watches (the KV manager's `changed`)."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def set(self) -> None:
        try:
            os.eventfd_write(self.fd, 1)
        except OSError:  # closed at shutdown, or the counter is full: a wake is pending
            pass

    def drain(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass


class IdleWait:
    """One scheduler's wait: its request sockets and its KV manager's signal, in one poller."""

    def __init__(self, sockets: list, signal: Signal):
        self.signal = signal
        self.poller = zmq.Poller()
        for s in sockets:
            self.poller.register(s, zmq.POLLIN)
        self.poller.register(signal.fd, zmq.POLLIN)
        self.ended_by: Counter[str] = Counter()  # "request", "signal" or "bound"

    def wait(self, bound_ms: float) -> str:
        """Wait for a request, a signal or `bound_ms`; returns which came."""
        ready = dict(self.poller.poll(bound_ms))
        if self.signal.fd in ready:
            self.signal.drain()
            why = "signal"
        else:
            why = "request" if ready else "bound"
        self.ended_by[why] += 1
        return why


def idle_wait_of(scheduler) -> IdleWait | None:
    """The scheduler's IdleWait, made at its first idle turn; None where it must not wait: not
    the pdc backend, not rank zero (no request socket), or an ingress that is no socket."""
    waiter = getattr(scheduler, _ATTR, False)
    if waiter is not False:
        return waiter
    waiter = None
    backend = getattr(getattr(scheduler, "transfer_backend", None), "value", None)
    queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None) or getattr(
        scheduler, "disagg_decode_prealloc_queue", None)
    signal = getattr(getattr(queue, "kv_manager", None), "changed", None)
    requests = getattr(scheduler, "recv_from_tokenizer", None)
    rpc = getattr(getattr(scheduler, "ipc_channels", None), "recv_from_rpc", None)
    if backend == "pdc" and isinstance(signal, Signal) and isinstance(requests, zmq.Socket):
        waiter = IdleWait([s for s in (requests, rpc) if isinstance(s, zmq.Socket)], signal)
    setattr(scheduler, _ATTR, waiter)
    return waiter


def after_on_idle(result, scheduler, *args, **kwargs):
    """After a turn that ran nothing: wait while a pdc transfer is pending (see the Note)."""
    bound_us = knobs.get("sglang_idle_wait_us")
    if bound_us <= 0:
        return None
    waiter = idle_wait_of(scheduler)
    if waiter is not None and not scheduler.is_fully_idle():
        waiter.wait(bound_us / 1000.0)
    return None


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOKED, after_on_idle, HookType.AFTER)
