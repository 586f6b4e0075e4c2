"""The transfer worker of a prefill rank: moves each use of a room forward, issues its writes,
and retires it. Its passes run on its own thread, or on the thread that made the work (Note
[Advance on the waking thread]); one pass at a time, under `advancing`, owns the engine
batches, the staging arena and the launches."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from .. import integrity, knobs
from .. import wire as W
from ..datapath import DescriptorTemplate, component_pairs
from ..engines.base import BatchState, TransferError
from ..indices import (
    IndexError_,
    check_page_coverage,
    prefill_pages_by_position,
    remap_kv_slots,
)
from ..metrics import TransferRecord, emit
from ..plan_types import RankId
from .common import (
    KVPoll,
)
from .records import _Chunk, _Final, _Peer, _Room, _Target
from .states import TERMINAL, advanced

if TYPE_CHECKING:
    from .host import PrefillHost
else:  # Note [Typed mixins]: the hosts are for the type checker only
    PrefillHost = object


# How often an idle transfer worker looks at its rooms' deadlines (seconds-long timeouts, and
# rooms failed by the hub's liveness timer), and how long it sleeps with no room at all; new
# work wakes it at once.
_DEADLINE_CHECK_S = 0.05
_IDLE_S = 1.0
# Note [Advance on the waking thread]: a direct-path request used to cross two thread
# hand-offs inside prefill besides the wire: the hub thread read decode's request and woke the
# transfer worker, which issued the writes; the engine's completion thread saw the write end
# and woke the worker again, which sent Success. Each wake-up is a futex and a wait for the
# GIL (0.15-0.25 ms each in the H200 trace of a 1K request, BENCHMARKS.md (v)). Now the thread
# that made the work runs the pass itself when no other pass is running: `advancing` is
# held by whichever thread is in a pass, so passes stay one at a time and everything a pass
# owns (engine batches, the staging arena, the launches) keeps one user, as it had when only
# the worker ran them. A thread that finds a pass running wakes the worker, which scans again
# after it (the wake is cleared before a scan), so no work is lost. The engine's completion
# thread does this only where it does nothing but wait (`callbacks_may_work`: cuda_ipc); the
# sender's `send()` (the serving engine's scheduler thread) still wakes the worker, so the
# scheduler never runs a submit. Knob `advance_inline` (0: always wake the worker).
# Passes an inline advance makes at most before it leaves the rest to the worker: the first
# issues a room's writes, the second sees nothing left to move.
_INLINE_PASSES = 2


class PrefillWorker(PrefillHost):
    """Part of PrefillEndpoint (prefill.py), whose state these methods use."""

    def _peers_of(self, r: _Room) -> list[tuple[RankId, _Peer | None]]:
        g, inst = self._decode_group(r), r.decode_instance
        # No request yet: the instance is unknown ("" stands for the only one it can be)
        return [(d, self.peers.get((inst or "", g, d))) for d in self.links]

    def _work(self) -> None:
        sleep_s = knobs.get("poll_sleep_s")
        polled = bool(knobs.get("worker_poll"))
        while not self._stop.is_set():
            self.wake.clear()  # before the scan: work that arrives during it sets it again
            with self.advancing:
                busy, inflight, events, rooms = self._pass()
            if not busy:
                # Nothing moved. Forward events (CUDA) and the writes of an engine that ends
                # batches only when polled are polled again soon, never spun on; otherwise
                # sleep until a message, a sender call or a finished batch wakes us (Note
                # [Completion wake-up]), waking now and then for the rooms' deadlines.
                if events or (inflight and (polled or not self._engine_wakes)):
                    time.sleep(sleep_s)
                elif polled:
                    self.wake.wait(sleep_s * 10)
                else:
                    self.wake.wait(_DEADLINE_CHECK_S if rooms else _IDLE_S)

    def advance_here(self) -> None:
        """Note [Advance on the waking thread]: the thread that just made work (the hub
        thread after a message, the engine's completion thread after a batch) moves the rooms
        forward itself when no pass is running, instead of waking the worker (one thread
        hand-off less on each side of a request); otherwise, and for what only polling moves
        on, the worker is woken as before."""
        if self._stop.is_set() or not self._inline or \
                not self.advancing.acquire(blocking=False):
            self.wake.set()
            return
        try:
            for _ in range(_INLINE_PASSES):  # the worker loops while a pass moves something
                busy, inflight, events, _ = self._pass()
                if not busy:
                    break
        finally:
            self.advancing.release()
        if busy or events or (inflight and (self._polled or not self._engine_wakes)):
            self.wake.set()

    def _pass(self) -> tuple[bool, bool, bool, bool]:
        """One look at every room (caller holds `advancing`): (anything moved, writes in
        flight, forward events waiting, any room)."""
        busy = inflight = False
        if self._waiting_events:
            self._poll_events()
        with self.lock:
            rooms = list(self.rooms.values())
            events = bool(self._waiting_events)
        for r in rooms:
            try:
                busy |= self._advance(r)
                inflight |= bool(r.inflight)
            except Exception as e:  # noqa: BLE001 - one room's bug must not stop all
                import sys
                import traceback

                self.counters["worker_errors"] += 1
                print(f"pdc: prefill worker error on room {r.room}: {e!r}", file=sys.stderr)
                traceback.print_exc()
                with self.lock:
                    r.fail(f"internal error: {e!r}")
        return busy, inflight, events, bool(rooms)

    def _poll_inflight(self, r: _Room) -> None:
        still = []
        for b in r.inflight:
            st = self.engine.poll(b)
            if st is BatchState.PENDING:
                still.append(b)
            elif st is BatchState.FAILED:
                with self.lock:
                    r.fail(f"transfer failed: {b.reason}")
            else:
                self._ring_written(r, b)  # Note [Staging ring]
        if len(still) < len(r.inflight):
            with self.lock:  # Note [Health]: progress of the writes in flight
                self.counters["batches_done"] += len(r.inflight) - len(still)
        r.inflight = still

    def _advance(self, r: _Room) -> bool:
        """Move one room forward; returns whether anything happened."""
        had = len(r.inflight)
        if had:
            self._poll_inflight(r)
        now = time.monotonic()
        with self.lock:
            if r.state not in TERMINAL and now - r.created > knobs.get("prefill_room_timeout_s"):
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
                assert p is not None  # with a peer not registered, it returned above
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
                issued = r.stats.batches
                self._submit(r, c, layers)
                if not finished:
                    r.stats.layer_batches += r.stats.batches - issued
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
        self._pump_rings(r)  # Note [Staging ring]
        if r.inflight:
            with self.lock:
                r.state = advanced(r.state, KVPoll.Transferring)
            if not r.written_sent and r.last_seen and self._by_event and \
                    all(c.sent_all for c in r.chunks) and not self._ring_pending(r):
                self._send_written(r)
            return True
        if r.last_seen and all(c.sent_all for c in r.chunks) and not self._ring_pending(r):
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
            whole_only = t.staged is not None
            tmpl = t.peer.templates.get(whole_only)
            if tmpl is None:
                tmpl = t.peer.templates[whole_only] = DescriptorTemplate.of(
                    self.links[d], self.local, t.peer.remote, whole_only)
            grids = None
            if getattr(self.engine, "takes_grids", False) and not whole_only and \
                    knobs.get("descriptor_grids"):
                grids = tmpl.grids(pairs, layers)
            if grids is not None:  # Note [Descriptor grids]
                if grids:
                    self._stamp_first(r)
                    self._issue(r, d, self.engine.submit_grids(t.peer.engine_peer, grids),
                                sum(g.total_bytes for g in grids), sum(g.count for g in grids))
                continue
            desc = tmpl.build(pairs, layers)
            src, dst, nbytes = desc.src, desc.dst, desc.nbytes
            if t.staged is not None:
                s2, d2, n2 = self._gather(c, t, self.links[d], layers)
                src, dst, nbytes = (np.concatenate([a, b.astype(np.uint64)]) for a, b in
                                    ((src, s2), (dst, d2), (nbytes, n2)))
            if len(src) == 0:
                continue
            self._stamp_first(r)
            self._issue(r, d, self.engine.submit_write(t.peer.engine_peer, src, dst, nbytes),
                        int(nbytes.sum()), len(src))

    @staticmethod
    def _stamp_first(r: _Room) -> None:
        if r.stats.batches == 0:  # the timeline's "first write submitted"
            r.stats.t_init = time.monotonic()

    def _issue(self, r: _Room, d: int, batch, total: int, count: int) -> None:
        """Counts a submitted batch of `count` descriptors and `total` bytes to decode rank d."""
        r.inflight.append(batch)
        r.last_batch[d] = batch  # Note [Success by event]
        r.stats.bytes += total
        r.stats.descriptors += count
        r.stats.batches += 1
        r.bytes_to[d] = r.bytes_to.get(d, 0) + total
        r.descriptors_to[d] = r.descriptors_to.get(d, 0) + count

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

    def _digest_chunk(self, r: _Room, c: _Chunk) -> None:
        """Add a complete chunk's source bytes to each link's digest (Note [Link digest])."""
        for d, t in r.targets.items():
            assert r.generation is not None  # set by the TransferRequest that made the target
            pairs = self._pairs(c, d, t)
            part = integrity.link_digest(r.room, r.generation, self.links[d], self.pools.view,
                                         pairs, "src")
            r.digests[d] = integrity.add(r.digests.get(d, 0), part)

    # Note [Success by event]: on the direct path a request's end waited for three things after
    # its last write was queued: the write, prefill's completion thread and pass, and the Success
    # message's trip to decode (0.7 + 0.7 ms after the submit in the H100 trace of a 1K request,
    # BENCHMARKS.md (w)). An engine whose writes end at an event another process can open
    # (cuda_ipc: the done event is made interprocess) lets prefill send, right after the last
    # write of a room is queued, a Transferring status carrying that event's handle and what its
    # Success will say; the message then crosses while the GPU writes. Decode opens the event and
    # its `poll()` ends the request once the event has completed; the engine's writes run in order
    # on one stream, so the last write's event covers every earlier one. Nothing else changes:
    # prefill still sends Success when its own completion thread sees the write end, decode
    # counts each source once (whichever comes first), and a failure still arrives as Failed.
    # The exported events are kept alive, bounded, after their batches end. Staged targets are
    # left out (decode scatters after Success). Knob `success_by_event`.
    def _send_written(self, r: _Room) -> None:
        """Note [Success by event]: every write of the room is queued; tell each direct-path
        target the event after its last one, with what its Success will say."""
        r.written_sent = True
        sends = []
        with self.lock:
            if r.state == KVPoll.Failed:
                return
            for d, t in r.targets.items():
                batch = r.last_batch.get(d)
                handle = self.engine.written_event(batch) if t.staged is None and \
                    batch is not None else b""
                if not handle:
                    continue  # staged (decode scatters after Success) or already ended
                sends.append((t.identity, self._written_status(r, d, KVPoll.Transferring,
                                                                written_event=handle)))
            self.counters["written_events_sent"] += len(sends)
        for ident, st in sends:
            self._reply(ident, st)

    def _written_status(self, r: _Room, d: RankId, state: KVPoll, **kw):
        """What decode rank d is told once the room's writes to it are all queued (its
        written event, Note [Success by event]) or landed (Success)."""
        assert r.generation is not None  # set by the TransferRequest of the target
        return self._status(r.room, r.generation, state, bytes_written=r.bytes_to.get(d, 0),
                            descriptors=r.descriptors_to.get(d, 0),
                            checksum=r.digests.get(d, 0) if r.checksum else None,
                            page_start=r.last_range[0], page_count=r.last_range[1], **kw)

    def _finish_success(self, r: _Room) -> None:
        with self.lock:
            if r.state == KVPoll.Failed:
                return  # an abort won the race; the next round drains and acks it
            r.state = KVPoll.Success
            r.stats.t_done = time.monotonic()
            parked = self._retire(r)
            sends = []
            for d, t in r.targets.items():
                sends.append((t.identity, self._written_status(r, d, KVPoll.Success)))
            self.counters["succeeded"] += 1
        self._free_gather_buffers(r, drained=True)
        for ident, st in sends:
            self._reply(ident, st)
        self._replay(parked)
        self.on_change()  # Note [State-change signal]

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
            sends: list[tuple[bytes, W.AbortAck | W.Status]] = []
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
        self.on_change()  # Note [State-change signal]
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
            layer_batches=r.stats.layer_batches,
            t_start=r.created, t_bootstrap_done=r.t_requested, t_first_write=r.stats.t_init,
            t_done=time.monotonic(), generation=r.generation or 0,
            t_forward_done=r.t_forward_done, ring_waits=self._ring_waits(r)))
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
