"""Data path: request indices × plan entries × byte segments → one descriptor list per peer.

Everything is vectorised with numpy: runs of contiguous items become one descriptor per run
when an entry moves whole items; head-slice or sub-block entries expand to one descriptor
per (item, piece). Every id is checked against the registered capacity on both sides before
any descriptor is produced (a peer's bad index fails its own request, never another's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .indices import (
    DecodeTarget,
    IndexError_,
    PrefillChunk,
    check_capacity,
    chunk_page_pairs,
    contiguous_runs,
    ring_pairs,
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
                    page_size: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(source ids, destination ids) of every component for one chunk."""
    out = {}
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
            out[c.name] = window_pairs(chunk, target, c.window_tokens, page_size)
        elif c.index == "slot":
            out[c.name] = _single(chunk.slot, target.slot, c.name, "slot")
        elif c.index == "aux":
            out[c.name] = _single(chunk.aux_row, target.aux_row, c.name, "aux row")
        elif c.index == "ring":
            if chunk.ring_slot < 0 or target.ring_slot < 0:
                raise IndexError_(f"component '{c.name}' needs a ring slot on both sides "
                                  f"(prefill {chunk.ring_slot}, decode {target.ring_slot})")
            out[c.name] = ring_pairs(chunk.ring_slot, target.ring_slot, c.ring_rows)
    return out


def _single(src: int, dst: int, comp: str, what: str):
    if src < 0 or dst < 0:
        raise IndexError_(f"component '{comp}' needs a {what} on both sides (prefill {src}, "
                          f"decode {dst})")
    return np.array([src], np.int64), np.array([dst], np.int64)


def build_descriptors(link: Link, local: dict[str, list[LocalBuffer]],
                      remote: dict[str, list[RemoteBuffer]],
                      pairs: dict[str, tuple[np.ndarray, np.ndarray]],
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
        if e.component not in pairs:
            continue
        if layers is not None and e.layer_id not in layers:
            continue
        if whole_only and not e.whole_item:
            continue
        src_ids, dst_ids = pairs[e.component]
        if len(src_ids) == 0:
            continue
        lb = local[e.component][e.src_pos]
        try:
            rb = remote[e.component][e.dst_pos]
        except (KeyError, IndexError):
            raise IndexError_(f"peer registered no entry {e.dst_pos} for component "
                              f"'{e.component}'") from None
        if rb.layer_id != e.layer_id or rb.item_bytes != e.dst_item_bytes:
            raise IndexError_(f"peer entry {e.dst_pos} of '{e.component}' is layer "
                              f"{rb.layer_id} with {rb.item_bytes} B items; the plan expects "
                              f"layer {e.layer_id} with {e.dst_item_bytes} B")
        if e.component not in runs_cache:
            check_capacity(src_ids, lb.capacity, f"prefill '{e.component}'")
            check_capacity(dst_ids, rb.capacity, f"decode '{e.component}'")
            runs_cache[e.component] = contiguous_runs(src_ids, dst_ids)
        if e.whole_item:
            group = whole.setdefault(e.component, ([], [], lb, rb))
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
