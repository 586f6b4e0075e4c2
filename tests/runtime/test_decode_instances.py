"""Many decode servers on one prefill rank without numbering themselves (Note [Decode
instances]): each registers as decode rank pp0.tp0 of group 0 under its own instance name; the
prefill rank keeps their registrations and rooms apart, and two live servers that share an
instance name are told so."""

from __future__ import annotations

import pytest
from pdc.runtime import knobs
from pdc.runtime.control import BootstrapServer, ControlError
from pdc.runtime.endpoints import DecodeEndpoint, KVPoll, PrefillEndpoint

from .failure_tools import R0, Family, ManualEngine, fill, send_all, values, wait_for

PAGES = [1, 2, 3]
SLOT = 1
A, B = "10.0.0.2:30001", "10.0.0.2:30002"


class OnePrefill:
    """One prefill rank of the tiny family (decode side: one DP group) and its bootstrap."""

    def __init__(self):
        self.fam = fam = Family()
        self.boot = BootstrapServer(1)
        self.ppools = fam.pools("prefill")
        self.pre = PrefillEndpoint(fam.layout, fam.wire, fam.plan, R0, 0, ManualEngine(),
                                   self.ppools, self.boot.address)
        self.decodes: list[DecodeEndpoint] = []

    def decode(self, instance: str):
        """A decode server's rank (its own pools and engine) registered under `instance`."""
        pools = self.fam.pools("decode")
        dec = DecodeEndpoint(self.fam.layout, self.fam.wire, self.fam.plan, R0, 0,
                             ManualEngine(), pools, self.boot.address, instance=instance)
        self.decodes.append(dec)
        dec.wait_ready(5)
        return dec, pools

    def close(self):
        for e in (*self.decodes, self.pre):
            e.close()
        self.boot.close()


def refusal(dec: DecodeEndpoint, room: int) -> str:
    """The reason prefill refuses decode's request for `room`."""
    rx = dec.receiver(room)
    rx.init(PAGES, slot=SLOT, aux_row=SLOT)
    wait_for(lambda: rx.poll() == KVPoll.Failed, what=f"room {room} refused")
    return rx.reason


@pytest.fixture
def prefill():
    p = OnePrefill()
    yield p
    p.close()


def test_two_decode_servers_register_as_the_same_rank_and_each_gets_its_own_requests(prefill):
    (da, pa), (db, pb) = prefill.decode(A), prefill.decode(B)
    assert sorted(p.name for p in prefill.pre.peers.values()) == [
        "decode.dp0.pp0.tp0@10.0.0.2:30001", "decode.dp0.pp0.tp0@10.0.0.2:30002"]
    fill(pa, PAGES, SLOT, 0x0A)
    fill(pb, PAGES, SLOT, 0x0B)
    # Both in flight at once: room 11 for A, room 12 for B.
    ra, rb = da.receiver(11), db.receiver(12)
    ra.init(PAGES, slot=SLOT, aux_row=SLOT)
    rb.init(PAGES, slot=SLOT, aux_row=SLOT)
    fill(prefill.ppools, PAGES, SLOT, 0x5A)
    ta = prefill.pre.sender(11)
    send_all(ta, PAGES, SLOT)
    wait_for(lambda: ra.poll() == KVPoll.Success, what="A's success")
    assert values(pa, PAGES, SLOT) == {0x5A}
    assert values(pb, PAGES, SLOT) == {0x0B}  # B's request waits; nothing of room 11 there
    fill(prefill.ppools, PAGES, SLOT, 0x5B)
    tb = prefill.pre.sender(12)
    send_all(tb, PAGES, SLOT)
    wait_for(lambda: rb.poll() == KVPoll.Success, what="B's success")
    assert values(pb, PAGES, SLOT) == {0x5B}
    assert values(pa, PAGES, SLOT) == {0x5A}
    assert prefill.pre.stats().get("reregistrations", 0) == 0


def test_a_room_of_one_decode_server_is_refused_to_another(prefill):
    (da, pa), (db, _) = prefill.decode(A), prefill.decode(B)
    ra = da.receiver(13)
    ra.init(PAGES, slot=SLOT, aux_row=SLOT)
    wait_for(lambda: 13 in prefill.pre.rooms and prefill.pre.rooms[13].targets,
             what="A's request at prefill")
    assert refusal(db, 13) == ("prefill.dp0.pp0.tp0: room 13 is served by decode instance "
                         "'10.0.0.2:30001', and decode.dp0.pp0.tp0@10.0.0.2:30002 is of "
                         "instance '10.0.0.2:30002'")
    # A's use of the room is untouched.
    fill(prefill.ppools, PAGES, SLOT, 0x3C)
    send_all(prefill.pre.sender(13), PAGES, SLOT)
    wait_for(lambda: ra.poll() == KVPoll.Success, what="A's success")
    assert values(pa, PAGES, SLOT) == {0x3C}


def test_two_live_decode_servers_with_one_instance_name_are_told(prefill):
    (dc, _), (dd, pd) = prefill.decode(A), prefill.decode(A)
    assert prefill.pre.stats()["reregistrations"] == 1  # as if the first had restarted
    assert refusal(dc, 14) == (
        "prefill.dp0.pp0.tp0: room 14: decode rank decode.dp0.pp0.tp0@10.0.0.2:30001 "
        "registered again from another connection while this one still sends: two decode "
        "servers share the instance name '10.0.0.2:30001'; hint: give each decode server its "
        "own address and port (Note [Decode instances])")
    # The one registered last is served.
    rd = dd.receiver(15)
    rd.init(PAGES, slot=SLOT, aux_row=SLOT)
    fill(prefill.ppools, PAGES, SLOT, 0x4D)
    send_all(prefill.pre.sender(15), PAGES, SLOT)
    wait_for(lambda: rd.poll() == KVPoll.Success, what="the second server's success")
    assert values(pd, PAGES, SLOT) == {0x4D}


def test_without_instance_names_a_second_decode_server_replaces_the_first(prefill):
    """What the 2P2D SGLang run hit before decode servers named themselves: both register as
    the same rank, and the first one's requests are refused."""
    (d1, _), _ = prefill.decode(""), prefill.decode("")
    assert refusal(d1, 16) == (
        "prefill.dp0.pp0.tp0: room 16: decode rank decode.dp0.pp0.tp0 registered again from "
        "another connection while this one still sends: two decode servers registered as the "
        "same rank without instance names; hint: number them as decode DP groups or name "
        "their instances (Note [Decode instances])")


def test_instance_names_do_not_grow_a_prefill_rank_without_bound(prefill):
    """Every name is a registration of its own: `max_registrations` caps them as it caps the
    transfer-engine peers (a hostile peer could otherwise register under endless names)."""
    knobs.override(max_registrations=2)
    try:
        prefill.decode(A)
        prefill.decode(B)
        prefill.decode(B)  # a restart of B on its port: the same registration
        with pytest.raises(ControlError) as e:
            prefill.decode("10.0.0.2:30003")
        assert str(e.value) == ("registration rejected by prefill.dp0.pp0.tp0: too many "
                                "registered decode ranks on this prefill rank (limit 2)")
    finally:
        knobs.reset()
