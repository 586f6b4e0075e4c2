"""Note [Spinning scheduler] without SGLang: the gate sleeps once per turn of a loop that turns
faster than TURN_S, never for a loop with forwards in it, never with the knob at 0."""

from __future__ import annotations

import pytest
from pdc.integrations.sglang import spin
from pdc.runtime import knobs


@pytest.fixture
def clock(monkeypatch):
    """time.monotonic and time.sleep of the gate on a clock the test moves."""
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    monkeypatch.setattr(spin.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(spin.time, "sleep", sleep)
    yield now, slept
    knobs.reset()


def loop(gate: spin.SpinGate, now: list[float], turns: int, keys=(1, 2, 3),
         turn_s: float = 0.0001) -> None:
    """A scheduler loop polling `keys` every turn, each turn `turn_s` long."""
    for _ in range(turns):
        for k in keys:
            gate.turn(k)
        now[0] += turn_s


def test_a_spinning_loop_sleeps_once_per_turn(clock):
    now, slept = clock
    knobs.override(sglang_spin_yield_us=200)
    gate = spin.SpinGate()
    loop(gate, now, 10)
    # the first turn is only seen when it ends; every later turn follows one that was fast
    assert slept == [0.0002] * 8 and gate.slept == 8


def test_a_loop_with_forwards_in_it_never_sleeps(clock):
    now, slept = clock
    knobs.override(sglang_spin_yield_us=200)
    gate = spin.SpinGate()
    loop(gate, now, 10, turn_s=spin.TURN_S * 5)  # a forward per turn
    assert slept == [] and gate.slept == 0


def test_the_knob_at_zero_never_sleeps(clock):
    now, slept = clock
    knobs.override(sglang_spin_yield_us=0)
    gate = spin.SpinGate()
    loop(gate, now, 10)
    assert slept == []


def test_one_pending_transfer_is_a_turn_of_its_own(clock):
    now, slept = clock
    knobs.override(sglang_spin_yield_us=500)
    gate = spin.SpinGate()
    loop(gate, now, 4, keys=(7,))
    assert slept == [0.0005] * 2
