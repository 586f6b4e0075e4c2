"""The handshake: a decode rank registers its buffers with every linked prefill rank, which
checks them against the plan before it accepts any request (Note [Registration room])."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from .. import knobs
from .. import wire as W
from ..bringup import silent as silent_peer
from ..control import ControlError, HostSettings, bootstrap_call
from ..datapath import RemoteBuffer
from ..indices import (
    DecodeTarget,
)
from ..layout_types import FamilyLayout
from ..plan_types import RankId
from .common import (
    REG_ROOM,
    KVPoll,
    _peer_name,
)
from .records import _Peer
from .states import TERMINAL

if TYPE_CHECKING:
    from .host import DecodeHost, PrefillHost
else:  # Note [Typed mixins]: the hosts are for the type checker only
    PrefillHost = DecodeHost = object


def _check_target(layout: FamilyLayout, capacities: dict[str, int], t: DecodeTarget) -> str:
    """Every id of a decode request against the capacities that decode registered
    (component -> its buffers' smallest capacity, `_Peer.capacities`)."""
    for comp in layout.components:
        cap = capacities.get(comp.name)
        if cap is None:
            continue
        if comp.index == "page":
            ids, what = t.page_ids, "page"
        elif comp.index == "window":
            ids = t.window_page_ids if t.window_page_ids is not None else np.array([], np.int64)
            what = "window page"
        elif comp.index == "slot":  # one slot, or one per layer (Note [Layer slots])
            ids = np.array([s for i, s in t.layer_slots if i in comp.layer_ids]
                           if t.layer_slots else [t.slot], np.int64)
            what = "slot"
        elif comp.index == "aux":
            ids, what = np.array([t.aux_row]), "aux row"
        else:
            r = comp.ring_rows
            ids = t.ring_slot * r + np.arange(r) if t.ring_slot >= 0 else np.array([-1])
            what = "ring row"
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= cap):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            return f"'{comp.name}' {what} {bad} is outside the registered capacity {cap}"
    return ""


# How many replaced incarnations a prefill rank remembers by connection, to tell two live
# decode servers that share an instance name from a restart (Note [Decode instances]).
SUPERSEDED_KEPT = 64


class PrefillHandshake(PrefillHost):
    """Registrations arriving at a prefill rank (hub thread); part of PrefillEndpoint.

    Note [Decode instances]: a prefill rank may serve many decode servers (xPyD) that do not
    number themselves: each one's plan has one decode DP group, so all of them register as
    decode rank pp0.tp0 of group 0. A registration therefore names its decode instance
    (`Register.instance`, e.g. the decode server's advertised address and port; "" when the
    deployment numbers its decode engines as DP groups instead, Note [DP routing]), and a
    prefill rank keeps one registration per (instance, DP group, rank). A room belongs to
    the instance whose TransferRequest came first: requests and aborts for it from another
    instance are refused, and a silent or restarted peer fails only its own instance's rooms.
    The same key registering again from another connection is a restart (the old
    incarnation's rooms fail); if the replaced connection then still sends, two live decode
    servers share one instance name, and its requests are refused saying so.
    """

    def _validate_register(self, msg) -> str:
        if msg.side != W.PeerSide.DECODE:
            return "only decode ranks register with a prefill rank"
        if msg.dp_group >= self.plan.topology.decode.dp:
            return (f"decode dp group {msg.dp_group} does not exist (the plan has "
                    f"{self.plan.topology.decode.dp})")
        if msg.page_size != self.page_size:
            return f"page size differs: prefill {self.page_size}, decode {msg.page_size}"
        if msg.plan_digest != self.digest:
            return ("plan digest differs: both sides must lower the same spec and topology "
                    f"(prefill {self.digest.hex()[:12]}, decode {msg.plan_digest.hex()[:12]})")
        rank = msg.rank
        try:
            reg = self.plan.registration("decode", rank)
        except KeyError:
            return f"decode rank {rank} is not part of the plan"
        if rank not in self.links:
            return f"decode rank {rank} has no link to prefill rank {self.rank}"
        for comp, section in zip(self.layout.components, msg.sections, strict=True):
            want = reg.entries(comp.name)
            got = [(e.tensor, e.layer_id) for e in section.entries]
            if tuple(got) != want:
                return (f"component '{comp.name}': decode registered entries {got[:4]}..., the "
                        f"plan expects {list(want)[:4]}...")
            for e in section.entries:
                if e.item_bytes != reg.item_bytes(comp.name):
                    return (f"component '{comp.name}': item bytes {e.item_bytes} on decode, the "
                            f"plan expects {reg.item_bytes(comp.name)}")
        return ""

    def _on_register(self, identity: bytes, msg) -> None:
        why = self._validate_register(msg)
        if why:
            self._reject(identity, "register", why)
            return
        key = (msg.instance, msg.dp_group, msg.rank)
        old = self.peers.get(key)
        if old is not None and old.identity == identity and old.agent_info == msg.agent_info:
            self._reply(identity, self._status(REG_ROOM, 0, KVPoll.WaitingForInput))
            return  # the same incarnation registering again: nothing changes
        limit = knobs.get("max_registrations")
        if msg.agent_info not in self.engine_peers and len(self.engine_peers) >= limit:
            self._reject(identity, "register",
                         f"too many transfer-engine peers on this prefill rank (limit {limit})")
            return
        if old is None and len(self.peers) >= limit:  # one per instance name: bounded too
            self._reject(identity, "register",
                         f"too many registered decode ranks on this prefill rank (limit {limit})")
            return
        try:
            engine_peer = self.engine.connect(msg.agent_info)
        except Exception as e:  # noqa: BLE001 - engine errors are reported, not raised
            self._reject(identity, "register", f"cannot connect the transfer engine: {e}")
            return
        self.engine_peers.add(msg.agent_info)
        remote = {
            comp.name: [RemoteBuffer(e.layer_id, comp.tensors.index(e.tensor), e.base_addr,
                                     e.item_bytes, e.capacity_items,
                                     comp.pitch_for(e.item_bytes))
                        for e in section.entries]
            for comp, section in zip(self.layout.components, msg.sections, strict=True)
        }
        name = _peer_name("decode", msg.dp_group, msg.rank, msg.instance)
        new = _Peer(name, identity, msg.agent_info, engine_peer, remote, msg.dp_group, msg.rank,
                    (msg.staging_addr, msg.staging_bytes), msg.instance)
        with self.lock:
            if old is not None:
                # A restarted decode rank: its earlier requests name pages of a process that
                # is gone, and no byte of them may land in the new one; rooms still waiting
                # for its request would wait for a request that the new process never sends.
                self.counters["reregistrations"] += 1
                if self.by_identity.pop(old.identity, None) is not None and \
                        old.identity != identity:
                    self.superseded[old.identity] = old
                    while len(self.superseded) > SUPERSEDED_KEPT:
                        self.superseded.popitem(last=False)
                for r in self.rooms.values():
                    if any(t.peer is old for t in r.targets.values()) or (
                            msg.rank not in r.targets and r.state not in TERMINAL and
                            self._waits_on(r, msg.instance, msg.dp_group)):
                        r.fail(f"decode rank {name} registered again (restarted); requests of "
                               "its previous incarnation fail")
            if old is not None:
                self.liveness.forget(old)
            self.peers[key] = new
            self.by_identity[identity] = new
            self.superseded.pop(identity, None)
            self.liveness.add(new, time.monotonic())
        self.counters["registrations"] += 1
        self._reply(identity, self._status(REG_ROOM, 0, KVPoll.WaitingForInput))

    def _requester(self, identity: bytes, room: int, rank: RankId) -> _Peer | str:
        """The registered peer a request or abort must come from, or why it may not."""
        if rank not in self.links:
            return f"decode rank {rank} has no link to prefill rank {self.rank}"
        peer = self.by_identity.get(identity)
        if peer is None and identity in self.superseded:
            old = self.superseded[identity]
            why = (f"room {room}: decode rank {old.name} registered again from another "
                   "connection while this one still sends: ")
            if old.instance:
                return why + (f"two decode servers share the instance name {old.instance!r}; "
                              "hint: give each decode server its own address and port (Note "
                              "[Decode instances])")
            return why + ("two decode servers registered as the same rank without instance "
                          "names; hint: number them as decode DP groups or name their "
                          "instances (Note [Decode instances])")
        if peer is None or peer.rank != rank:
            return f"room {room}: this connection did not register as decode rank {rank}"
        return peer


