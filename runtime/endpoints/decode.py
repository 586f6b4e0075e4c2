"""The decode front end: `DecodeEndpoint` (one per decode rank) and `DecodeReceiver` (one per
(room, generation))."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np

from .. import integrity, knobs, staging
from .. import wire as W
from ..bringup import unreachable_pairing
from ..control import ControlError, HostSettings, fetch_table
from ..engines.base import TransferEngine
from ..hub import Hub
from ..indices import (
    DecodeTarget,
    IndexError_,
)
from ..layout_types import FamilyLayout
from ..metrics import RecordBuffer, TransferMetrics, TransferRecord, emit, mark
from ..plan_types import Plan, RankId, dp_group_of_room
from ..pools import RankPools
from .common import (
    REG_ROOM,
    KVPoll,
    PageState,
    _peer_name,
    check_backend,
    check_knobs,
    no_signal,
)
from .faults import NO_FAULTS, Faults
from .handshake import DecodeHandshake
from .liveness import DecodeLiveness
from .liveness_model import Liveness
from .records import _Recv
from .staged import DecodeStaging, _deregister_arena, _launches, _staging_arena
from .states import TERMINAL, advanced, page_state


class DecodeEndpoint(DecodeHandshake, DecodeLiveness, DecodeStaging):
    """One decode rank's endpoint. Its state lives here; the handshake, liveness and the
    staged path are its parts, one module each, all working on this state under
    `self.lock`."""

    def __init__(self, layout: FamilyLayout, wire_module, plan: Plan, rank: RankId,
                 dp_group: int, engine: TransferEngine, pools: RankPools, bootstrap: str,
                 metrics: TransferMetrics | RecordBuffer | None = None,
                 faults: Faults = NO_FAULTS, instance: str = ""):
        """`instance` names the decode server this rank belongs to, for prefill ranks that
        serve several that do not number themselves (Note [Decode instances])."""
        check_backend(plan, engine)
        check_knobs()
        self.faults = faults  # Note [Fault hooks]; NO_FAULTS when serving
        self.metrics = metrics  # per-request records (runtime/metrics.py); None: log knob only
        self.rank_label = f"dp{dp_group}.pp{rank.pp}.tp{rank.tp}"
        self.instance = instance
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
        self.addresses: dict[str, str] = {}
        self.source_rank: dict[str, RankId] = {}
        self.links = {lk.prefill: lk for lk in plan.links_to(rank)}
        self.sources = list(self.links)
        self.counters: Counter = Counter()
        self._last_hb = 0.0
        self._hb_seq = 0
        self._last_refresh = 0.0
        self._refreshing = False
        self.liveness = Liveness()  # of the prefill ranks, by name (Note [Peer liveness])
        self.on_change = no_signal  # Note [State-change signal]
        self.last_rejection = ""
        self._reg_payload = b""
        # Last: the hub thread starts handling messages and timers at once.
        self.hub = Hub(self._on_message, bind=False, on_tick=self._tick,
                       on_refused=self._on_refused)
        table = fetch_table(bootstrap, knobs.get("bootstrap_timeout_s"))
        why = unreachable_pairing(f"decode rank {self.rank_label}", HostSettings.from_knobs(),
                                  {f"prefill.dp{g}.pp{pp}.tp{tp}": a
                                   for (g, pp, tp), a in table.items()}, bootstrap)
        if why:
            self.hub.close()
            raise ControlError(why)
        buffers = {
            name: [W.RegEntry(layer_id=b.layer_id, tensor=b.tensor,
                              base_addr=pools.address(name, i), item_bytes=b.item_bytes,
                              capacity_items=b.capacity) for i, b in enumerate(bufs)]
            for name, bufs in pools.buffers.items()
        }
        reg = W.Register(
            side=W.PeerSide.DECODE, dp_group=dp_group, rank=rank,
            page_size=plan.topology.decode.page_size, plan_digest=bytes.fromhex(plan.digest()),
            agent_info=engine.agent_info(), instance=instance,
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
                    self.liveness.add(name, time.monotonic())
                    self.addresses[name] = table[(g, src.pp, src.tp)]
                self.hub.connect(name, self.addresses[name])
                self.hub.send(name, self._reg_payload)

    def receiver(self, room: int, generation: int = 0,
                 prefill_dp_group: int | None = None, arrived: float = 0.0) -> DecodeReceiver:
        """Decode's handle on one use of `room`. `prefill_dp_group` is the router's choice
        of prefill DP rank (Note [DP routing]); without it, room % prefill dp. `arrived`:
        when the serving engine first saw the request (time.monotonic()), for its timeline
        (Note [Timeline stamps])."""
        return DecodeReceiver(self, room, generation, prefill_dp_group, arrived)

    def stats(self) -> dict:
        with self.lock:
            out = dict(self.counters)
            out.update(requests=len(self.recvs), dropped_sends=self.hub.dropped,
                       handler_errors=self.hub.handler_errors,
                       max_stall_ms=round(self.liveness.max_stall_s * 1e3),
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

    def _record(self, rv: _Recv) -> None:
        # Decode has no forward to wait for: its transfer runs from the request to the end.
        emit(self.metrics, TransferRecord(
            side="decode", rank=self.rank_label, room=rv.room, ok=rv.state == KVPoll.Success,
            reason=rv.reason, bytes=rv.bytes, descriptors=rv.descriptors,
            batches=len(rv.succeeded), engine=self.engine.name, t_start=rv.t_start,
            t_bootstrap_done=rv.t_requested, t_first_write=rv.t_requested,
            t_done=time.monotonic(), generation=rv.generation, t_arrived=rv.t_arrived))

    def _fail(self, rv: _Recv, reason: str) -> None:
        """Fail a request and tell every source that may still write to stop."""
        if rv.state in TERMINAL:
            return
        self._settle(rv, wait=True, finish=False)  # no page back while its scatter runs
        rv.state, rv.reason = KVPoll.Failed, reason
        rv.written.clear()  # Note [Success by event]: its sources' Failed or Abort decides
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
        return page_state(rv.state, requested=rv.requested, quarantined=rv.quarantined,
                          quiet=rv.quiet, expected=rv.expected)

    def _quarantine(self, rv: _Recv) -> None:
        if not rv.quarantined:
            rv.quarantined = True
            self.counters["quarantined"] += 1

    def _complete(self, rv: _Recv) -> None:
        """Every source reported Success: scatter staged bytes, verify, then Success (at once,
        or once a queued scatter has ended: Note [Scatter by event])."""
        why = self._unstage(rv)
        if why:
            self._fail(rv, why)
            return
        if rv.scatter is None:
            self._succeed(rv)

    def _succeed(self, rv: _Recv) -> None:
        """The request's bytes are in the pools: verify, then Success."""
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
        assert rv.target is not None  # every source answered the request that init() sent
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
            self.liveness.heard(name, time.monotonic())
            if isinstance(msg, W.Status):
                self._on_status(name, msg)
            elif isinstance(msg, W.RingFilled):
                self._on_ring_filled(name, msg)  # Note [Staging ring]
            elif isinstance(msg, W.AbortAck):
                rv = self.recvs.get((msg.room, msg.generation))
                if rv is None or not rv.requested or name not in rv.expected:
                    self.counters["stale_messages"] += 1
                    return
                if msg.drained:
                    rv.quiet.add(name)
                else:
                    rv.loud.add(name)
                    if rv.state in TERMINAL:
                        self._quarantine(rv)

    def _on_refused(self, name: str, reason: str) -> None:
        """A prefill rank refused our control messages (Note [Control authentication]): the
        registration fails now, with the peer's reason, instead of at its deadline."""
        with self.lock:
            self.counters["refused_by_prefill"] += 1
            self.last_rejection = f"{name}: {reason}"
            if self.reg_state.get(name, (None,))[0] == KVPoll.Bootstrapping:
                self.reg_state[name] = (KVPoll.Failed, reason)

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
            rv.written.pop(name, None)
            self._source_done(rv, name, msg)
        elif msg.state == KVPoll.Transferring and msg.written_event:
            self._on_written(rv, name, msg)
        elif msg.state == KVPoll.Failed:
            rv.quiet.add(name)  # sent only once its writes drained (Note [Failure semantics])
            self._fail(rv, f"{name}: {msg.reason}")
            if rv.loud:
                self._quarantine(rv)
        else:
            rv.state = advanced(rv.state, KVPoll(msg.state))  # Note [Request states]

    def _source_done(self, rv: _Recv, name: str, msg) -> None:
        """Every write of source `name` has landed (its Success, or its written event
        completed: Note [Success by event]); each source counts once."""
        if name in rv.succeeded:
            self.counters["sources_done_twice"] += 1  # its Success after its event
            return
        rv.succeeded[name] = msg
        rv.quiet.add(name)
        rv.bytes += msg.bytes_written
        rv.descriptors += msg.descriptors
        if rv.state not in TERMINAL and rv.succeeded.keys() >= rv.expected:
            self._complete(rv)

    def _on_written(self, rv: _Recv, name: str, msg) -> None:
        """Note [Success by event]: a source's writes are all queued; `poll()` ends them when
        this event completes. An event this engine cannot open leaves the source to its
        Success message."""
        rv.state = advanced(rv.state, KVPoll.Transferring)
        if rv.state in TERMINAL or name in rv.succeeded:
            return
        try:
            ev = self.engine.open_written_event(msg.written_event)
        except RuntimeError:
            ev = None
        if ev is None:
            self.counters["written_events_unopened"] += 1
            return
        rv.written[name] = (msg, ev)
        # Note [Landed wake-up]: the caller woken as the bytes land, not at its next poll;
        # a source is this endpoint's peer: endpoints sharing an engine may name theirs alike
        if self.engine.watch_written(ev, f"{id(self):x}/{name}", self._signal):
            self.counters["written_events_watched"] += 1

    def _signal(self) -> None:
        self.on_change()  # looked up per call: the serving engine sets it after start

    def _landed(self, rv: _Recv) -> None:
        """Sources whose written event has completed are done (Note [Success by event]); an
        event that raises is dropped, and the source's Success or Failed decides."""
        for name, (msg, ev) in list(rv.written.items()):
            try:
                done = ev.query()
            except RuntimeError:
                self.counters["written_events_failed"] += 1
                del rv.written[name]
                continue
            if done:
                del rv.written[name]
                self.counters["written_events_landed"] += 1
                if rv.state not in TERMINAL:
                    self._source_done(rv, name, msg)


