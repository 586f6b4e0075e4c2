"""Note [Small writes inline] in runtime/engines/mooncake.py: a small write to an idle peer is
made in the caller's thread (done when submit_write returns), a large one, or any with the
knob at 0, goes through the peer's worker thread; every byte arrives either way. Two real
Mooncake engines in one process over loopback TCP."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from pdc.runtime import knobs
from pdc.runtime.engines import BatchState, make_engine

pytestmark = [pytest.mark.engines, pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="mooncake: library not installed")]

ITEM_BYTES, STRIDE = 400, 4096


@pytest.fixture(scope="module")
def pair():
    src_engine, dst_engine = make_engine("mooncake"), make_engine("mooncake")
    src = np.arange(1 << 20, dtype=np.uint64).view(np.uint8)[: 1 << 20].copy()
    dst = np.zeros(1 << 20, np.uint8)
    src_engine.register(src.ctypes.data, src.nbytes)
    dst_engine.register(dst.ctypes.data, dst.nbytes)
    peer = src_engine.connect(dst_engine.agent_info())
    yield src_engine, peer, src, dst
    knobs.reset()
    src_engine.close()
    dst_engine.close()


def _write(pair, count: int, first: int):
    engine, peer, src, dst = pair
    offsets = (np.arange(count, dtype=np.uint64) + first) * STRIDE
    nbytes = np.full(count, ITEM_BYTES, np.uint64)
    batch = engine.submit_write(peer, offsets + src.ctypes.data, offsets + dst.ctypes.data,
                                nbytes)
    state_at_return = engine.poll(batch)
    engine.wait(batch, 20.0)
    for o in offsets.astype(np.int64):
        assert np.array_equal(dst[o:o + ITEM_BYTES], src[o:o + ITEM_BYTES]), f"offset {o}"
    return state_at_return


def test_small_write_is_made_inline_and_large_one_through_the_worker(pair):
    knobs.override(inline_write_bytes=8 * ITEM_BYTES)
    engine = pair[0]
    before = engine.report()["inline_writes"]
    assert _write(pair, 8, 0) is BatchState.DONE  # done when submit_write returned
    assert engine.report()["inline_writes"] == before + 1
    _write(pair, 9, 16)  # one byte over the knob: the worker's
    assert engine.report()["inline_writes"] == before + 1


def test_knob_zero_sends_every_write_through_the_worker(pair):
    knobs.override(inline_write_bytes=0)
    engine = pair[0]
    before = engine.report()["inline_writes"]
    _write(pair, 4, 40)
    assert engine.report()["inline_writes"] == before
