"""Explicit DP routing (Note [DP routing]): the router's choice of prefill DP rank and decode DP
group travels with the request; idle DP groups (DP attention padding) see nothing of it."""

from __future__ import annotations

import pytest
from pdc.runtime.control import BootstrapServer
from pdc.runtime.endpoints import DecodeEndpoint, KVPoll, PrefillEndpoint

from .failure_tools import R0, Family, ManualEngine, fill, send_all, values, wait_for

PAGES = [1, 2, 3]
SLOT = 1


class Groups:
    """Prefill dp=2 and decode dp=2 of the tiny family (tp=1), in this process."""

    def __init__(self):
        self.fam = fam = Family({"tp": 1, "dp": 2}, {"tp": 1, "dp": 2})
        self.boot = BootstrapServer(2)
        self.ppools = [fam.pools("prefill") for _ in range(2)]
        self.dpools = [fam.pools("decode") for _ in range(2)]
        self.pre = [PrefillEndpoint(fam.layout, fam.wire, fam.plan, R0, g, ManualEngine(),
                                    self.ppools[g], self.boot.address) for g in range(2)]
        self.dec = [DecodeEndpoint(fam.layout, fam.wire, fam.plan, R0, g, ManualEngine(),
                                   self.dpools[g], self.boot.address) for g in range(2)]
        for d in self.dec:
            d.wait_ready(5)

    def close(self):
        for e in (*self.dec, *self.pre):
            e.close()
        self.boot.close()


@pytest.fixture(scope="module")
def groups():
    g = Groups()
    yield g
    g.close()


def test_router_choice_other_than_room_mod_dp(groups):
    room = 4  # room % 2 == 0, routed to prefill group 1 and decode group 1
    fill(groups.ppools[1], PAGES, SLOT, 0x5A)
    fill(groups.ppools[0], PAGES, SLOT, 0x11)  # the group the default routing would pick
    before_idle = values(groups.dpools[0], PAGES, SLOT)
    rx = groups.dec[1].receiver(room, 0, prefill_dp_group=1)
    rx.init(PAGES, slot=SLOT, aux_row=SLOT)
    tx = groups.pre[1].sender(room, decode_dp_group=1)
    send_all(tx, PAGES, SLOT)
    wait_for(lambda: rx.poll() == KVPoll.Success, what="decode success")
    wait_for(lambda: tx.poll() == KVPoll.Success, what="prefill success")
    assert values(groups.dpools[1], PAGES, SLOT) == {0x5A}
    # DP attention padding: the idle decode group and the unchosen prefill group saw nothing.
    assert values(groups.dpools[0], PAGES, SLOT) == before_idle
    assert room not in groups.pre[0].rooms and room not in groups.pre[0].finished


def test_group_learned_from_the_request_when_prefill_is_not_told(groups):
    room = 6
    fill(groups.ppools[1], PAGES, SLOT, 0x33)
    rx = groups.dec[1].receiver(room, 0, prefill_dp_group=1)
    rx.init(PAGES, slot=SLOT, aux_row=SLOT)
    send_all(groups.pre[1].sender(room), PAGES, SLOT)
    wait_for(lambda: rx.poll() == KVPoll.Success, what="decode success")
    assert values(groups.dpools[1], PAGES, SLOT) == {0x33}


def test_router_and_request_disagree(groups):
    room = 8
    rx = groups.dec[1].receiver(room, 0, prefill_dp_group=0)
    rx.init(PAGES, slot=SLOT, aux_row=SLOT)
    pre = groups.pre[0]
    wait_for(lambda: room in pre.rooms, what="the request at prefill")
    tx = pre.sender(room, decode_dp_group=0)
    wait_for(lambda: tx.poll() == KVPoll.Failed, what="prefill failure")
    assert tx.reason == ("the router chose decode dp group 0 for room 8, but its transfer "
                         "request came from group 1")
    wait_for(lambda: rx.poll() == KVPoll.Failed, what="decode failure")


def test_groups_that_do_not_exist(groups):
    with pytest.raises(ValueError) as e:
        groups.dec[0].receiver(10, 0, prefill_dp_group=2)
    assert str(e.value) == "room 10: prefill dp group 2 does not exist (the plan has 2)"
    with pytest.raises(ValueError) as e:
        groups.pre[0].sender(10, decode_dp_group=5)
    assert str(e.value) == "room 10: decode dp group 5 does not exist (the plan has 2)"
