"""The page paths the GPU benchmarks compare, on top of the local device engine.

`PageEngine(device)` is a LocalDeviceEngine (runtime/engines/local_device.py) with
`plan_pages` / `submit_pages`; `IpcPageEngine` the same over CUDA IPC (a CudaIpcEngine):
- "push" / "pull": the direct peer kernel, one launch for every copy of the plan, run by the
  source (push) or destination (pull) GPU, reading and writing the pools over NVLink;
- "staged": copy_kernels.gather into a staging slot on the source device, one bulk copy to a
  slot on the destination device, copy_kernels.scatter, pipelined in chunks of about
  `staging_chunk_bytes` over `staging_slots` slots per device.
The serving runtime does not use them (its staged path is runtime/staging.py through the
endpoints), so they live beside the benchmarks. CPU tensors run the kernels through the Triton
interpreter, which is how tests/bench/test_local_device_engine.py runs them without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton.language as tl
from pdc.runtime import copy_kernels as _ck
from pdc.runtime.copy_specs import SegmentSpec, pow2_alignment
from pdc.runtime.engines.base import Batch, BatchState, DescriptorError, TransferError
from pdc.runtime.engines.cuda_ipc import CudaIpcEngine, _IpcPeer
from pdc.runtime.engines.local_device import LocalDeviceEngine
from pdc.runtime.indices import IndexError_
from pdc.runtime.plan_types import Link, Segment

_DIRECT_COLS = 16  # columns of the direct kernel's per-copy int64 table (10 used)
_MAX_ENTRIES = 65535  # CUDA's gridDim.y, which indexes copies


def _pool_to_pool(
    table_ptr,  # int64 [copies, _DIRECT_COLS]: see PagePlan.direct_table
    src_index_ptr,  # int64 [n] source item ids
    dst_index_ptr,  # int64 [n] destination item ids
    word_ptr,  # any tensor of the word type: fixes the pointer type of the pool bases
    n_indices,
    n_col_chunks,
    n_work,  # row blocks x column chunks of one copy; program p does p, p + grid, p + 2 grid..
    TABLE_COLS: tl.constexpr,
    ALIGN: tl.constexpr,  # bytes every pointer is a multiple of (hint only)
    VEC: tl.constexpr,  # words every offset and length is a multiple of (hint only)
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    # The direct peer kernel: copies[e] piece r of item src[j] -> piece r of item dst[j], every
    # (j, r) one row, read from one pool and written to the other whatever GPU each is on (UVA
    # with peer access). Same tiling and int64 addressing as copy_kernels._copy_segments; the
    # grid may be smaller than the work (a cap on the SMs a transfer occupies next to compute).
    pid = tl.program_id(0).to(tl.int64)
    n_prog = tl.num_programs(0).to(tl.int64)
    entry = tl.program_id(1).to(tl.int64)
    row_ptr = table_ptr + entry * TABLE_COLS
    src_base = tl.multiple_of(tl.load(row_ptr + 0).to(word_ptr.dtype), ALIGN)
    dst_base = tl.multiple_of(tl.load(row_ptr + 1).to(word_ptr.dtype), ALIGN)
    src_item = tl.load(row_ptr + 2)
    dst_item = tl.load(row_ptr + 3)
    src_off = tl.load(row_ptr + 4)
    dst_off = tl.load(row_ptr + 5)
    seg_words = tl.load(row_ptr + 6) * VEC
    repeat = tl.load(row_ptr + 7)
    src_stride = tl.load(row_ptr + 8)
    dst_stride = tl.load(row_ptr + 9)

    n_rows = n_indices * repeat
    for w in range(pid, n_work, n_prog):
        row_block = w // n_col_chunks
        col_chunk = w - row_block * n_col_chunks
        q = row_block * ROWS + tl.arange(0, ROWS)
        row_ok = q < n_rows
        j = q // repeat
        r = q - j * repeat
        s_item = tl.load(src_index_ptr + j, mask=row_ok, other=0)
        d_item = tl.load(dst_index_ptr + j, mask=row_ok, other=0)
        s_row = tl.multiple_of(s_item * src_item + src_off + r * src_stride, VEC)
        d_row = tl.multiple_of(d_item * dst_item + dst_off + r * dst_stride, VEC)

        col_lo = col_chunk * (ITERS * BLOCK)
        left = tl.maximum(seg_words - col_lo, 0)
        n_iter = tl.minimum((left + BLOCK - 1) // BLOCK, ITERS)
        n_iter = tl.where(row_block * ROWS < n_rows, n_iter, 0)
        for it in range(0, n_iter):
            cols = col_lo + it * BLOCK + tl.arange(0, BLOCK)
            mask = row_ok[:, None] & (cols < seg_words)[None, :]
            vals = tl.load(src_base + (s_row[:, None] + cols[None, :]), mask=mask)
            tl.store(dst_base + (d_row[:, None] + cols[None, :]), vals, mask=mask)


_direct_compiled = None
_direct_interpreted = None


def _direct_kernel(device):
    # Chosen per call from the device, as copy_kernels does: never through TRITON_INTERPRET.
    global _direct_compiled, _direct_interpreted
    if device.type == "cuda":
        if _direct_compiled is None:
            from triton.runtime.jit import JITFunction

            _direct_compiled = JITFunction(
                _pool_to_pool, do_not_specialize=["n_indices", "n_col_chunks", "n_work"]
            )
        return _direct_compiled
    if _direct_interpreted is None:
        from triton.runtime.interpreter import InterpretedFunction

        _direct_interpreted = InterpretedFunction(_pool_to_pool)
    return _direct_interpreted


@dataclass(frozen=True)
class PageCopy:
    """One pool pair of a page transfer: for every index position j, `segment` of item
    `src_ids[j]` of the pool at `src` goes to item `dst_ids[j]` of the pool at `dst`.

    `segment` is the plan's `Segment` (repeat pieces, offsets and strides inside the items), so
    a head merge or split (hetero TP) is a copy like any other. `page_copies` builds these from a
    plan link.
    """

    src: int
    dst: int
    src_item_bytes: int
    dst_item_bytes: int
    src_capacity: int
    dst_capacity: int
    segment: Segment

    def __post_init__(self) -> None:
        s = self.segment
        for name in ("src", "dst", "src_item_bytes", "dst_item_bytes", "src_capacity",
                     "dst_capacity"):
            if int(getattr(self, name)) <= 0:
                raise DescriptorError(f"PageCopy.{name} must be positive")
        if s.nbytes <= 0 or s.repeat < 1 or min(s.src_offset, s.dst_offset) < 0:
            raise DescriptorError(f"PageCopy segment {s} is empty or negative")
        if s.repeat > 1 and min(s.src_stride, s.dst_stride) < s.nbytes:
            raise DescriptorError(f"PageCopy segment {s} has overlapping pieces")
        for side, off, stride, item in (("source", s.src_offset, s.src_stride,
                                         self.src_item_bytes),
                                        ("destination", s.dst_offset, s.dst_stride,
                                         self.dst_item_bytes)):
            if off + (s.repeat - 1) * stride + s.nbytes > item:
                raise DescriptorError(f"PageCopy segment {s} leaves the {item} B {side} item")

    @property
    def unit_bytes(self) -> int:
        return self.segment.nbytes * self.segment.repeat


def page_copies(link: Link, local: dict, remote: dict, component: str,
                layers: set[int] | None = None) -> tuple[PageCopy, ...]:
    """The `PageCopy`s of one component of a plan link, from the data path's buffer tables
    (`datapath.LocalBuffer` lists for this rank, `datapath.RemoteBuffer` lists of the peer),
    checked the way `datapath.build_descriptors` checks them. `layers` keeps only those layers
    (per-layer streaming)."""
    out = []
    for e in link.entries:
        if e.component != component or (layers is not None and e.layer_id not in layers):
            continue
        lb = local[component][e.src_pos]
        try:
            rb = remote[component][e.dst_pos]
        except (KeyError, IndexError):
            raise IndexError_(f"peer registered no entry {e.dst_pos} for component "
                              f"'{component}'") from None
        if rb.layer_id != e.layer_id or rb.item_bytes != e.dst_item_bytes:
            raise IndexError_(f"peer entry {e.dst_pos} of '{component}' is layer {rb.layer_id} "
                              f"with {rb.item_bytes} B items; the plan expects layer "
                              f"{e.layer_id} with {e.dst_item_bytes} B")
        if lb.item_bytes != e.src_item_bytes:
            raise IndexError_(f"local entry {e.src_pos} of '{component}' has {lb.item_bytes} B "
                              f"items; the plan expects {e.src_item_bytes} B")
        for seg in e.segments:
            out.append(PageCopy(lb.base, rb.base, lb.item_bytes, rb.item_bytes, lb.capacity,
                                rb.capacity, seg))
    return tuple(out)


class PagePlan:
    """Page copies from one device engine to one of its peers, validated once; made by
    `PageEngine.plan_pages` and reused for every request (the device tables are cached
    here, as `copy_kernels.EntryTable` caches its own)."""

    def __init__(self, peer: str, copies: tuple[PageCopy, ...], src_device, dst_device):
        if not copies:
            raise DescriptorError("plan_pages: no copies")
        if len(copies) > _MAX_ENTRIES:
            raise DescriptorError(f"plan_pages: at most {_MAX_ENTRIES} copies, got {len(copies)}")
        self.peer = peer
        self.copies = copies
        self.src_device = src_device
        self.dst_device = dst_device
        src_entries, dst_entries = [], []
        for c in copies:
            src_entries.append(_ck.Entry(c.src, SegmentSpec.of(c.segment, c.src_item_bytes, "src"),
                                         c.src_capacity))
            dst_entries.append(_ck.Entry(c.dst, SegmentSpec.of(c.segment, c.dst_item_bytes, "dst"),
                                         c.dst_capacity))
        self.gather_table = _ck.EntryTable(src_entries, device=src_device)
        self.scatter_table = _ck.EntryTable(dst_entries, device=dst_device)
        self.unit_bytes = self.gather_table.unit_bytes  # bytes of one index position
        self.src_capacity = min(c.src_capacity for c in copies)
        self.dst_capacity = min(c.dst_capacity for c in copies)
        self.max_seg_bytes = max(c.segment.nbytes for c in copies)
        self.max_repeat = max(c.segment.repeat for c in copies)
        self.alignment = pow2_alignment(*(v for c in copies for v in (
            c.src, c.dst, c.src_item_bytes, c.dst_item_bytes, c.segment.src_offset,
            c.segment.dst_offset, c.segment.nbytes, c.segment.src_stride, c.segment.dst_stride)))
        self._direct: dict = {}

    def direct_table(self, device):
        """(int64 device table, word bytes, words per vector) of the direct kernel on device."""
        got = self._direct.get(device)
        if got is None:
            word = min(self.alignment, 4)
            vec = self.alignment // word
            rows = []
            for c in self.copies:
                s = c.segment
                rows.append([c.src, c.dst, c.src_item_bytes // word, c.dst_item_bytes // word,
                             s.src_offset // word, s.dst_offset // word, s.nbytes // (word * vec),
                             s.repeat, s.src_stride // word, s.dst_stride // word]
                            + [0] * (_DIRECT_COLS - 10))
            table = torch.tensor(rows, dtype=torch.int64).to(device)
            got = self._direct[device] = (table, word, vec)
        return got


class PageEngine(LocalDeviceEngine):
    """A local device engine with the benchmarks' page paths (module docstring). Submits are
    serialised by the engine's lock; every method is thread-safe."""

    def __init__(self, device: object = "cuda", *, staging_chunk_bytes: int = 256 << 20,
                 staging_slots: int = 3, direct_tiling=None, **kwargs) -> None:
        super().__init__(device, **kwargs)
        if staging_chunk_bytes < 1 or staging_slots < 1:
            raise DescriptorError("local: staging_chunk_bytes and staging_slots must be >= 1")
        self.staging_chunk_bytes = int(staging_chunk_bytes)
        self.staging_slots = int(staging_slots)
        # copy_kernels.Tiling of the direct kernel; None: copy_kernels.default_tiling
        self.direct_tiling = direct_tiling
        self._slots: dict = {}  # (src dev, dst dev, side, slot) -> uint8 staging tensor
        self._slot_events: dict = {}  # (src dev, dst dev, slot) -> [copy done, scatter done]

    def plan_pages(self, peer: str, copies: Sequence[PageCopy]) -> PagePlan:
        """Validates page copies from this engine's memory into `peer`'s once: every source
        pool inside memory registered here, every destination pool inside memory the peer
        registered, one launch's worth of copies."""
        copies = tuple(copies)
        for i, c in enumerate(copies):
            if not isinstance(c, PageCopy):
                raise DescriptorError(f"copies[{i}] must be a PageCopy, got {type(c).__name__}")
        with self._lock:
            self._check_open()
            target = self._peer(peer)
            if copies:
                src = np.array([c.src for c in copies], np.uint64)
                dst = np.array([c.dst for c in copies], np.uint64)
                s_len = np.array([c.src_item_bytes * c.src_capacity for c in copies], np.uint64)
                d_len = np.array([c.dst_item_bytes * c.dst_capacity for c in copies], np.uint64)
                bad = self._regions.outside(src, s_len)
                if bad.size:
                    raise DescriptorError(f"local: source pool of copy {int(bad[0])} is not "
                                          "inside memory registered in this engine")
                bad = target.ranges.outside(dst, d_len)
                if bad.size:
                    raise DescriptorError(f"local: destination pool of copy {int(bad[0])} is not "
                                          f"inside memory {peer} registered")
            return PagePlan(peer, copies, self.device, target.device)

    def submit_pages(self, plan: PagePlan, src_ids, dst_ids, *, path: str = "push",
                     after=None, chunks: int | None = None, programs: int | None = None
                     ) -> Batch:
        """Moves, for every copy of `plan` and every j, item src_ids[j] to item dst_ids[j].

        `path`: "push" or "pull" (the direct peer kernel on the source or destination GPU) or
        "staged". `chunks` splits a staged transfer into that many pipelined chunks (default:
        chunks of about `staging_chunk_bytes`). `programs` caps the direct kernel's programs
        per copy (each then loops), so a transfer next to compute occupies few SMs. Every id is
        checked against every pool's capacity before anything is queued. Returns at once;
        `poll`/`wait` the batch.
        """
        if programs is not None and int(programs) < 1:
            raise DescriptorError(f"local: programs must be >= 1, got {programs}")
        if path not in ("push", "pull", "staged"):
            raise DescriptorError(f"local: path must be 'push', 'pull' or 'staged', not {path!r}")
        s, d = _page_ids(plan, src_ids, dst_ids)
        n = len(s)
        with self._lock:
            self._check_open()
            target = self._peer(plan.peer)
            if target.device != plan.dst_device or plan.src_device != self.device:
                raise DescriptorError("local: page plan was made for other devices")
            ops = 0
            handles: list = []
            if n:
                if path == "staged":
                    ops, handles = self._staged(plan, s, d, after, chunks)
                else:
                    on = plan.src_device if path == "push" else plan.dst_device
                    other = plan.dst_device if path == "push" else plan.src_device
                    if self._cuda and on != other and \
                            not self._peer_access.get((on.index, other.index)):
                        raise TransferError(f"local: {on} cannot access {other} (no peer "
                                            "access); use path='staged'")
                    ops, handles = self._direct(plan, s, d, after, on, programs)
            batch = Batch(peer=plan.peer, handles=handles, nbytes=n * plan.unit_bytes,
                          descriptors=ops)
            if not handles:
                batch.state = BatchState.DONE
            return batch

    def _launch_direct(self, plan: PagePlan, s_idx, d_idx, n: int, device,
                       programs: int | None = None) -> None:
        table, word, vec = plan.direct_table(device)
        tile = self.direct_tiling or _ck.default_tiling(plan.max_seg_bytes, n * plan.max_repeat,
                                                        device)
        block = max(1, tile.block_bytes // word)
        n_col_chunks = -(-(plan.max_seg_bytes // word) // (block * tile.iters))
        n_row_blocks = -(-(n * plan.max_repeat) // tile.rows)
        n_work = n_col_chunks * n_row_blocks
        if n_work > 2**31 - 1:
            raise DescriptorError("local: page transfer too large for one launch")
        grid = (min(n_work, programs) if programs else n_work, len(plan.copies))
        _direct_kernel(device)[grid](
            table, s_idx, d_idx, _word_anchor(table, word), n, n_col_chunks, n_work,
            TABLE_COLS=_DIRECT_COLS, ALIGN=plan.alignment, VEC=vec, ROWS=tile.rows, BLOCK=block,
            ITERS=tile.iters, num_warps=tile.num_warps)

    # The four device operations, one method each (a benchmark counts them instead of running
    # them to time the host work around them). Indices were checked by _page_ids.

    def _gather(self, plan: PagePlan, idx, staging) -> None:
        _ck.gather(plan.gather_table, idx, staging, check_indices=False)

    def _scatter(self, plan: PagePlan, idx, staging) -> None:
        _ck.scatter(plan.scatter_table, idx, staging, check_indices=False)

    def _bulk_copy(self, dst, src) -> None:
        dst.copy_(src, non_blocking=True)

    def _upload(self, ids: np.ndarray, device):
        """Index array -> int64 tensor on device, queued on the current stream. From pinned
        memory: a copy from pageable memory may wait for the stream to drain (the driver stages
        it), which would stall the host behind the very work a transfer waits for."""
        host = torch.from_numpy(ids)
        if not self._cuda:
            return host
        return host.pin_memory().to(device, non_blocking=True)

    def _direct(self, plan: PagePlan, s: np.ndarray, d: np.ndarray, after, on, programs):
        ids = np.concatenate((s, d))
        n = len(s)
        if not self._cuda:
            ids = self._upload(ids, on)
            self._launch_direct(plan, ids[:n], ids[n:], n, on, programs)
            return 1, []
        ready = self._ready_event(after)
        stream = self._stream(on, "direct")
        with torch.cuda.device(on), torch.cuda.stream(stream):
            stream.wait_event(ready)
            ids = self._upload(ids, on)
            self._launch_direct(plan, ids[:n], ids[n:], n, on, programs)
            done = torch.cuda.Event()
            done.record(stream)
        return 1, [done]

    def _slot(self, key: tuple, nbytes: int, device):
        buf = self._slots.get(key)
        if buf is None or buf.numel() < nbytes:
            if buf is not None and self._cuda:
                torch.cuda.synchronize(device)  # the old slot may still be read or written
            buf = self._slots[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf

    def _staged(self, plan: PagePlan, s: np.ndarray, d: np.ndarray, after, chunks):
        n = len(s)
        if chunks is None:
            per = max(1, self.staging_chunk_bytes // plan.unit_bytes)
        else:
            if int(chunks) < 1:
                raise DescriptorError(f"local: chunks must be >= 1, got {chunks}")
            per = -(-n // int(chunks))
        n_chunks = -(-n // per)
        src_dev, dst_dev = plan.src_device, plan.dst_device
        slot_bytes = max(self.staging_chunk_bytes, per * plan.unit_bytes)
        if not self._cuda:
            s_idx, d_idx = self._upload(s, src_dev), self._upload(d, dst_dev)
            for c in range(n_chunks):
                lo, hi = c * per, min(n, (c + 1) * per)
                nb = (hi - lo) * plan.unit_bytes
                a = self._slot((src_dev, dst_dev, "src", 0), slot_bytes, src_dev)[:nb]
                b = self._slot((src_dev, dst_dev, "dst", 0), slot_bytes, dst_dev)[:nb]
                self._gather(plan, s_idx[lo:hi], a)
                self._bulk_copy(b, a)
                self._scatter(plan, d_idx[lo:hi], b)
            return n_chunks, []
        ready = self._ready_event(after)
        g = self._stream(src_dev, "gather")
        c0 = self._stream(src_dev, "copy")
        c1 = self._stream(dst_dev, "copy")
        sc = self._stream(dst_dev, "scatter")
        with torch.cuda.device(src_dev), torch.cuda.stream(g):
            g.wait_event(ready)
            s_idx = self._upload(s, src_dev)
        with torch.cuda.device(dst_dev), torch.cuda.stream(sc):
            d_idx = self._upload(d, dst_dev)
        done = None
        for c in range(n_chunks):
            lo, hi = c * per, min(n, (c + 1) * per)
            nb = (hi - lo) * plan.unit_bytes
            k = c % self.staging_slots
            a = self._slot((src_dev, dst_dev, "src", k), slot_bytes, src_dev)[:nb]
            b = self._slot((src_dev, dst_dev, "dst", k), slot_bytes, dst_dev)[:nb]
            events = self._slot_events.get((src_dev, dst_dev, k))
            if events is None:
                events = self._slot_events[(src_dev, dst_dev, k)] = [None, None]
            copied, scattered = events
            with torch.cuda.device(src_dev), torch.cuda.stream(g):
                if copied is not None:
                    g.wait_event(copied)  # slot a is free once its last copy has read it
                self._gather(plan, s_idx[lo:hi], a)
                gathered = torch.cuda.Event()
                gathered.record(g)
            with torch.cuda.stream(c1), torch.cuda.stream(c0):
                c0.wait_event(gathered)
                if scattered is not None:
                    c0.wait_event(scattered)  # slot b is free once its last scatter read it
                self._bulk_copy(b, a)
                copied = torch.cuda.Event()
                copied.record(c0)
            with torch.cuda.device(dst_dev), torch.cuda.stream(sc):
                sc.wait_event(copied)
                self._scatter(plan, d_idx[lo:hi], b)
                scattered = torch.cuda.Event()
                scattered.record(sc)
            events[0], events[1] = copied, scattered
            done = scattered
        return n_chunks, [done]

    def close(self) -> None:
        super().close()  # waits for the streams, which may still use the slots
        with self._lock:
            self._slots.clear()
            self._slot_events.clear()


class IpcPageEngine(PageEngine, CudaIpcEngine):
    """The page paths over CUDA IPC: a peer of another process is reached through the mappings
    the CudaIpcEngine opened (its destination pools translated into them)."""

    def plan_pages(self, peer: str, copies) -> PagePlan:
        plan = super().plan_pages(peer, copies)  # validated against the peer's own addresses
        target = self._peers.get(peer)
        if not isinstance(target, _IpcPeer):
            return plan
        dst = target.translate(np.array([c.dst for c in plan.copies], np.uint64))
        moved = tuple(PageCopy(c.src, int(d), c.src_item_bytes, c.dst_item_bytes,
                               c.src_capacity, c.dst_capacity, c.segment)
                      for c, d in zip(plan.copies, dst.tolist(), strict=True))
        return PagePlan(peer, moved, plan.src_device, plan.dst_device)

    def submit_pages(self, plan: PagePlan, src_ids, dst_ids, **kwargs) -> Batch:
        target = self._peers.get(plan.peer)
        if isinstance(target, _IpcPeer) and not self._alive(plan.peer, target):
            n = len(np.asarray(src_ids))
            return Batch(peer=plan.peer, handles=[], nbytes=n * plan.unit_bytes, descriptors=0,
                         state=BatchState.FAILED, reason="peer process has exited")
        return super().submit_pages(plan, src_ids, dst_ids, **kwargs)


def _word_anchor(table, word: int):
    # A view of the table as the launch's word type: the kernel only reads its pointer type.
    return table.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[word])


def _page_ids(plan: PagePlan, src_ids, dst_ids) -> tuple[np.ndarray, np.ndarray]:
    s = np.ascontiguousarray(src_ids, dtype=np.int64)
    d = np.ascontiguousarray(dst_ids, dtype=np.int64)
    if s.ndim != 1 or d.ndim != 1 or len(s) != len(d):
        raise DescriptorError(f"src_ids and dst_ids must be 1-D of equal length, got shapes "
                              f"{s.shape} and {d.shape}")
    if len(s):
        for ids, cap, side in ((s, plan.src_capacity, "source"),
                               (d, plan.dst_capacity, "destination")):
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= cap:
                raise DescriptorError(f"local: {side} item {lo if lo < 0 else hi} is outside "
                                      f"the pools' capacity {cap}")
    return s, d
