"""Prefill and decode endpoints: the request lifecycle on top of plans, pools and an engine.

Serving engines use the contract they know (names follow SGLang's): prefill
`endpoint.sender(room).send(...)` per chunk; decode `endpoint.receiver(room, generation)
.init(...)`; both `poll()` -> KVPoll and `abort()`.

Threads per endpoint: one control hub (ZeroMQ; owns the sockets, see control.Hub) and one
transfer worker (prefill only; owns the engine batches). State shared between them sits
behind one lock per endpoint. Status is monotone: Bootstrapping < WaitingForInput <
Transferring < Success; Failed is terminal and carries a reason.

Note [Registration room]: replies to a registration travel as Status messages for the
reserved room REG_ROOM, so the wire needs no separate message type for them. Messages a
prefill rank refuses without a room to fail (malformed bytes, an abort from a connection that
is not the registered rank) are answered the same way, with the reason.

Note [Failure semantics]: what each side promises, so that no byte of a request lands in
memory that was given to another one.
- A prefill rank reports a terminal state for a (room, generation) only once none of its
  writes for it is in flight: Success after the last batch completed, Failed (a Status, or
  an AbortAck with drained=true to a rank that aborted) after every issued batch completed
  or failed. A decode rank therefore counts a prefill rank as *quiet* for a request once it
  has any of these from it. When the writes cannot be drained within `drain_timeout_s`,
  prefill says so (AbortAck drained=false) and decode quarantines at once.
- A decode request that fails for any reason of its own (abort, deadline, silent peer,
  checksum) sends an Abort to every prefill rank not yet quiet. Its pages stay allocated
  (`page_state` PENDING) until all are quiet (REUSABLE), or for at most
  `abort_ack_timeout_s`, after which they are QUARANTINED: the serving engine must never
  reuse them (a frozen prefill rank may wake up and finish its writes).
- Generations: decode keys requests by (room, generation) and ignores every message of
  another generation. Prefill serves one use of a room at a time; a request or abort of a
  newer generation ends the current use (it fails and drains) before the next use starts
  (Note [Room uses]).
- Peers: a linked peer silent for `peer_dead_after_s` fails the requests that wait on it,
  with a reason; a restarted decode rank registers again and replaces its earlier
  incarnation, whose requests fail; decode re-reads the bootstrap table to reach a restarted
  prefill rank.
- Input: every message is decoded defensively (wire.py), every request and abort must come
  from the connection that registered as that rank, every index is checked before any
  write, and everything keyed by peer input is capped (knobs.py).

Note [Room uses]: `PrefillEndpoint.rooms` holds the live use of each room. A use starts at the
first `sender(room)` or TransferRequest, takes its generation from the first request, and
ends in Success or Failed (retired into the bounded `finished` table). While a failed use
still drains, a newer request and a new `sender(room)` go to its successor, which becomes
live when the old use retires. A use that failed before any sender attached (decode aborted
before prefill started, a bad index) answers the first later `sender(room)` with Failed, so
a late prefill scheduler learns of the abort instead of waiting for its deadline.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from . import integrity, knobs, staging
from . import wire as W
from .control import ControlError, Hub, bootstrap_call, fetch_table
from .datapath import LocalBuffer, RemoteBuffer, build_descriptors, component_pairs
from .engines.base import BatchState, TransferEngine, TransferError
from .indices import (
    DecodeTarget,
    IndexError_,
    PrefillChunk,
    check_capacity,
    check_page_coverage,
    prefill_pages_by_position,
    remap_kv_slots,
)
from .layout_types import FamilyLayout
from .metrics import RecordBuffer, TransferMetrics, TransferRecord, emit
from .plan_types import Plan, RankId, dp_group_of_room
from .pools import RankPools, address

REG_ROOM = 2**64 - 1


KVPoll = W.KVPoll  # one enum for the API and the wire (progress order, Failed terminal)
_TERMINAL = (KVPoll.Success, KVPoll.Failed)


class PageState(enum.Enum):
    """May the decode pages of a request be given to another request?"""

    IN_USE = "in_use"  # the request is not finished: prefill may write
    PENDING = "pending"  # failed; waiting for every prefill rank to confirm its writes drained
    REUSABLE = "reusable"  # no write of this request can land any more
    QUARANTINED = "quarantined"  # unknown: never reuse these pages


@dataclass
class RequestStats:
    bytes: int = 0
    descriptors: int = 0
    batches: int = 0
    t_init: float = 0.0
    t_done: float = 0.0


def check_backend(plan: Plan, engine: TransferEngine) -> None:
    """A plan runs only over the engine it was lowered for (Note [Plan backend]).

    Note [Plan backend]: lowering applies the backend's rules (NIXL and MORI refuse
    heterogeneous attention TP, MORI refuses PP), so a plan lowered for Mooncake and run over
    NIXL would bypass NIXL's refusal. Each endpoint refuses a plan for another engine before
    it registers anything; the plan digest exchanged in the handshake covers the backend, so
    two sides that pass this check with different plans are refused there. An engine names
    the backend its plans use (`TransferEngine.backend`): its own name, or "local" for
    cuda_ipc, which moves any descriptor list within one host as the local engines do.
    """
    if plan.topology.backend != engine.backend:
        runs = f"'{engine.name}'" if engine.backend == engine.name else \
            f"'{engine.name}' (plans for '{engine.backend}')"
        raise ValueError(
            f"the plan was lowered for backend '{plan.topology.backend}' but this endpoint's "
            f"engine is {runs}; hint: lower the plan for '{engine.backend}' (its "
            "backend rules may refuse this topology) or run the "
            f"'{plan.topology.backend}' engine")


def _peer_name(side: str, dp: int, rank: RankId) -> str:
    return f"{side}.dp{dp}.{rank}"


def _clip(reason: str) -> str:
    return reason.encode()[:W.MAX_REASON_BYTES].decode(errors="ignore") or "failed"


# ~~~ prefill ~~~


@dataclass
class _Chunk:
    chunk: PrefillChunk
    chunk_id: int
    stream: bool
    ready_layers: set = field(default_factory=set)
    all_ready: bool = False
    coverage_checked: bool = False
    # Note [Indices once per chunk]: a streamed chunk is submitted once per layer, and its
    # index pairs (and staging positions) depend only on the chunk and the decode target, so
    # they are computed on the first submit and reused by every later layer and the digest.
    pairs: dict = field(default_factory=dict)  # decode RankId -> component_pairs(...)
    positions: dict = field(default_factory=dict)  # decode RankId -> chunk_positions(...)
    sent_layers: set = field(default_factory=set)
    sent_all: bool = False


class _Peer:
    """One incarnation of a registered decode rank."""

    def __init__(self, name: str, identity: bytes, agent_info: bytes, engine_peer: str,
                 remote: dict, dp: int, rank: RankId, staging_arena: tuple[int, int] = (0, 0)):
        self.name = name
        self.staging_arena = staging_arena  # (address, bytes) decode registered for staging
        self.identity = identity
        self.agent_info = agent_info
        self.engine_peer = engine_peer
        self.remote = remote  # component -> [RemoteBuffer]
        self.dp = dp
        self.rank = rank
        self.last_heard = time.monotonic()
        self.dead = False
        self.rooms_created = 0  # live rooms its requests created (max_pending_rooms_per_peer)


@dataclass
class _Staged:
    """The staged part of one link of a request (Note [Staging layout])."""

    remote_addr: int  # decode's region
    nbytes: int
    blocks: list  # staging.Block
    local: object = None  # this rank's gather buffer (numpy or torch bytes), region layout
    arena_offset: int | None = None  # where `local` sits in the arena; None: its own buffer


@dataclass
class _Target:
    target: DecodeTarget
    peer: _Peer  # the incarnation that asked: writes go to its memory only
    identity: bytes
    staged: _Staged | None = None


@dataclass
class _Room:
    room: int
    generation: int | None = None  # from the first TransferRequest (Note [Room uses])
    chunks: list = field(default_factory=list)
    targets: dict = field(default_factory=dict)  # decode RankId -> _Target
    inflight: list = field(default_factory=list)  # engine Batches
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    aborted_by: dict = field(default_factory=dict)  # decode RankId -> (identity, generation)
    last_seen: bool = False
    has_sender: bool = False
    created: float = field(default_factory=time.monotonic)
    failed_at: float = 0.0
    successor: _Room | None = None
    parked: list = field(default_factory=list)  # (identity, TransferRequest) for this use
    checksum: bool = field(default_factory=lambda: bool(knobs.get("checksum")))
    digests: dict = field(default_factory=dict)  # decode RankId -> running link digest
    bytes_to: dict = field(default_factory=dict)  # decode RankId -> bytes written
    last_range: tuple = (0, 0)  # (page_start, page_count) of the last chunk
    retired: bool = False
    created_by: _Peer | None = None  # the peer whose request created the room
    decode_dp: int | None = None  # decode DP group serving it (Note [DP routing]); None: unknown
    t_requested: float = 0.0  # every linked decode rank's TransferRequest arrived
    remap_saved: list = field(default_factory=list)  # (row view, original bytes), Note [Slot-valued state]
    remapped: set = field(default_factory=set)  # components whose rows remap_saved holds
    stats: RequestStats = field(default_factory=RequestStats)

    def fail(self, reason: str) -> bool:
        """Failed, unless already terminal; returns whether it changed."""
        if self.state in _TERMINAL:
            return False
        self.state, self.reason, self.failed_at = KVPoll.Failed, reason, time.monotonic()
        return True


@dataclass
class _Final:
    """What a prefill rank remembers of a retired use of a room."""

    state: KVPoll
    reason: str
    generation: int | None
    had_sender: bool


class PrefillEndpoint:
    def __init__(self, layout: FamilyLayout, wire_module, plan: Plan, rank: RankId,
                 dp_group: int, engine: TransferEngine, pools: RankPools, bootstrap: str,
                 metrics: TransferMetrics | RecordBuffer | None = None):
        check_backend(plan, engine)
        self.metrics = metrics  # per-request records (runtime/metrics.py); None: log knob only
        self.rank_label = f"dp{dp_group}.pp{rank.pp}.tp{rank.tp}"
        self.transport = engine.transport()  # Note [Reported transport]
        self.layout = layout
        self.wire = wire_module
        self.plan = plan
        self.digest = bytes.fromhex(plan.digest())
        self.rank = rank
        self.dp_group = dp_group
        self.engine = engine
        self.pools = pools
        self.page_size = plan.topology.prefill.page_size
        self._has_pages = any(c.index == "page" for c in layout.components)
        self._slot_valued = [c for c in layout.components if c.holds == "kv_slots"]
        self.links = {lk.decode: lk for lk in plan.links_from(rank)}
        self.local = {
            name: [LocalBuffer(pools.address(name, i), b.item_bytes, b.capacity)
                   for i, b in enumerate(bufs)]
            for name, bufs in pools.buffers.items()
        }
        for base, nbytes in pools.regions():
            engine.register(base, nbytes)
        # Gather buffers of the staged path; only the transfer worker touches the arena.
        self.arena = _staging_arena(engine, pools)
        self.launches = _launches(pools, layout)  # worker thread only
        self.lock = threading.Lock()
        self.rooms: dict[int, _Room] = {}
        self.finished: OrderedDict[int, _Final] = OrderedDict()
        # Streaming sends every real layer and every sentinel once the forward is done.
        self._all_ids = {i for i, _ in layout.kind_of} | {
            c.sentinel for c in layout.components if c.request_wide}
        # (event, mark, [(use, its streaming chunks)]) of layer_done / forward_done calls whose
        # CUDA event had not completed yet, in call order
        self._waiting_events: list = []
        self.peers: dict[tuple[int, RankId], _Peer] = {}
        self.by_identity: dict[bytes, _Peer] = {}
        self.engine_peers: set[bytes] = set()  # agent infos connected (max_registrations)
        self.counters: Counter = Counter()
        self._stop = threading.Event()
        self.wake = threading.Event()  # set when the worker may have new work
        self._hb_seq = 0
        self._last_hb = 0.0
        self._last_tick = 0.0
        self.max_stall_s = 0.0  # longest gap between two timer runs of the control thread
        # Last: the hub thread starts handling messages and timers at once.
        self.hub = Hub(self._on_message, bind=True, on_tick=self._tick)
        p = plan.topology.prefill
        bootstrap_call(bootstrap, {"op": "put", "dp": dp_group, "pp": rank.pp, "tp": rank.tp,
                                   "endpoint": self.hub.address,
                                   "expected": p.dp * p.pp * p.tp},
                       knobs.get("bootstrap_timeout_s"))
        self.worker = threading.Thread(target=self._work, name="pdc-prefill-worker", daemon=True)
        self.worker.start()

    # ~~~ serving-engine API ~~~

    def sender(self, room: int, generation: int | None = None,
               decode_dp_group: int | None = None) -> PrefillSender:
        """Start (or join) this rank's use of `room` (Note [Room uses]). Pass the request's
        generation when the scheduler knows it (the router handed it out with the room): the
        sender then serves that generation only, even if it comes late. `decode_dp_group` is
        the router's choice of decode DP group (Note [DP routing]); without it the group is
        learned from the first TransferRequest."""
        ddp = self.plan.topology.decode.dp
        if decode_dp_group is not None and not 0 <= decode_dp_group < ddp:
            raise ValueError(f"room {room}: decode dp group {decode_dp_group} does not exist "
                             f"(the plan has {ddp})")
        g = generation
        with self.lock:
            live = self.rooms.get(room)
            if live is None:
                fin = self.finished.get(room)
                if fin is not None and fin.state == KVPoll.Failed and not fin.had_sender and (
                        g is None or fin.generation is None or g == fin.generation):
                    # The use ended before prefill started it (decode aborted first, or its
                    # request was refused): this sender reports that and sends nothing.
                    fin.had_sender = True
                    return self._ended(room, fin.generation, fin.reason)
                if fin is not None and g is not None and fin.generation is not None and \
                        g < fin.generation:
                    return self._ended(room, g, f"superseded by generation {fin.generation}")
                r = self._new_room(room)
                r.generation = g
            elif g is not None and live.generation is not None and g < live.generation:
                return self._ended(room, g, f"superseded by generation {live.generation}")
            elif g is not None and live.generation is not None and g > live.generation or \
                    live.has_sender and live.state == KVPoll.Failed:
                # The next use: it starts once the current one has ended and drained.
                r = live.successor = live.successor or _Room(room)
                if r.has_sender:
                    raise ValueError(f"room {room}: the next use already has a sender")
                r.generation = g if g is not None else r.generation
            elif not live.has_sender:
                r = live  # created by decode's request (or failed before a sender came)
                r.generation = g if r.generation is None else r.generation
            else:
                raise ValueError(f"room {room} already has a live sender")
            r.has_sender = True
            if decode_dp_group is not None:
                if r.decode_dp is not None and r.decode_dp != decode_dp_group:
                    r.fail(f"the router chose decode dp group {decode_dp_group} for room "
                           f"{room}, but its transfer request came from group {r.decode_dp}")
                r.decode_dp = decode_dp_group
            return PrefillSender(self, r)

    def _ended(self, room: int, generation: int | None, reason: str) -> PrefillSender:
        """A sender for a use that is already over: poll() says Failed and why."""
        self.counters["late_senders"] += 1
        r = _Room(room, generation, state=KVPoll.Failed, reason=reason, has_sender=True,
                  retired=True)
        return PrefillSender(self, r)

    def layer_done(self, layer_id: int, event=None) -> None:
        """The forward finished writing `layer_id` for every streaming chunk sent so far.

        On a GPU the kernels are only queued when the forward returns from a layer: pass the
        CUDA event recorded after it (anything with `query()`); the worker issues the layer's
        writes once the event has completed, and never blocks the forward's thread."""
        self._mark(event, lambda c: c.ready_layers.add(layer_id))
        self.wake.set()

    def forward_done(self, event=None) -> None:
        """The forward finished: every streaming chunk sent so far is complete (once `event`,
        if given, has completed)."""
        self._mark(event, lambda c: setattr(c, "all_ready", True))

    def _mark(self, event, mark) -> None:
        with self.lock:
            uses = [(r, [c for c in r.chunks if c.stream]) for r in self._uses()]
            if event is None:
                for _, chunks in uses:
                    for c in chunks:
                        mark(c)
            else:
                self._waiting_events.append((event, mark, uses))

    def _poll_events(self) -> None:
        """Apply layer_done / forward_done calls whose CUDA events completed, in call order
        (a later layer's event never overtakes an earlier one's)."""
        with self.lock:
            while self._waiting_events:
                event, mark, uses = self._waiting_events[0]
                try:
                    if not event.query():
                        return
                except Exception as e:  # noqa: BLE001 - a broken forward fails its requests
                    for r, _ in uses:
                        r.fail(f"the forward's event for this layer failed: {e!r}")
                    self._waiting_events.pop(0)
                    continue
                self._waiting_events.pop(0)
                for _, chunks in uses:
                    for c in chunks:
                        mark(c)

    def _uses(self):
        for r in self.rooms.values():
            yield r
            if r.successor is not None:
                yield r.successor

    def stats(self) -> dict:
        """Counters and table sizes, for tests and monitoring."""
        with self.lock:
            out = dict(self.counters)
            out.update(rooms=len(self.rooms), finished=len(self.finished),
                       peers=len(self.peers), engine_peers=len(self.engine_peers),
                       dropped_sends=self.hub.dropped, handler_errors=self.hub.handler_errors,
                       max_stall_ms=round(self.max_stall_s * 1e3),
                       transport=self.transport.describe())
            return out

    def close(self) -> None:
        self._stop.set()
        self.wake.set()
        self.worker.join(timeout=5)
        self.hub.close()
        _deregister_arena(self.engine, self.arena)

    def _new_room(self, room: int) -> _Room:
        r = self.rooms[room] = _Room(room)
        self.finished.pop(room, None)
        return r

    # ~~~ control messages (hub thread) ~~~

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
            self.wake.set()  # a request, abort or registration may give the worker work

    def _on_decoded(self, identity: bytes, payload: bytes) -> None:
        try:
            msg = self.wire.decode(payload)
        except W.WireError as e:
            # Malformed input fails nothing but itself; tell the sender why.
            self._reject(identity, "malformed", f"malformed message: {e}")
            return
        peer = self.by_identity.get(identity)
        if peer is not None:
            peer.last_heard = time.monotonic()
            if peer.dead:
                peer.dead = False
                self.counters["peers_revived"] += 1
        if isinstance(msg, W.Register):
            self._on_register(identity, msg)
        elif isinstance(msg, W.TransferRequest):
            self._on_request(identity, msg)
        elif isinstance(msg, W.Abort):
            self._on_abort(identity, msg)
        elif isinstance(msg, W.Heartbeat):
            if peer is None:
                self.counters["rejected_heartbeat"] += 1
        else:
            self._reject(identity, "unexpected",
                         f"unexpected message: a decode rank does not send {type(msg).__name__}")

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
        key = (msg.dp_group, msg.rank)
        old = self.peers.get(key)
        if old is not None and old.identity == identity and old.agent_info == msg.agent_info:
            self._reply(identity, self._status(REG_ROOM, 0, KVPoll.WaitingForInput))
            return  # the same incarnation registering again: nothing changes
        limit = knobs.get("max_registrations")
        if msg.agent_info not in self.engine_peers and len(self.engine_peers) >= limit:
            self._reject(identity, "register",
                         f"too many transfer-engine peers on this prefill rank (limit {limit})")
            return
        try:
            engine_peer = self.engine.connect(msg.agent_info)
        except Exception as e:  # noqa: BLE001 - engine errors are reported, not raised
            self._reject(identity, "register", f"cannot connect the transfer engine: {e}")
            return
        self.engine_peers.add(msg.agent_info)
        remote = {
            comp.name: [RemoteBuffer(e.layer_id, comp.tensors.index(e.tensor), e.base_addr,
                                     e.item_bytes, e.capacity_items)
                        for e in section.entries]
            for comp, section in zip(self.layout.components, msg.sections, strict=True)
        }
        name = _peer_name("decode", msg.dp_group, msg.rank)
        new = _Peer(name, identity, msg.agent_info, engine_peer, remote, msg.dp_group, msg.rank,
                    (msg.staging_addr, msg.staging_bytes))
        with self.lock:
            if old is not None:
                # A restarted decode rank: its earlier requests name pages of a process that
                # is gone, and no byte of them may land in the new one; rooms still waiting
                # for its request would wait for a request that the new process never sends.
                self.counters["reregistrations"] += 1
                self.by_identity.pop(old.identity, None)
                for r in self.rooms.values():
                    if any(t.peer is old for t in r.targets.values()) or (
                            msg.rank not in r.targets and r.state not in _TERMINAL and
                            self._decode_group(r) == msg.dp_group):
                        r.fail(f"decode rank {name} registered again (restarted); requests of "
                               "its previous incarnation fail")
            self.peers[key] = new
            self.by_identity[identity] = new
        self.counters["registrations"] += 1
        self._reply(identity, self._status(REG_ROOM, 0, KVPoll.WaitingForInput))

    def _requester(self, identity: bytes, room: int, rank: RankId) -> _Peer | str:
        """The registered peer a request or abort must come from, or why it may not."""
        if rank not in self.links:
            return f"decode rank {rank} has no link to prefill rank {self.rank}"
        peer = self.by_identity.get(identity)
        if peer is None or peer.rank != rank:
            return f"room {room}: this connection did not register as decode rank {rank}"
        return peer

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
            msg.ring_slot, msg.aux_row, np.asarray(msg.window_page_ids, np.int64))
        why = _check_target(self.layout, peer.remote, target)
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
            r.decode_dp = peer.dp
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
            if r.state < KVPoll.WaitingForInput:
                r.state = KVPoll.WaitingForInput

    def _check_staging(self, peer: _Peer, rank: RankId, target: DecodeTarget,
                       msg) -> tuple[str, _Staged | None]:
        """A staged request's region against decode's registered arena and the staging layout
        this rank derives from the plan and the request (Note [Staging layout])."""
        lo, size = peer.staging_arena
        addr, nbytes = msg.staging_addr, msg.staging_bytes
        if not (lo <= addr and addr + nbytes <= lo + size):
            return (f"staging region {addr:#x}+{nbytes} is outside the staging arena decode "
                    f"registered ({lo:#x}+{size})"), None
        items = staging.request_items(self.layout, target, self.page_size)
        blocks, need = staging.link_blocks(self.links[rank], items)
        if nbytes != need:
            return (f"staging region of {nbytes} bytes; this request's staging layout needs "
                    f"{need} (both sides must lower the same plan)"), None
        return "", _Staged(addr, nbytes, blocks)

    def _answer_retired(self, identity: bytes, room: int, gen: int, fin: _Final) -> None:
        """A request for a use that already ended (caller holds the lock)."""
        if fin.state == KVPoll.Failed and (fin.generation is None or gen == fin.generation):
            self._reply(identity, self._status(room, gen, KVPoll.Failed, fin.reason))
        else:
            # A repeat of a request that succeeded (its Success went out), or an older one.
            self.counters["stale_requests"] += 1

    def _on_abort(self, identity: bytes, msg) -> None:
        room, gen, rank = msg.room, msg.generation, msg.decode_rank
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
            if r.stats.batches and r.state not in _TERMINAL:
                self.counters["aborts_mid_transfer"] += 1
                if r.inflight:
                    self.counters["aborts_with_writes_in_flight"] += 1
            r.fail("aborted by decode")
            # The worker acks once every issued write of the room completed or failed.

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_hb >= knobs.get("heartbeat_interval_s"):
            self._last_hb = now
            self._hb_seq += 1
            hb = self.wire.encode(W.Heartbeat(side=W.PeerSide.PREFILL, rank=self.rank,
                                              sequence=self._hb_seq,
                                              monotonic_ns=time.monotonic_ns()))
            for p in list(self.peers.values()):
                self.hub.send(p.identity, hb)
        dead_after = knobs.get("peer_dead_after_s")
        with self.lock:
            gap = now - self._last_tick if self._last_tick else 0.0
            self.max_stall_s = max(self.max_stall_s, gap)
            stalled = gap > dead_after
            self._last_tick = now
            for p in self.peers.values():
                if stalled:
                    # This process did not run for a while (stopped or starved): silence it
                    # could not hear says nothing about the peers. Give them a fresh window.
                    p.last_heard = max(p.last_heard, now)
                if p.dead or now - p.last_heard <= dead_after:
                    continue
                p.dead = True
                self.counters["peers_dead"] += 1
                for r in self.rooms.values():
                    if p.rank in self.links and r.state not in _TERMINAL and \
                            self._decode_group(r) == p.dp:
                        r.fail(f"decode peer {p.name} silent for {dead_after} s")

    # ~~~ transfer worker ~~~

    def _peers_of(self, r: _Room) -> list[tuple[RankId, _Peer | None]]:
        g = self._decode_group(r)
        return [(d, self.peers.get((g, d))) for d in self.links]

    def _work(self) -> None:
        sleep_s = knobs.get("poll_sleep_s")
        while not self._stop.is_set():
            self.wake.clear()  # before the scan: work that arrives during it sets it again
            busy = waiting = False
            if self._waiting_events:
                self._poll_events()
            with self.lock:
                rooms = list(self.rooms.values())
                waiting = bool(self._waiting_events)
            for r in rooms:
                try:
                    busy |= self._advance(r)
                    waiting |= bool(r.inflight)
                except Exception as e:  # noqa: BLE001 - one room's bug must not stop all
                    import sys
                    import traceback

                    self.counters["worker_errors"] += 1
                    print(f"pdc: prefill worker error on room {r.room}: {e!r}", file=sys.stderr)
                    traceback.print_exc()
                    with self.lock:
                        r.fail(f"internal error: {e!r}")
            if not busy:
                # Nothing moved: poll in-flight writes again soon, but never spin on them;
                # with none in flight, sleep until a message or a sender call wakes us.
                if waiting:
                    time.sleep(sleep_s)
                else:
                    self.wake.wait(sleep_s * 10)

    def _poll_inflight(self, r: _Room) -> None:
        still = []
        for b in r.inflight:
            st = self.engine.poll(b)
            if st is BatchState.PENDING:
                still.append(b)
            elif st is BatchState.FAILED:
                with self.lock:
                    r.fail(f"transfer failed: {b.reason}")
        r.inflight = still

    def _advance(self, r: _Room) -> bool:
        """Move one room forward; returns whether anything happened."""
        had = len(r.inflight)
        if had:
            self._poll_inflight(r)
        now = time.monotonic()
        with self.lock:
            if r.state not in _TERMINAL and now - r.created > knobs.get("prefill_room_timeout_s"):
                r.fail(self._timeout_reason(r))
            state = r.state
            peers = self._peers_of(r)
        if state == KVPoll.Failed:
            return self._finish_failed(r)
        if r.inflight:
            return len(r.inflight) < had  # still waiting on its writes
        if any(p is None for _, p in peers) or any(d not in r.targets for d, _ in peers):
            return False  # waiting for decode registration or its TransferRequest
        for d, p in peers:
            if r.targets[d].peer is not p:
                with self.lock:
                    r.fail(f"decode rank {p.name} registered again (restarted); requests of "
                           "its previous incarnation fail")
                return True
        progressed = False
        for c in list(r.chunks):
            if c.sent_all:
                continue
            if not c.stream:
                layers, finished = None, True
            elif c.all_ready:
                layers, finished = (self._all_ids - c.sent_layers), True
            else:
                layers, finished = (c.ready_layers - c.sent_layers), False
                if not layers:
                    continue
            with self.lock:
                if r.state == KVPoll.Failed:
                    return True  # stop issuing: an abort or a failure arrived meanwhile
            try:
                if c.chunk.last and not c.coverage_checked and self._has_pages:
                    # Before the last chunk's first write (Note [Exact page coverage]).
                    for t in r.targets.values():
                        first = min(c.prefix_pages(t.target.prefix_len, self.page_size)
                                    for c in self.layout.components if c.index == "page")
                        check_page_coverage([x.chunk for x in r.chunks], t.target,
                                            self.page_size, first)
                    c.coverage_checked = True
                if c.chunk.last and self._slot_valued:
                    # Only once the row is final: its sentinel's turn (forward_done) or now.
                    due = [comp for comp in self._slot_valued if comp.name not in r.remapped
                           and (layers is None or comp.sentinel in layers)]
                    if due:
                        self._remap_slots(r, c, due)
                self._submit(r, c, layers)
                if finished and r.checksum:
                    self._digest_chunk(r, c)
            except (IndexError_, ValueError) as e:
                with self.lock:
                    r.fail(f"bad index: {e}")
                return True
            except TransferError as e:
                with self.lock:
                    r.fail(f"transfer refused: {e}")
                return True
            if layers is not None:
                c.sent_layers |= layers
            c.sent_all = finished
            if c.chunk.last and finished:
                r.last_range = (c.chunk.page_start, len(c.chunk.page_ids))
            progressed = True
        if r.inflight:
            with self.lock:
                if r.state < KVPoll.Transferring:
                    r.state = KVPoll.Transferring
            return True
        if r.last_seen and all(c.sent_all for c in r.chunks):
            self._finish_success(r)
            return True
        return progressed

    def _timeout_reason(self, r: _Room) -> str:
        t = knobs.get("prefill_room_timeout_s")
        missing = [str(d) for d, _ in self._peers_of(r) if d not in r.targets]
        if missing:
            return f"no transfer request from decode rank(s) {', '.join(missing)} within {t} s"
        if not r.has_sender or not r.last_seen:
            return f"prefill did not send the last chunk within {t} s"
        return f"transfer not finished within {t} s"

    def _submit(self, r: _Room, c: _Chunk, layers) -> None:
        """Issue one chunk's writes (`layers`: only these; None: all) to every decode target."""
        for d, t in r.targets.items():
            pairs = self._pairs(c, d, t)
            desc = build_descriptors(self.links[d], self.local, t.peer.remote, pairs, layers,
                                     whole_only=t.staged is not None)
            src, dst, nbytes = desc.src, desc.dst, desc.nbytes
            if t.staged is not None:
                s2, d2, n2 = self._gather(c, t, self.links[d], layers)
                src, dst, nbytes = (np.concatenate([a, b.astype(np.uint64)]) for a, b in
                                    ((src, s2), (dst, d2), (nbytes, n2)))
            if len(src) == 0:
                continue
            if r.stats.batches == 0:
                r.stats.t_init = time.monotonic()
            batch = self.engine.submit_write(t.peer.engine_peer, src, dst, nbytes)
            total = int(nbytes.sum())
            r.inflight.append(batch)
            r.stats.bytes += total
            r.stats.descriptors += len(src)
            r.stats.batches += 1
            r.bytes_to[d] = r.bytes_to.get(d, 0) + total

    def _remap_slots(self, r: _Room, c: _Chunk, due: list) -> None:
        """Note [Slot-valued state]: some request-wide rows hold token slots of the KV page
        pool (e.g. the DSA top-k seed as physical slots, `holds: kv_slots` in the spec);
        copied as bytes they would name prefill's pages on decode. Before the last chunk's
        writes, prefill rewrites its own row to decode's slots of the same token positions
        (it knows both page lists), and restores the row when the use retires, so a retry
        starts from the serving engine's values. Every decode rank of the request must hold
        the same page list (they share one page table); otherwise the request fails."""
        chunks = [x.chunk for x in r.chunks]
        n = max((ch.page_start + len(ch.page_ids) for ch in chunks), default=0)
        src_pages = prefill_pages_by_position(chunks, n)
        targets = list(r.targets.values())
        dst = targets[0].target.page_ids
        if any(not np.array_equal(t.target.page_ids, dst) for t in targets[1:]):
            raise IndexError_("decode ranks of the request hold different page lists; "
                              "slot-valued state needs one page table")
        dst = np.concatenate([np.asarray(dst, np.int64), np.full(max(0, n - len(dst)), -1)])
        for comp in due:
            r.remapped.add(comp.name)
            row_id = c.chunk.aux_row if comp.index == "aux" else c.chunk.slot
            if row_id < 0:
                continue  # a missing row id fails the request in component_pairs
            dtype = np.dtype(comp.dtype)
            for pos in range(len(self.pools.buffers.get(comp.name, ()))):
                row = self.pools.view(comp.name, pos)[row_id]
                host = row if isinstance(row, np.ndarray) else row.cpu().numpy()
                original = host.copy()
                mapped = remap_kv_slots(original.view(dtype), src_pages, dst, self.page_size,
                                        f"'{comp.name}'").astype(dtype)
                if isinstance(row, np.ndarray):
                    row[:] = mapped.view(np.uint8)
                else:
                    import torch

                    row.copy_(torch.from_numpy(mapped.view(np.uint8)))
                    original = torch.from_numpy(original).to(row.device)
                r.remap_saved.append((row, original))

    def _pairs(self, c: _Chunk, d: RankId, t: _Target) -> dict:
        """Note [Indices once per chunk]."""
        pairs = c.pairs.get(d)
        if pairs is None:
            pairs = c.pairs[d] = component_pairs(self.layout, c.chunk, t.target, self.page_size)
        return pairs

    def _gather(self, c: _Chunk, t: _Target, link, layers):
        """Pack the chunk's pieces of the link's partial entries into this rank's gather
        buffer at their staging offsets; one descriptor per contiguous stretch of it."""
        st = t.staged
        if st.local is None:
            self._reserve_gather_buffer(st)
        base = address(st.local)
        positions = c.positions.get(t.peer.rank)
        if positions is None:
            positions = c.positions[t.peer.rank] = staging.chunk_positions(
                self.layout, c.chunk, t.target, self.page_size)
        if self.launches is not None:
            offs_a, lens_a = self.launches.gather_chunk(link, st.blocks, self.pools.view,
                                                        positions, layers, st.local)
            if len(offs_a) and not self.engine.orders_after(self.pools.device):
                self.pools.sync()  # the engine reads the gather buffer once it is submitted
            return staging.merge_descriptors(base + offs_a, st.remote_addr + offs_a, lens_a)
        # Blocks of one component share the chunk's runs of items: (component, j0, n) -> (ids,
        # blocks), checked once and, with the copy kernels, gathered in one launch.
        groups: dict[tuple, tuple] = {}
        for b, ids, j0, n in staging.chunk_block_ranges(st.blocks, link, positions, layers):
            if j0 + n > b.items:
                raise IndexError_(f"'{link.entries[b.entry].component}' staging item "
                                  f"{j0 + n - 1} is outside the {b.items} items decode asked for")
            groups.setdefault((link.entries[b.entry].component, j0, n), (ids, []))[1].append(b)
        offs, lens = [], []
        for (comp, j0, n), (ids, blocks) in groups.items():
            pools = [self.pools.view(comp, link.entries[b.entry].src_pos) for b in blocks]
            check_capacity(ids, min(p.shape[0] for p in pools), f"prefill '{comp}'")
            for b, pool in zip(blocks, pools, strict=True):
                tb = b.segment.total_bytes
                at = b.offset + j0 * tb
                staging.gather(pool, ids, b.segment, st.local[at:at + n * tb])
                offs.append(at)
                lens.append(n * tb)
        if offs:
            self.pools.sync()  # the engine reads the gather buffer as soon as it is submitted
        offs_a = np.asarray(offs, np.int64)
        return staging.merge_descriptors(base + offs_a, st.remote_addr + offs_a,
                                         np.asarray(lens, np.int64))

    def _reserve_gather_buffer(self, st: _Staged) -> None:
        off = self.arena.alloc(st.nbytes) if self.arena is not None else None
        if off is not None:
            st.local, st.arena_offset = self.arena.view(off, st.nbytes), off
            return
        # The arena is full (or off): a buffer of its own, registered for this request only.
        self.counters["staging_own_buffers"] += 1
        st.local = self.pools.new_bytes(max(st.nbytes, 1), zeroed=False)
        self.engine.register(address(st.local), len(st.local))

    def _free_gather_buffers(self, r: _Room, drained: bool) -> None:
        """Give back the gather buffers of a retired use. Not after an undrained failure: a
        stuck write may still read them (decode quarantines its side)."""
        for t in r.targets.values():
            st = t.staged
            if st is None or st.local is None:
                continue
            if not drained:
                self.counters["staging_bytes_stranded"] += st.nbytes
            elif st.arena_offset is not None:
                self.arena.release(st.arena_offset, st.nbytes)
            else:
                self.engine.deregister(address(st.local))
            st.local = None

    def _digest_chunk(self, r: _Room, c: _Chunk) -> None:
        """Add a complete chunk's source bytes to each link's digest (Note [Link digest])."""
        for d, t in r.targets.items():
            pairs = self._pairs(c, d, t)
            part = integrity.link_digest(r.room, r.generation, self.links[d], self.pools.view,
                                         pairs, "src")
            r.digests[d] = integrity.add(r.digests.get(d, 0), part)

    def _finish_success(self, r: _Room) -> None:
        with self.lock:
            if r.state == KVPoll.Failed:
                return  # an abort won the race; the next round drains and acks it
            r.state = KVPoll.Success
            r.stats.t_done = time.monotonic()
            parked = self._retire(r)
            sends = [(t.identity, self._status(
                r.room, r.generation, KVPoll.Success, bytes_written=r.bytes_to.get(d, 0),
                checksum=r.digests.get(d, 0) if r.checksum else None,
                page_start=r.last_range[0], page_count=r.last_range[1]))
                for d, t in r.targets.items()]
            self.counters["succeeded"] += 1
        self._free_gather_buffers(r, drained=True)
        for ident, st in sends:
            self._reply(ident, st)
        self._replay(parked)

    def _finish_failed(self, r: _Room) -> bool:
        drained = True
        if r.inflight:
            if time.monotonic() - r.failed_at < knobs.get("drain_timeout_s"):
                return False  # drain first: no write of this room may land after the ack
            drained = False  # writes stuck (e.g. a frozen peer): say so, decode quarantines
            self.counters["drain_timeouts"] += 1
        with self.lock:
            if self.rooms.get(r.room) is not r:
                return False
            parked = self._retire(r)
            reason = r.reason or "failed"
            gen = r.generation
            sends = []
            for d, p in self._peers_of(r):
                if d in r.aborted_by:
                    ident, agen = r.aborted_by[d]
                    sends.append((ident, W.AbortAck(room=r.room, generation=agen,
                                                    prefill_rank=self.rank, drained=drained)))
                    continue
                t = r.targets.get(d)
                ident = t.identity if t is not None else (p.identity if p is not None else None)
                if ident is None or gen is None:
                    continue
                if not drained:
                    sends.append((ident, W.AbortAck(room=r.room, generation=gen,
                                                    prefill_rank=self.rank, drained=False)))
                sends.append((ident, self._status(r.room, gen, KVPoll.Failed, reason)))
            self.counters["failed"] += 1
        self._free_gather_buffers(r, drained)
        for ident, msg in sends:
            self._reply(ident, msg)
        self._replay(parked)
        return True

    def _retire(self, r: _Room) -> list:
        """End a use of a room (caller holds the lock): remember its outcome, make its
        successor live; returns the successor's parked requests to handle again."""
        if self.rooms.get(r.room) is r:
            del self.rooms[r.room]
        if r.created_by is not None:
            r.created_by.rooms_created -= 1
            r.created_by = None
        r.retired = True
        r.inflight = [] if r.state == KVPoll.Failed else r.inflight
        for row, original in r.remap_saved:
            row[:] = original  # the source row as the serving engine wrote it
        r.remap_saved, r.remapped = [], set()
        emit(self.metrics, TransferRecord(
            side="prefill", rank=self.rank_label, room=r.room, ok=r.state == KVPoll.Success,
            reason=r.reason if r.state == KVPoll.Failed else "", bytes=r.stats.bytes,
            descriptors=r.stats.descriptors, batches=r.stats.batches, engine=self.engine.name,
            t_start=r.created, t_bootstrap_done=r.t_requested, t_first_write=r.stats.t_init,
            t_done=time.monotonic()))
        self._remember(r.room, _Final(r.state, r.reason, r.generation, r.has_sender))
        nxt, r.successor = r.successor, None
        if nxt is None:
            return []
        self.rooms[r.room] = nxt
        self.finished.pop(r.room, None)
        nxt.created = time.monotonic()
        parked, nxt.parked = nxt.parked, []
        return parked

    def _remember(self, room: int, fin: _Final) -> None:
        self.finished[room] = fin
        self.finished.move_to_end(room)
        while len(self.finished) > knobs.get("max_finished_rooms"):
            self.finished.popitem(last=False)

    def _replay(self, parked: list) -> None:
        for identity, msg in parked:
            self._on_request(identity, msg)


