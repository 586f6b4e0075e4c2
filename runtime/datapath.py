"""Data path: request indices × plan entries × byte segments → one descriptor list per peer.

Everything is vectorised with numpy: runs of contiguous items become one descriptor per run
when an entry moves whole items; head-slice or sub-block entries expand to one descriptor
per (item, piece). Every id is checked against the registered capacity on both sides before
any descriptor is produced (a peer's bad index fails its own request, never another's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .engines.base import DescriptorGrid
from .indices import (
    DecodeTarget,
    IndexError_,
    PrefillChunk,
    check_capacity,
    chunk_page_pairs,
    contiguous_runs,
    pair_key,
    ring_pairs,
    slot_ids,
    window_pairs,
)
from .layout_types import FamilyLayout
from .plan_types import Link


@dataclass(frozen=True)
class RemoteBuffer:
    """A peer's registered buffer, as its Register message announced it."""

    layer_id: int
    tensor: int
    base: int
    item_bytes: int
    capacity: int
    pitch: int = 0  # bytes from item i to i + 1, from the layout (Note [Item pitch]); 0: packed

    @property
    def stride(self) -> int:
        return self.pitch or self.item_bytes


@dataclass(frozen=True)
class LocalBuffer:
    base: int
    item_bytes: int
    capacity: int
    pitch: int = 0

    @property
    def stride(self) -> int:
        return self.pitch or self.item_bytes


@dataclass
class Descriptors:
    src: np.ndarray  # uint64 source addresses
    dst: np.ndarray  # uint64 destination addresses
    nbytes: np.ndarray  # uint64 lengths

    @property
    def count(self) -> int:
        return len(self.src)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum()) if len(self.nbytes) else 0


def component_pairs(layout: FamilyLayout, chunk: PrefillChunk, target: DecodeTarget,
                    page_size: int) -> dict:
    """(source ids, destination ids) of every component for one chunk, by component name
    (by (name, layer) for a slot component with a slot per layer: pair_key)."""
    out: dict = {}
    pages: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # by prefix pages skipped
    for c in layout.components:
        if c.index == "page":
            if c.send == "every_chunk" or chunk.last:
                skip = c.prefix_pages(target.prefix_len, page_size)
                if skip not in pages:
                    pages[skip] = chunk_page_pairs(chunk, target, page_size, skip)
                out[c.name] = pages[skip]
        elif not chunk.last:
            continue
        elif c.index == "window":
            out[c.name] = window_pairs(chunk, target, c.window_tokens, page_size,
                                       c.prefix_pages(target.prefix_len, page_size))
        elif c.index == "slot":
            out.update(slot_pairs(c.name, c.layer_ids, chunk, target))
        elif c.index == "aux":
            out[c.name] = _single(chunk.aux_row, target.aux_row, c.name, "aux row")
        elif c.index == "ring":
            if chunk.ring_slot < 0 or target.ring_slot < 0:
                raise IndexError_(f"component '{c.name}' needs a ring slot on both sides "
                                  f"(prefill {chunk.ring_slot}, decode {target.ring_slot})")
            out[c.name] = ring_pairs(chunk.ring_slot, target.ring_slot, c.ring_rows)
    return out


def slot_pairs(comp: str, layers: tuple[int, ...], chunk: PrefillChunk,
               target: DecodeTarget) -> dict:
    """A slot component's (source, destination) ids: under the component's name when both
    sides keep the request's state in one slot, else under (name, layer) for each layer
    (Note [Layer slots] in indices.py)."""
    src = slot_ids(chunk.slot, chunk.layer_slots, layers)
    dst = slot_ids(target.slot, target.layer_slots, layers)
    if isinstance(src, int) and isinstance(dst, int):
        return {comp: _single(src, dst, comp, "slot")}
    return {(comp, i): _single(src if isinstance(src, int) else src[i],
                               dst if isinstance(dst, int) else dst[i], comp,
                               f"slot for layer {i}") for i in layers}


def _single(src: int, dst: int, comp: str, what: str):
    if src < 0 or dst < 0:
        raise IndexError_(f"component '{comp}' needs a {what} on both sides (prefill {src}, "
                          f"decode {dst})")
    return np.array([src], np.int64), np.array([dst], np.int64)


