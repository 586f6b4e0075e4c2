"""Integrity: a 64-bit digest of the bytes one link of one request carries.

Note [Link digest]: with the `checksum` knob on, each prefill rank digests the source bytes it
wrote to a decode rank, item by item, and sends the digest with its Success; the decode rank
recomputes it over its destination items and fails the request on a mismatch, before
Success. The two agree only when every byte of the link arrived and nothing else (a stale
write of an aborted request, a write of another room) landed in those items in between.

    digest = sum over (link entry k, item with destination id i) of
             mix(key(room, generation, k, i) ^ H(bytes the entry moves of that item))  mod 2^64

- H hashes the entry's bytes of one item in a fixed order (its segments, then their pieces;
  the whole item when the entry moves whole items), word by word with a position-dependent
  nonlinear mix, so reordered or swapped words change it.
- Keying each term by the destination id and entry index catches items that traded places;
  keying by room and generation means a digest of another request never matches.
- The sum is order-independent: prefill adds each chunk's terms when the chunk is complete,
  decode sums over the final set of items. Both sides read the bytes once (numpy, vectorised).

The decode side cannot see the prefill's chunking, so prefill's Success says where its last
chunk lay (`Status.page_start`, `page_count`): page components sent with every chunk cover the
absolute positions from decode's prefix to the end of that chunk, `last_chunk` ones only that
chunk (`destination_pairs`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

from .indices import DecodeTarget, IndexError_, pair_key, slot_ids
from .layout_types import FamilyLayout
from .plan_types import Link, LinkEntry

_U = np.uint64
_GOLDEN = _U(0x9E3779B97F4A7C15)
_C1 = _U(0xBF58476D1CE4E5B9)
_C2 = _U(0x94D049BB133111EB)
_MASK = (1 << 64) - 1

Views = Callable[[str, int], np.ndarray]  # (component, entry position) -> [capacity, item_bytes]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised over uint64 (wraps mod 2^64)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> _U(30))) * _C1
        z = (z ^ (z >> _U(27))) * _C2
        return z ^ (z >> _U(31))


@lru_cache(maxsize=64)
def _word_salt(words: int) -> np.ndarray:
    return _mix(np.arange(words, dtype=np.uint64) * _U(0xD6E8FEB86659FD93))


def _row_hashes(rows: np.ndarray) -> np.ndarray:
    """One uint64 per row of a 2-D uint8 array."""
    n, length = rows.shape
    pad = (-length) % 8
    if pad:
        rows = np.concatenate([rows, np.zeros((n, pad), np.uint8)], axis=1)
    words = np.ascontiguousarray(rows).view("<u8")
    h = _mix(words ^ _word_salt(words.shape[1])[None, :])
    with np.errstate(over="ignore"):
        return h.sum(axis=1, dtype=np.uint64) ^ _U(length)


@lru_cache(maxsize=4096)
def _columns(entry: LinkEntry, side: str) -> np.ndarray | None:
    """Byte columns of one item an entry moves, in (segment, piece) order; None: all of them."""
    if entry.whole_item:
        return None
    cols = []
    for s in entry.segments:
        off, stride = (s.src_offset, s.src_stride) if side == "src" else (s.dst_offset,
                                                                           s.dst_stride)
        starts = off + stride * np.arange(s.repeat, dtype=np.int64)
        cols.append((starts[:, None] + np.arange(s.nbytes, dtype=np.int64)[None, :]).ravel())
    return np.concatenate(cols)


def _request_key(room: int, generation: int) -> np.uint64:
    k = _mix(np.array([room & _MASK, (generation << 1) | 1], np.uint64))
    return k[0] ^ k[1]


def link_digest(room: int, generation: int, link: Link, views: Views,
                pairs: dict, side: str) -> int:
    """Digest of what `link` moves for `pairs` (component -> (source ids, destination ids)),
    read from the source items (`side="src"`, prefill) or the destination items (`"dst"`)."""
    key = _request_key(room, generation)
    total = np.zeros(1, np.uint64)
    for k, e in enumerate(link.entries):
        at = pair_key(pairs, e.component, e.layer_id)
        if at is None:
            continue
        src_ids, dst_ids = pairs[at]
        if len(dst_ids) == 0:
            continue
        ids = np.asarray(src_ids if side == "src" else dst_ids, np.int64)
        view = views(e.component, e.src_pos if side == "src" else e.dst_pos)
        cols = _columns(e, side)
        rows = view[ids] if cols is None else view[ids[:, None], cols[None, :]]
        if not isinstance(rows, np.ndarray):  # device pools (pools.TensorPools): rows only
            rows = rows.cpu().numpy()
        with np.errstate(over="ignore"):
            keys = _mix(np.asarray(dst_ids, np.uint64) + key * _U(k + 1) + _U(k))
            total += _mix(_row_hashes(rows) ^ keys).sum(dtype=np.uint64)
    return int(total[0])


def add(a: int, b: int) -> int:
    return (a + b) & _MASK


def destination_pairs(layout: FamilyLayout, target: DecodeTarget, page_size: int,
                      last_start: int, last_count: int) -> dict:
    """Destination ids of every component a whole request writes, as decode knows them
    (Note [Link digest]); both halves of each pair are the destination ids."""
    end = last_start + last_count
    if end > len(target.page_ids):
        raise IndexError_(f"prefill reports pages up to position {end}, decode allocated "
                          f"{len(target.page_ids)}")
    out: dict = {}
    for c in layout.components:
        if c.index == "page":
            prefix = c.prefix_pages(target.prefix_len, page_size)
            lo = prefix if c.send == "every_chunk" else max(prefix, last_start)
            ids = np.asarray(target.page_ids, np.int64)[lo:end] if end > lo else \
                np.zeros(0, np.int64)
        elif c.index == "window":
            ids = np.asarray(target.window_page_ids if target.window_page_ids is not None
                             else [], np.int64)
        elif c.index == "slot" and target.layer_slots:
            slots = slot_ids(target.slot, target.layer_slots, c.layer_ids)
            for i in c.layer_ids:  # Note [Layer slots]: keyed as datapath.slot_pairs keys
                s = slots if isinstance(slots, int) else slots[i]
                one = np.array([s] if s >= 0 else [], np.int64)
                out[(c.name, i)] = (one, one)
            continue
        elif c.index == "slot":
            ids = np.array([target.slot] if target.slot >= 0 else [], np.int64)
        elif c.index == "aux":
            ids = np.array([target.aux_row] if target.aux_row >= 0 else [], np.int64)
        else:
            r = c.ring_rows
            ids = (target.ring_slot * r + np.arange(r, dtype=np.int64)
                   if target.ring_slot >= 0 else np.zeros(0, np.int64))
        out[c.name] = (ids, ids)
    return out
