"""Staged path: gather partial items into one region, write it in bulk, scatter on decode.

A head slice of a KV page is `page_size` small pieces; under mismatched attention TP (or page
size 1) the direct path needs one descriptor per piece, and engines pay per descriptor. The
staged path packs those pieces on prefill into a staging buffer laid out exactly like a
region decode reserved in its registered staging arena, writes the region with a handful of
large descriptors, and decode scatters it into its pools once every source reported Success.
Entries that move whole items keep the direct path (they are already one descriptor per run).

Note [Staging layout]: the region of one (request, prefill rank -> decode rank) link holds,
for every partial entry of the link in plan order and every segment of it, a block of
`items(component) * segment.total_bytes` bytes; item j of the block is the j-th item the
request moves for that component (pages: absolute position minus the decode prefix pages;
window pages, slot, aux row and ring rows in the order of the request's ids). Both sides
compute it from the plan and the decode target alone, so a chunk knows where its items go
without any further message.

Copies run with numpy on host pools (pools.RankPools) and, for device pools, as one copy-kernel
launch per component (`Launches`) through the family's generated kernels module
(generated/<family>/kernels.py), or with torch indexing (the staging_copies knob).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .indices import DecodeTarget, IndexError_, PrefillChunk, check_capacity, contiguous_runs
from .layout_types import FamilyLayout
from .plan_types import Link, Segment
from .pools import address


@dataclass(frozen=True)
class Block:
    entry: int  # index in link.entries
    segment: Segment
    component: str
    offset: int  # bytes from the start of the link's staging region
    items: int  # items of the component this request moves


def request_items(layout: FamilyLayout, target: DecodeTarget, page_size: int) -> dict[str, int]:
    out = {}
    for c in layout.components:
        out[c.name] = {
            "page": max(0, len(target.page_ids) - c.prefix_pages(target.prefix_len, page_size)),
            "window": 0 if target.window_page_ids is None else len(target.window_page_ids),
            "ring": c.ring_rows,
        }.get(c.index, 1)
    return out


# Note [Staging programs]: a link's blocks, and everything derived from them (pool views,
# kernel entry tables, dense-layout checks), depend only on the link and on how many items the
# request moves per component, never on the page ids. An 8K Llama-70B link has 160 blocks; built
# per request they cost milliseconds of Python on each side, the staged path's whole fixed
# cost (BENCHMARKS.md (k)). So `link_blocks` returns one tuple per (link, items), kept across
# requests, and `Launches` keys its programs by that tuple's identity.
_BLOCKS_LIMIT = 1024
_blocks_cache: dict[tuple, tuple] = {}  # (id(link), items) -> (link, blocks, region bytes)


def link_blocks(link: Link, items: dict[str, int]) -> tuple[tuple[Block, ...], int]:
    """Blocks of the partial entries of `link` and the region's total bytes (Note [Staging
    programs]: the same tuple for the same link and item counts)."""
    key = (id(link), tuple(sorted(items.items())))
    hit = _blocks_cache.get(key)
    if hit is not None and hit[0] is link:
        return hit[1], hit[2]
    blocks, offset = [], 0
    for i, e in enumerate(link.entries):
        if e.whole_item:
            continue
        for seg in e.segments:
            blocks.append(Block(i, seg, e.component, offset, items[e.component]))
            offset += items[e.component] * seg.total_bytes
    if len(_blocks_cache) >= _BLOCKS_LIMIT:
        _blocks_cache.clear()
    out = tuple(blocks)
    _blocks_cache[key] = (link, out, offset)
    return out, offset


_partial_cache: dict[int, tuple] = {}  # id(link) -> (link, {component: segment repeats})


def partial_descriptors(link: Link, items: dict[str, int]) -> int:
    """Descriptors the direct path would need for the link's partial entries (decode asks
    at every request: the per-entry sums are kept per link, Note [Staging programs])."""
    hit = _partial_cache.get(id(link))
    if hit is None or hit[0] is not link:
        repeats: dict[str, int] = {}
        for e in link.entries:
            if not e.whole_item:
                repeats[e.component] = repeats.get(e.component, 0) + sum(
                    s.repeat for s in e.segments)
        if len(_partial_cache) >= _BLOCKS_LIMIT:
            _partial_cache.clear()
        hit = _partial_cache[id(link)] = (link, repeats)
    return sum(items[c] * n for c, n in hit[1].items())


def chunk_positions(layout: FamilyLayout, chunk: PrefillChunk, target: DecodeTarget,
                    page_size: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(prefill item ids, item positions j in the staging blocks) per component for a chunk."""
    out = {}
    n = len(chunk.page_ids)
    pos = np.arange(chunk.page_start, chunk.page_start + n, dtype=np.int64)
    for c in layout.components:
        if c.index == "page":
            if c.send == "every_chunk" or chunk.last:
                skip = c.prefix_pages(target.prefix_len, page_size)
                keep = pos >= skip
                out[c.name] = (np.asarray(chunk.page_ids, np.int64)[keep], pos[keep] - skip)
        elif not chunk.last:
            continue
        elif c.index == "window":
            w = np.asarray(chunk.window_page_ids if chunk.window_page_ids is not None else [],
                           np.int64)
            out[c.name] = (w, np.arange(len(w), dtype=np.int64))
        elif c.index == "slot":
            _one_slot(chunk.layer_slots, c.name)
            out[c.name] = (np.array([chunk.slot], np.int64), np.zeros(1, np.int64))
        elif c.index == "aux":
            out[c.name] = (np.array([chunk.aux_row], np.int64), np.zeros(1, np.int64))
        elif c.index == "ring":
            r = c.ring_rows
            out[c.name] = (chunk.ring_slot * r + np.arange(r, dtype=np.int64),
                           np.arange(r, dtype=np.int64))
    return out


