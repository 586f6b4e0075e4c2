"""The control messages of a prefill rank (hub thread): requests, aborts, replies."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from .. import knobs
from .. import wire as W
from ..indices import (
    DecodeTarget,
)
from ..plan_types import dp_group_of_room
from .common import (
    REG_ROOM,
    KVPoll,
    _clip,
)
from .handshake import _check_target
from .records import _Final, _Peer, _Room, _Target
from .states import TERMINAL, advanced

if TYPE_CHECKING:
    from .host import PrefillHost
else:  # Note [Typed mixins]: the hosts are for the type checker only
    PrefillHost = object


class PrefillControl(PrefillHost):
    """Part of PrefillEndpoint (prefill.py), whose state these methods use."""

    def _reply(self, identity: bytes, msg) -> None:
        self.hub.send(identity, self.wire.encode(msg))

    def _status(self, room: int, generation: int, state: KVPoll, reason: str = "", **kw):
        return W.Status(room=room, generation=generation, prefill_rank=self.rank, state=state,
                        reason=_clip(reason) if state == KVPoll.Failed else reason[:200], **kw)

    def _reject(self, identity: bytes, what: str, why: str, room: int = REG_ROOM,
                generation: int = 0) -> None:
        self.counters[f"rejected_{what}"] += 1
        self._reply(identity, self._status(room, generation, KVPoll.Failed, why))

    def _on_message(self, identity: bytes, payload: bytes) -> None:
        try:
            self._on_decoded(identity, payload)
        finally:
            # a request, abort or registration may make work: Note [Advance on the waking
            # thread]
            self.advance_here()

    def _on_decoded(self, identity: bytes, payload: bytes) -> None:
        try:
            msg = self.wire.decode(payload)
        except W.WireError as e:
            # Malformed input fails nothing but itself; tell the sender why.
            self._reject(identity, "malformed", f"malformed message: {e}")
            return
        peer = self.by_identity.get(identity)
        if peer is not None and self.liveness.heard(peer, time.monotonic()):
            self.counters["peers_revived"] += 1
        if isinstance(msg, W.Register):
            self._on_register(identity, msg)
        elif isinstance(msg, W.TransferRequest):
            self._on_request(identity, msg)
        elif isinstance(msg, W.Abort):
            self._on_abort(identity, msg)
        elif isinstance(msg, W.RingFreed):
            self._on_ring_freed(identity, msg)  # Note [Staging ring]
        elif isinstance(msg, W.Heartbeat):
            if peer is None:
                self.counters["rejected_heartbeat"] += 1
        else:
            self._reject(identity, "unexpected",
                         f"unexpected message: a decode rank does not send {type(msg).__name__}")

    def _decode_group(self, r: _Room) -> int:
        """Note [DP routing]: the router chooses a request's prefill DP rank and decode DP
        group and hands both to the schedulers; a request carries them instead of each side
        deriving them from the room id. Decode sends its TransferRequests only to the prefill
        group it was told (`receiver(..., prefill_dp_group=)`); prefill learns the decode
        group from `sender(..., decode_dp_group=)` or from the first TransferRequest (the
        group its sender registered in), and refuses requests and aborts from another group.
        Until either says, the default routing (room % dp) stands in, as when a router
        passes nothing."""
        if r.decode_dp is not None:
            return r.decode_dp
        return dp_group_of_room(r.room, self.plan.topology.decode.dp)

    def _waits_on(self, r: _Room, instance: str, dp: int) -> bool:
        """May room `r` be waiting on decode group `dp` of `instance`? A room learns its
        instance from its first TransferRequest (Note [Decode instances]); before that, only
        when every registered decode rank is of that instance."""
        if r.decode_instance is None:
            if any(p.instance != instance for p in self.peers.values()):
                return False
        elif r.decode_instance != instance:
            return False
        return self._decode_group(r) == dp

    def _other_instance(self, r: _Room, peer: _Peer) -> str:
        if r.decode_instance is None or r.decode_instance == peer.instance:
            return ""
        return (f"room {r.room} is served by decode instance {r.decode_instance!r}, and "
                f"{peer.name} is of instance {peer.instance!r}")

    def _other_group(self, r: _Room, peer: _Peer) -> str:
        if r.decode_dp is None or r.decode_dp == peer.dp:
            return ""
        return (f"room {r.room} is served by decode dp group {r.decode_dp}, and {peer.name} "
                f"is in group {peer.dp}")

    def _on_request(self, identity: bytes, msg) -> None:
        room, gen, rank = msg.room, msg.generation, msg.decode_rank
        # Any prefill DP group may serve any room: decode sends to the group the router chose.
        peer = self._requester(identity, room, rank)
        if isinstance(peer, str):
            self._reject(identity, "request", peer, room, gen)
            return
        target = DecodeTarget(
            np.asarray(msg.dst_page_ids, np.int64), int(msg.decode_prefix_tokens), msg.slot,
            msg.ring_slot, msg.aux_row, np.asarray(msg.window_page_ids, np.int64),
            tuple(zip(msg.layer_slots[0::2].tolist(), msg.layer_slots[1::2].tolist(),
                      strict=True)))
        why = _check_target(self.layout, peer.capacities, target)
        staged = None
        if not why and msg.staging_bytes:
            why, staged = self._check_staging(peer, rank, target, msg)
        with self.lock:
            r = self.rooms.get(room)
            if r is None:
                fin = self.finished.get(room)
                if fin is not None and (fin.generation is None or gen <= fin.generation):
                    self._answer_retired(identity, room, gen, fin)
                    return
                limit = knobs.get("max_pending_rooms")
                if len(self.rooms) >= limit:
                    self._reject(identity, "request", f"too many pending rooms (limit {limit})",
                                 room, gen)
                    return
                limit = knobs.get("max_pending_rooms_per_peer")
                if peer.rooms_created >= limit:
                    self._reject(identity, "request", f"too many pending rooms from {peer.name} "
                                 f"(limit {limit})", room, gen)
                    return
                r = self._new_room(room)
                r.created_by = peer
                peer.rooms_created += 1
            other = self._other_instance(r, peer)
            if other:  # before the generations: another instance's uses are not this room's
                self._reject(identity, "request", other, room, gen)
                return
            if r.generation is not None and gen < r.generation:
                self.counters["stale_requests"] += 1
                return  # decode has moved on to a newer use of this room
            if r.generation is not None and gen > r.generation:
                # A newer use: the current one ends (and drains) first (Note [Room uses]).
                r.fail(f"superseded by generation {gen} of room {room}")
                nxt = r.successor = r.successor or _Room(room)
                nxt.parked = [(i, m) for i, m in nxt.parked if m.decode_rank != rank]
                nxt.parked.append((identity, msg))  # the newest per decode rank: bounded
                self.counters["superseded"] += 1
                return
            r.generation = gen
            other = self._other_group(r, peer)
            if other:
                self._reject(identity, "request", other, room, gen)
                return
            if r.state == KVPoll.Failed:
                return  # the use is draining; its Failed status goes to this rank too
            r.decode_dp, r.decode_instance = peer.dp, peer.instance
            if rank in r.targets:
                self.counters["duplicate_requests"] += 1
                return
            if why:
                # Refused before any write: no byte of this request may land anywhere.
                self.counters["bad_index"] += 1
                r.fail(f"bad index from decode {rank}: {why}")
                return
            r.targets[rank] = _Target(target, peer, identity, staged)
            if len(r.targets) == len(self.links):
                r.t_requested = time.monotonic()
            r.state = advanced(r.state, KVPoll.WaitingForInput)

    def _answer_retired(self, identity: bytes, room: int, gen: int, fin: _Final) -> None:
        """A request for a use that already ended (caller holds the lock)."""
        if fin.state == KVPoll.Failed and (fin.generation is None or gen == fin.generation):
            self._reply(identity, self._status(room, gen, KVPoll.Failed, fin.reason))
        else:
            # A repeat of a request that succeeded (its Success went out), or an older one.
            self.counters["stale_requests"] += 1

    def _on_abort(self, identity: bytes, msg) -> None:
        room, gen, rank = msg.room, msg.generation, msg.decode_rank
        if self.faults.ack_abort_before_drain:  # Note [Fault hooks]: a sabotage run only
            self._reply(identity, W.AbortAck(room=room, generation=gen, prefill_rank=self.rank,
                                             drained=True))
            return
        peer = self._requester(identity, room, rank)
        if isinstance(peer, str):
            self._reject(identity, "abort", f"abort refused: {peer}")
            return
        self.counters["aborts"] += 1
        ack = W.AbortAck(room=room, generation=gen, prefill_rank=self.rank, drained=True)
        with self.lock:
            r = self.rooms.get(room)
            if r is None:
                fin = self.finished.get(room)
                if fin is None or (fin.generation is not None and gen > fin.generation):
                    # Aborted before this rank saw the room: remember it for a late sender.
                    self._remember(room, _Final(KVPoll.Failed, "aborted by decode", gen, False))
                self._reply(identity, ack)  # a retired use has nothing in flight
                return
            other = self._other_instance(r, peer)
            if other:
                self._reject(identity, "abort", f"abort refused: {other}")
                return
            if r.generation is not None and gen < r.generation:
                self._reply(identity, ack)  # that use retired (drained) before this began
                return
            if r.generation is not None and gen > r.generation:
                # Abort of a newer use that is still parked: nothing of it was issued.
                nxt = r.successor
                if nxt is not None:
                    nxt.parked = [(i, m) for i, m in nxt.parked
                                  if not (m.generation == gen and m.decode_rank == rank)]
                    nxt.fail("aborted by decode")
                self._reply(identity, ack)
                return
            other = self._other_group(r, peer)
            if other:
                self._reject(identity, "abort", f"abort refused: {other}")
                return
            r.aborted_by[rank] = (identity, gen)
            if r.stats.batches and r.state not in TERMINAL:
                self.counters["aborts_mid_transfer"] += 1
                if r.inflight:
                    self.counters["aborts_with_writes_in_flight"] += 1
            r.fail("aborted by decode")