def _launches(pools: RankPools, layout) -> staging.Launches | None:
    """Copy-kernel launches for the staged path on device pools (the staging_copies knob),
    through the family's generated kernels module where it has one."""
    mode = knobs.get("staging_copies")
    if mode not in ("auto", "torch", "kernels"):
        raise ValueError(f"staging_copies is {mode!r}; use auto, torch or kernels")
    device = getattr(pools, "device", None)
    if device is None or mode == "torch" or (mode == "auto" and device.type != "cuda"):
        return None
    return staging.Launches(staging.family_kernels(layout))


def _staging_arena(engine: TransferEngine, pools: RankPools) -> staging.Arena | None:
    """The rank's staging arena, in the pools' memory (host or device), registered."""
    nbytes = knobs.get("staging_arena_bytes")
    if nbytes <= 0:
        return None
    arena = staging.Arena(nbytes, pools.new_bytes(max(nbytes, staging.Arena.ALIGN),
                                                  zeroed=False))
    engine.register(arena.base, len(arena.buf))
    return arena


def _deregister_arena(engine: TransferEngine, arena: staging.Arena | None) -> None:
    """An endpoint registered its staging arena itself, so it deregisters it: an engine that
    outlives the endpoint (the parity harness reuses engines) must not keep the range."""
    if arena is None:
        return
    try:
        engine.deregister(arena.base)
    except TransferError:
        pass  # the engine is already closed