def _one_slot(layer_slots, comp: str) -> None:
    """The staged path packs one slot item per slot component; a request with a slot per
    layer (Note [Layer slots]) takes the direct path."""
    if layer_slots:
        raise IndexError_(f"component '{comp}': the staged path moves one slot per request, "
                          f"this request names a slot per layer; use the direct path "
                          f"(staging off)")


def target_ids(layout: FamilyLayout, target: DecodeTarget, page_size: int) -> dict[str, np.ndarray]:
    """Decode item ids per component, in staging item order (j = 0, 1, ...)."""
    out = {}
    for c in layout.components:
        if c.index == "page":
            skip = c.prefix_pages(target.prefix_len, page_size)
            out[c.name] = np.asarray(target.page_ids, np.int64)[skip:]
        elif c.index == "window":
            out[c.name] = np.asarray(target.window_page_ids, np.int64)
        elif c.index == "slot":
            _one_slot(target.layer_slots, c.name)
            out[c.name] = np.array([target.slot], np.int64)
        elif c.index == "aux":
            out[c.name] = np.array([target.aux_row], np.int64)
        else:
            out[c.name] = target.ring_slot * c.ring_rows + np.arange(c.ring_rows, dtype=np.int64)
    return out


def _pieces(pool, offset: int, nbytes: int, repeat: int, stride: int):
    """[capacity, repeat, nbytes] writable view of the segment pieces of every item (a numpy
    array, or a torch tensor for device pools)."""
    cap = pool.shape[0]
    # Rows are the pool's own stride apart: an item pitch (Note [Item pitch]) keeps them apart.
    row = pool.strides[0] if isinstance(pool, np.ndarray) else pool.stride(0)
    strides = (row, stride if repeat > 1 else 0, 1)
    if isinstance(pool, np.ndarray):
        return np.lib.stride_tricks.as_strided(pool[:, offset:], shape=(cap, repeat, nbytes),
                                               strides=strides, writeable=True)
    return pool.as_strided((cap, repeat, nbytes), strides, pool.storage_offset() + offset)


