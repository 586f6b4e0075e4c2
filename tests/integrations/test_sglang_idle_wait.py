"""Note [SGLang idle wait] (integrations/sglang/idle_wait.py): the hook on SGLang's
`Scheduler.on_idle`, on a stand-in scheduler (a unit test) with real ZeroMQ sockets and the
KV manager's real eventfd. The real servers run it by default (test_sglang_servers.py and the
other server tests; the knob's default is on)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import zmq
from pdc.integrations.sglang import idle_wait as IW
from pdc.runtime import knobs


@pytest.fixture
def sockets():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    yield pull, push
    push.close(0)
    pull.close(0)
    ctx.term()
    knobs.reset()


def scheduler(requests, *, backend="pdc", fully_idle=False, mode="decode"):
    """What the hook reads of SGLang's Scheduler: backend, KV manager, request sockets."""
    queue = SimpleNamespace(kv_manager=SimpleNamespace(changed=IW.Signal()))
    queues = {"disagg_decode_prealloc_queue" if mode == "decode" else
              "disagg_prefill_bootstrap_queue": queue}
    return SimpleNamespace(transfer_backend=SimpleNamespace(value=backend),
                           recv_from_tokenizer=requests,
                           ipc_channels=SimpleNamespace(recv_from_rpc=None),
                           is_fully_idle=lambda: fully_idle, **queues)


def test_a_state_change_ends_the_wait(sockets):
    knobs.override(sglang_idle_wait_us=60_000_000)  # only the signal can end it
    sched = scheduler(sockets[0])
    threading.Timer(0.05, sched.disagg_decode_prealloc_queue.kv_manager.changed.set).start()
    IW.after_on_idle(None, sched)
    assert sched._pdc_idle_wait.ended_by == {"signal": 1}


def test_a_request_for_the_scheduler_ends_the_wait(sockets):
    knobs.override(sglang_idle_wait_us=60_000_000)
    pull, push = sockets
    sched = scheduler(pull, mode="prefill")
    threading.Timer(0.05, push.send, (b"a request",)).start()
    IW.after_on_idle(None, sched)
    assert sched._pdc_idle_wait.ended_by == {"request": 1}
    assert pull.recv() == b"a request"  # left for SGLang's own read


def test_without_an_event_the_wait_ends_at_its_bound(sockets):
    knobs.override(sglang_idle_wait_us=1000)
    sched = scheduler(sockets[0])
    IW.after_on_idle(None, sched)
    IW.after_on_idle(None, sched)
    assert sched._pdc_idle_wait.ended_by == {"bound": 2}


def test_a_signal_set_before_the_wait_is_not_lost(sockets):
    knobs.override(sglang_idle_wait_us=60_000_000)
    sched = scheduler(sockets[0])
    sched.disagg_decode_prealloc_queue.kv_manager.changed.set()
    IW.after_on_idle(None, sched)
    knobs.override(sglang_idle_wait_us=1000)
    IW.after_on_idle(None, sched)  # drained: the next wait has nothing pending
    assert sched._pdc_idle_wait.ended_by == {"signal": 1, "bound": 1}


@pytest.mark.parametrize("case", ["fully idle", "knob off", "another backend", "not rank zero"])
def test_no_wait_where_the_loop_must_not_wait(sockets, case):
    knobs.override(sglang_idle_wait_us=0 if case == "knob off" else 60_000_000)
    sched = scheduler(None if case == "not rank zero" else sockets[0],
                      backend="mooncake" if case == "another backend" else "pdc",
                      fully_idle=case == "fully idle")
    IW.after_on_idle(None, sched)  # returns at once: a wait here would outlast the test
    waiter = getattr(sched, "_pdc_idle_wait", None)
    assert waiter is None or not waiter.ended_by
