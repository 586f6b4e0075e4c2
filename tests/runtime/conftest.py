"""Fixtures of the endpoint tests: a prefill/decode pair over the test family (failure_tools)."""

from __future__ import annotations

import pytest
from pdc.runtime import knobs

from .failure_tools import Family, Pair, tight_knobs


@pytest.fixture(scope="module")
def fam():
    """The tiny test family (tests/runtime/specs/tiny.yaml), prefill tp=1 -> decode tp=1; a
    module that needs another topology defines its own `fam`."""
    return Family()


@pytest.fixture
def pair(fam):
    """Prefill and decode endpoints of `fam` over the local engine, with the tight knobs
    (short timeouts) the failure tests rely on; closed, and knobs reset, after the test."""
    tight_knobs()
    p = Pair(fam)
    yield p
    p.close()
    knobs.reset()
