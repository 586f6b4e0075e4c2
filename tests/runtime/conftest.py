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