def _check_target(layout: FamilyLayout, remote: dict, t: DecodeTarget) -> str:
    """Every id of a decode request against the capacities that decode registered."""
    for comp in layout.components:
        bufs = remote.get(comp.name, [])
        if not bufs:
            continue
        cap = min(b.capacity for b in bufs)
        if comp.index == "page":
            ids, what = t.page_ids, "page"
        elif comp.index == "window":
            ids, what = t.window_page_ids, "window page"
        elif comp.index == "slot":
            ids, what = np.array([t.slot]), "slot"
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


class PrefillSender:
    """Prefill's handle on one use of a room (Note [Room uses])."""

    def __init__(self, ep: PrefillEndpoint, r: _Room):
        self.ep = ep
        self.room = r.room
        self._r = r
        self._chunk_id = 0

    def send(self, page_ids, page_start: int, last_chunk: bool, seq_len: int, *, slot: int = -1,
             ring_slot: int = -1, aux_row: int = -1, window_page_ids=None,
             stream: bool = False) -> None:
        """Queue one chunk: its pages (absolute positions page_start..), and with the last
        chunk the slot / ring / aux ids. `stream=True` holds each layer until layer_done().
        A chunk for a use that already failed (e.g. decode aborted) is dropped: poll() says
        Failed and why."""
        chunk = PrefillChunk(page_start, np.asarray(page_ids, np.int64), last_chunk, seq_len,
                             slot, ring_slot, aux_row,
                             None if window_page_ids is None else np.asarray(window_page_ids,
                                                                             np.int64))
        with self.ep.lock:
            r = self._r
            if r.last_seen:
                raise ValueError(f"room {self.room}: send() after the last chunk")
            r.last_seen = last_chunk
            if r.state == KVPoll.Failed or r.retired:
                self.ep.counters["chunks_dropped"] += 1
                return
            r.chunks.append(_Chunk(chunk, self._chunk_id, stream))
            self._chunk_id += 1
        self.ep.wake.set()

    def send_cached(self, page_ids, cached_tokens: int) -> None:
        """Send the pages prefill holds from its own prefix cache now, before the forward.

        Note [Cached-prefix early send]: a prefix-cache hit on prefill leaves pages that are
        final before the forward runs ("lever B"). They go out at once as one complete
        chunk at positions 0.. (`cached_tokens` tokens), while the forward's chunks follow
        with `stream=True` from the first page not wholly cached, so the transfer of the
        cached part overlaps the forward instead of following its layers. Pages below
        decode's own prefix are still skipped (Note [Prefix skip])."""
        self.send(page_ids, 0, False, cached_tokens)

    def poll(self) -> KVPoll:
        """Terminal only once no write of this use is in flight: the caller may reuse its
        source pages as soon as it sees Success or Failed."""
        with self.ep.lock:
            r = self._r
            if r.state == KVPoll.Failed and not r.retired:
                return KVPoll.Transferring if r.inflight or r.stats.batches else \
                    KVPoll.WaitingForInput
            return r.state

    @property
    def stats(self) -> RequestStats:
        """Bytes, descriptors, batches and first-submit / done times of this request."""
        with self.ep.lock:
            return self._r.stats

    @property
    def reason(self) -> str:
        with self.ep.lock:
            return self._r.reason if self._r.state == KVPoll.Failed else ""

    def abort(self) -> None:
        with self.ep.lock:
            if self._r.fail("aborted by prefill"):
                self.ep.counters["prefill_aborts"] += 1
        self.ep.wake.set()


