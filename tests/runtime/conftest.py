"""Fixtures of the endpoint tests: a prefill/decode pair over the test family (failure_tools)."""

from __future__ import annotations

import pytest
from pdc.runtime import knobs

# failure_tools is imported inside the fixtures: it needs the compiler's front end (jsonschema,
# yaml), which a bare GPU image running the engine tests (bench/run_gpu_engines.sh) lacks.


@pytest.fixture(scope="module")
def fam():
    """The tiny test family (tests/runtime/specs/tiny.yaml), prefill tp=1 -> decode tp=1; a
    module that needs another topology defines its own `fam`."""
    from .failure_tools import Family

    return Family()


@pytest.fixture
def pair(fam):
    """Prefill and decode endpoints of `fam` over the local engine, with the tight knobs
    (short timeouts) the failure tests rely on; closed, and knobs reset, after the test."""
    from .failure_tools import Pair, tight_knobs

    tight_knobs()
    p = Pair(fam)
    yield p
    p.close()
    knobs.reset()


@pytest.fixture
def make_pair(fam, monkeypatch):
    """`make_pair(engine_cls, **knobs)`: a `pair` with that prefill engine and those knobs,
    whose worker sleeps until woken (its 50 ms look at the deadlines moved to 30 s), so that
    no pass of its own runs when a test's message arrives (Note [Advance on the waking
    thread]); every pair made is closed, and knobs reset, after the test."""
    from pdc.runtime.endpoints import prefill_worker

    from .failure_tools import Pair, tight_knobs

    monkeypatch.setattr(prefill_worker, "_DEADLINE_CHECK_S", 30.0)
    pairs = []

    def make(engine, **extra):
        tight_knobs(**extra)
        p = Pair(fam, engine=engine)
        pairs.append(p)
        return p

    yield make
    for p in pairs:
        p.close()
    knobs.reset()
