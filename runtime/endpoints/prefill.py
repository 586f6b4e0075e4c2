"""The prefill front end: `PrefillEndpoint` (one per prefill rank) and `PrefillSender` (one per
use of a room)."""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict

import numpy as np

from .. import knobs
from ..control import bootstrap_call
from ..datapath import LocalBuffer
from ..engines.base import TransferEngine
from ..hub import Hub
from ..indices import (
    PrefillChunk,
)
from ..layout_types import FamilyLayout
from ..metrics import RecordBuffer, TransferMetrics
from ..plan_types import Plan, RankId
from ..pools import RankPools
from .common import (
    KVPoll,
    RequestStats,
    check_backend,
    check_knobs,
    no_signal,
)
from .faults import NO_FAULTS, Faults
from .handshake import PrefillHandshake
from .liveness import PrefillLiveness
from .liveness_model import Liveness
from .prefill_control import PrefillControl
from .prefill_worker import PrefillWorker
from .records import _Chunk, _Final, _Peer, _Room
from .staged import PrefillStaging, _deregister_arena, _launches, _staging_arena
from .states import TERMINAL, sender_poll


class PrefillEndpoint(PrefillHandshake, PrefillControl, PrefillLiveness, PrefillWorker,
                      PrefillStaging):
    """One prefill rank's endpoint. Its state lives here; the handshake, the control
    messages, liveness, the transfer worker and the staged path are its parts, one module
    each, all working on this state under `self.lock`."""

    def __init__(self, layout: FamilyLayout, wire_module, plan: Plan, rank: RankId,
                 dp_group: int, engine: TransferEngine, pools: RankPools, bootstrap: str,
                 metrics: TransferMetrics | RecordBuffer | None = None,
                 faults: Faults = NO_FAULTS):
        check_backend(plan, engine)
        check_knobs()
        self.faults = faults  # Note [Fault hooks]; NO_FAULTS when serving
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
            name: [LocalBuffer(pools.address(name, i), b.item_bytes, b.capacity, b.pitch)
                   for i, b in enumerate(bufs)]
            for name, bufs in pools.buffers.items()
        }
        for base, nbytes in pools.regions():
            engine.register(base, nbytes)
        # Gather buffers of the staged path; only a worker pass (under `advancing`) touches
        # the arena and the launches.
        self.arena = _staging_arena(engine, pools)
        self.launches = _launches(pools, layout)
        self.lock = threading.Lock()
        self.rooms: dict[int, _Room] = {}
        self.finished: OrderedDict[int, _Final] = OrderedDict()
        # Streaming sends every real layer and every sentinel once the forward is done.
        self._all_ids = {i for i, _ in layout.kind_of} | {
            c.sentinel for c in layout.components if c.request_wide and c.sentinel is not None}
        # (event, mark, [(use, its streaming chunks)]) of layer_done / forward_done calls whose
        # CUDA event had not completed yet, in call order
        self._waiting_events: list = []
        # (decode instance, DP group, rank) -> its registered incarnation (Note [Decode
        # instances] in handshake.py)
        self.peers: dict[tuple[str, int, RankId], _Peer] = {}
        self.by_identity: dict[bytes, _Peer] = {}
        # connection -> the incarnation a later registration replaced (bounded): one still
        # sending means two live decode servers share an instance name
        self.superseded: OrderedDict[bytes, _Peer] = OrderedDict()
        self.engine_peers: set[bytes] = set()  # agent infos connected (max_registrations)
        self.counters: Counter = Counter()
        self._stop = threading.Event()
        self.wake = threading.Event()  # set when the worker may have new work
        # Note [Advance on the waking thread]: one pass over the rooms at a time, on any thread
        self.advancing = threading.Lock()
        self._inline = bool(knobs.get("advance_inline"))
        self._polled = bool(knobs.get("worker_poll"))
        self._by_event = bool(knobs.get("success_by_event"))  # Note [Success by event]
        # Note [Completion wake-up]; a batch's end moves its room on the engine's thread
        # where that thread does nothing else (cuda_ipc), else it wakes the worker
        self._engine_wakes = engine.on_completion(
            self.advance_here if getattr(engine, "callbacks_may_work", False) else self.wake.set)
        self._hb_seq = 0
        self._last_hb = 0.0
        self.liveness = Liveness()  # of self.peers' incarnations (Note [Peer liveness])
        self.on_change = no_signal  # Note [State-change signal]
        # Last: the hub thread starts handling messages and timers at once.
        self.hub = Hub(self._on_message, bind=True, on_tick=self._tick)
        p = plan.topology.prefill
        bootstrap_call(bootstrap, {"op": "put", "dp": dp_group, "pp": rank.pp, "tp": rank.tp,
                                   "endpoint": self.hub.address,
                                   "expected": p.dp * p.pp * p.tp},
                       knobs.get("bootstrap_timeout_s"))
        self.worker = threading.Thread(target=self._work, name="pdc-prefill-worker", daemon=True)
        self.worker.start()

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
                _apply(mark, uses)
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
                _apply(mark, uses)

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
                       unauthenticated=self.hub.refused,
                       max_stall_ms=round(self.liveness.max_stall_s * 1e3),
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


