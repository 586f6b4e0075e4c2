"""Note [Process watch]: a peer process's liveness by pidfd, and by /proc where pidfd is refused."""

from __future__ import annotations

import os
import subprocess

import pytest
from pdc.runtime.engines import local
from pdc.runtime.engines.local import ProcessWatch, _start_time_ticks


@pytest.fixture(params=["pidfd", "proc"])
def watch_kind(request, monkeypatch):
    if request.param == "proc":
        def refused(pid):
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(local.os, "pidfd_open", refused)
    return request.param


def test_a_running_peer_is_alive_and_an_exited_one_is_not_even_before_it_is_reaped(watch_kind):
    p = subprocess.Popen(["sleep", "60"])
    watch = ProcessWatch(p.pid, _start_time_ticks(p.pid))
    assert (watch_kind, watch.alive()) == (watch_kind, True)
    p.kill()
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, still a zombie
    assert (watch_kind, watch.alive()) == (watch_kind, False)
    p.wait()
    assert (watch_kind, watch.alive()) == (watch_kind, False)


def test_a_start_time_that_names_another_process_is_not_alive(watch_kind):
    p = subprocess.Popen(["sleep", "60"])
    try:
        assert not ProcessWatch(p.pid, _start_time_ticks(p.pid) - 1).alive()
    finally:
        p.kill()
        p.wait()


def test_a_pid_that_is_gone_at_connect_is_not_alive(watch_kind):
    p = subprocess.Popen(["true"])
    ticks = _start_time_ticks(p.pid) or 1
    p.wait()
    assert not ProcessWatch(p.pid, ticks).alive()


def test_the_pidfd_is_closed_with_the_watch():
    p = subprocess.Popen(["sleep", "60"])
    try:
        before = len(os.listdir("/proc/self/fd"))
        watch = ProcessWatch(p.pid, _start_time_ticks(p.pid))
        assert len(os.listdir("/proc/self/fd")) == before + 1
        del watch
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        p.kill()
        p.wait()