def _entry_error(e, remote: dict[str, list[RemoteBuffer]]) -> str:
    """Why the peer's registration cannot take entry `e` of the plan ("" if it can)."""
    try:
        rb = remote[e.component][e.dst_pos]
    except (KeyError, IndexError):
        return f"peer registered no entry {e.dst_pos} for component '{e.component}'"
    if rb.layer_id != e.layer_id or rb.item_bytes != e.dst_item_bytes:
        return (f"peer entry {e.dst_pos} of '{e.component}' is layer {rb.layer_id} with "
                f"{rb.item_bytes} B items; the plan expects layer {e.layer_id} with "
                f"{e.dst_item_bytes} B")
    return ""


@dataclass(frozen=True)
class _WholeGroup:
    """The whole-item entries of one component on a link: base addresses on both sides."""

    component: str
    # the bases as a grid's rows (uint64 [entries], read-only): made once, not per chunk
    src_rows: np.ndarray
    dst_rows: np.ndarray
    local: LocalBuffer  # the first entry's buffers: capacity and stride of the component
    remote: RemoteBuffer | None
    error: str  # the first entry the peer's registration cannot take, or ""


@dataclass(frozen=True)
class DescriptorTemplate:
    """Note [Descriptor templates]: what `build_descriptors` derives from the link and the two
    sides' registrations alone (the loop over the plan's entries: buffer lookups, the
    peer-registration checks, base addresses), computed once per (link, peer incarnation,
    whole_only). A chunk then costs one broadcast per component instead of a Python loop over
    the link's 160 Llama entries (about 0.5 ms per request on the H200 box's CPU, section (p)
    of BENCHMARKS.md). The descriptors are the same, in the same order, as
    `build_descriptors` gives; chunks limited to some layers (streaming) and per-layer slot
    ids (Note [Layer slots]) take `build_descriptors` itself."""

    link: Link
    local: dict[str, list[LocalBuffer]]
    remote: dict[str, list[RemoteBuffer]]
    whole_only: bool
    partial: bool  # the link has partial entries this template would move: not templated
    groups: tuple[_WholeGroup, ...]

    @staticmethod
    def of(link: Link, local: dict[str, list[LocalBuffer]],
           remote: dict[str, list[RemoteBuffer]], whole_only: bool = False
           ) -> DescriptorTemplate:
        bases: dict[str, tuple[list[int], list[int], LocalBuffer, RemoteBuffer | None, str]] = {}
        partial = False
        for e in link.entries:
            if not e.whole_item:
                partial |= not whole_only
                continue
            lb = local[e.component][e.src_pos]
            why = _entry_error(e, remote)
            rb = None if why else remote[e.component][e.dst_pos]
            g = bases.setdefault(e.component, ([], [], lb, rb, why))
            if why and not g[4]:
                g = bases[e.component] = (g[0], g[1], g[2], g[3], why)
            g[0].append(lb.base)
            g[1].append(rb.base if rb is not None else 0)
        groups = tuple(_WholeGroup(c, _rows(s), _rows(d), lb, rb, why)
                       for c, (s, d, lb, rb, why) in bases.items())
        return DescriptorTemplate(link, local, remote, whole_only, partial, groups)

    def grids(self, pairs: dict, layers: set[int] | None = None) -> list[DescriptorGrid] | None:
        """The chunk's descriptors as one grid per component (Note [Descriptor grids]): the
        entries' base addresses as rows, the id runs as runs; None where `build` would not
        use the template either."""
        if layers is not None or self.partial or any(isinstance(k, tuple) for k in pairs):
            return None
        out = []
        for g in self.groups:
            ids = pairs.get(g.component)
            if ids is None or len(ids[0]) == 0:
                continue
            if g.error:
                raise IndexError_(g.error)
            assert g.remote is not None  # set whenever error is ""
            src_ids, dst_ids = ids
            check_capacity(src_ids, g.local.capacity, f"prefill '{g.component}'")
            check_capacity(dst_ids, g.remote.capacity, f"decode '{g.component}'")
            ss, ds, n = contiguous_runs(src_ids, dst_ids)
            lb, rb = g.local, g.remote
            if (lb.stride != lb.item_bytes or rb.stride != rb.item_bytes) and len(n) and \
                    int(n.max()) > 1:
                raise IndexError_(f"component '{g.component}' has pitched items but moves a run "
                                  f"of {int(n.max())}; only one item per request may be pitched")
            out.append(DescriptorGrid(g.src_rows, g.dst_rows,
                                      (ss * lb.stride).view(np.uint64),
                                      (ds * rb.stride).view(np.uint64),
                                      (n * lb.item_bytes).view(np.uint64)))
        return out

    def build(self, pairs: dict, layers: set[int] | None = None) -> Descriptors:
        """`build_descriptors(link, local, remote, pairs, layers, whole_only)`, faster."""
        grids = self.grids(pairs, layers)
        if grids is None:
            return build_descriptors(self.link, self.local, self.remote, pairs, layers,
                                     self.whole_only)
        srcs, dsts, lens = [], [], []
        for g in grids:
            s, d, n = g.expand()
            srcs.append(s)
            dsts.append(d)
            lens.append(n)
        if not srcs:
            empty = np.zeros(0, np.uint64)
            return Descriptors(empty, empty.copy(), empty.copy())
        return Descriptors(np.concatenate(srcs), np.concatenate(dsts), np.concatenate(lens))


