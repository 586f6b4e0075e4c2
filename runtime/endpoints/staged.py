"""The staged path's hookup in the endpoints (Note [Staging layout] in runtime/staging.py): each
rank's staging arena and copy-kernel launches, prefill's gather buffers, decode's regions and
their scatter into the pools."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from .. import knobs, staging, staging_ring
from .. import wire as W
from ..engines.base import TransferEngine, TransferError
from ..indices import (
    DecodeTarget,
    IndexError_,
    check_capacity,
)
from ..plan_types import RankId
from ..pools import RankPools, address
from .common import KVPoll
from .records import _Chunk, _Peer, _Recv, _Room, _Staged, _Target
from .states import TERMINAL

if TYPE_CHECKING:
    from .host import DecodeHost, PrefillHost
else:  # Note [Typed mixins]: the hosts are for the type checker only
    PrefillHost = DecodeHost = object


def _launches(pools: RankPools, layout) -> staging.Launches | None:
    """Copy-kernel launches for the staged path on device pools (the staging_copies knob),
    through the family's generated kernels module where it has one."""
    mode = knobs.get("staging_copies")  # one of auto, torch, kernels (knobs.get checks)
    device = getattr(pools, "device", None)
    if device is None or mode == "torch" or (mode == "auto" and device.type != "cuda"):
        return None
    return staging.Launches(staging.family_kernels(layout))


# Note [Scatter by event]: decode's staged scatter on a GPU is queued by the control thread,
# which then records a CUDA event instead of synchronising the stream (1.3 ms for an 8K
# Llama-70B request on the H200, during which no other control message was handled). The
# request turns Success once the event has completed: at the serving engine's next poll() or
# the control thread's next tick, whichever comes first. The staging regions stay reserved
# until then (the scatter reads them); an abort, a failure or a release() in between waits
# for the event first, so that no page is given back while the scatter still writes it.
def _scatter_event(pools: RankPools):
    """A CUDA event after the copies queued on the pools' device so far; None off CUDA."""
    device = getattr(pools, "device", None)
    if device is None or device.type != "cuda":
        return None
    import torch

    ev = torch.cuda.Event(blocking=True)  # Note [Sleeping waits]
    ev.record(torch.cuda.current_stream(device))
    return ev


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