class DecodeReceiver:
    """Decode's handle on one (room, generation)."""

    def __init__(self, ep: DecodeEndpoint, room: int, generation: int,
                 prefill_dp_group: int | None = None, arrived: float = 0.0):
        self.ep = ep
        self.room = room
        self.generation = generation
        sources = ep._sources_for(room, prefill_dp_group)
        with ep.lock:
            key = (room, generation)
            if key in ep.recvs:
                raise ValueError(f"room {room} generation {generation} is in use; a new use of "
                                 "the room needs a new generation")
            self._rv = ep.recvs[key] = _Recv(room, generation, sources, t_arrived=arrived)

    def init(self, page_ids, prefix_len: int = 0, *, slot: int = -1, ring_slot: int = -1,
             aux_row: int = -1, window_page_ids=None, layer_slots=None) -> None:
        """Tell prefill where this request's state goes (decode pool ids). `layer_slots`:
        {layer id: slot} when the state layers have a slot each (Note [Layer slots])."""
        window = np.asarray(window_page_ids if window_page_ids is not None else [], np.int64)
        per_layer = tuple(sorted((int(i), int(s)) for i, s in (layer_slots or {}).items()))
        target = DecodeTarget(np.asarray(page_ids, np.int64), prefix_len, slot, ring_slot,
                              aux_row, window, per_layer)
        ep = self.ep
        items = staging.request_items(ep.layout, target, ep.page_size)
        with ep.lock:
            rv = self._rv
            if rv.requested or rv.state in TERMINAL:
                raise ValueError(f"room {self.room}: init() after the request started or ended")
            rv.target = target
            rv.requested = True
            rv.t_requested = time.monotonic()
            rv.deadline = rv.t_requested + knobs.get("transfer_timeout_s")
            rv.state = KVPoll.WaitingForInput
            regions = {name: ep._stage(rv, name, items) for name in sorted(rv.expected)}
            if ep.faults.staging_region is not None:  # Note [Fault hooks]: tests only
                regions = {n: ep.faults.staging_region(*r) for n, r in regions.items()}
            rv.staged_links = len(rv.staged)
            slots = {name: ring.slots for name, ring in rv.rings.items()}
        for name, (addr, nbytes) in regions.items():
            # One message per source: each link of a staged request has its own region.
            ep.hub.send(name, ep.wire.encode(W.TransferRequest(
                room=self.room, generation=self.generation, decode_rank=ep.rank,
                dst_page_ids=target.page_ids, decode_prefix_tokens=prefix_len, slot=slot,
                ring_slot=ring_slot, aux_row=aux_row, window_page_ids=window,
                layer_slots=np.array([x for pair in per_layer for x in pair], np.int64),
                staging_addr=addr, staging_bytes=nbytes, staging_slots=slots.get(name, 0))))

    def poll(self) -> KVPoll:
        with self.ep.lock:
            rv = self._rv
            if rv.written:
                self.ep._landed(rv)  # Note [Success by event]
            self.ep._settle(rv)  # Note [Scatter by event]
            state = rv.state
            first = state in TERMINAL and not rv.seen
            rv.seen = rv.seen or first
        if first:  # when the serving engine learned it (Note [Timeline stamps])
            mark("seen", "decode", self.room, self.generation, ok=state == KVPoll.Success)
        return state

    @property
    def reason(self) -> str:
        with self.ep.lock:
            return self._rv.reason

    @property
    def bytes(self) -> int:
        with self.ep.lock:
            return self._rv.bytes

    @property
    def descriptors(self) -> int:
        """Descriptors the prefill ranks submitted for this request (their Success
        statuses); decode itself submits none."""
        with self.ep.lock:
            return self._rv.descriptors

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
            self.ep._settle(rv, wait=True)  # its last sources succeeded: it ends now
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