def _rows(bases: list[int]) -> np.ndarray:
    rows = np.asarray(bases, np.int64).view(np.uint64)
    rows.flags.writeable = False
    return rows


def build_descriptors(link: Link, local: dict[str, list[LocalBuffer]],
                      remote: dict[str, list[RemoteBuffer]],
                      pairs: dict,
                      layers: set[int] | None = None, whole_only: bool = False) -> Descriptors:
    """Descriptors of `link` for one chunk; `layers` limits them to finished layers, and
    `whole_only` leaves out partial entries (the staged path moves those).

    Whole-item entries of one component share their id runs, so their descriptors are built
    for all entries at once (base addresses x runs); the loop over entries only collects base
    addresses and checks the peer's registration.
    """
    srcs, dsts, lens = [], [], []
    runs_cache: dict[str, tuple] = {}
    whole: dict[str, tuple[list[int], list[int], LocalBuffer, RemoteBuffer]] = {}
    for e in link.entries:
        key = pair_key(pairs, e.component, e.layer_id)
        if key is None:
            continue
        if layers is not None and e.layer_id not in layers:
            continue
        if whole_only and not e.whole_item:
            continue
        src_ids, dst_ids = pairs[key]
        if len(src_ids) == 0:
            continue
        lb = local[e.component][e.src_pos]
        why = _entry_error(e, remote)
        if why:
            raise IndexError_(why)
        rb = remote[e.component][e.dst_pos]
        if key not in runs_cache:
            check_capacity(src_ids, lb.capacity, f"prefill '{e.component}'")
            check_capacity(dst_ids, rb.capacity, f"decode '{e.component}'")
            runs_cache[key] = contiguous_runs(src_ids, dst_ids)
        if e.whole_item:
            group = whole.setdefault(key, ([], [], lb, rb))
            group[0].append(lb.base)
            group[1].append(rb.base)
            continue
        s_items = lb.base + src_ids * lb.stride
        d_items = rb.base + dst_ids * rb.stride
        for seg in e.segments:
            k = np.arange(seg.repeat, dtype=np.int64)
            so = seg.src_offset + k * seg.src_stride
            do = seg.dst_offset + k * seg.dst_stride
            srcs.append((s_items[:, None] + so[None, :]).reshape(-1))
            dsts.append((d_items[:, None] + do[None, :]).reshape(-1))
            lens.append(np.full(len(src_ids) * seg.repeat, seg.nbytes, np.int64))
    for comp, (s_bases, d_bases, lb, rb) in whole.items():
        ss, ds, n = runs_cache[comp]
        comp = comp if isinstance(comp, str) else comp[0]
        if (lb.stride != lb.item_bytes or rb.stride != rb.item_bytes) and len(n) and \
                int(n.max()) > 1:
            # Only slot state has a pitch (Note [Item pitch]): one item per request.
            raise IndexError_(f"component '{comp}' has pitched items but moves a run of "
                              f"{int(n.max())}; only one item per request may be pitched")
        sb = np.asarray(s_bases, np.int64)[:, None]
        db = np.asarray(d_bases, np.int64)[:, None]
        srcs.append((sb + (ss * lb.stride)[None, :]).reshape(-1))
        dsts.append((db + (ds * rb.stride)[None, :]).reshape(-1))
        lens.append(np.broadcast_to(n * lb.item_bytes, (len(s_bases), len(n))).reshape(-1))
    if not srcs:
        empty = np.zeros(0, np.uint64)
        return Descriptors(empty, empty.copy(), empty.copy())
    return Descriptors(np.concatenate(srcs).astype(np.uint64),
                       np.concatenate(dsts).astype(np.uint64),
                       np.concatenate(lens).astype(np.uint64))
