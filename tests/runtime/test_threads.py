"""Note [Switch interval]: the knob sets the process's switch interval, 0 leaves it, and a
value the interpreter cannot honour is refused with the fix."""

from __future__ import annotations

import sys

import pytest
from pdc.runtime import knobs
from pdc.runtime.threads import apply_switch_interval


@pytest.fixture(autouse=True)
def _restore():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)
    knobs.reset()


def test_zero_leaves_the_interpreters_interval():
    before = sys.getswitchinterval()
    assert apply_switch_interval() is None
    assert sys.getswitchinterval() == before


def test_knob_sets_the_interval_in_microseconds():
    knobs.override(switch_interval_us=500)
    assert apply_switch_interval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_too_small_an_interval_is_refused():
    knobs.override(switch_interval_us=5)
    with pytest.raises(ValueError) as e:
        apply_switch_interval()
    assert str(e.value) == (
        "PDC_SWITCH_INTERVAL_US=5 is below 10 us, which would have the interpreter switch "
        "threads more often than it can run them; hint: use 100-1000 us, or 0 to leave the "
        "interpreter's interval")
