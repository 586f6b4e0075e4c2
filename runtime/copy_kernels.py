"""Generic Triton copy kernels that pack pool items into a staging buffer and back.

A *pool* is one contiguous buffer of `capacity` items of `item_bytes` bytes each (one layer's KV
pages, per-request state slots, ring rows). An *entry* is one pool plus the byte segment of each
item that a transfer moves (`SegmentSpec`). For a list of item indices:

- `gather` copies, for every entry e and index position j, the segment of item `indices[j]` of
  pool e to `staging[staging_offset[e] + j * packed_bytes(e):]`, its pieces back to back;
- `scatter` is the inverse, staging to pool items.

Every entry of a transfer goes through ONE kernel launch; the kernel only moves bytes (as 1-, 2-
or 4-byte words, never interpreted as numbers). docs/kernels.md explains the design; in short:

- pool base addresses travel in an int64 table and become pointers inside the kernel
  (`addr.to(pointer_type)`), so one launch serves pools of any dtype and any number of entries;
- all address arithmetic is int64: a pool holds more than 2^31 bytes well before a model is big;
- the launcher picks the widest word (and 16-byte vectors) that every address, offset and length
  allows, and promises that alignment to the compiler, which is what makes GPU copies fast;
- CPU tensors run through the Triton interpreter and CUDA tensors through the compiler, chosen per
  call from the tensors' device, so `TRITON_INTERPRET` and import order do not matter here.

The data model (`SegmentSpec`, `Entry`, `Tiling`, `default_tiling`) lives in runtime/copy_specs.py
and is re-exported here. Generated per-family modules bind the family's `SegmentSpec`s once, build an `EntryTable` per
registered pool set (the device table is cached there), and call `gather`/`scatter` per request.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from .copy_specs import (
    Entry,
    SegmentSpec,
    Tiling,
    _as_int,
    _cdiv,
    default_tiling,
    pow2_alignment,
)

__all__ = [
    "Entry",
    "EntryTable",
    "SegmentSpec",
    "Prepared",
    "Tiling",
    "default_tiling",
    "gather",
    "gather_reference",
    "prepare",
    "scatter",
    "scatter_reference",
]

# Columns of the per-entry int64 table the kernel reads (see `EntryTable._device_table`).
# Everything except the address is in words of the launch's word size; the segment length is in
# vectors so that the kernel can multiply it back by the constexpr VEC and the compiler can see
# that every segment length is a multiple of the vector width.
_COL_ADDR = 0  # pool base address, bytes
_COL_ITEM = 1  # item stride, words
_COL_SEG_OFFSET = 2  # offset of the first piece inside an item, words
_COL_SEG_VECS = 3  # length of one piece, vectors of VEC words
_COL_REPEAT = 4  # pieces per item
_COL_SEG_STRIDE = 5  # distance between successive pieces, words
_COL_PREFIX = 6  # dense staging layout: words of all earlier entries' packed units
_TABLE_COLS = 8  # one spare column keeps rows 64-byte sized

_MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y, which indexes entries
_MAX_GRID_X = 2**31 - 1
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_ALIGNS = (1, 2, 4, 8, 16)


# ~~~ kernel ~~~


def _copy_segments(
    table_ptr,  # int64 [E, _TABLE_COLS], see the _COL_* constants
    index_ptr,  # int64 [n] item indices, shared by all entries
    staging_ptr,  # staging buffer viewed as words; also fixes the pointer type of pool bases
    stage_off_ptr,  # int64 [E] staging offsets in words, read only when not DENSE
    n_indices,
    n_col_chunks,  # programs along one piece, same for all entries of the launch
    TABLE_COLS: tl.constexpr,
    TO_STAGING: tl.constexpr,  # True: gather (pool -> staging); False: scatter
    DENSE: tl.constexpr,  # staging offsets are n_indices * prefix (entry-major, no gaps)
    ALIGN: tl.constexpr,  # bytes every pointer is a multiple of (hint only)
    VEC: tl.constexpr,  # words every offset and length is a multiple of (hint only)
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,  # words per row per iteration
    ITERS: tl.constexpr,  # column blocks per program
):
    # Program ids are int32; widen before any product so no offset is ever computed in int32.
    pid = tl.program_id(0).to(tl.int64)
    entry = tl.program_id(1).to(tl.int64)
    row_block = pid // n_col_chunks
    col_chunk = pid - row_block * n_col_chunks

    row_ptr = table_ptr + entry * TABLE_COLS
    addr = tl.load(row_ptr + 0)
    item_words = tl.load(row_ptr + 1)
    seg_offset = tl.load(row_ptr + 2)
    seg_words = tl.load(row_ptr + 3) * VEC
    repeat = tl.load(row_ptr + 4)
    seg_stride = tl.load(row_ptr + 5)
    if DENSE:
        stage_base = tl.load(row_ptr + 6) * n_indices
    else:
        stage_base = tl.load(stage_off_ptr + entry)

    # The address -> pointer idiom: an int64 cast to the staging pointer's type is an inttoptr on
    # the GPU and a reinterpretation of the host address in the interpreter.
    pool_ptr = tl.multiple_of(addr.to(staging_ptr.dtype), ALIGN)

    # A row is one piece: q = j * repeat + r for index position j and piece r. Pieces are packed
    # back to back, so piece q of this entry starts at stage_base + q * seg_words.
    n_rows = n_indices * repeat
    q = row_block * ROWS + tl.arange(0, ROWS)
    row_ok = q < n_rows
    j = q // repeat
    r = q - j * repeat
    item = tl.load(index_ptr + j, mask=row_ok, other=0)
    pool_row = tl.multiple_of(item * item_words + seg_offset + r * seg_stride, VEC)
    stage_row = tl.multiple_of(stage_base + q * seg_words, VEC)

    # Entries share one grid sized for the largest; a program past this entry's rows or piece
    # length runs zero iterations instead of masking a full loop.
    col_lo = col_chunk * (ITERS * BLOCK)
    left = tl.maximum(seg_words - col_lo, 0)
    n_iter = tl.minimum((left + BLOCK - 1) // BLOCK, ITERS)
    n_iter = tl.where(row_block * ROWS < n_rows, n_iter, 0)
    for it in range(0, n_iter):
        cols = col_lo + it * BLOCK + tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (cols < seg_words)[None, :]
        pool_at = pool_ptr + (pool_row[:, None] + cols[None, :])
        stage_at = staging_ptr + (stage_row[:, None] + cols[None, :])
        if TO_STAGING:
            tl.store(stage_at, tl.load(pool_at, mask=mask), mask=mask)
        else:
            tl.store(pool_at, tl.load(stage_at, mask=mask), mask=mask)


# The compiled kernel for CUDA tensors. JITFunction is built directly rather than through
# triton.jit, because triton.jit returns an interpreter object whenever TRITON_INTERPRET=1 was set
# before this import; a CUDA launch through the interpreter would dereference device addresses
# from the table on the host. The counts are not specialised: Triton would otherwise compile extra
# variants when a count is 1 or a multiple of 16, and a request of a new size would stall on one.
_compiled_kernel = JITFunction(_copy_segments, do_not_specialize=["n_indices", "n_col_chunks"])
_interpreted_kernel = None


# Note [Launch device]: Triton launches on the calling thread's current CUDA device and its
# current stream. A thread that never selected a device is on cuda:0, so a launch from it for
# tensors on cuda:1 would run on cuda:0's stream (reaching cuda:1 over peer access), and a
# sync of cuda:1 would not wait for it. Launches therefore run under the staging tensor's
# device (on that device's current stream). Triton's interpreter, used for CPU tensors,
# patches module state while a kernel runs, so interpreted launches are serialised.
_INTERPRETER_LOCK = threading.Lock()


def _launch_context(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else _INTERPRETER_LOCK


def _kernel_for(device: torch.device):
    global _interpreted_kernel
    if device.type == "cuda":
        return _compiled_kernel
    if device.type == "cpu":
        if _interpreted_kernel is None:
            from triton.runtime.interpreter import InterpretedFunction

            _interpreted_kernel = InterpretedFunction(_copy_segments)
        return _interpreted_kernel
    raise ValueError(
        f"unsupported device {device}: copies run on CUDA, or on CPU through the Triton "
        f"interpreter"
    )


# ~~~ entry table ~~~


class EntryTable:
    """A validated list of entries and their device-side table, built once and reused.

    Building checks that all tensor pools share one device; `device` names it when every pool is
    a raw address. The int64 table the kernel reads is cached per word size, so a transfer that
    reuses the table costs no host-to-device copy.
    """

    def __init__(self, entries: Sequence[Entry], device: torch.device | str | None = None):
        entries = tuple(entries)
        for i, entry in enumerate(entries):
            if not isinstance(entry, Entry):
                raise ValueError(f"entries[{i}] must be an Entry, got {type(entry).__name__}")
        if len(entries) > _MAX_GRID_Y:
            raise ValueError(
                f"at most {_MAX_GRID_Y} entries fit in one launch, got {len(entries)}"
            )
        dev = torch.device(device) if device is not None else None
        for i, entry in enumerate(entries):
            if entry.device is None:
                continue
            if dev is None:
                dev = entry.device
            elif entry.device != dev:
                raise ValueError(f"entries[{i}].pool is on {entry.device}, expected {dev}")
        self.entries = entries
        self.device = dev
        # Entry.__post_init__ sets every capacity it was not given (from the pool's bytes).
        self.capacities = tuple(cast(int, e.capacity) for e in entries)
        self.packed_bytes = tuple(e.spec.packed_bytes for e in entries)
        self.max_seg_bytes = max((e.spec.seg_bytes for e in entries), default=0)
        self.max_repeat = max((e.spec.repeat for e in entries), default=0)
        self.alignment = pow2_alignment(
            *(e.address for e in entries), *(e.spec.alignment() for e in entries)
        )
        prefix, total = [], 0
        for p in self.packed_bytes:
            prefix.append(total)
            total += p
        self.prefix_bytes = tuple(prefix)
        self.unit_bytes = total  # bytes of all entries' segments for one index position
        self._tables: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def staging_offsets(self, n_indices: int) -> list[int]:
        """Byte offsets of the dense (entry-major, gap-free) staging layout for n indices."""
        return [n_indices * p for p in self.prefix_bytes]

    def staging_nbytes(self, n_indices: int) -> int:
        """Bytes of the dense staging layout for n indices."""
        return n_indices * self.unit_bytes

    def _device_table(self, word: int, vec: int, device: torch.device) -> torch.Tensor:
        key = (word, vec, device)
        table = self._tables.get(key)
        if table is None:
            rows = []
            for entry, prefix in zip(self.entries, self.prefix_bytes, strict=True):
                s = entry.spec
                rows.append([
                    entry.address,
                    s.item_bytes // word,
                    s.seg_offset // word,
                    s.seg_bytes // (word * vec),
                    s.repeat,
                    s.seg_stride // word,
                    prefix // word,
                    0,
                ])
            table = torch.tensor(rows, dtype=torch.int64).reshape(-1, _TABLE_COLS).to(device)
            self._tables[key] = table
        return table


# ~~~ launchers ~~~


def _check_indices(
    table: EntryTable, indices: object, device: torch.device, check: bool, unique: bool
) -> torch.Tensor:
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int64:
        raise ValueError(f"indices must be int64, got {indices.dtype}")
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"indices are on {indices.device}, expected {device}")
    if not check or indices.numel() == 0 or len(table) == 0:
        return indices.contiguous()
    # One host sync for both bounds; the control plane that already checked indices on receipt
    # passes check_indices=False to keep the hot path free of it.
    lo, hi = torch.stack([indices.min(), indices.max()]).tolist()
    cap = min(table.capacities)
    if lo < 0 or hi >= cap:
        e = next(i for i, c in enumerate(table.capacities) if lo < 0 or hi >= c)
        c = table.capacities[e]
        pos = int(((indices < 0) | (indices >= c)).nonzero()[0, 0])
        raise ValueError(
            f"indices[{pos}] = {int(indices[pos])} is out of range for entry {e} (capacity {c})"
        )
    if unique:
        values, counts = torch.unique(indices, return_counts=True)
        if bool((counts > 1).any()):
            dup = int(values[counts > 1][0])
            raise ValueError(f"scatter indices must be unique, but item {dup} appears more than once")
    return indices.contiguous()


def _check_staging_fits(
    offsets: Sequence[int], table: EntryTable, n: int, staging_nbytes: int
) -> None:
    for e, (o, p) in enumerate(zip(offsets, table.packed_bytes, strict=True)):
        if o + n * p > staging_nbytes:
            raise ValueError(
                f"staging holds {staging_nbytes} bytes but entry {e} needs bytes "
                f"[{o}, {o + n * p})"
            )


def _check_explicit_offsets(
    staging_offsets: Sequence[int], table: EntryTable, n: int, staging_nbytes: int,
    to_staging: bool,
) -> None:
    offsets = [_as_int("gather" if to_staging else "scatter", "staging_offsets", o)
               for o in staging_offsets]
    if len(offsets) != len(table):
        raise ValueError(f"staging_offsets has {len(offsets)} values for {len(table)} entries")
    for e, o in enumerate(offsets):
        if o < 0:
            raise ValueError(f"staging_offsets[{e}] must be >= 0, got {o}")
    _check_staging_fits(offsets, table, n, staging_nbytes)
    if to_staging and n > 0:
        # Two entries packing into the same bytes would race; scatter may read shared bytes.
        spans = sorted((o, o + n * p, e) for e, (o, p) in
                       enumerate(zip(offsets, table.packed_bytes, strict=True)))
        for (lo_a, hi_a, a), (lo_b, hi_b, b) in zip(spans, spans[1:], strict=False):
            if lo_b < hi_a:
                a, b = sorted((a, b))
                raise ValueError(
                    f"staging regions of entries {a} and {b} overlap: "
                    f"[{lo_a}, {hi_a}) and [{lo_b}, {hi_b})"
                )


def launch_alignment(
    table: EntryTable, staging: torch.Tensor,
    staging_offsets: Sequence[int] | np.ndarray | None, max_align: int,
) -> int:
    """Bytes that every pointer, offset and length of the launch is a multiple of (<= 16).

    The dense staging layout needs no term of its own: its offsets are sums of packed sizes,
    which the segment lengths already divide.
    """
    if staging_offsets is None:
        offsets: tuple = ()
    elif isinstance(staging_offsets, np.ndarray):
        offsets = (staging_offsets,)  # one reduction, not one Python step per offset
    else:
        offsets = tuple(staging_offsets)
    return min(max_align, table.alignment, pow2_alignment(staging.data_ptr(), *offsets))


@dataclass(frozen=True)
class Prepared:
    """One checked copy-kernel launch, ready to run (again): its device tensors exist, so it
    may be captured into a CUDA graph (Note [Staging graphs] in runtime/staging_graphs.py)."""

    device: torch.device
    grid: tuple[int, int]
    args: tuple  # table, indices, staging words, staging offsets (words), n, column chunks
    meta: dict
    word: int  # bytes per word: explicit staging offsets are given to the kernel in words

    def run(self) -> None:
        with _launch_context(self.device):
            _kernel_for(self.device)[self.grid](*self.args, **self.meta)


def prepare(
    entries: Sequence[Entry] | EntryTable,
    indices: torch.Tensor,
    staging: torch.Tensor,
    staging_offsets: Sequence[int] | None = None,
    *,
    check_indices: bool = True,
    max_align: int = 16,
    tiling: Tiling | None = None,
    to_staging: bool = True,
    offsets_words: torch.Tensor | None = None,
) -> Prepared | None:
    """The launch `gather` (`to_staging`) or `scatter` would make, checked; None when it moves
    nothing. `offsets_words` is a device buffer the caller fills with `staging_offsets` in the
    launch's words (`Prepared.word`) before each run; by default the launch gets its own."""
    table = entries if isinstance(entries, EntryTable) else EntryTable(entries)
    if max_align not in _ALIGNS:
        raise ValueError(f"max_align must be one of 1, 2, 4, 8, 16, got {max_align}")
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"staging must be a torch.Tensor, got {type(staging).__name__}")
    if not staging.is_contiguous():
        raise ValueError("staging must be a contiguous tensor")
    device = staging.device
    if table.device is not None and table.device != device:
        raise ValueError(f"staging is on {device}, but the entries' pools are on {table.device}")
    _kernel_for(device)  # an unsupported device is refused before anything else
    indices = _check_indices(table, indices, device, check_indices, unique=not to_staging)
    n = indices.numel()
    n_entries = len(table)

    staging_nbytes = staging.numel() * staging.element_size()
    if staging_offsets is None:
        # Dense layout: entries are packed in order, so the last byte needed is the total; the
        # per-entry walk below only runs to name the entry in the error.
        if n * table.unit_bytes > staging_nbytes:
            _check_staging_fits(table.staging_offsets(n), table, n, staging_nbytes)
    else:
        _check_explicit_offsets(staging_offsets, table, n, staging_nbytes, to_staging)
    if n == 0 or n_entries == 0:
        return None

    align = launch_alignment(table, staging, staging_offsets, max_align)
    word = min(align, 4)
    vec = align // word
    tile = tiling or default_tiling(table.max_seg_bytes, n * table.max_repeat, device)
    block = max(1, tile.block_bytes // word)
    rows = tile.rows
    max_seg_words = table.max_seg_bytes // word
    n_col_chunks = _cdiv(max_seg_words, block * tile.iters)
    n_row_blocks = _cdiv(n * table.max_repeat, rows)
    if n_col_chunks * n_row_blocks > _MAX_GRID_X:
        raise ValueError(
            f"launch needs {n_col_chunks * n_row_blocks} programs per entry, more than "
            f"{_MAX_GRID_X}; use a larger Tiling"
        )

    flat = staging.reshape(-1).view(torch.uint8)
    words = flat[: staging_nbytes - staging_nbytes % word].view(_WORD_DTYPES[word])
    dev_table = table._device_table(word, vec, device)
    if staging_offsets is None:
        stage_offs = dev_table  # never read: DENSE derives offsets from the table's prefixes
    elif offsets_words is not None:
        stage_offs = offsets_words
    else:
        stage_offs = torch.tensor([int(o) // word for o in staging_offsets], dtype=torch.int64,
                                  device=device)
    meta = {"TABLE_COLS": _TABLE_COLS, "TO_STAGING": to_staging,
            "DENSE": staging_offsets is None, "ALIGN": align, "VEC": vec, "ROWS": rows,
            "BLOCK": block, "ITERS": tile.iters, "num_warps": tile.num_warps}
    return Prepared(device, (n_col_chunks * n_row_blocks, n_entries),
                    (dev_table, indices, words, stage_offs, n, n_col_chunks), meta, word)


def _launch(
    entries: Sequence[Entry] | EntryTable,
    indices: torch.Tensor,
    staging: torch.Tensor,
    staging_offsets: Sequence[int] | None,
    check_indices: bool,
    max_align: int,
    tiling: Tiling | None,
    to_staging: bool,
) -> None:
    launch = prepare(entries, indices, staging, staging_offsets, check_indices=check_indices,
                     max_align=max_align, tiling=tiling, to_staging=to_staging)
    if launch is not None:
        launch.run()


def gather(
    entries: Sequence[Entry] | EntryTable,
    indices: torch.Tensor,
    staging: torch.Tensor,
    *,
    staging_offsets: Sequence[int] | None = None,
    check_indices: bool = True,
    max_align: int = 16,
    tiling: Tiling | None = None,
) -> None:
    """Pack, for every entry e and position j, the segment of item `indices[j]` of e's pool into
    `staging` at byte `staging_offsets[e] + j * e.spec.packed_bytes`, in one kernel launch.

    `staging_offsets` defaults to the dense entry-major layout (`EntryTable.staging_offsets`);
    explicit offsets must give disjoint regions. `check_indices` bounds-checks every index
    against every entry's capacity (one host sync); pass False only for indices checked already.
    `max_align` caps the word size in bytes (16 allows 16-byte vectors; 1 forces byte copies).
    Raises ValueError before launching when an argument is malformed. Asynchronous on CUDA.
    """
    _launch(entries, indices, staging, staging_offsets, check_indices, max_align, tiling, True)


def scatter(
    entries: Sequence[Entry] | EntryTable,
    indices: torch.Tensor,
    staging: torch.Tensor,
    *,
    staging_offsets: Sequence[int] | None = None,
    check_indices: bool = True,
    max_align: int = 16,
    tiling: Tiling | None = None,
) -> None:
    """Unpack the inverse of `gather`: staging bytes at `staging_offsets[e] + j *
    e.spec.packed_bytes` into the segment of item `indices[j]` of e's pool.

    The entries' specs describe the destination side; they may place pieces differently from the
    sender's as long as each unit's packed bytes match. With `check_indices`, indices must also be
    unique (two writes to one item in one launch would race). Entries must not write overlapping
    pool bytes; that is not checked.
    """
    _launch(entries, indices, staging, staging_offsets, check_indices, max_align, tiling, False)


# ~~~ torch references ~~~


def _reference_views(
    entries: Sequence[Entry] | EntryTable, n: int, staging: torch.Tensor,
    staging_offsets: Sequence[int] | None,
):
    table = entries if isinstance(entries, EntryTable) else EntryTable(entries)
    offsets = table.staging_offsets(n) if staging_offsets is None else list(staging_offsets)
    flat = staging.reshape(-1).view(torch.uint8)
    for entry, capacity, offset in zip(table.entries, table.capacities, offsets, strict=True):
        if not isinstance(entry.pool, torch.Tensor):
            raise ValueError("the torch references need tensor pools, not addresses")
        s = entry.spec
        items = entry.pool.reshape(-1).view(torch.uint8)[: capacity * s.item_bytes]
        items = items.view(capacity, s.item_bytes)
        starts = s.seg_offset + s.seg_stride * torch.arange(s.repeat, device=items.device)
        cols = (starts[:, None] + torch.arange(s.seg_bytes, device=items.device)[None, :]).reshape(-1)
        yield items, cols, flat[offset: offset + n * s.packed_bytes].view(n, s.packed_bytes)


def gather_reference(
    entries: Sequence[Entry] | EntryTable,
    indices: torch.Tensor,
    staging: torch.Tensor,
    *,
    staging_offsets: Sequence[int] | None = None,
) -> None:
    """What `gather` does, with torch indexing on byte views (tensor pools only)."""
    idx = indices.long()
    for items, cols, out in _reference_views(entries, idx.numel(), staging, staging_offsets):
        out.copy_(items[idx][:, cols])


def scatter_reference(
    entries: Sequence[Entry] | EntryTable,
    indices: torch.Tensor,
    staging: torch.Tensor,
    *,
    staging_offsets: Sequence[int] | None = None,
) -> None:
    """What `scatter` does, with torch indexing on byte views (tensor pools only)."""
    idx = indices.long()
    for items, cols, src in _reference_views(entries, idx.numel(), staging, staging_offsets):
        items[idx[:, None], cols[None, :]] = src
