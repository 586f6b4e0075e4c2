"""Staging rings: a staged request larger than decode's arena moves piece by piece through a
few slots of it, instead of falling back to the direct path.

Note [Staging ring]: a staged link normally takes one region of decode's staging arena laid
out for the whole request (Note [Staging layout] in runtime/staging.py). When the arena cannot
hold that region, decode reserves a ring instead: `slots` equal slots of `slot_bytes` each,
one contiguous region named in the TransferRequest (`staging_slots` > 0). Then:

1. Prefill cuts each chunk's staged items into pieces: (staging blocks of one component, a
   run of items j0 .. j0 + n) whose packed bytes fit one slot (every block's n items back to
   back, in block order). Block-major: a piece takes a run's items of as many blocks as fit,
   so each block's run is one copy on each side as in a whole region (item-major pieces of
   one page of all 160 blocks cost 2.7x more copies on the CPU box, BENCHMARKS.md (t)). Each piece is gathered into the same slot of prefill's own gather
   buffer, written to decode's slot with one descriptor, and once that write completed,
   announced with RingFilled (slot, j0, n, block indices). On device pools a piece is
   gathered and scattered like a region, by one copy-kernel launch (`staging.Launches`, its
   blocks laid out as the slot holds them: `Launches.piece_blocks`), replayed as a graph
   once the piece's shape was seen (Note [Staging graphs]); elsewhere by torch or numpy per
   block.
2. Decode scatters the piece from the slot into its pools on its control thread
   (synchronised before the next step), then answers RingFreed (slot). Prefill fills a slot
   only while it holds it: all slots at first, and a slot again once its RingFreed arrived.
   A piece that finds no free slot waits (counted: `staging_ring_waits` on prefill, the
   Prometheus counter `pdc:kv_transfer_staging_ring_waits_total`), and the transfer worker
   sleeps until a message wakes it.
3. Success follows the last RingFilled on the same control connection, so decode has
   scattered every piece when it sees it; it checks that the pieces brought exactly the
   bytes of the request's staging layout (none lost, none twice) before it succeeds.

Why these messages, not a counter in memory: writes are one-sided, and an engine's completion
is seen by the writer only; the control connection is already ordered, authenticated and
watched by liveness, so a dead peer or an abort ends a ring like any request (prefill drains
its writes, decode frees the ring's region when the pages are reusable, or quarantines it with
them). A ring is reserved whole at init(), so two rings never wait for each other: every
piece fits one slot, and decode frees a slot without waiting for anything else. Requests
whose region fits keep the whole-region path, unchanged.

The ring's size (decode): `staging_ring_slots` slots of at most `staging_ring_slot_bytes`,
taking at most half of the arena's largest free stretch (so the next request, or the other
link of this one, still finds a ring: rings shrink geometrically as the arena fills), fewer or
smaller slots when that half is shorter, never smaller than one item of the link's largest
staging block (the smallest piece). When not even one such slot is free,
the link takes the direct path: counted `staging_full` (the arena is busy) or
`staging_too_small` (even an empty arena could not hold one slot).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from . import staging
from .indices import IndexError_, check_capacity, contiguous_runs
from .plan_types import Link
from .staging import ALIGN, Arena, Block


def min_slot_bytes(blocks: tuple[Block, ...]) -> int:
    """Bytes of the smallest piece that every piece can be cut down to: one item of the
    largest block, aligned like arena regions."""
    big = max((b.segment.total_bytes for b in blocks), default=1)
    return -(-big // ALIGN) * ALIGN


def reserve(arena: Arena, blocks: tuple[Block, ...], slots: int, slot_bytes: int
            ) -> tuple[int, int, int] | str:
    """A ring in `arena` for a link with `blocks`: (arena offset, slots, slot bytes), or why
    not ("staging_too_small" / "staging_full")."""
    least = min_slot_bytes(blocks)
    if len(arena.buf) < least:
        return "staging_too_small"
    room = arena.largest()
    if room < least:
        return "staging_full"
    room = max(room // 2, least)  # the next request still finds a ring
    size = max(least, min(slot_bytes, room // max(slots, 1)) // ALIGN * ALIGN)
    n = max(1, min(slots, room // size))
    off = arena.alloc(n * size)
    assert off is not None  # the largest free stretch holds n * size
    return off, n, size


@dataclass(frozen=True)
class Piece:
    """Items j0 .. j0 + n of the staging blocks `blocks` (indices into the link's blocks),
    from prefill items `ids`; `nbytes` packed."""

    blocks: tuple[int, ...]
    ids: np.ndarray
    j0: int
    n: int
    nbytes: int


def pieces(blocks: tuple[Block, ...], link: Link, positions, layers, slot_bytes: int
           ) -> list[Piece]:
    """A chunk's staged items (`positions`: staging.chunk_positions; `layers`: only those, or
    None) cut into pieces of at most `slot_bytes` (Note [Staging ring])."""
    by_comp: dict[str, list[int]] = {}
    for i, b in enumerate(blocks):
        e = link.entries[b.entry]
        if e.component in positions and (layers is None or e.layer_id in layers):
            by_comp.setdefault(e.component, []).append(i)
    out = []
    for comp, idx in by_comp.items():
        src, j = positions[comp]
        if not len(j):
            continue
        starts, _, lens = contiguous_runs(j, j)
        at = 0
        for j0, n in zip(starts.tolist(), lens.tolist(), strict=True):
            ids = src[at:at + n]
            at += n
            out.extend(_run_pieces(blocks, idx, ids, j0, n, slot_bytes))
    return out


def _run_pieces(blocks, idx: list[int], ids: np.ndarray, j0: int, n: int, slot_bytes: int):
    """Pieces of one run of n items over the blocks `idx`: block-major, so that each block's
    items move in as few copies as in a whole region (one per block and run) while the run
    fits a slot; a block whose run alone does not fit is cut into runs of items."""
    out = []
    i = 0
    while i < len(idx):
        tb = blocks[idx[i]].segment.total_bytes
        if n * tb > slot_bytes:  # this block's run alone overflows a slot: cut the items
            m = max(1, slot_bytes // tb)
            for k in range(0, n, m):
                c = min(m, n - k)
                out.append(Piece((idx[i],), ids[k:k + c], j0 + k, c, c * tb))
            i += 1
            continue
        group, used = [], 0
        while i < len(idx) and used + n * blocks[idx[i]].segment.total_bytes <= slot_bytes:
            used += n * blocks[idx[i]].segment.total_bytes
            group.append(idx[i])
            i += 1
        out.append(Piece(tuple(group), ids, j0, n, used))
    return out


def check_piece(blocks: tuple[Block, ...], link: Link, block_ids, j0: int, n: int,
                slot_bytes: int) -> tuple[str, int]:
    """Decode's check of a RingFilled: (component, packed bytes); raises IndexError_."""
    comps = set()
    total = 0
    for bi in block_ids:
        if not 0 <= bi < len(blocks):
            raise IndexError_(f"staging block {bi} does not exist (the link has {len(blocks)})")
        b = blocks[bi]
        comps.add(link.entries[b.entry].component)
        if j0 + n > b.items:
            raise IndexError_(f"staging items {j0}..{j0 + n - 1} are outside the {b.items} "
                              f"items decode asked for")
        total += n * b.segment.total_bytes
    if len(comps) != 1:
        raise IndexError_(f"a piece names blocks of {len(comps)} components; one is allowed")
    if total > slot_bytes:
        raise IndexError_(f"a piece of {total} bytes does not fit a ring slot of {slot_bytes}")
    return comps.pop(), total


