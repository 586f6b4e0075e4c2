"""Note [Endpoint CPUs] (runtime/cpus.py): the knob endpoint_cpus moves the threads pdc starts,
and only those."""

from __future__ import annotations

import os
import threading

import pytest
from pdc.runtime import knobs
from pdc.runtime.cpus import on_endpoint_cpus, parse_cpus, place_this_thread

CPUS = sorted(os.sched_getaffinity(0))


def thread_cpus() -> set[int]:
    """The CPUs the calling thread may run on."""
    return os.sched_getaffinity(threading.get_native_id())
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")


def test_cpu_lists_parse_and_bad_ones_name_the_part():
    assert parse_cpus("") == set() and parse_cpus("1") == {1}
    assert parse_cpus(" 0, 2-4 ,7") == {0, 2, 3, 4, 7}
    with pytest.raises(ValueError) as e:
        parse_cpus("1,x")
    assert str(e.value) == "endpoint_cpus: 'x' is not a CPU number or range (e.g. '1' or '2-3')"
    with pytest.raises(ValueError) as e:
        parse_cpus("3-1")
    assert str(e.value) == "endpoint_cpus: '3-1' is not a range of CPU numbers"


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    if "error" in out:
        raise out["error"]
    return out["value"]


@needs_two
def test_a_placed_thread_and_the_threads_it_starts_run_on_the_knobs_cpus():
    knobs.override(endpoint_cpus=str(CPUS[-1]))
    try:
        def opener():
            place_this_thread()
            started = _in_thread(thread_cpus)  # a thread started after: inherits the mask
            return thread_cpus(), started

        assert _in_thread(opener) == ({CPUS[-1]}, {CPUS[-1]})
        assert thread_cpus() == set(CPUS)  # the test's own thread never moved
    finally:
        knobs.reset()


@needs_two
def test_threads_started_inside_the_block_keep_the_cpus_and_the_caller_moves_back():
    knobs.override(endpoint_cpus=str(CPUS[0]))
    try:
        def caller():
            with on_endpoint_cpus():
                inside = thread_cpus()
                started = _in_thread(thread_cpus)
            return inside, started, thread_cpus()

        assert _in_thread(caller) == ({CPUS[0]}, {CPUS[0]}, set(CPUS))
    finally:
        knobs.reset()


def test_an_empty_knob_moves_nothing_and_a_refused_mask_warns(capsys):
    def both():
        with on_endpoint_cpus():
            a = thread_cpus()
        place_this_thread()
        return a, thread_cpus()

    assert _in_thread(both) == (set(CPUS), set(CPUS))
    knobs.override(endpoint_cpus="4000")  # no such CPU: the kernel refuses the mask
    try:
        assert _in_thread(both) == (set(CPUS), set(CPUS))
    finally:
        knobs.reset()
    err = capsys.readouterr().err
    assert err.count("pdc: endpoint_cpus [4000] refused (") == 2
    assert f"pdc's threads stay on CPUs {CPUS}" in err