class PrefillStaging(PrefillHost):
    """The staged path of a prefill rank; part of PrefillEndpoint (prefill.py), whose state
    these methods use."""

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
        slots = msg.staging_slots
        if slots:  # Note [Staging ring]
            least = staging_ring.min_slot_bytes(blocks)
            if nbytes // slots < least:
                return (f"staging ring slot of {nbytes // slots} bytes cannot hold one item "
                        f"of this request's largest staging block ({least} bytes)"), None
            ring = staging_ring.PrefillRing(slots, nbytes // slots)
            return "", _Staged(addr, nbytes, blocks, ring=ring)
        if nbytes != need:
            return (f"staging region of {nbytes} bytes; this request's staging layout needs "
                    f"{need} (both sides must lower the same plan)"), None
        return "", _Staged(addr, nbytes, blocks)

    def _gather(self, c: _Chunk, t: _Target, link, layers):
        """Pack the chunk's pieces of the link's partial entries into this rank's gather
        buffer at their staging offsets; one descriptor per contiguous stretch of it."""
        st = t.staged
        assert st is not None  # _submit gathers for staged targets only
        if st.local is None:
            self._reserve_gather_buffer(st)
        base = address(st.local)
        positions = c.positions.get(t.peer.rank)
        if positions is None:
            positions = c.positions[t.peer.rank] = staging.chunk_positions(
                self.layout, c.chunk, t.target, self.page_size)
        if st.ring is not None:  # queued; _pump_rings writes them (Note [Staging ring])
            st.ring.todo.extend(staging_ring.pieces(st.blocks, link, positions, layers,
                                                    st.ring.slot_bytes))
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        if self.launches is not None:
            offs_a, lens_a = self.launches.gather_chunk(link, st.blocks, self.pools.view,
                                                        positions, layers, st.local)
            # Launches exist for device pools only (_launches), so the pools have a device.
            if len(offs_a) and not self.engine.orders_after(getattr(self.pools, "device", None)):
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
        if self.arena is not None:
            off = self.arena.alloc(st.nbytes)
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
                assert self.arena is not None  # the offset is one of its regions
                self.arena.release(st.arena_offset, st.nbytes)
            else:
                self.engine.deregister(address(st.local))
            st.local = None


    # ~~~ rings (Note [Staging ring]) ~~~

    def _pump_rings(self, r: _Room) -> None:
        """Write queued pieces into the free slots of each ring of the room (worker)."""
        for t in r.targets.values():
            ring = t.staged.ring if t.staged is not None else None
            if ring is None:
                continue
            while ring.todo:
                with self.lock:
                    if r.state == KVPoll.Failed:
                        return
                    slot = ring.free.pop(0) if ring.free else None
                    if slot is None:
                        if not ring.waiting:
                            ring.waiting = True
                            ring.waits += 1
                            self.counters["staging_ring_waits"] += 1
                        break
                ring.waiting = False
                piece = ring.todo.popleft()
                self._write_piece(r, t, slot, piece)

    def _write_piece(self, r: _Room, t: _Target, slot: int, piece) -> None:
        st = t.staged
        assert st is not None and st.ring is not None  # only a ring's pieces are written here
        ring = st.ring
        if st.local is None:
            self._reserve_gather_buffer(st)
        at = slot * ring.slot_bytes
        link = self.links[t.peer.rank]
        slot_buf = st.local[at:at + ring.slot_bytes]
        if self.launches is not None:  # the piece as one launch, like a region's chunk
            blocks = self.launches.piece_blocks(st.blocks, piece.blocks, piece.n)
            self.launches.gather_chunk(
                link, blocks, self.pools.view,
                {blocks[0].component: (piece.ids, np.arange(piece.n, dtype=np.int64))}, None,
                slot_buf)
            n = piece.nbytes
            if not self.engine.orders_after(getattr(self.pools, "device", None)):
                self.pools.sync()  # the engine reads the gather buffer once it is submitted
        else:
            n = staging_ring.copy_piece("gather", self.pools.view, st.blocks, link,
                                        piece.blocks, piece.ids, slot_buf, "src")
            self.pools.sync()  # the engine reads the gather buffer once it is submitted
        batch = self.engine.submit_write(
            t.peer.engine_peer, np.array([address(st.local) + at], np.uint64),
            np.array([st.remote_addr + at], np.uint64), np.array([n], np.uint64))
        ring.writing[id(batch)] = (slot, piece)
        if r.stats.batches == 0:
            r.stats.t_init = time.monotonic()
        r.inflight.append(batch)
        r.stats.bytes += n
        r.stats.descriptors += 1
        r.stats.batches += 1
        d = t.peer.rank
        r.bytes_to[d] = r.bytes_to.get(d, 0) + n
        r.descriptors_to[d] = r.descriptors_to.get(d, 0) + 1

    def _ring_written(self, r: _Room, batch) -> None:
        """A write finished: if it carried a ring piece, tell decode (RingFilled)."""
        for t in r.targets.values():
            ring = t.staged.ring if t.staged is not None else None
            got = ring.writing.pop(id(batch), None) if ring is not None else None
            if ring is None or got is None:
                continue
            slot, p = got
            assert r.generation is not None  # set by the TransferRequest of the target
            with self.lock:
                ring.filled.add(slot)  # before the message: its RingFreed may come at once
            self._reply(t.identity, W.RingFilled(
                room=r.room, generation=r.generation, prefill_rank=self.rank, slot=slot,
                first_item=p.j0, items=p.n, blocks=np.asarray(p.blocks, np.int64)))
            return

    def _ring_pending(self, r: _Room) -> bool:
        """Pieces of the room still to be written."""
        return any(t.staged is not None and t.staged.ring is not None and t.staged.ring.todo
                   for t in r.targets.values())

    def _ring_waits(self, r: _Room) -> int:
        return sum(t.staged.ring.waits for t in r.targets.values()
                   if t.staged is not None and t.staged.ring is not None)

    def _on_ring_freed(self, identity: bytes, msg) -> None:
        """Decode scattered a piece: its slot may be filled again (control thread)."""
        with self.lock:
            r = self.rooms.get(msg.room)
            t = r.targets.get(msg.decode_rank) if r is not None else None
            ring = t.staged.ring if t is not None and t.staged is not None else None
            if r is None or t is None or r.generation != msg.generation or ring is None:
                return  # the use ended (the last pieces' slots come back after Success)
            if t.identity != identity or msg.slot not in ring.filled:
                self.counters["stale_ring_messages"] += 1  # only a slot decode holds comes back
                return
            ring.filled.discard(msg.slot)
            ring.free.append(msg.slot)


class DecodeStaging(DecodeHost):
    """The staged path of a decode rank; part of DecodeEndpoint (decode.py), whose state these
    methods use. Caller holds the lock."""

    def _stage(self, rv: _Recv, name: str, items: dict[str, int]) -> tuple[int, int]:
        """Reserve a staging region for the link from `name` when its partial entries would
        need many descriptors; (address, bytes), or (0, 0) for the direct path."""
        link = self.links[self.source_rank[name]]
        if self.arena is None or \
                staging.partial_descriptors(link, items) <= knobs.get("staged_min_descriptors"):
            return 0, 0
        blocks, nbytes = staging.link_blocks(link, items)
        off = self.arena.alloc(nbytes) if nbytes else None
        if off is None and nbytes and knobs.get("staging_ring_slots") > 0:
            got = staging_ring.reserve(self.arena, blocks, knobs.get("staging_ring_slots"),
                                       knobs.get("staging_ring_slot_bytes"))
            if isinstance(got, str):
                self.counters[got] += 1
                return 0, 0
            off, slots, size = got
            rv.staged[name] = (off, slots * size, blocks)
            rv.rings[name] = staging_ring.DecodeRing(off, slots, size, nbytes)
            self.counters["staged_links"] += 1
            self.counters["staging_rings"] += 1
            return self.arena.base + off, slots * size
        if off is None:
            self.counters["staging_full" if nbytes else "staging_empty"] += 1
            return 0, 0
        rv.staged[name] = (off, nbytes, blocks)
        self.counters["staged_links"] += 1
        return self.arena.base + off, nbytes

    def _unstage(self, rv: _Recv) -> str:
        """Scatter every staging region of a request into the pools (all sources are quiet:
        they reported Success); returns why it could not. On a GPU the scatter is only queued:
        `rv.scatter` is its event, and the request ends in `_settle` (Note [Scatter by
        event])."""
        if not rv.staged:
            return ""
        # A staged request was init()ed (its target set) and reserved its regions in the arena.
        assert rv.target is not None and self.arena is not None
        ids = staging.target_ids(self.layout, rv.target, self.page_size)
        queued = False
        try:
            for name, (off, nbytes, blocks) in rv.staged.items():
                ring = rv.rings.get(name)
                if ring is not None:  # scattered piece by piece (Note [Staging ring])
                    if ring.got != ring.need:
                        return (f"staged ring from {name}: {ring.got} of {ring.need} staged "
                                f"bytes arrived ({ring.pieces} pieces)")
                    continue
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
            rv.scatter = _scatter_event(self.pools) if self.launches is not None else None
            queued = rv.scatter is not None
            if not queued:
                self.pools.sync()  # Success means the bytes are in the pools
        except (IndexError_, ValueError) as e:
            return f"staged scatter: {e}"
        finally:
            if not queued:
                self._free_staging(rv)  # else once the scatter has read the regions
        return ""

    def _settle(self, rv: _Recv, wait: bool = False, finish: bool = True) -> bool:
        """Note [Scatter by event]: whether the request's staged scatter is over (always, when
        none is queued). Once its event has completed (`wait`: wait for it), the staging
        regions go back to the arena and, with `finish`, the request ends (checksums, then
        Success). Caller holds the lock."""
        ev = rv.scatter
        if ev is None:
            return True
        try:
            if wait:
                ev.synchronize()
            elif not ev.query():
                return False
            failed = ""
        except RuntimeError as e:  # a CUDA error surfaces at the event
            failed = f"staged scatter: CUDA: {e}"
        rv.scatter = None
        self._free_staging(rv)
        if finish and rv.state not in TERMINAL:
            if failed:
                self._fail(rv, failed)
            else:
                self._succeed(rv)
        return True

    def _free_staging(self, rv: _Recv) -> None:
        for off, nbytes, _ in rv.staged.values():
            assert self.arena is not None  # the regions are its own
            self.arena.release(off, nbytes)
        rv.staged.clear()
        rv.rings.clear()

    def _on_ring_filled(self, name: str, msg) -> None:
        """Note [Staging ring]: scatter one piece from its slot into the pools, then free the
        slot (RingFreed). Caller holds the lock."""
        rv = self.recvs.get((msg.room, msg.generation))
        ring = rv.rings.get(name) if rv is not None else None
        if rv is None or ring is None or msg.prefill_rank != self.source_rank[name]:
            self.counters["stale_messages"] += 1
            return
        if rv.state in TERMINAL:
            return  # failed or aborted: the region is freed with the pages, not slot by slot
        assert rv.target is not None and self.arena is not None  # a ring was reserved in init()
        try:
            if msg.slot >= ring.slots:
                raise IndexError_(f"slot {msg.slot} of a ring of {ring.slots}")
            _, blocks = rv.staged[name][1:]
            link = self.links[self.source_rank[name]]
            block_ids = msg.blocks.tolist()
            comp, nbytes = staging_ring.check_piece(blocks, link, block_ids, msg.first_item,
                                                    msg.items, ring.slot_bytes)
            if ring.ids is None:
                ring.ids = staging.target_ids(self.layout, rv.target, self.page_size)
            ids = ring.ids[comp][msg.first_item:msg.first_item + msg.items]
            at = ring.offset + msg.slot * ring.slot_bytes
            slot_view = self.arena.view(at, ring.slot_bytes)
            if self.launches is not None:  # the piece as one launch, like a region
                piece = self.launches.piece_blocks(blocks, block_ids, msg.items)
                self.launches.scatter_link(link, piece, self.pools.view, {comp: ids}, slot_view)
                ring.got += nbytes
            else:
                ring.got += staging_ring.copy_piece(
                    "scatter", self.pools.view, blocks, link, block_ids, ids, slot_view, "dst")
            ring.pieces += 1
            self.pools.sync()  # the slot may be written again once RingFreed leaves
        except (IndexError_, ValueError) as e:
            self._fail(rv, f"staged ring from {name}: {e}")
            return
        self.hub.send(name, self.wire.encode(W.RingFreed(
            room=rv.room, generation=rv.generation, decode_rank=self.rank, slot=msg.slot)))