def copy_piece(direction: str, view, blocks: tuple[Block, ...], link: Link, block_ids,
               ids: np.ndarray, slot, side: str) -> int:
    """Gather (prefill, `side` src) or scatter (decode, `side` dst) one piece between the
    pools and `slot` (numpy or torch bytes); returns the packed bytes."""
    at = 0
    n = len(ids)
    for bi in block_ids:
        b = blocks[bi]
        e = link.entries[b.entry]
        pool = view(e.component, e.src_pos if side == "src" else e.dst_pos)
        check_capacity(ids, pool.shape[0], f"{'prefill' if side == 'src' else 'decode'} "
                                           f"'{e.component}'")
        nb = n * b.segment.total_bytes
        getattr(staging, direction)(pool, ids, b.segment, slot[at:at + nb])
        at += nb
    return at


@dataclass
class PrefillRing:
    """Prefill's side of one link's ring. `free` is shared with the control thread (credits
    arrive there): touch it under the endpoint's lock."""

    slots: int
    slot_bytes: int
    free: list = field(default_factory=list)  # slot indices prefill may fill now
    todo: deque = field(default_factory=deque)  # Pieces not yet written
    writing: dict = field(default_factory=dict)  # id(batch) -> (slot, Piece)
    filled: set = field(default_factory=set)  # slots announced to decode, not yet freed
    waiting: bool = False  # the next piece found no free slot (counted once per wait)
    waits: int = 0

    def __post_init__(self) -> None:
        self.free = list(range(self.slots))


@dataclass
class DecodeRing:
    """Decode's side of one link's ring."""

    offset: int  # arena offset of slot 0
    slots: int
    slot_bytes: int
    need: int  # bytes of the request's whole staging layout on this link
    got: int = 0  # bytes the pieces brought so far
    pieces: int = 0
    ids: dict | None = None  # staging.target_ids of the request, once the first piece came
