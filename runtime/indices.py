"""Per-request index math: which source item goes to which destination item.

Pure numpy, shared by the runtime's data path and the compiler's request-level coverage
tests, so the proof exercises the very function that builds descriptors.

Note [Absolute page positions]: a chunk names its pages by absolute position in the
request (`page_start` = index of its first page among all the request's pages), and the
decode side's page list is indexed by that absolute position. Offsets relative to the chunk
would write every chunk over the first one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class IndexError_(ValueError):
    """An index from a peer is inconsistent or out of range; the message says which."""


@dataclass(frozen=True)
class PrefillChunk:
    """What prefill sends for one chunk of one request (ids are its own pool ids)."""

    page_start: int  # absolute position of page_ids[0] among the request's pages
    page_ids: np.ndarray  # int64 prefill page ids of this chunk
    last: bool
    seq_len: int  # tokens prefilled so far (after this chunk)
    slot: int = -1  # slot-state index (mamba slot), last chunk only
    ring_slot: int = -1  # req_pool_idx for ring state, last chunk only
    aux_row: int = -1  # metadata row, last chunk only
    window_page_ids: np.ndarray | None = None  # window pool ids, positions window_first..
    # Note [Layer slots]: (layer id, slot) of every layer whose slot differs per layer; empty:
    # every slot component of every layer uses `slot`. Last chunk only.
    layer_slots: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class DecodeTarget:
    """What decode allocated for a request (ids are decode pool ids)."""

    page_ids: np.ndarray  # int64, one per absolute page position of the whole request
    prefix_len: int  # tokens decode already holds (prefix cache): their pages are not sent
    slot: int = -1
    ring_slot: int = -1
    aux_row: int = -1
    window_page_ids: np.ndarray | None = None
    layer_slots: tuple[tuple[int, int], ...] = ()  # Note [Layer slots]


def slot_ids(slot: int, layer_slots: tuple[tuple[int, int], ...],
             layers: tuple[int, ...]) -> dict[int, int] | int:
    """Note [Layer slots]: a request's state usually sits in one slot for every layer (one
    mamba slot per request, SGLang's and vLLM's 1:1 hybrids). An engine may instead give the
    state layers of a request several slots: vLLM's hybrid cache manager gives a model with 3
    GDN layers per attention layer 3 state groups, each with its own block per request, and
    layer i's state lives in the block of its group. A request then names a slot per layer
    (`layer_slots`, on the wire as TransferRequest.layer_slots), and the data path pairs a
    slot component's items layer by layer. Returns `slot` when the request names no layer
    slots, else the slot of each of `layers` (a component's layer ids); a layer it does not
    name raises."""
    if not layer_slots:
        return slot
    given = dict(layer_slots)
    missing = [i for i in layers if i not in given]
    if missing:
        raise IndexError_(f"the request names slots for layers {sorted(given)} but not for "
                          f"layer {missing[0]}")
    return {i: given[i] for i in layers}


def pair_key(pairs: dict, comp: str, layer: int):
    """The key of `pairs` (component ids by component) that holds component `comp`'s ids at
    `layer`: (comp, layer) for a slot component with a slot per layer (Note [Layer slots]),
    else comp; None if neither."""
    if (comp, layer) in pairs:
        return comp, layer
    return comp if comp in pairs else None


def pages_of(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def window_first_page(seq_len: int, window_tokens: int, page_size: int,
                      prefix_pages: int = 0) -> int:
    """Absolute position of the first page holding one of the last `window_tokens` tokens,
    or of the first page past decode's prefix when that comes later (`prefix_pages`: the
    window pages decode's cache holds already, Note [Prefix skip])."""
    return max(prefix_pages, max(0, seq_len - window_tokens) // page_size)


def chunk_page_pairs(chunk: PrefillChunk, target: DecodeTarget, page_size: int,
                     prefix_pages: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(prefill page ids, decode page ids) this chunk writes; see Note [Absolute page positions].
    `prefix_pages`: pages decode holds already (Note [Prefix skip]); default from its prefix."""
    n = len(chunk.page_ids)
    positions = np.arange(chunk.page_start, chunk.page_start + n, dtype=np.int64)
    if n and (chunk.page_start < 0 or positions[-1] >= len(target.page_ids)):
        raise IndexError_(f"chunk pages {chunk.page_start}..{chunk.page_start + n - 1} exceed "
                          f"the {len(target.page_ids)} pages decode allocated")
    if prefix_pages is None:
        prefix_pages = target.prefix_len // page_size
    keep = positions >= prefix_pages
    return np.asarray(chunk.page_ids, np.int64)[keep], np.asarray(target.page_ids, np.int64)[positions[keep]]


def window_pairs(chunk: PrefillChunk, target: DecodeTarget, window_tokens: int,
                 page_size: int, prefix_pages: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Note [Window pages]: a window component lives in a page space of its own (SGLang's
    SWAKVPool keeps its sliding layers apart from the full ones), so a request names its
    window pages in a second list on each side (PrefillChunk / DecodeTarget
    .window_page_ids, TransferRequest.window_page_ids on the wire), sent with the last chunk:
    one id per absolute page position from window_first_page to the prompt's last page. The
    two lists pair up position by position; a list of another length fails the request."""
    src = np.asarray(chunk.window_page_ids if chunk.window_page_ids is not None else [], np.int64)
    dst = np.asarray(target.window_page_ids if target.window_page_ids is not None else [],
                     np.int64)
    want = pages_of(chunk.seq_len, page_size) - window_first_page(chunk.seq_len, window_tokens,
                                                                  page_size, prefix_pages)
    if len(src) != want or len(dst) != want:
        raise IndexError_(f"window needs {want} pages, prefill sent {len(src)}, decode holds "
                          f"{len(dst)}")
    return src, dst


def check_page_coverage(chunks, target: DecodeTarget, page_size: int,
                        first_page: int | None = None) -> None:
    """At the last chunk: every page decode needs was sent, and decode allocated exactly the
    prompt's pages (Note [Exact page coverage]).

    Note [Exact page coverage]: bounds checks alone let a request end in Success with pages
    that nobody wrote: decode allocating 7 pages for a 5-page prompt, or chunks that skip
    pages 0-2. Once prefill has the last chunk it knows the prompt's length (`seq_len`), so
    it checks that decode's page list has exactly pages_of(seq_len) entries and that the
    chunks' absolute positions cover every page from decode's first non-prefix page to the
    end. A page partly inside the prefix is needed (it is sent, see
    chunk_page_pairs). `first_page` is the first page any component must have: 0 when one
    is sent whole on a prefix hit (Note [Prefix skip]). A mismatch fails that request only,
    naming both counts.
    """
    chunks = list(chunks)
    last = chunks[-1]
    want = pages_of(last.seq_len, page_size)
    have = len(target.page_ids)
    if have != want:
        raise IndexError_(f"the prompt has {want} pages ({last.seq_len} tokens) but decode "
                          f"allocated {have}")
    if target.prefix_len > last.seq_len:
        raise IndexError_(f"decode holds a prefix of {target.prefix_len} tokens but the prompt "
                          f"has only {last.seq_len}")
    first = target.prefix_len // page_size if first_page is None else first_page
    covered = np.zeros(want, bool)
    for c in chunks:
        lo = max(0, min(want, c.page_start))
        covered[lo:max(lo, min(want, c.page_start + len(c.page_ids)))] = True
    missing = np.flatnonzero(~covered[first:]) + first
    if len(missing):
        need = want - first
        raise IndexError_(f"prefill sent {need - len(missing)} of the {need} pages decode "
                          f"needs (positions {first}..{want - 1}); missing {_ranges(missing)}")


def prefill_pages_by_position(chunks, n_pages: int) -> np.ndarray:
    """Prefill page id at each absolute page position the chunks named (-1 where none did)."""
    out = np.full(n_pages, -1, np.int64)
    for c in chunks:
        ids = np.asarray(c.page_ids, np.int64)
        lo, hi = max(0, c.page_start), min(n_pages, c.page_start + len(ids))
        if hi > lo:
            out[lo:hi] = ids[lo - c.page_start:hi - c.page_start]
    return out


def remap_kv_slots(values: np.ndarray, src_pages: np.ndarray, dst_pages: np.ndarray,
                   page_size: int, what: str) -> np.ndarray:
    """Prefill physical token slots (page id * page_size + offset) -> decode's slots of the
    same token positions; negative values (padding) stay. Note [Slot-valued state]."""
    values = np.asarray(values, np.int64)
    out = values.copy()
    valid = values >= 0
    if not valid.any():
        return out
    pages = values[valid] // page_size
    known = src_pages >= 0
    positions = np.flatnonzero(known)
    order = np.argsort(src_pages[known], kind="stable")
    sorted_pages = src_pages[known][order]
    idx = np.searchsorted(sorted_pages, pages)
    found = idx < len(sorted_pages)
    found[found] = sorted_pages[idx[found]] == pages[found]
    if not found.all():
        bad = int(values[valid][~found][0])
        raise IndexError_(f"{what} value {bad} names prefill page {bad // page_size}, which is "
                          f"not one of the {len(positions)} pages prefill sent for the request")
    pos = positions[order[idx]]
    out[valid] = dst_pages[pos] * page_size + values[valid] % page_size
    return out


def _ranges(positions: np.ndarray) -> str:
    """'0-2, 5' for [0, 1, 2, 5]; at most four ranges, then how many more."""
    runs = np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1)
    text = [f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs[:4]]
    if len(runs) > 4:
        text.append(f"and {len(runs) - 4} more ranges")
    return ", ".join(text)


def ring_pairs(src_slot: int, dst_slot: int, ring_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows slot*R .. slot*R+R-1 on both sides (row = slot * R + pos % R)."""
    r = np.arange(ring_rows, dtype=np.int64)
    return src_slot * ring_rows + r, dst_slot * ring_rows + r


def contiguous_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split paired index arrays into runs where both advance by one: (src_start, dst_start, length)."""
    src = np.asarray(src, np.int64)
    dst = np.asarray(dst, np.int64)
    if len(src) != len(dst):
        raise IndexError_(f"{len(src)} source indices but {len(dst)} destination indices")
    if len(src) < 2:  # no run to split (one item: a slot, an aux row)
        return src.copy(), dst.copy(), np.ones(len(src), np.int64)
    # slices, not np.diff: a request's grids call this per component (a few µs each)
    breaks = np.flatnonzero((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src)]))
    return src[starts], dst[starts], ends - starts


def check_capacity(ids: np.ndarray, capacity: int, what: str) -> None:
    """Refuse any index outside [0, capacity) before a single byte moves."""
    if len(ids) == 0:
        return
    if ids.dtype == np.int64 and int(ids.view(np.uint64).max()) < capacity:
        return  # one reduction: as uint64 a negative id lies above every capacity
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= capacity:
        bad = lo if lo < 0 else hi
        raise IndexError_(f"{what} index {bad} is outside the registered capacity {capacity}")
