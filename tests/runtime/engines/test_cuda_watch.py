"""Note [Landed wake-up], unit level: a stand-in for the driver's three calls records what
LandedWatch queues, and the test plays the driver's callback thread. The GPU test in
test_cuda_ipc.py runs the real driver between two processes."""

from __future__ import annotations

import ctypes

import pytest
from pdc.runtime import knobs
from pdc.runtime.engines import cuda_watch
from pdc.runtime.engines.cuda_watch import LandedWatch


class _Fn:
    def __init__(self, body) -> None:
        self.body, self.argtypes = body, None

    def __call__(self, *a):
        return self.body(*a)


class FakeDriver:
    """cuStreamCreate / cuStreamWaitEvent / cuLaunchHostFunc / cuStreamDestroy_v2 as records."""

    def __init__(self) -> None:
        self.streams, self.waits, self.queued, self.destroyed = 0, [], [], []
        self.refuse_wait = self.refuse_launch = False

        def create(ref, flags):
            self.streams += 1
            ctypes.cast(ref, ctypes.POINTER(ctypes.c_void_p))[0] = 0x1000 * self.streams
            return 0

        self.cuStreamCreate = _Fn(create)
        self.cuStreamWaitEvent = _Fn(lambda s, e, f: 1 if self.refuse_wait else
                                     self.waits.append((s, e)) or 0)
        self.cuLaunchHostFunc = _Fn(lambda s, fn, token: 1 if self.refuse_launch else
                                    self.queued.append((s, token)) or 0)
        self.cuStreamDestroy_v2 = _Fn(lambda s: self.destroyed.append(s) or 0)

    def run(self, stream: int) -> None:
        """The driver's callback thread: every host function queued on `stream`, in order."""
        for s, token in [q for q in self.queued if q[0] == stream]:
            self.queued.remove((s, token))
            cuda_watch._fire(token)


class Ev:
    cuda_event = 0xE0


@pytest.fixture
def watch():
    cu = FakeDriver()
    w = LandedWatch(cu, lambda index: None, 0)
    yield cu, w
    w.close()


def test_each_source_waits_on_a_stream_of_its_own_and_fires_once(watch):
    cu, w = watch
    fired = []
    assert w.watch(Ev(), "p0", lambda: fired.append("p0"))
    assert w.watch(Ev(), "p1", lambda: fired.append("p1"))
    assert w.watch(Ev(), "p0", lambda: fired.append("p0 again"))
    assert cu.streams == 2 and [s for s, _ in cu.waits] == [0x1000, 0x2000, 0x1000]
    cu.run(0x2000)
    assert fired == ["p1"]
    cu.run(0x1000)
    assert fired == ["p1", "p0", "p0 again"]
    cuda_watch._fire(10**9)  # an unknown token: nothing to call
    assert fired == ["p1", "p0", "p0 again"]


def test_a_stream_stuck_past_the_dead_window_is_given_up(watch, monkeypatch):
    cu, w = watch
    fired = []
    assert w.watch(Ev(), "p0", lambda: fired.append("stuck"))
    (stuck, token), = cu.queued
    given_up = cuda_watch.stats["streams_given_up"]
    now = cuda_watch.time.monotonic() + knobs.get("peer_dead_after_s") + 1
    monkeypatch.setattr(cuda_watch.time, "monotonic", lambda: now)
    assert w.watch(Ev(), "p0", lambda: fired.append("fresh"))
    assert cu.streams == 2 and cuda_watch.stats["streams_given_up"] == given_up + 1
    cu.run(0x2000)
    cuda_watch._fire(token)  # the stuck wait ending late calls nothing
    assert fired == ["fresh"]


def test_refusals_leave_the_event_to_the_poll_and_errors_stay_in_python(watch):
    cu, w = watch
    cu.refuse_wait = True
    assert not w.watch(Ev(), "p0", lambda: None)
    cu.refuse_wait, cu.refuse_launch = False, True
    assert not w.watch(Ev(), "p0", lambda: None)
    assert cu.queued == []
    cu.refuse_launch = False
    errors = cuda_watch.stats["callback_errors"]
    assert w.watch(Ev(), "p0", lambda: 1 / 0)
    cu.run(0x1000)
    assert cuda_watch.stats["callback_errors"] == errors + 1


def test_close_destroys_the_streams_and_forgets_their_callbacks(watch):
    cu, w = watch
    fired = []
    assert w.watch(Ev(), "p0", lambda: fired.append(1))
    w.close()
    assert cu.destroyed == [0x1000]
    cu.run(0x1000)
    assert fired == []
