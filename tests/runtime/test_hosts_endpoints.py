"""Prefill on 127.0.0.2 and decode on 127.0.0.3 (Note [Bind and advertise]): both endpoints and
their engines take the host from the knobs when they are made, a real request moves every byte,
and each side's control socket and engine name its own address."""

from __future__ import annotations

import numpy as np
import pytest
from pdc.runtime import knobs
from pdc.runtime.control import BootstrapServer
from pdc.runtime.endpoints import DecodeEndpoint, KVPoll, PrefillEndpoint
from pdc.runtime.engines import make_engine
from pdc.runtime.plan_types import RankId
from pdc.runtime.pools import Capacity, RankPools

from ..compiler.planning import ROOT, plan_for
from .failure_tools import wait_for

pytestmark = pytest.mark.engines

LLAMA = ROOT / "specs" / "llama3-70b.yaml"


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_prefill_and_decode_on_distinct_loopback_hosts(engine):
    from pdc.runtime.family import Family

    layout, plan = plan_for(LLAMA, {"tp": 1}, {"tp": 1}, backend=engine)
    wire = Family.load("llama3_70b")
    r0, cap = RankId(0, 0), Capacity(pages=8, slots=2, aux_rows=2, window_pages=1)
    made = []
    try:
        knobs.override(bind_host="127.0.0.2")
        boot = BootstrapServer(1)
        made.append(boot)
        pe = make_engine(engine)
        made.append(pe)
        pp = RankPools(layout, plan.registration("prefill", r0), cap)
        pre = PrefillEndpoint(layout, wire, plan, r0, 0, pe, pp, boot.address)
        made.append(pre)
        knobs.override(bind_host="127.0.0.3")
        de = make_engine(engine)
        made.append(de)
        dp = RankPools(layout, plan.registration("decode", r0), cap)
        dec = DecodeEndpoint(layout, wire, plan, r0, 0, de, dp, boot.address)
        made.append(dec)
        dec.wait_ready(10)
        assert boot.address.startswith("tcp://127.0.0.2:")
        assert pre.hub.address.startswith("tcp://127.0.0.2:")
        if engine == "mooncake":
            assert pre.transport.devices == "127.0.0.2" and dec.transport.devices == "127.0.0.3"
        src, dst = [1, 4, 6], [7, 0, 3]
        for pos in range(len(pp.buffers["kv"])):
            pp.view("kv", pos)[src] = np.uint8(pos % 251)
        rv = dec.receiver(5, 0)
        rv.init(dst, 0, aux_row=1)
        pre.sender(5).send(src, 0, True, 3 * 16, aux_row=1)
        wait_for(lambda: rv.poll() in (KVPoll.Success, KVPoll.Failed), timeout=20,
                 what="the request")
        assert rv.poll() == KVPoll.Success, rv.reason
        for pos in range(len(dp.buffers["kv"])):
            assert set(np.unique(dp.view("kv", pos)[dst]).tolist()) == {pos % 251}
    finally:
        knobs.reset("bind_host")
        for obj in reversed(made):
            obj.close()