# ~~~ decode ~~~


@dataclass
class _Recv:
    room: int
    generation: int
    expected: set  # prefill peer names
    target: DecodeTarget | None = None
    requested: bool = False  # init() sent the TransferRequests
    succeeded: dict = field(default_factory=dict)  # name -> Success Status
    quiet: set = field(default_factory=set)  # sources that will not write any more
    loud: set = field(default_factory=set)  # sources that said their writes may still land
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    deadline: float = 0.0
    abort_deadline: float = 0.0
    quarantined: bool = False
    released: bool = False
    suspect: bool = False  # in flight while this process was frozen (Note [Frozen decode])
    bytes: int = 0
    staged: dict = field(default_factory=dict)  # source name -> (arena offset, bytes, blocks)
    staged_links: int = 0  # links init() sent through the staged path
    t_start: float = field(default_factory=time.monotonic)  # receiver() made
    t_requested: float = 0.0  # init() sent the TransferRequests


class DecodeEndpoint:
    def __init__(self, layout: FamilyLayout, wire_module, plan: Plan, rank: RankId,
                 dp_group: int, engine: TransferEngine, pools: RankPools, bootstrap: str,
                 metrics: TransferMetrics | RecordBuffer | None = None):
        check_backend(plan, engine)
        self.metrics = metrics  # per-request records (runtime/metrics.py); None: log knob only
        self.rank_label = f"dp{dp_group}.pp{rank.pp}.tp{rank.tp}"
        self.transport = engine.transport()  # Note [Reported transport]
        self.layout = layout
        self.wire = wire_module
        self.plan = plan
        self.rank = rank
        self.dp_group = dp_group
        self.engine = engine
        self.pools = pools
        self.page_size = plan.topology.decode.page_size
        self.bootstrap = bootstrap
        for base, nbytes in pools.regions():
            engine.register(base, nbytes)
        # Staging regions handed to prefill ranks. Registered before agent_info(): NIXL peers
        # only accept writes into memory listed in the metadata they received.
        self.arena = _staging_arena(engine, pools)
        self.launches = _launches(pools, layout)  # hub thread only (scatters run in _complete)
        self.lock = threading.Lock()
        self.recvs: dict[tuple[int, int], _Recv] = {}
        self.reg_state: dict[str, tuple[KVPoll, str]] = {}
        self.last_heard: dict[str, float] = {}
        self.addresses: dict[str, str] = {}
        self.source_rank: dict[str, RankId] = {}
        self.links = {lk.prefill: lk for lk in plan.links_to(rank)}
        self.sources = list(self.links)
        self.counters: Counter = Counter()
        self._last_hb = 0.0
        self._hb_seq = 0
        self._last_refresh = 0.0
        self._refreshing = False
        self._last_tick = 0.0
        self.max_stall_s = 0.0  # longest gap between two timer runs of the control thread
        self.last_rejection = ""
        self._reg_payload = b""
        # Last: the hub thread starts handling messages and timers at once.
        self.hub = Hub(self._on_message, bind=False, on_tick=self._tick)
        table = fetch_table(bootstrap, knobs.get("bootstrap_timeout_s"))
        buffers = {
            name: [W.RegEntry(layer_id=b.layer_id, tensor=b.tensor,
                              base_addr=pools.address(name, i), item_bytes=b.item_bytes,
                              capacity_items=b.capacity) for i, b in enumerate(bufs)]
            for name, bufs in pools.buffers.items()
        }
        reg = W.Register(
            side=W.PeerSide.DECODE, dp_group=dp_group, rank=rank,
            page_size=plan.topology.decode.page_size, plan_digest=bytes.fromhex(plan.digest()),
            agent_info=engine.agent_info(), control_endpoint="",
            sections=self.wire.registration_sections(buffers),
            staging_addr=self.arena.base if self.arena is not None else 0,
            staging_bytes=len(self.arena.buf) if self.arena is not None else 0)
        self._reg_payload = self.wire.encode(reg)
        for g in range(plan.topology.prefill.dp):
            for src in self.sources:
                name = _peer_name("prefill", g, src)
                with self.lock:  # the hub thread reads these tables already
                    self.source_rank[name] = src
                    self.reg_state[name] = (KVPoll.Bootstrapping, "")
                    self.last_heard[name] = time.monotonic()
                    self.addresses[name] = table[(g, src.pp, src.tp)]
                self.hub.connect(name, self.addresses[name])
                self.hub.send(name, self._reg_payload)

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
                raise ControlError(f"prefill ranks did not accept the registration within "
                                   f"{timeout_s} s")
            time.sleep(0.005)

    def receiver(self, room: int, generation: int = 0,
                 prefill_dp_group: int | None = None) -> DecodeReceiver:
        """Decode's handle on one use of `room`. `prefill_dp_group` is the router's choice
        of prefill DP rank (Note [DP routing]); without it, room % prefill dp."""
        return DecodeReceiver(self, room, generation, prefill_dp_group)

    def stats(self) -> dict:
        with self.lock:
            out = dict(self.counters)
            out.update(requests=len(self.recvs), dropped_sends=self.hub.dropped,
                       handler_errors=self.hub.handler_errors,
                       max_stall_ms=round(self.max_stall_s * 1e3),
                       transport=self.transport.describe())
            return out

    def close(self) -> None:
        """Stop the control thread and give the staging arena back to the engine (the caller
        owns the pools and deregisters them)."""
        self.hub.close()
        _deregister_arena(self.engine, self.arena)

    def _sources_for(self, room: int, prefill_dp_group: int | None) -> set[str]:
        """The prefill ranks of the group the router chose (Note [DP routing])."""
        pdp = self.plan.topology.prefill.dp
        g = dp_group_of_room(room, pdp) if prefill_dp_group is None else prefill_dp_group
        if not 0 <= g < pdp:
            raise ValueError(f"room {room}: prefill dp group {g} does not exist (the plan has "
                             f"{pdp})")
        return {_peer_name("prefill", g, s) for s in self.sources}

    # ~~~ request state (caller holds the lock) ~~~

    def _record(self, rv: _Recv) -> None:
        # Decode has no forward to wait for: its transfer runs from the request to the end.
        emit(self.metrics, TransferRecord(
            side="decode", rank=self.rank_label, room=rv.room, ok=rv.state == KVPoll.Success,
            reason=rv.reason, bytes=rv.bytes, descriptors=0, batches=len(rv.succeeded),
            engine=self.engine.name, t_start=rv.t_start, t_bootstrap_done=rv.t_requested,
            t_first_write=rv.t_requested, t_done=time.monotonic()))

    def _fail(self, rv: _Recv, reason: str) -> None:
        """Fail a request and tell every source that may still write to stop."""
        if rv.state in _TERMINAL:
            return
        rv.state, rv.reason = KVPoll.Failed, reason
        self.counters["failed"] += 1
        self._record(rv)
        if rv.suspect:
            self._quarantine(rv)
        rv.abort_deadline = time.monotonic() + knobs.get("abort_ack_timeout_s")
        if not rv.requested:
            return
        loud = sorted(rv.expected - rv.quiet)
        if loud:
            msg = self.wire.encode(W.Abort(room=rv.room, generation=rv.generation,
                                           decode_rank=self.rank))
            for name in loud:
                self.hub.send(name, msg)
            self.counters["aborts_sent"] += len(loud)

    def _page_state(self, rv: _Recv) -> PageState:
        if rv.state not in _TERMINAL:
            return PageState.IN_USE
        if rv.quarantined:
            return PageState.QUARANTINED
        if rv.state == KVPoll.Success or not rv.requested or rv.quiet >= rv.expected:
            return PageState.REUSABLE
        return PageState.PENDING

    def _quarantine(self, rv: _Recv) -> None:
        if not rv.quarantined:
            rv.quarantined = True
            self.counters["quarantined"] += 1

    def _stage(self, rv: _Recv, name: str, items: dict[str, int]) -> tuple[int, int]:
        """Reserve a staging region for the link from `name` when its partial entries would
        need many descriptors; (address, bytes), or (0, 0) for the direct path."""
        link = self.links[self.source_rank[name]]
        if self.arena is None or \
                staging.partial_descriptors(link, items) <= knobs.get("staged_min_descriptors"):
            return 0, 0
        blocks, nbytes = staging.link_blocks(link, items)
        off = self.arena.alloc(nbytes) if nbytes else None
        if off is None:
            self.counters["staging_full" if nbytes else "staging_empty"] += 1
            return 0, 0
        rv.staged[name] = (off, nbytes, blocks)
        self.counters["staged_links"] += 1
        return self.arena.base + off, nbytes

    def _unstage(self, rv: _Recv) -> str:
        """Scatter every staging region of a request into the pools (all sources are quiet:
        they reported Success); returns why it could not."""
        if not rv.staged:
            return ""
        ids = staging.target_ids(self.layout, rv.target, self.page_size)
        try:
            for name, (off, nbytes, blocks) in rv.staged.items():
                link = self.links[self.source_rank[name]]
                region = self.arena.view(off, nbytes)
                if self.launches is not None:
                    self.launches.scatter_link(link, blocks, self.pools.view, ids, region)
                    continue
                by_component: dict[str, list] = {}
                for b in blocks:
                    by_component.setdefault(link.entries[b.entry].component, []).append(b)
                for comp, bs in by_component.items():
                    pools = [self.pools.view(comp, link.entries[b.entry].dst_pos) for b in bs]
                    check_capacity(ids[comp], min(p.shape[0] for p in pools),
                                   f"decode '{comp}'")
                    for b, pool in zip(bs, pools, strict=True):
                        staging.scatter(pool, ids[comp], b.segment,
                                        region[b.offset:b.offset + b.items * b.segment.total_bytes])
            self.pools.sync()  # Success means the bytes are in the pools
        except (IndexError_, ValueError) as e:
            return f"staged scatter: {e}"
        finally:
            self._free_staging(rv)
        return ""

    def _free_staging(self, rv: _Recv) -> None:
        for off, nbytes, _ in rv.staged.values():
            self.arena.release(off, nbytes)
        rv.staged.clear()

    def _complete(self, rv: _Recv) -> None:
        """Every source reported Success: scatter staged bytes, verify, then Success."""
        why = self._unstage(rv)
        if why:
            self._fail(rv, why)
            return
        if knobs.get("checksum"):
            why = self._verify_checksums(rv)
            if why:
                self.counters["checksum_mismatches"] += 1
                self._fail(rv, why)
                return
        rv.state = KVPoll.Success
        self.counters["succeeded"] += 1
        self._record(rv)

    def _verify_checksums(self, rv: _Recv) -> str:
        for name in sorted(rv.expected):
            st = rv.succeeded[name]
            if st.checksum is None:
                return (f"{name} sent no checksum, and this decode rank requires one "
                        "(set the checksum knob on both sides)")
            try:
                pairs = integrity.destination_pairs(self.layout, rv.target, self.page_size,
                                                    st.page_start, st.page_count)
            except IndexError_ as e:
                return f"checksum: {name}: {e}"
            got = integrity.link_digest(rv.room, rv.generation, self.links[st.prefill_rank],
                                        self.pools.view, pairs, "dst")
            if got != st.checksum:
                return (f"checksum mismatch on the link from {name}: prefill wrote "
                        f"{st.checksum:#018x}, decode holds {got:#018x}")
        return ""

    # ~~~ control messages (hub thread) ~~~

    def _on_message(self, name: str, payload: bytes) -> None:
        try:
            msg = self.wire.decode(payload)
        except W.WireError as e:
            # An unreadable reply to our registration (e.g. the peer compiled another spec:
            # fingerprint mismatch) fails the registration now instead of at the deadline.
            with self.lock:
                self.counters["malformed"] += 1
                if self.reg_state.get(name, (None,))[0] == KVPoll.Bootstrapping:
                    self.reg_state[name] = (KVPoll.Failed, f"cannot read its reply: {e}")
            return
        with self.lock:
            self.last_heard[name] = time.monotonic()
            if isinstance(msg, W.Status):
                self._on_status(name, msg)
            elif isinstance(msg, W.AbortAck):
                rv = self.recvs.get((msg.room, msg.generation))
                if rv is None or not rv.requested or name not in rv.expected:
                    self.counters["stale_messages"] += 1
                    return
                if msg.drained:
                    rv.quiet.add(name)
                else:
                    rv.loud.add(name)
                    if rv.state in _TERMINAL:
                        self._quarantine(rv)

    def _on_status(self, name: str, msg) -> None:
        if msg.room == REG_ROOM:
            state = self.reg_state.get(name, (None,))[0]
            if state in (KVPoll.Bootstrapping, None) or msg.state == KVPoll.WaitingForInput:
                self.reg_state[name] = (KVPoll(msg.state), msg.reason)
            elif msg.state == KVPoll.Failed:
                self.counters["rejected_by_prefill"] += 1
                self.last_rejection = f"{name}: {msg.reason}"
            return
        rv = self.recvs.get((msg.room, msg.generation))
        if rv is None or not rv.requested or name not in rv.expected or \
                msg.prefill_rank != self.source_rank[name]:
            # Unknown room, other generation, or an answer before we asked (a prefill rank
            # that failed the room first answers our request with that outcome): ignored.
            self.counters["stale_messages"] += 1
            return
        if msg.state == KVPoll.Success:
            rv.succeeded[name] = msg
            rv.quiet.add(name)
            rv.bytes += msg.bytes_written
            if rv.state not in _TERMINAL and rv.succeeded.keys() >= rv.expected:
                self._complete(rv)
        elif msg.state == KVPoll.Failed:
            rv.quiet.add(name)  # sent only once its writes drained (Note [Failure semantics])
            self._fail(rv, f"{name}: {msg.reason}")
            if rv.loud:
                self._quarantine(rv)
        elif rv.state < msg.state and rv.state not in _TERMINAL:
            rv.state = KVPoll(msg.state)

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_hb >= knobs.get("heartbeat_interval_s"):
            self._last_hb = now
            self._hb_seq += 1
            hb = self.wire.encode(W.Heartbeat(side=W.PeerSide.DECODE, rank=self.rank,
                                              sequence=self._hb_seq,
                                              monotonic_ns=time.monotonic_ns()))
            for name in list(self.reg_state):
                self.hub.send(name, hb)
        dead_after = knobs.get("peer_dead_after_s")
        with self.lock:
            if self._last_tick:
                self.max_stall_s = max(self.max_stall_s, now - self._last_tick)
            if self._last_tick and now - self._last_tick > dead_after:
                # Note [Frozen decode]: this process was stopped (or starved) for longer than
                # a peer may be silent. The transport may still hold writes that peers gave
                # up on meanwhile and that land as soon as it runs again, so pages of requests
                # in flight across the gap are quarantined unless they succeed.
                self.counters["self_freezes"] += 1
                for rv in self.recvs.values():
                    if rv.requested and rv.state != KVPoll.Success:
                        rv.suspect = True
                        if rv.state == KVPoll.Failed:
                            self._quarantine(rv)
                for n in self.last_heard:  # what it could not hear says nothing of the peers
                    self.last_heard[n] = now
            self._last_tick = now
            dead = {n for n, t in self.last_heard.items() if now - t > dead_after}
            for rv in self.recvs.values():
                if rv.state == KVPoll.Failed:
                    if rv.requested and not rv.quarantined and now > rv.abort_deadline and \
                            not rv.quiet >= rv.expected:
                        self._quarantine(rv)
                    if rv.staged and self._page_state(rv) == PageState.REUSABLE:
                        self._free_staging(rv)  # no source may write into it any more
                    continue
                if rv.state == KVPoll.Success or not rv.requested:
                    continue
                missing = sorted(rv.expected - rv.succeeded.keys())
                if now > rv.deadline:
                    self._fail(rv, f"timed out after {knobs.get('transfer_timeout_s')} s "
                                   f"waiting for {', '.join(missing)}")
                    continue
                silent = [n for n in missing if n in dead]
                if silent:
                    self._fail(rv, f"prefill peer {silent[0]} silent for {dead_after} s")
        if dead and now - self._last_refresh >= knobs.get("reconnect_interval_s") and \
                not self._refreshing:
            self._last_refresh = now
            self._refreshing = True
            threading.Thread(target=self._refresh, args=(sorted(dead),), daemon=True,
                             name="pdc-decode-reconnect").start()

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
                        self.last_heard[name] = time.monotonic()  # a new peer: fresh window
                        self.counters["reconnects"] += 1
                    self.hub.connect(name, addr)
                self.hub.send(name, self._reg_payload)
        except ControlError:
            pass  # the leader itself may be gone; try again later
        finally:
            self._refreshing = False