class DecodeHandshake(DecodeHost):
    """A decode rank's registration with its prefill ranks; part of DecodeEndpoint."""

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every linked prefill rank accepted the registration (fail fast)."""
        timeout_s = knobs.get("bootstrap_timeout_s") if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                states = dict(self.reg_state)
            failed = [(n, why) for n, (s, why) in states.items() if s == KVPoll.Failed]
            if failed:
                raise ControlError(f"registration rejected by {failed[0][0]}: {failed[0][1]}")
            if all(s == KVPoll.WaitingForInput for s, _ in states.values()):
                return
            if time.monotonic() > deadline:
                silent = sorted(n for n, (st, _) in states.items() if st != KVPoll.WaitingForInput)
                more = f" ({len(silent) - 1} more prefill ranks silent)" if len(silent) > 1 else ""
                raise ControlError(
                    "registration: " + silent_peer(f"{silent[0]} at {self.addresses[silent[0]]}",
                                                   timeout_s,
                                                   HostSettings.from_knobs().advertise) + more)
            time.sleep(0.005)

    def _refresh(self, names: list[str]) -> None:
        """Re-read the bootstrap table and register again with the silent ranks: at their new
        address when they moved (restarted), else where they are (a restarted rank may get
        its old port back; a rank that is merely slow answers the repeat as a no-op)."""
        try:
            reply = bootstrap_call(self.bootstrap, {"op": "get"},
                                   max(0.2, knobs.get("reconnect_interval_s")))
            table = reply.get("table", {})
            for name in names:
                g, src = int(name.split(".")[1][2:]), self.source_rank[name]
                addr = table.get(f"{g}/{src.pp}/{src.tp}")
                if addr is None:
                    continue
                if addr != self.addresses[name]:
                    with self.lock:
                        self.addresses[name] = addr
                        self.reg_state[name] = (KVPoll.Bootstrapping, "")
                        self.liveness.add(name, time.monotonic())  # a new peer: fresh window
                        self.counters["reconnects"] += 1
                    self.hub.connect(name, addr)
                self.hub.send(name, self._reg_payload)
        except ControlError:
            pass  # the leader itself may be gone; try again later
        finally:
            self._refreshing = False