def _index(like, ids: np.ndarray):
    """`ids` as an index of `like`: itself for numpy, an int64 tensor on `like`'s device."""
    if isinstance(like, np.ndarray):
        return ids
    import torch

    return torch.as_tensor(ids, dtype=torch.int64).to(like.device, non_blocking=True)


def gather(pool, ids: np.ndarray, seg: Segment, out) -> None:
    """Pack the source pieces of items `ids` back to back into `out` (len(ids) * total)."""
    view = _pieces(pool, seg.src_offset, seg.nbytes, seg.repeat, seg.src_stride)
    out.reshape(len(ids), seg.repeat, seg.nbytes)[:] = view[_index(pool, ids)]


def scatter(pool, ids: np.ndarray, seg: Segment, packed) -> None:
    """Unpack `packed` into the destination pieces of items `ids`."""
    view = _pieces(pool, seg.dst_offset, seg.nbytes, seg.repeat, seg.dst_stride)
    view[_index(pool, ids)] = packed.reshape(len(ids), seg.repeat, seg.nbytes)


def chunk_block_ranges(blocks: tuple[Block, ...], link: Link, positions, layers=None):
    """Yield (block, prefill ids, first j, count) for each contiguous j-run of a chunk."""
    # The runs depend on the component only: computed once per component, not once per block
    # (160 blocks of an 8K Llama link cost ~7 ms of numpy calls per link on a 2-core VM,
    # most of the staged path's fixed cost; BENCHMARKS.md (k)).
    runs: dict[str, list] = {}
    for b in blocks:
        e = link.entries[b.entry]
        if e.component not in positions:
            continue
        if layers is not None and e.layer_id not in layers:
            continue
        got = runs.get(e.component)
        if got is None:
            src, j = positions[e.component]
            got = runs[e.component] = []
            if len(j):
                starts, _, lens = contiguous_runs(j, j)
                at = 0
                for j0, n in zip(starts.tolist(), lens.tolist(), strict=True):
                    got.append((src[at:at + n], j0, n))
                    at += n
        for ids, j0, n in got:
            yield b, ids, j0, n


def _item_runs(j: np.ndarray) -> list[tuple[int, int]]:
    """(first j, count) of each run of consecutive positions in `j` (non-empty): what
    `contiguous_runs(j, j)` gives, in one pass (a whole chunk is one run)."""
    j = np.asarray(j, np.int64)
    breaks = np.flatnonzero(j[1:] - j[:-1] != 1)
    if not len(breaks):
        return [(int(j[0]), len(j))]
    starts = np.concatenate(([0], breaks + 1))
    counts = np.diff(np.concatenate((starts, [len(j)])))
    return list(zip(j[starts].tolist(), counts.tolist(), strict=True))


