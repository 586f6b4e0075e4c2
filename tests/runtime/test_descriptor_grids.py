"""The direct path hands a grid-taking engine a chunk's descriptors as grids (Note [Descriptor
grids] in runtime/engines/base.py): prefill's worker, in process, over an engine that records
what it was given and writes the expanded list."""

from __future__ import annotations

import pytest
from pdc.runtime import knobs
from pdc.runtime.endpoints import KVPoll
from pdc.runtime.engines.base import expand_grids

from .failure_tools import Family, ManualEngine, Pair, send_all, values, wait_for
from .test_failures import start


class GridEngine(ManualEngine):
    takes_grids = True

    def __init__(self) -> None:
        super().__init__()
        self.grids: list = []
        self.flat = 0

    def submit_grids(self, peer, grids):
        self.grids.append(grids)
        return super().submit_grids(peer, grids)

    def submit_write(self, peer, src, dst, nbytes):
        self.flat += 1
        return super().submit_write(peer, src, dst, nbytes)


@pytest.mark.parametrize("on", [1, 0])
def test_a_request_moves_as_grids_where_the_engine_takes_them(on):
    knobs.override(descriptor_grids=on)
    p = Pair(Family(), engine=GridEngine)
    try:
        s, rv = start(p, 7, [1, 2, 5], 2, 9)
        send_all(s, [1, 2, 5], 2)
        wait_for(lambda: rv.poll() == KVPoll.Success, what="Success")
        assert values(p.dpools, [1, 2, 5], 2) == {9}
        if on:
            # every chunk as grids: submit_write ran only under the default submit_grids
            assert len(p.peng.grids) == p.peng.flat >= 1
            kv = [g for grids in p.peng.grids for g in grids if len(g.run_bytes) == 2]
            assert kv and all(len(g.src_rows) == len(p.ppools.buffers["kv"]) for g in kv)
            descriptors = sum(len(expand_grids(grids)[0]) for grids in p.peng.grids)
            assert s.stats.descriptors == descriptors
        else:
            assert p.peng.grids == [] and p.peng.flat >= 1
    finally:
        p.close()
        knobs.reset()
