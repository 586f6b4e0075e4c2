"""Note [pdc threads' cores]: a thread pdc starts from a thread bound to one core (as a CPU
serving engine binds its own) runs on the CPUs of the `thread_cpus` knob; "inherit" keeps
the starter's mask; a library made inside `own_cores` starts its threads there too."""

from __future__ import annotations

import os
import threading

import pytest
from pdc.runtime import knobs
from pdc.runtime.threads import own_cores, pdc_cpus, thread

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or
                                len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


@pytest.fixture(autouse=True)
def _reset():
    yield
    knobs.reset()


def _from_a_thread_bound_to(core: int, body):
    """Run `body()` in a thread bound to `core`, as the serving engine's thread is."""
    out = {}

    def starter():
        os.sched_setaffinity(0, {core})
        out["value"] = body()

    t = threading.Thread(target=starter)
    t.start()
    t.join(10)
    return out["value"]


def _mask_of_a_pdc_thread():
    seen = {}
    t = thread(lambda: seen.setdefault("mask", os.sched_getaffinity(0)), "pdc-test")
    t.start()
    t.join(10)
    return seen["mask"]


def test_a_pdc_thread_leaves_the_engines_core_by_default():
    assert _from_a_thread_bound_to(0, _mask_of_a_pdc_thread) == os.sched_getaffinity(0)


def test_inherit_keeps_the_starters_core():
    knobs.override(thread_cpus="inherit")
    assert _from_a_thread_bound_to(0, _mask_of_a_pdc_thread) == {0}


def test_a_cpu_list_is_honoured():
    knobs.override(thread_cpus="1")
    assert _from_a_thread_bound_to(0, _mask_of_a_pdc_thread) == {1}


def test_own_cores_widens_the_caller_for_the_block_only():
    def body():
        with own_cores():
            inside = os.sched_getaffinity(0)
            native = _mask_of_a_pdc_thread()  # stands for a library's thread started here
        return inside, native, os.sched_getaffinity(0)

    inside, native, after = _from_a_thread_bound_to(0, body)
    assert inside == native == os.sched_getaffinity(0) and after == {0}


def test_cpu_lists_parse_and_bad_ones_are_refused():
    knobs.override(thread_cpus="0-2,5")
    assert pdc_cpus() == {0, 1, 2, 5}
    knobs.override(thread_cpus="inherit")
    assert pdc_cpus() is None
    knobs.override(thread_cpus="cores")
    with pytest.raises(ValueError) as e:
        pdc_cpus()
    assert str(e.value) == ("PDC_THREAD_CPUS='cores' is not 'all', 'inherit' or a CPU list; "
                            "hint: e.g. PDC_THREAD_CPUS=2-3,6")