def merge_descriptors(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray):
    """Merge descriptors that continue each other on both sides (sorted by source)."""
    if len(src) < 2:
        return src, dst, nbytes
    order = np.argsort(src, kind="stable")
    src, dst, nbytes = src[order], dst[order], nbytes[order]
    cont = (src[:-1] + nbytes[:-1] == src[1:]) & (dst[:-1] + nbytes[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    sums = np.add.reduceat(nbytes, starts)
    return src[starts], dst[starts], sums


ALIGN = 64  # bytes: arena regions start and end on this


class Arena:
    """First-fit allocator over one registered staging buffer: a numpy array, or a torch
    tensor from TensorPools.new_bytes for device pools."""

    ALIGN = ALIGN

    def __init__(self, nbytes: int, buf=None):
        self.buf = np.zeros(max(nbytes, self.ALIGN), np.uint8) if buf is None else buf
        self.base = address(self.buf)
        self.free: list[tuple[int, int]] = [(0, len(self.buf))]  # (offset, size), sorted

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new region, or None when it does not fit."""
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        for i, (off, avail) in enumerate(self.free):
            if avail >= size:
                if avail == size:
                    self.free.pop(i)
                else:
                    self.free[i] = (off + size, avail - size)
                return off
        return None

    def release(self, offset: int, nbytes: int) -> None:
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        self.free.append((offset, size))
        self.free.sort()
        merged = [self.free[0]]
        for off, sz in self.free[1:]:
            last_off, last_sz = merged[-1]
            if last_off + last_sz == off:
                merged[-1] = (last_off, last_sz + sz)
            else:
                merged.append((off, sz))
        self.free = merged

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buf[offset:offset + nbytes]

    def largest(self) -> int:
        """Bytes of the largest free stretch (what one alloc can get at most)."""
        return max((sz for _, sz in self.free), default=0)

    def whole(self) -> bool:
        """Every byte is free (no region is reserved)."""
        return self.free == [(0, len(self.buf))]


def family_kernels(layout: FamilyLayout):
    """The generated kernels module of the layout's family, or None when it has none. A
    layout bound at start (Note [Bound families] in runtime/binding.py) has the geometry of
    the served model, not the one the module's alignments were derived from: it uses the
    generic kernels."""
    import importlib

    if layout.bound:
        return None

    try:
        return importlib.import_module(f"pdc.generated.{layout.py_name}.kernels")
    except ModuleNotFoundError:
        return None


@dataclass(frozen=True)
class _Group:
    """The blocks of one component of a link, as one copy-kernel launch."""

    component: str
    table: object  # copy_kernels.EntryTable over the blocks' pools
    capacity: int  # items every pool of the group holds
    items: int  # items of the component the request moves
    offsets: np.ndarray  # int64 [blocks]: block offsets in the link's region, bytes
    total_bytes: np.ndarray  # int64 [blocks]: bytes per item of each block
    unit_bytes: int  # bytes per item of all the group's blocks together
    dense_at: int  # region offset of the kernels' dense layout, or -1 (Note [Staging layout])


class Launches:
    """One-launch gathers and scatters with the copy kernels (runtime/copy_kernels.py) for
    device pools: every staging block of one component and one run of items moves in a single
    launch instead of one torch op per block. The kernels' packed layout (entry e's item j at
    `staging_offsets[e] + j * packed_bytes`) is Note [Staging layout] with the blocks' offsets
    (for a component whose blocks follow each other in the region, the kernels' dense layout
    at the first block's offset). The launches of one call replay as a CUDA graph when its
    shape ran before (Note [Staging graphs], runtime/staging_graphs.py).

    Programs (Note [Staging programs]) are built once per blocks tuple, side and layer set and
    kept, at most `limit` of them (streaming asks for one set per layer)."""

    def __init__(self, kernels=None, limit: int = 512):
        # The family's generated kernels module (generated/<family>/kernels.py: the copy
        # kernels with the word alignment each component's copies may promise), or None for
        # the generic kernels (a spec evaluated with overrides has no generated module).
        self.kernels = kernels
        self.limit = limit
        self.tables: OrderedDict = OrderedDict()  # key -> (blocks, {component: _Group})
        self.calls: OrderedDict = OrderedDict()  # shape -> _Call (Note [Staging call shapes])
        self.pieces: OrderedDict = OrderedDict()  # ring piece shape -> (blocks, piece blocks)
        self._lock = threading.Lock()
        from .staging_graphs import LaunchGraphs

        self.graphs = LaunchGraphs()

    def piece_blocks(self, blocks: tuple[Block, ...], block_ids, n: int) -> tuple[Block, ...]:
        """The blocks `block_ids` of a link's `blocks` as one ring piece lays them out in its
        slot (Note [Staging ring]: each block's n items back to back, in block order), so that
        gather_chunk and scatter_link move a piece like a region. Kept per piece shape: the
        launches' tables, call shapes and graphs are keyed by the tuple's identity."""
        key = (id(blocks), tuple(block_ids), n)
        with self._lock:
            hit = self.pieces.get(key)
            if hit is not None and hit[0] is blocks:
                self.pieces.move_to_end(key)
                return hit[1]
        out, at = [], 0
        for bi in block_ids:
            b = blocks[bi]
            out.append(Block(b.entry, b.segment, b.component, at, n))
            at += n * b.segment.total_bytes
        got = tuple(out)
        with self._lock:
            self.pieces[key] = (blocks, got)
            while len(self.pieces) > self.limit:
                self.pieces.popitem(last=False)
        return got

    def _max_align(self, comp: str) -> int:
        if self.kernels is not None and comp in self.kernels.ALIGN:
            return self.kernels.ALIGN[comp]
        return 16

    def _groups(self, side: str, link: Link, blocks: tuple[Block, ...], view, layers):
        key = (side, id(blocks), None if layers is None else tuple(sorted(layers)))
        with self._lock:
            hit = self.tables.get(key)
            if hit is not None and hit[0] is blocks:
                self.tables.move_to_end(key)
                return hit[1]
        from . import copy_kernels as K

        by_component: dict[str, list[Block]] = {}
        for b in blocks:
            e = link.entries[b.entry]
            if layers is None or e.layer_id in layers:
                by_component.setdefault(e.component, []).append(b)
        groups = {}
        for comp, bs in by_component.items():
            entries, capacities = [], []
            for b in bs:
                e, sg = link.entries[b.entry], b.segment
                pool = view(comp, e.src_pos if side == "src" else e.dst_pos)
                capacities.append(pool.shape[0])
                entries.append(K.Entry(pool, K.SegmentSpec.of(sg, pool.shape[1], side)))
            table = K.EntryTable(entries)
            offsets = np.array([b.offset for b in bs], np.int64)
            total = np.array([b.segment.total_bytes for b in bs], np.int64)
            items = bs[0].items
            prefix = np.asarray(table.prefix_bytes, np.int64)
            dense = bool(np.array_equal(offsets - offsets[0], items * prefix))
            groups[comp] = _Group(comp, table, int(min(capacities)), items, offsets, total,
                                  int(total.sum()), int(offsets[0]) if dense else -1)
        with self._lock:
            self.tables[key] = (blocks, groups)
            while len(self.tables) > self.limit:
                self.tables.popitem(last=False)
        return groups

    def gather_chunk(self, link: Link, blocks: tuple[Block, ...], view, positions,
                     layers, out) -> tuple[np.ndarray, np.ndarray]:
        """Pack a chunk's items (`positions`: chunk_positions) of the link's blocks into the
        gather buffer `out`; returns the (offsets, bytes) of the region it filled."""
        runs, ids_parts = [], []
        groups = self._groups("src", link, blocks, view, layers)
        for comp, g in groups.items():
            if comp not in positions:
                continue
            src, j = positions[comp]
            if not len(j):
                continue
            at = 0
            for j0, n in _item_runs(j):
                ids = src[at:at + n]
                at += n
                if j0 + n > g.items:
                    raise IndexError_(f"'{comp}' staging item {j0 + n - 1} is outside the "
                                      f"{g.items} items decode asked for")
                check_capacity(ids, g.capacity, f"prefill '{comp}'")
                runs.append((g, j0, n))
                ids_parts.append(ids)
        call = self._launch(("src", id(blocks), None if layers is None else tuple(sorted(layers))),
                            blocks, runs, ids_parts, out, True)
        if call is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return call.region_offsets, call.region_bytes

    def scatter_link(self, link: Link, blocks: tuple[Block, ...], view,
                     ids: dict[str, np.ndarray], region) -> None:
        """Every item of every block from a link's staging region into the pools (`ids`:
        target_ids, decode item ids per component)."""
        runs, ids_parts = [], []
        for comp, g in self._groups("dst", link, blocks, view, None).items():
            got = ids[comp]
            check_capacity(got, g.capacity, f"decode '{comp}'")
            if len(got):  # every item: the blocks' own offsets (the dense layout, if dense)
                runs.append((g, 0, len(got)))
                ids_parts.append(got)
        self._launch(("dst", id(blocks)), blocks, runs, ids_parts, region, False)

    def _launch(self, key: tuple, blocks, runs, ids_parts, staging_buf,
                to_staging: bool) -> _Call | None:
        """One launch per (group, first item, items) of `runs`, each moving its part of
        `ids_parts`, all reading their ids and offsets from one buffer and addressing the
        staging buffer's base tensor (Note [Staging graphs]). What the call's shape fixes is
        kept (Note [Staging call shapes])."""
        if not runs:
            return None
        base = staging_buf if staging_buf._base is None else staging_buf._base
        if base.dim() != 1 or base.dtype != staging_buf.dtype or not base.is_contiguous():
            base = staging_buf
        base_ptr = base.data_ptr()
        rel = staging_buf.data_ptr() - base_ptr
        shape_key = (key, base_ptr, rel, tuple([(g.component, j0, n) for g, j0, n in runs]))
        with self._lock:
            call = self.calls.get(shape_key)
            if call is not None and call.blocks is blocks:
                self.calls.move_to_end(shape_key)
            else:
                call = None
        if call is None:
            call = self._shape(blocks, runs, base, rel, to_staging)
            with self._lock:
                self.calls[shape_key] = call
                while len(self.calls) > self.limit:
                    self.calls.popitem(last=False)
        ids_parts.append(call.offsets_words)  # the values: every run's ids, then the offsets

        def build(dev):
            from . import copy_kernels as K

            launches, i, o = [], 0, call.total_ids
            for (g, _, n), at in zip(runs, call.offsets_bytes, strict=True):
                e = len(at)
                launch = K.prepare(g.table, dev[i:i + n], base, at.tolist(), check_indices=False,
                                   max_align=self._max_align(g.component),
                                   to_staging=to_staging, offsets_words=dev[o:o + e])
                i, o = i + n, o + e
                if launch is not None:
                    launches.append(launch)
            return launches

        self.graphs.run((*key, base_ptr, base.numel(), call.graph_shape), blocks, ids_parts,
                        base.device, build)
        return call

    def _shape(self, blocks, runs, base, rel: int, to_staging: bool) -> _Call:
        from . import copy_kernels as K

        shape, offs_words, offs_bytes, region_offs, region_lens = [], [], [], [], []
        for g, j0, n in runs:
            if to_staging and g.dense_at >= 0 and j0 == 0 and n == g.items:
                region_offs.append(np.array([g.dense_at], np.int64))
                region_lens.append(np.array([n * g.unit_bytes], np.int64))
                at = g.offsets  # == dense_at + n * prefix (dense)
            else:
                at = g.offsets if j0 == 0 else g.offsets + j0 * g.total_bytes
                region_offs.append(at)
                region_lens.append(n * g.total_bytes)
            at = np.asarray(at, np.int64) + rel
            align = K.launch_alignment(g.table, base, at, self._max_align(g.component))
            shape.append((g.component, n, align))
            offs_words.append(at // min(align, 4))
            offs_bytes.append(at)
        kept = [np.concatenate(p) for p in (offs_words, region_offs, region_lens)]
        for arr in kept:
            arr.flags.writeable = False  # shared by every call of the shape
        return _Call(blocks, tuple(shape), kept[0], tuple(offs_bytes),
                     sum(n for _, _, n in runs), kept[1], kept[2])


@dataclass(frozen=True)
class _Call:
    """Note [Staging call shapes]: what one shape of a gather or scatter call fixes (the link's
    blocks, the runs of items, the place of the region in the arena): the launches' shape
    (component, items, word alignment), the staging offsets in words and bytes, and for a
    gather the region's (offsets, bytes). A call of a kept shape brings only its item ids:
    its checks (the items' range, the pools' capacity) and one concatenation run per call,
    the alignment and offsets do not. Kept per `Launches`, the least recently used dropped
    beyond its `limit`."""

    blocks: tuple
    graph_shape: tuple  # (component, items, alignment) per launch
    offsets_words: np.ndarray  # int64: every launch's staging offsets, in its words
    offsets_bytes: tuple  # int64 [blocks] per launch: staging offsets in bytes
    total_ids: int
    region_offsets: np.ndarray  # int64: what a gather returns
    region_bytes: np.ndarray
