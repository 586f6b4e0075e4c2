"""Shared by the parity tests: the torch thread count every test runs under.

torch's thread count changes float results (mamba2 fp32 differs between 1 and 2 threads), so
a test computes its in-process reference with the thread count of the processes it compares
against: its module's TORCH_THREADS, else the parity workers' DEFAULT_THREADS. It is set per
test, not at import time, so neither the collection order of the modules nor the machine's
core count can change it.
"""

from __future__ import annotations

import pytest

from pdc.verify.parity_case import DEFAULT_THREADS

try:
    import torch
except ImportError:  # the modules that need torch skip themselves
    torch = None


@pytest.fixture(autouse=True)
def torch_threads(request):
    threads = getattr(request.module, "TORCH_THREADS", DEFAULT_THREADS)
    if torch is None:
        yield threads
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    yield threads
    torch.set_num_threads(before)