def _apply(mark, uses) -> None:
    """Mark the streaming chunks of each use; a use whose last chunk is now complete has
    its forward done (Note [Timeline stamps])."""
    now = 0.0
    for r, chunks in uses:
        for c in chunks:
            mark(c)
            if c.chunk.last and c.all_ready and not r.t_forward_done:
                now = now or time.monotonic()
                r.t_forward_done = now


class PrefillSender:
    """Prefill's handle on one use of a room (Note [Room uses])."""

    def __init__(self, ep: PrefillEndpoint, r: _Room):
        self.ep = ep
        self.room = r.room
        self._r = r
        self._chunk_id = 0

    def send(self, page_ids, page_start: int, last_chunk: bool, seq_len: int, *, slot: int = -1,
             ring_slot: int = -1, aux_row: int = -1, window_page_ids=None,
             stream: bool = False, layer_slots=None) -> None:
        """Queue one chunk: its pages (absolute positions page_start..), and with the last
        chunk the slot / ring / aux ids (`layer_slots`: {layer id: slot} when the state
        layers have a slot each, Note [Layer slots]). `stream=True` holds each layer until
        layer_done().
        A chunk for a use that already failed (e.g. decode aborted) is dropped: poll() says
        Failed and why."""
        chunk = PrefillChunk(page_start, np.asarray(page_ids, np.int64), last_chunk, seq_len,
                             slot, ring_slot, aux_row,
                             None if window_page_ids is None else np.asarray(window_page_ids,
                                                                             np.int64),
                             tuple(sorted((int(i), int(s))
                                          for i, s in (layer_slots or {}).items())))
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
            if last_chunk and not stream:
                r.t_forward_done = time.monotonic()  # a complete chunk: its forward is done
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
            return sender_poll(r.state, retired=r.retired, in_flight=bool(r.inflight),
                               issued=bool(r.stats.batches))

    def writes_pending(self) -> bool:
        """Are writes of this use queued but not issued, or issued and not completed? An
        integration whose engine may reuse a source page once this says False asks it
        (Note [SGLang per-layer sends] in integrations/sglang/layerwise.py)."""
        with self.ep.lock:
            r = self._r
            return bool(r.inflight) or (r.state not in TERMINAL and not r.retired and
                                        any(not c.sent_all for c in r.chunks))

    @property
    def stats(self) -> RequestStats:
        """Bytes, descriptors, batches and first-submit / done times of this request."""
        with self.ep.lock:
            return self._r.stats

    @property
    def decode_prefix_tokens(self) -> int:
        """Tokens decode already holds for this use (Note [Prefix skip]), as its request said;
        0 before any decode rank asked. An integration whose scheduler sends only the pages
        past decode's prefix (SGLang) reads it once poll() says WaitingForInput."""
        with self.ep.lock:
            return min((t.target.prefix_len for t in self._r.targets.values()), default=0)

    @property
    def reason(self) -> str:
        with self.ep.lock:
            return self._r.reason if self._r.state == KVPoll.Failed else ""

    def abort(self) -> None:
        with self.ep.lock:
            if self._r.fail("aborted by prefill"):
                self.ep.counters["prefill_aborts"] += 1
        self.ep.wake.set()