class DecodeReceiver:
    """Decode's handle on one (room, generation)."""

    def __init__(self, ep: DecodeEndpoint, room: int, generation: int,
                 prefill_dp_group: int | None = None):
        self.ep = ep
        self.room = room
        self.generation = generation
        sources = ep._sources_for(room, prefill_dp_group)
        with ep.lock:
            key = (room, generation)
            if key in ep.recvs:
                raise ValueError(f"room {room} generation {generation} is in use; a new use of "
                                 "the room needs a new generation")
            self._rv = ep.recvs[key] = _Recv(room, generation, sources)

    def init(self, page_ids, prefix_len: int = 0, *, slot: int = -1, ring_slot: int = -1,
             aux_row: int = -1, window_page_ids=None) -> None:
        """Tell prefill where this request's state goes (decode pool ids)."""
        target = DecodeTarget(np.asarray(page_ids, np.int64), prefix_len, slot, ring_slot,
                              aux_row, np.asarray(window_page_ids if window_page_ids is not None
                                                  else [], np.int64))
        ep = self.ep
        items = staging.request_items(ep.layout, target, ep.page_size)
        with ep.lock:
            rv = self._rv
            if rv.requested or rv.state in _TERMINAL:
                raise ValueError(f"room {self.room}: init() after the request started or ended")
            rv.target = target
            rv.requested = True
            rv.t_requested = time.monotonic()
            rv.deadline = rv.t_requested + knobs.get("transfer_timeout_s")
            rv.state = KVPoll.WaitingForInput
            regions = {name: ep._stage(rv, name, items) for name in sorted(rv.expected)}
            rv.staged_links = len(rv.staged)
        for name, (addr, nbytes) in regions.items():
            # One message per source: each link of a staged request has its own region.
            ep.hub.send(name, ep.wire.encode(W.TransferRequest(
                room=self.room, generation=self.generation, decode_rank=ep.rank,
                dst_page_ids=target.page_ids, decode_prefix_tokens=prefix_len, slot=slot,
                ring_slot=ring_slot, aux_row=aux_row, window_page_ids=target.window_page_ids,
                staging_addr=addr, staging_bytes=nbytes)))

    def poll(self) -> KVPoll:
        with self.ep.lock:
            return self._rv.state

    @property
    def reason(self) -> str:
        with self.ep.lock:
            return self._rv.reason

    @property
    def bytes(self) -> int:
        with self.ep.lock:
            return self._rv.bytes

    @property
    def page_state(self) -> PageState:
        with self.ep.lock:
            return self.ep._page_state(self._rv)

    @property
    def links(self) -> tuple[int, int]:
        """(links through the staged path, links) of this request on this decode rank."""
        with self.ep.lock:
            return self._rv.staged_links, len(self._rv.expected)

    @property
    def quarantined(self) -> bool:
        return self.page_state == PageState.QUARANTINED

    def abort(self, timeout_s: float | None = None, wait: bool = True) -> bool:
        """Abort (Failed, "aborted by decode") and ask every source to stop. With `wait`,
        block until the pages are resolved. Returns True when the pages may be reused now,
        False while they are pending (wait=False) or once they are quarantined; a request
        that already succeeded returns True."""
        with self.ep.lock:
            rv = self._rv
            if rv.state == KVPoll.Success:
                return True
            if rv.state != KVPoll.Failed:
                self.ep.counters["aborts"] += 1
            self.ep._fail(rv, "aborted by decode")
            if timeout_s is not None:
                rv.abort_deadline = time.monotonic() + timeout_s
        while wait:
            state = self.page_state
            if state != PageState.PENDING:
                return state == PageState.REUSABLE
            time.sleep(0.002)
        return self.page_state == PageState.REUSABLE

    def cancel(self) -> None:
        """Give up a request before init(): decode named no page, so nothing of it can be
        written, but every source is told (Abort), so a prefill rank that already holds the
        request's KV frees it now instead of at its prefill_room_timeout_s. Then release()."""
        ep = self.ep
        with ep.lock:
            rv = self._rv
            if rv.requested:
                raise ValueError(f"room {self.room}: cancel() after init(); use abort()")
            ep._fail(rv, "cancelled by decode")
            msg = ep.wire.encode(W.Abort(room=rv.room, generation=rv.generation,
                                         decode_rank=ep.rank))
            for name in sorted(rv.expected):
                ep.hub.send(name, msg)
            ep.counters["aborts_sent"] += len(rv.expected)

    def release(self) -> None:
        """Forget this request. Pages not yet resolved (in use or pending) are quarantined:
        the caller gave up waiting, so it must not reuse them."""
        with self.ep.lock:
            rv = self._rv
            if self.ep._page_state(rv) in (PageState.IN_USE, PageState.PENDING):
                self.ep._fail(rv, "released before it finished")
                self.ep._quarantine(rv)
            if rv.staged and self.ep._page_state(rv) == PageState.REUSABLE:
                self.ep._free_staging(rv)
            elif rv.staged:
                # Quarantined with the pages: a late write may still land in the region.
                self.ep.counters["staging_bytes_quarantined"] += sum(
                    n for _, n, _ in rv.staged.values())
                rv.staged.clear()
            rv.released = True
            self.ep.recvs.pop((self.room, self.generation), None)
