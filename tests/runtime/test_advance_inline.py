"""Note [Advance on the waking thread]: the prefill thread that makes work moves the rooms
forward itself when no pass is running (the control thread after decode's request, an
engine's completion thread after a batch), and wakes the worker otherwise. Each test records
the thread every write was submitted on, and the thread that signalled prefill's Success."""

from __future__ import annotations

import threading

from pdc.runtime.endpoints import KVPoll

from .failure_tools import ManualEngine, fill, send_all, wait_for


class ThreadsEngine(ManualEngine):
    """ManualEngine noting the thread of each submit; with `callbacks_may_work`, its held
    writes end (and call the completion callbacks) on the thread that releases them, as
    cuda_ipc's completion thread does."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []
        self.callbacks: list = []

    def submit_write(self, peer, src, dst, nbytes):
        self.threads.append(threading.current_thread().name)
        return super().submit_write(peer, src, dst, nbytes)


class WorkingCallbacks(ThreadsEngine):
    callbacks_may_work = True

    def on_completion(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def release(self, fail: bool = False) -> int:
        n = super().release(fail)
        for cb in self.callbacks:
            cb()
        return n


def success_thread(pair, sender) -> list[str]:
    """The name of the thread on which prefill first signalled a change that found Success
    (later signals of the same state follow on whichever thread)."""
    seen: list[str] = []

    def note() -> None:
        if not seen and sender.poll() == KVPoll.Success:
            seen.append(threading.current_thread().name)

    pair.pre.on_change = note
    return seen


def worker_idle(pair) -> bool:
    """The worker is asleep: no wake pending and no pass running."""
    if pair.pre.wake.is_set() or not pair.pre.advancing.acquire(blocking=False):
        return False
    pair.pre.advancing.release()
    return True


def request_after_last_chunk(pair, room: int):
    fill(pair.ppools, [1, 2], 1, 7)
    s = pair.pre.sender(room, 0)
    send_all(s, [1, 2], 1)
    wait_for(lambda: worker_idle(pair), what="the worker asleep after the last chunk")
    seen = success_thread(pair, s)
    rv = pair.dec.receiver(room, 0)
    rv.init([1, 2], 0, slot=1, aux_row=1)
    return s, rv, seen


def test_a_request_after_the_last_chunk_is_issued_and_answered_on_the_control_thread(
        make_pair):
    pair = make_pair(ThreadsEngine)
    s, rv, seen = request_after_last_chunk(pair, 30)
    wait_for(lambda: rv.poll() == KVPoll.Success, what="decode's Success")
    assert pair.peng.threads == ["pdc-hub"]
    assert seen == ["pdc-hub"]
    assert pair.dpools.view("kv", 0)[[1, 2]].min() == 7


def test_with_the_knob_off_the_worker_issues_the_writes(make_pair):
    pair = make_pair(ThreadsEngine, advance_inline=0)
    s, rv, seen = request_after_last_chunk(pair, 31)
    wait_for(lambda: rv.poll() == KVPoll.Success, what="decode's Success")
    assert pair.peng.threads == ["pdc-prefill-worker"]
    assert seen == ["pdc-prefill-worker"]


def test_a_pass_running_elsewhere_leaves_the_request_to_the_worker(make_pair):
    pair = make_pair(ThreadsEngine)
    fill(pair.ppools, [1, 2], 1, 5)
    s = pair.pre.sender(32, 0)
    send_all(s, [1, 2], 1)
    wait_for(lambda: worker_idle(pair), what="the worker asleep after the last chunk")
    with pair.pre.advancing:  # as if a pass of another thread were running
        rv = pair.dec.receiver(32, 0)
        rv.init([1, 2], 0, slot=1, aux_row=1)
        wait_for(lambda: pair.pre.wake.is_set(), what="the control thread waking the worker")
        assert pair.peng.submitted == 0
    wait_for(lambda: rv.poll() == KVPoll.Success, what="decode's Success")
    assert pair.peng.threads == ["pdc-prefill-worker"]


def test_a_batch_ending_on_a_completion_thread_that_may_work_sends_success_there(make_pair):
    pair = make_pair(WorkingCallbacks)
    pair.peng.hold = True
    s, rv, seen = request_after_last_chunk(pair, 33)
    wait_for(lambda: pair.peng.held, what="the write submitted and held")
    assert s.poll() == KVPoll.Transferring
    done = threading.Thread(target=pair.peng.release, name="engine-completion")
    done.start()
    done.join(5)
    wait_for(lambda: rv.poll() == KVPoll.Success, what="decode's Success")
    assert pair.peng.threads == ["pdc-hub"]
    assert seen == ["engine-completion"]


def test_a_completion_callback_that_may_not_work_only_wakes_the_worker(make_pair):
    class WakeOnly(WorkingCallbacks):
        callbacks_may_work = False

    pair = make_pair(WakeOnly)
    pair.peng.hold = True
    s, rv, seen = request_after_last_chunk(pair, 34)
    wait_for(lambda: pair.peng.held, what="the write submitted and held")
    done = threading.Thread(target=pair.peng.release, name="engine-completion")
    done.start()
    done.join(5)
    wait_for(lambda: rv.poll() == KVPoll.Success, what="decode's Success")
    assert seen == ["pdc-prefill-worker"]
