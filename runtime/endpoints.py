"""Prefill and decode endpoints: the request lifecycle on top of plans, pools and an engine.

Serving engines use the contract they know (names follow SGLang's): prefill
`endpoint.sender(room).send(...)` per chunk; decode `endpoint.receiver(room).init(...)`;
both `poll()` -> KVPoll and `abort()`.

Threads per endpoint: one control hub (ZeroMQ; owns the sockets, see control.Hub) and one
transfer worker (prefill only; owns the engine batches). State shared between them sits
behind one lock per endpoint. Status is monotone: Bootstrapping < WaitingForInput <
Transferring < Success; Failed is terminal and carries a reason.

Note [Registration room]: replies to a registration travel as Status messages for the
reserved room REG_ROOM, so the wire needs no separate message type for them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from . import knobs
from . import wire as W
from .control import ControlError, Hub, bootstrap_call, fetch_table
from .datapath import LocalBuffer, RemoteBuffer, build_descriptors, component_pairs
from .engines.base import BatchState, TransferEngine, TransferError
from .indices import DecodeTarget, IndexError_, PrefillChunk
from .layout_types import FamilyLayout
from .plan_types import Plan, RankId, dp_group_of_room
from .pools import RankPools

REG_ROOM = 2**64 - 1


KVPoll = W.KVPoll  # one enum for the API and the wire (progress order, Failed terminal)


@dataclass
class RequestStats:
    bytes: int = 0
    descriptors: int = 0
    batches: int = 0
    t_init: float = 0.0
    t_done: float = 0.0


def _peer_name(side: str, dp: int, rank: RankId) -> str:
    return f"{side}.dp{dp}.{rank}"


class _Family:
    """The generated modules of one family, bundled."""

    def __init__(self, layout: FamilyLayout, wire_module):
        self.layout = layout
        self.wire = wire_module


# ~~~ prefill ~~~


@dataclass
class _Chunk:
    chunk: PrefillChunk
    chunk_id: int
    stream: bool
    ready_layers: set = field(default_factory=set)
    all_ready: bool = False
    sent_layers: set = field(default_factory=set)
    sent_all: bool = False


@dataclass
class _Room:
    room: int
    generation: int = 0
    chunks: list = field(default_factory=list)
    targets: dict = field(default_factory=dict)  # decode RankId -> DecodeTarget
    inflight: list = field(default_factory=list)  # engine Batches
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    aborted_by: dict = field(default_factory=dict)  # decode peer name -> generation
    done_chunks: int = 0
    last_seen: bool = False
    stats: RequestStats = field(default_factory=RequestStats)


class _Peer:
    def __init__(self, name: str, engine_peer: str, remote: dict, dp: int, rank: RankId):
        self.name = name
        self.engine_peer = engine_peer
        self.remote = remote  # component -> [RemoteBuffer]
        self.dp = dp
        self.rank = rank
        self.last_heard = time.monotonic()
        self.dead = False


class PrefillEndpoint:
    def __init__(self, layout: FamilyLayout, wire_module, plan: Plan, rank: RankId,
                 dp_group: int, engine: TransferEngine, pools: RankPools, bootstrap: str):
        self.layout = layout
        self.wire = wire_module
        self.plan = plan
        self.digest = bytes.fromhex(plan.digest())
        self.rank = rank
        self.dp_group = dp_group
        self.engine = engine
        self.pools = pools
        self.page_size = plan.topology.prefill.page_size
        self.links = {lk.decode: lk for lk in plan.links_from(rank)}
        self.local = {
            name: [LocalBuffer(pools.address(name, i), b.item_bytes, b.capacity)
                   for i, b in enumerate(bufs)]
            for name, bufs in pools.buffers.items()
        }
        engine.register(pools.base, pools.nbytes)
        self.lock = threading.Lock()
        self.rooms: dict[int, _Room] = {}
        self.finished: OrderedDict[int, tuple[KVPoll, str, RequestStats]] = OrderedDict()
        # Streaming sends every real layer and every sentinel once the forward is done.
        self._all_ids = {i for i, _ in layout.kind_of} | {
            c.sentinel for c in layout.components if c.request_wide}
        self.peers: dict[tuple[int, RankId], _Peer] = {}
        self.identity: dict[str, bytes] = {}  # peer name -> router identity
        self._stop = threading.Event()
        self.hub = Hub(self._on_message, bind=True, on_tick=self._tick)
        self._hb_seq = 0
        self._last_hb = 0.0
        bootstrap_call(bootstrap, {"op": "put", "dp": dp_group, "pp": rank.pp, "tp": rank.tp,
                                   "endpoint": self.hub.address},
                       knobs.get("bootstrap_timeout_s"))
        self.worker = threading.Thread(target=self._work, name="pdc-prefill-worker", daemon=True)
        self.worker.start()

    # ~~~ serving-engine API ~~~

    def sender(self, room: int) -> PrefillSender:
        return PrefillSender(self, room)

    def layer_done(self, layer_id: int) -> None:
        """The forward finished writing `layer_id` for every streaming chunk sent so far."""
        with self.lock:
            for r in self.rooms.values():
                for c in r.chunks:
                    if c.stream:
                        c.ready_layers.add(layer_id)

    def forward_done(self) -> None:
        """The forward finished: every streaming chunk sent so far is complete."""
        with self.lock:
            for r in self.rooms.values():
                for c in r.chunks:
                    c.all_ready = True

    def close(self) -> None:
        self._stop.set()
        self.worker.join(timeout=5)
        self.hub.close()

    # ~~~ control messages (hub thread) ~~~

    def _reply(self, identity: bytes, msg) -> None:
        self.hub.send(identity, self.wire.encode(msg))

    def _status(self, room: int, generation: int, state: KVPoll, reason: str = "",
                nbytes: int = 0):
        return W.Status(room=room, generation=generation, prefill_rank=self.rank, state=state,
                        bytes_written=nbytes,
                        reason=reason.encode()[:W.MAX_REASON_BYTES].decode(errors="ignore"))

    def _on_message(self, identity: bytes, payload: bytes) -> None:
        try:
            msg = self.wire.decode(payload)
        except W.WireError as e:
            # Malformed input fails nothing but itself; tell the sender why.
            self._reply(identity, self._status(REG_ROOM, 0, KVPoll.Failed,
                                               f"malformed message: {e}"))
            return
        if isinstance(msg, W.Register):
            self._on_register(identity, msg)
        elif isinstance(msg, W.TransferRequest):
            self._on_request(identity, msg)
        elif isinstance(msg, W.Abort):
            self._on_abort(identity, msg)
        elif isinstance(msg, W.Heartbeat):
            for p in self.peers.values():
                if self.identity.get(p.name) == identity:
                    p.last_heard = time.monotonic()

    def _validate_register(self, msg) -> str:
        if msg.side != W.PeerSide.DECODE:
            return "only decode ranks register with a prefill rank"
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
        if not why and len(self.peers) >= knobs.get("max_registrations"):
            why = f"too many registrations (limit {knobs.get('max_registrations')})"
        if why:
            self._reply(identity, self._status(REG_ROOM, 0, KVPoll.Failed, why))
            return
        rank = msg.rank
        name = _peer_name("decode", msg.dp_group, rank)
        try:
            engine_peer = self.engine.connect(msg.agent_info)
        except Exception as e:  # noqa: BLE001 - engine errors are reported, not raised
            self._reply(identity, self._status(REG_ROOM, 0, KVPoll.Failed,
                                               f"cannot connect the transfer engine: {e}"))
            return
        remote = {
            comp.name: [RemoteBuffer(e.layer_id, comp.tensors.index(e.tensor), e.base_addr,
                                     e.item_bytes, e.capacity_items)
                        for e in section.entries]
            for comp, section in zip(self.layout.components, msg.sections, strict=True)
        }
        with self.lock:
            self.peers[(msg.dp_group, rank)] = _Peer(name, engine_peer, remote, msg.dp_group, rank)
            self.identity[name] = identity
        self._reply(identity, self._status(REG_ROOM, 0, KVPoll.WaitingForInput))

    def _on_request(self, identity: bytes, msg) -> None:
        rank = msg.decode_rank
        with self.lock:
            if dp_group_of_room(msg.room, self.plan.topology.prefill.dp) != self.dp_group:
                why = f"room {msg.room} belongs to prefill dp group " \
                      f"{dp_group_of_room(msg.room, self.plan.topology.prefill.dp)}"
                self._reply(identity, self._status(msg.room, msg.generation, KVPoll.Failed, why))
                return
            if rank not in self.links:
                self._reply(identity, self._status(msg.room, msg.generation, KVPoll.Failed,
                                                   f"decode rank {rank} has no link to {self.rank}"))
                return
            r = self.rooms.get(msg.room)
            if r is None:
                if len(self.rooms) >= knobs.get("max_pending_rooms"):
                    self._reply(identity, self._status(msg.room, msg.generation, KVPoll.Failed,
                                                       "too many pending rooms"))
                    return
                r = self.rooms[msg.room] = _Room(msg.room, msg.generation)
            if msg.generation < r.generation:
                return  # a stale request of an aborted earlier use of this room
            r.generation = msg.generation
            target = DecodeTarget(
                np.asarray(msg.dst_page_ids, np.int64), int(msg.decode_prefix_tokens), msg.slot,
                msg.ring_slot, msg.aux_row, np.asarray(msg.window_page_ids, np.int64))
            peer = self.peers.get((dp_group_of_room(msg.room, self.plan.topology.decode.dp), rank))
            why = "decode rank sent a request before registering" if peer is None else \
                _check_target(self.layout, peer.remote, target)
            if why:
                # Refused before any write: no byte of this request may land anywhere.
                r.state, r.reason = KVPoll.Failed, f"bad index from decode {rank}: {why}"
                return
            r.targets[rank] = target
            if r.state < KVPoll.WaitingForInput:
                r.state = KVPoll.WaitingForInput

    def _on_abort(self, identity: bytes, msg) -> None:
        rank = msg.decode_rank
        with self.lock:
            r = self.rooms.get(msg.room)
            if r is None or msg.generation < r.generation:
                self._reply(identity, W.AbortAck(room=msg.room, generation=msg.generation,
                                                 prefill_rank=self.rank, drained=True))
                return
            r.aborted_by[rank] = (identity, msg.generation)
            if r.state != KVPoll.Success:
                r.state = KVPoll.Failed
                r.reason = r.reason or "aborted by decode"

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_hb >= knobs.get("heartbeat_interval_s"):
            self._last_hb = now
            self._hb_seq += 1
            hb = self.wire.encode(W.Heartbeat(side=W.PeerSide.PREFILL, rank=self.rank,
                                              sequence=self._hb_seq,
                                              monotonic_ns=time.monotonic_ns()))
            for _name, ident in list(self.identity.items()):
                self.hub.send(ident, hb)
        dead_after = knobs.get("peer_dead_after_s")
        with self.lock:
            for p in self.peers.values():
                if not p.dead and now - p.last_heard > dead_after:
                    p.dead = True
                    for r in self.rooms.values():
                        if r.state < KVPoll.Success and any(
                                t == p.rank for t in r.targets) and \
                                dp_group_of_room(r.room, self.plan.topology.decode.dp) == p.dp:
                            r.state = KVPoll.Failed
                            r.reason = f"decode peer {p.name} silent for {dead_after} s"

    # ~~~ transfer worker ~~~

    def _peers_of(self, room: int) -> list[tuple[RankId, _Peer | None]]:
        g = dp_group_of_room(room, self.plan.topology.decode.dp)
        return [(d, self.peers.get((g, d))) for d in self.links]

    def _work(self) -> None:
        sleep_s = knobs.get("poll_sleep_s")
        while not self._stop.is_set():
            busy = False
            with self.lock:
                rooms = list(self.rooms.values())
            for r in rooms:
                busy |= self._advance(r)
            if not busy:
                time.sleep(sleep_s * 10)

    def _advance(self, r: _Room) -> bool:
        """Move one room forward; returns whether anything happened."""
        with self.lock:
            state = r.state
            peers = self._peers_of(r.room)
        if r.inflight:
            still = []
            for b in r.inflight:
                st = self.engine.poll(b)
                if st is BatchState.PENDING:
                    still.append(b)
                elif st is BatchState.FAILED:
                    with self.lock:
                        if r.state != KVPoll.Failed:
                            r.state, r.reason = KVPoll.Failed, f"transfer failed: {b.reason}"
            r.inflight = still
            if still:
                return True
        if state == KVPoll.Failed:
            self._finish_failed(r, peers)
            return False
        if state == KVPoll.Success:
            return False
        if any(p is None for _, p in peers) or any(d not in r.targets for d, _ in peers):
            return False  # waiting for decode registration or its TransferRequest
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
            try:
                self._submit(r, c, peers, layers)
            except (IndexError_, ValueError) as e:
                with self.lock:
                    r.state, r.reason = KVPoll.Failed, f"bad index: {e}"
                self._finish_failed(r, peers)
                return True
            except TransferError as e:
                with self.lock:
                    r.state, r.reason = KVPoll.Failed, f"transfer refused: {e}"
                self._finish_failed(r, peers)
                return True
            if layers is not None:
                c.sent_layers |= layers
            c.sent_all = finished
            progressed = True
        if r.inflight:
            with self.lock:
                if r.state < KVPoll.Transferring:
                    r.state = KVPoll.Transferring
            return True
        if r.last_seen and all(c.sent_all for c in r.chunks):
            with self.lock:
                r.state = KVPoll.Success
                r.stats.t_done = time.monotonic()
            for _d, p in peers:
                self.hub.send(self.identity[p.name], self.wire.encode(self._status(
                    r.room, r.generation, KVPoll.Success, nbytes=r.stats.bytes)))
            with self.lock:
                self._retire(r)
            return True
        return progressed

    def _retire(self, r: _Room) -> None:
        """Forget a finished room but remember its outcome for poll() (bounded)."""
        self.rooms.pop(r.room, None)
        self.finished[r.room] = (r.state, r.reason, r.stats)
        while len(self.finished) > knobs.get("max_pending_rooms"):
            self.finished.popitem(last=False)

    def _submit(self, r: _Room, c: _Chunk, peers, layers) -> None:
        for d, p in peers:
            target = r.targets[d]
            pairs = component_pairs(self.layout, c.chunk, target, self.page_size)
            desc = build_descriptors(self.links[d], self.local, p.remote, pairs, layers)
            if desc.count == 0:
                continue
            if r.stats.batches == 0:
                r.stats.t_init = time.monotonic()
            batch = self.engine.submit_write(p.engine_peer, desc.src, desc.dst, desc.nbytes)
            r.inflight.append(batch)
            r.stats.bytes += desc.total_bytes
            r.stats.descriptors += desc.count
            r.stats.batches += 1

    def _finish_failed(self, r: _Room, peers) -> None:
        if r.inflight:
            return  # drain first: no write of this room may land after the ack
        with self.lock:
            if self.rooms.get(r.room) is not r:
                return
            self._retire(r)
            reason = r.reason or "failed"
        for d, p in peers:
            if p is None:
                continue
            ident = self.identity.get(p.name)
            if ident is None:
                continue
            if d in r.aborted_by:
                ident2, gen = r.aborted_by[d]
                self.hub.send(ident2, self.wire.encode(W.AbortAck(
                    room=r.room, generation=gen, prefill_rank=self.rank, drained=True)))
            else:
                self.hub.send(ident, self.wire.encode(self._status(
                    r.room, r.generation, KVPoll.Failed, reason)))


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
    def __init__(self, ep: PrefillEndpoint, room: int):
        self.ep = ep
        self.room = room
        self._chunk_id = 0

    def send(self, page_ids, page_start: int, last_chunk: bool, seq_len: int, *, slot: int = -1,
             ring_slot: int = -1, aux_row: int = -1, window_page_ids=None,
             stream: bool = False) -> None:
        """Queue one chunk: its pages (absolute positions page_start..), and with the last
        chunk the slot / ring / aux ids. `stream=True` holds each layer until layer_done()."""
        chunk = PrefillChunk(page_start, np.asarray(page_ids, np.int64), last_chunk, seq_len,
                             slot, ring_slot, aux_row,
                             None if window_page_ids is None else np.asarray(window_page_ids,
                                                                             np.int64))
        with self.ep.lock:
            r = self.ep.rooms.get(self.room)
            if r is None:
                r = self.ep.rooms[self.room] = _Room(self.room)
                self.ep.finished.pop(self.room, None)
            if r.last_seen:
                raise ValueError(f"room {self.room}: send() after the last chunk")
            r.chunks.append(_Chunk(chunk, self._chunk_id, stream))
            r.last_seen = last_chunk
            self._chunk_id += 1

    def poll(self) -> KVPoll:
        with self.ep.lock:
            r = self.ep.rooms.get(self.room)
            if r is not None:
                return r.state
            return self.ep.finished.get(self.room, (KVPoll.Bootstrapping, "", None))[0]

    @property
    def stats(self) -> RequestStats:
        """Bytes, descriptors, batches and first-submit / done times of this request."""
        with self.ep.lock:
            r = self.ep.rooms.get(self.room)
            if r is not None:
                return r.stats
            done = self.ep.finished.get(self.room)
            return done[2] if done else RequestStats()

    @property
    def reason(self) -> str:
        with self.ep.lock:
            r = self.ep.rooms.get(self.room)
            if r is not None:
                return r.reason
            done = self.ep.finished.get(self.room)
            return done[1] if done else ""

    def abort(self) -> None:
        with self.ep.lock:
            r = self.ep.rooms.get(self.room)
            if r is not None and r.state != KVPoll.Success:
                r.state, r.reason = KVPoll.Failed, "aborted by prefill"


# ~~~ decode ~~~


@dataclass
class _Recv:
    room: int
    generation: int
    expected: set  # prefill peer names
    target: DecodeTarget | None = None
    succeeded: set = field(default_factory=set)
    acked: set = field(default_factory=set)
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    deadline: float = 0.0
    aborting: bool = False
    bytes: int = 0


class DecodeEndpoint:
    def __init__(self, layout: FamilyLayout, wire_module, plan: Plan, rank: RankId,
                 dp_group: int, engine: TransferEngine, pools: RankPools, bootstrap: str):
        self.layout = layout
        self.wire = wire_module
        self.plan = plan
        self.rank = rank
        self.dp_group = dp_group
        self.engine = engine
        self.pools = pools
        engine.register(pools.base, pools.nbytes)
        self.lock = threading.Lock()
        self.recvs: dict[int, _Recv] = {}
        self.reg_state: dict[str, tuple[KVPoll, str]] = {}
        self.last_heard: dict[str, float] = {}
        self.sources = [lk.prefill for lk in plan.links_to(rank)]
        self.hub = Hub(self._on_message, bind=False, on_tick=self._tick)
        self._last_hb = 0.0
        self._hb_seq = 0
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
            sections=self.wire.registration_sections(buffers))
        payload = self.wire.encode(reg)
        for g in range(plan.topology.prefill.dp):
            for src in self.sources:
                name = _peer_name("prefill", g, src)
                self.reg_state[name] = (KVPoll.Bootstrapping, "")
                self.last_heard[name] = time.monotonic()
                self.hub.connect(name, table[(g, src.pp, src.tp)])
                self.hub.send(name, payload)

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

    def receiver(self, room: int, generation: int = 0) -> DecodeReceiver:
        return DecodeReceiver(self, room, generation)

    def close(self) -> None:
        self.hub.close()

    def _sources_for(self, room: int) -> set[str]:
        g = dp_group_of_room(room, self.plan.topology.prefill.dp)
        return {_peer_name("prefill", g, s) for s in self.sources}

    def _on_message(self, name: str, payload: bytes) -> None:
        try:
            msg = self.wire.decode(payload)
        except W.WireError as e:
            # An unreadable reply to our registration (e.g. the peer compiled another spec:
            # fingerprint mismatch) fails the registration now instead of at the deadline.
            with self.lock:
                if self.reg_state.get(name, (None,))[0] == KVPoll.Bootstrapping:
                    self.reg_state[name] = (KVPoll.Failed, f"cannot read its reply: {e}")
            return
        with self.lock:
            self.last_heard[name] = time.monotonic()
            if isinstance(msg, W.Status):
                if msg.room == REG_ROOM:
                    if self.reg_state.get(name, (None,))[0] != KVPoll.Failed:
                        self.reg_state[name] = (KVPoll(msg.state), msg.reason)
                    return
                rv = self.recvs.get(msg.room)
                if rv is None or msg.generation != rv.generation or name not in rv.expected:
                    return  # unknown room or an older generation: ignored
                if msg.state == KVPoll.Success:
                    rv.succeeded.add(name)
                    rv.bytes += msg.bytes_written
                    if rv.succeeded == rv.expected and rv.state < KVPoll.Success:
                        rv.state = KVPoll.Success
                elif msg.state == KVPoll.Failed and rv.state != KVPoll.Success:
                    rv.state = KVPoll.Failed
                    rv.reason = rv.reason or f"{name}: {msg.reason}"
                elif msg.state < KVPoll.Success and rv.state < msg.state:
                    rv.state = KVPoll(msg.state)
            elif isinstance(msg, W.AbortAck):
                rv = self.recvs.get(msg.room)
                if rv is not None and msg.generation == rv.generation:
                    rv.acked.add(name)

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_hb >= knobs.get("heartbeat_interval_s"):
            self._last_hb = now
            self._hb_seq += 1
            hb = self.wire.encode(W.Heartbeat(side=W.PeerSide.DECODE, rank=self.rank,
                                              sequence=self._hb_seq,
                                              monotonic_ns=time.monotonic_ns()))
            for name in self.reg_state:
                self.hub.send(name, hb)
        dead_after = knobs.get("peer_dead_after_s")
        with self.lock:
            for rv in self.recvs.values():
                if rv.state >= KVPoll.Success:
                    continue
                if rv.target is not None and now > rv.deadline:
                    rv.state, rv.reason = KVPoll.Failed, \
                        f"timed out after {knobs.get('transfer_timeout_s')} s"
                    continue
                silent = [n for n in rv.expected if now - self.last_heard.get(n, now) > dead_after
                          and n not in rv.succeeded]
                if silent and rv.target is not None:
                    rv.state, rv.reason = KVPoll.Failed, \
                        f"prefill peer {silent[0]} silent for {dead_after} s"


class DecodeReceiver:
    def __init__(self, ep: DecodeEndpoint, room: int, generation: int):
        self.ep = ep
        self.room = room
        self.generation = generation
        with ep.lock:
            ep.recvs[room] = _Recv(room, generation, ep._sources_for(room))

    def init(self, page_ids, prefix_len: int = 0, *, slot: int = -1, ring_slot: int = -1,
             aux_row: int = -1, window_page_ids=None) -> None:
        """Tell prefill where this request's state goes (decode pool ids)."""
        target = DecodeTarget(np.asarray(page_ids, np.int64), prefix_len, slot, ring_slot,
                              aux_row, np.asarray(window_page_ids if window_page_ids is not None
                                                  else [], np.int64))
        msg = W.TransferRequest(
            room=self.room, generation=self.generation, decode_rank=self.ep.rank,
            dst_page_ids=target.page_ids, decode_prefix_tokens=prefix_len, slot=slot,
            ring_slot=ring_slot, aux_row=aux_row, window_page_ids=target.window_page_ids)
        payload = self.ep.wire.encode(msg)
        with self.ep.lock:
            rv = self.ep.recvs[self.room]
            rv.target = target
            rv.deadline = time.monotonic() + knobs.get("transfer_timeout_s")
            rv.state = KVPoll.WaitingForInput
            names = sorted(rv.expected)
        for name in names:
            self.ep.hub.send(name, payload)

    def poll(self) -> KVPoll:
        with self.ep.lock:
            return self.ep.recvs[self.room].state

    @property
    def reason(self) -> str:
        with self.ep.lock:
            return self.ep.recvs[self.room].reason

    @property
    def bytes(self) -> int:
        with self.ep.lock:
            return self.ep.recvs[self.room].bytes

    def abort(self, timeout_s: float | None = None) -> bool:
        """Abort and wait for every source's drain ack; returns False when the ack timed
        out, in which case the caller must quarantine the request's pages, not reuse them."""
        timeout_s = knobs.get("abort_ack_timeout_s") if timeout_s is None else timeout_s
        with self.ep.lock:
            rv = self.ep.recvs[self.room]
            if rv.state == KVPoll.Success:
                return True
            rv.aborting = True
            rv.state, rv.reason = KVPoll.Failed, rv.reason or "aborted by decode"
            names = sorted(rv.expected)
        msg = self.ep.wire.encode(W.Abort(room=self.room, generation=self.generation,
                                          decode_rank=self.ep.rank))
        for n in names:
            self.ep.hub.send(n, msg)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.ep.lock:
                if rv.acked >= rv.expected:
                    return True
            time.sleep(0.002)
        return False

    def release(self) -> None:
        with self.ep.lock:
            self.ep.recvs.pop(self.room, None)
