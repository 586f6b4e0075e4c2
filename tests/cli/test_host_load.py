"""Note [Demo load]: the demos' `--load N` busy processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pdc.serving import host_load


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # ended; its parent has not reaped it
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_busy_processes_compute_while_the_block_runs_and_end_with_it():
    assert host_load.busy_text() == ""
    cores = sorted(os.sched_getaffinity(0))
    with host_load.busy_cores(2) as procs:
        assert len(procs) == 2
        # one core each, round robin over this process's cores
        assert [os.sched_getaffinity(p.pid) for p in procs] == [
            {cores[0]}, {cores[1 % len(cores)]}]
        assert host_load.busy_text() == ", 2 busy process(es) beside (--load 2)"
        time.sleep(1.0)
        assert all(_cpu_seconds(p.pid) > 0.1 for p in procs)
    assert host_load.busy_text() == ""
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2


def test_no_load_starts_nothing():
    with host_load.busy_cores(0) as procs:
        assert procs == [] and host_load.busy_text() == ""


def test_a_busy_process_ends_itself_when_the_demo_is_killed():
    demo = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from pdc.serving.host_load import busy_cores\n"
        "with busy_cores(1) as procs:\n"
        "    print(procs[0].pid, flush=True)\n"
        "    time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    busy = int(demo.stdout.readline())
    demo.kill()  # no finally runs: the busy process must notice by itself
    demo.wait()
    assert _gone(busy, within_s=10.0)


def test_the_load_average_is_three_numbers():
    assert len(host_load.load_average().split(", ")) == 3
