"""Same-host engine: writes straight into a peer process's memory with process_vm_writev.

No sockets and no threads: the kernel copies each descriptor from this process's address space
into the peer's, so a write is finished when `submit_write` returns (poll then says DONE).

The kernel only checks that the peer's pages are mapped and writable, not that the peer meant
to expose them, so this engine checks every destination against the ranges the peer listed in
its agent_info before writing anything. Permission follows ptrace rules (same uid and, under
Yama ptrace_scope >= 1, CAP_SYS_PTRACE or a PR_SET_PTRACER grant from the peer); without it
the first write fails with EPERM, which is raised as a TransferError that says so.

Peers are identified by pid. Because a pid can be reused after the peer exits, agent_info also
carries the peer's boot id, pid-namespace inode and process start time, and every submit checks
the start time again so that bytes never land in an unrelated process.

Device mode (`LocalEngine(device="cuda:0")`, class `LocalDeviceEngine`, end of this file) moves
GPU memory between engines of ONE process, each engine owning one device (a rank's GPU): one
process drives both GPUs, as the benchmarks do. It has three ways to move a request's pages, all
queued on the engine's own CUDA streams: a direct peer kernel that reads the source pool and
writes the destination pool on the other GPU (`submit_pages(path="push"|"pull")`), a staged
path (gather -> one bulk copy-engine copy -> scatter, pipelined in chunks; `path="staged"`), and
`submit_write`, one copy-engine copy per descriptor. CPU tensors take the same code through the
Triton interpreter, which is how it is tested without a GPU. docs/engines.md has the details.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..indices import IndexError_
from ..plan_types import Link, Segment
from .base import (
    Batch,
    BatchState,
    DescriptorError,
    RegionTable,
    TransferEngine,
    TransferError,
    TransportInfo,
    as_descriptors,
    check_region,
)

# Linux caps each process_vm_writev call at IOV_MAX iovecs on either side.
IOV_MAX = 1024

_libc = ctypes.CDLL(None, use_errno=True)
_process_vm_writev = _libc.process_vm_writev
_process_vm_writev.restype = ctypes.c_ssize_t
_process_vm_writev.argtypes = [
    ctypes.c_int,  # pid
    ctypes.c_void_p,  # local iovec array
    ctypes.c_ulong,
    ctypes.c_void_p,  # remote iovec array
    ctypes.c_ulong,
    ctypes.c_ulong,  # flags, must be 0
]


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _start_time_ticks(pid: int) -> int | None:
    """Start time of pid (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces and parentheses; fields follow the last ")".
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped: its memory is gone
        return None
    return int(fields[19])  # field 22 overall: starttime


class _Peer:
    def __init__(self, pid: int, start_ticks: int, ranges: RegionTable) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.ranges = ranges


class LocalEngine(TransferEngine):
    """process_vm_writev between processes of one host; any number per process, thread-safe."""

    name = "local"

    def __new__(cls, device: object = None, **kwargs: object) -> LocalEngine:
        # `LocalEngine(device=...)` (and `make_engine("local", device=...)`) builds the device
        # mode, LocalDeviceEngine; without a device it is the host engine below.
        if cls is LocalEngine and device is not None:
            return super().__new__(LocalDeviceEngine)
        return super().__new__(cls)

    def __init__(self, device: None = None) -> None:
        self._regions = RegionTable()
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        start = _start_time_ticks(self._pid)
        if start is None:
            raise TransferError("local: cannot read /proc/self/stat; is /proc mounted?")
        self._start_ticks = start

    def transport(self) -> TransportInfo:
        return TransportInfo(self.name, "process_vm_writev", "", "same host, host memory")

    # -- memory -------------------------------------------------------------------------------

    def register(self, addr: int, nbytes: int) -> None:
        addr, nbytes = check_region(addr, nbytes)
        with self._lock:
            self._check_open()
            self._regions.add(addr, nbytes)

    def deregister(self, addr: int) -> None:
        with self._lock:
            self._check_open()
            self._regions.remove(addr)

    # -- peers --------------------------------------------------------------------------------

    def agent_info(self) -> bytes:
        # The ranges are a snapshot: a peer that connected earlier must connect() again to see
        # ranges registered later.
        with self._lock:
            info = {
                "engine": self.name,
                "pid": self._pid,
                "start_ticks": self._start_ticks,
                "boot_id": _boot_id(),
                "pid_ns": _pid_namespace(),
                "ranges": [[addr, nbytes] for addr, nbytes in self._regions.items()],
            }
        return json.dumps(info).encode()

    def connect(self, agent_info: bytes) -> str:
        try:
            info = json.loads(bytes(agent_info))
            pid, start_ticks = int(info["pid"]), int(info["start_ticks"])
            ranges = RegionTable([(int(a), int(n)) for a, n in info["ranges"]])
            boot_id, pid_ns = info["boot_id"], int(info["pid_ns"])
            if info.get("engine") != self.name:
                raise ValueError(f"made by engine {info.get('engine')!r}")
        except (ValueError, TypeError, KeyError) as exc:
            raise DescriptorError(f"local: agent_info is not a local-engine blob: {exc}") from None
        if boot_id != _boot_id() or pid_ns != _pid_namespace():
            raise TransferError(
                f"local: peer pid {pid} is on another host or in another pid namespace; "
                "the local engine only reaches processes it can see by pid"
            )
        if _start_time_ticks(pid) != start_ticks:
            raise TransferError(f"local: peer pid {pid} has exited")
        peer = f"pid:{pid}"
        with self._lock:
            self._check_open()
            self._peers[peer] = _Peer(pid, start_ticks, ranges)
        return peer

    # -- transfers ----------------------------------------------------------------------------

    def submit_write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray
    ) -> Batch:
        src_u, dst_u, nbytes_u = as_descriptors(src, dst, nbytes)
        with self._lock:
            self._check_open()
            target = self._peers.get(peer)
            if target is None:
                raise TransferError(f"local: unknown peer {peer!r}; connect() it first")
            # Both checks come before the first byte is written.
            outside = self._regions.outside(src_u, nbytes_u)
            if outside.size:
                i = int(outside[0])
                raise DescriptorError(
                    f"local: source descriptor {i} [{int(src_u[i]):#x}, +{int(nbytes_u[i])}) is "
                    f"not inside memory registered in this process ({outside.size} such)"
                )
            outside = target.ranges.outside(dst_u, nbytes_u)
            if outside.size:
                i = int(outside[0])
                raise DescriptorError(
                    f"local: destination descriptor {i} [{int(dst_u[i]):#x}, "
                    f"+{int(nbytes_u[i])}) is not inside memory {peer} registered "
                    f"({outside.size} such); nothing was written"
                )
        batch = Batch(
            peer=peer, handles=[], nbytes=int(nbytes_u.sum()), descriptors=int(src_u.size)
        )
        if _start_time_ticks(target.pid) != target.start_ticks:
            batch.state, batch.reason = BatchState.FAILED, "peer process has exited"
            return batch
        written = 0
        try:
            for start in range(0, src_u.size, IOV_MAX):
                stop = min(start + IOV_MAX, src_u.size)
                written += _write_chunk(
                    target.pid, src_u[start:stop], dst_u[start:stop], nbytes_u[start:stop]
                )
        except _PeerGone as exc:
            batch.state = BatchState.FAILED
            batch.reason = f"{exc} after {written} of {batch.nbytes} bytes"
            return batch
        except OSError as exc:
            if written == 0 and exc.errno == errno.EPERM:
                raise TransferError(
                    f"local: process_vm_writev into {peer} is not permitted (EPERM): this "
                    "process needs ptrace access to the peer (same uid, and CAP_SYS_PTRACE or "
                    "kernel.yama.ptrace_scope=0, or a PR_SET_PTRACER grant from the peer)"
                ) from None
            batch.state = BatchState.FAILED
            batch.reason = f"process_vm_writev: {exc} after {written} of {batch.nbytes} bytes"
            return batch
        batch.state = BatchState.DONE
        return batch

    def poll(self, batch: Batch) -> BatchState:
        return batch.state

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._peers.clear()
            self._regions = RegionTable()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("local: engine is closed")


class _PeerGone(Exception):
    pass


def _write_chunk(pid: int, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> int:
    """Writes up to IOV_MAX descriptors, resuming after partial writes; returns bytes written."""
    # An (n, 2) uint64 array has the memory layout of struct iovec[n] on 64-bit Linux.
    local = np.stack([src, nbytes], axis=1)
    remote = np.stack([dst, nbytes], axis=1)
    total = int(nbytes.sum())
    done = 0
    first = 0
    while done < total:
        count = local.shape[0] - first
        ret = _process_vm_writev(
            pid, local[first:].ctypes.data, count, remote[first:].ctypes.data, count, 0
        )
        if ret < 0:
            err = ctypes.get_errno()
            if err == errno.ESRCH:
                raise _PeerGone("peer process has exited")
            if err == errno.EINTR:
                continue
            raise OSError(err, os.strerror(err))
        if ret == 0:
            # A fault on the first remote byte: the peer unmapped registered memory.
            raise OSError(errno.EFAULT, "peer memory not writable (unmapped since register?)")
        done += ret
        if done == total:
            break
        # Partial write: skip the iovecs that are complete, trim the one that is not.
        lengths = local[first:, 1]
        ends = np.cumsum(lengths)
        full = int(np.searchsorted(ends, ret, side="right"))
        first += full
        consumed = ret - (int(ends[full - 1]) if full else 0)
        if consumed:  # local and remote are fresh arrays from np.stack, safe to edit
            local[first, 0] += consumed
            local[first, 1] -= consumed
            remote[first, 0] += consumed
            remote[first, 1] -= consumed
    return total


# ~~~ device mode ~~~
#
# GPU memory of engines in one process. torch, triton and the copy kernels are imported on first
# use, so the host engine above works on machines that have neither.

torch = None  # the torch module, set by _device_modules()
tl = None  # triton.language, read by _pool_to_pool when Triton compiles or interprets it
_ck = None  # pdc.runtime.copy_kernels

# Device engines of this process by token; connect() finds its peer here.
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

_DIRECT_COLS = 16  # columns of the direct kernel's per-copy int64 table (10 used)
_MAX_ENTRIES = 65535  # CUDA's gridDim.y, which indexes copies


def _device_modules():
    global torch, tl, _ck
    if torch is None:
        try:
            import torch as torch_module
            import triton.language as triton_language

            from .. import copy_kernels
        except ImportError as exc:
            raise TransferError(
                f"local: device mode needs torch and triton (pip install 'pdc[kernels]'): {exc}"
            ) from None
        tl, _ck, torch = triton_language, copy_kernels, torch_module
    return torch


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


def _pow2_alignment(*values: int) -> int:
    g = 0
    for v in values:
        g = int(np.gcd(g, int(v)))
    return 16 if g == 0 else min(16, g & -g)


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
    `LocalDeviceEngine.plan_pages` and reused for every request (the device tables are cached
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
            s = c.segment
            src_entries.append(_ck.Entry(c.src, _ck.SegmentSpec(
                s.src_offset, s.nbytes, s.repeat, s.src_stride, c.src_item_bytes), c.src_capacity))
            dst_entries.append(_ck.Entry(c.dst, _ck.SegmentSpec(
                s.dst_offset, s.nbytes, s.repeat, s.dst_stride, c.dst_item_bytes), c.dst_capacity))
        self.gather_table = _ck.EntryTable(src_entries, device=src_device)
        self.scatter_table = _ck.EntryTable(dst_entries, device=dst_device)
        self.unit_bytes = self.gather_table.unit_bytes  # bytes of one index position
        self.src_capacity = min(c.src_capacity for c in copies)
        self.dst_capacity = min(c.dst_capacity for c in copies)
        self.max_seg_bytes = max(c.segment.nbytes for c in copies)
        self.max_repeat = max(c.segment.repeat for c in copies)
        self.alignment = _pow2_alignment(*(v for c in copies for v in (
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


class _DevicePeer:
    def __init__(self, engine: LocalDeviceEngine, device, ranges: RegionTable) -> None:
        self.engine = weakref.ref(engine)
        self.device = device
        self.ranges = ranges


class _CudaArray:
    """Just enough of __cuda_array_interface__ for torch to alias registered device bytes."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (addr, False), "version": 3}


class LocalDeviceEngine(LocalEngine):
    """Device mode of the local engine: moves memory of one device (a rank's GPU) into memory
    of another device engine of the same process. Build with `LocalEngine(device="cuda:1")`.

    Memory is registered as usual (`register(addr, nbytes)`, on this engine's device) or with
    `register_tensor(t)`. Peers are engines of this process (agent_info carries a token; an
    engine of another process is refused: CUDA IPC is not implemented). All work is queued on
    the engine's own streams after the producer's work: by default the work queued so far on
    the current stream of the source device, or the CUDA event given as `after`. `poll` asks a
    CUDA event, so submit never blocks.

    Ways to move bytes:
    - `submit_write(peer, src, dst, nbytes)`: one copy-engine copy (cudaMemcpyAsync, peer
      when the devices differ) per descriptor; right for a few large contiguous runs.
    - `submit_pages(plan, src_ids, dst_ids, path=...)` with a `PagePlan` from `plan_pages`:
      "push" / "pull": the direct peer kernel, one launch for every copy of the plan, run by the
      source (push) or destination (pull) GPU, reading and writing the pools over NVLink;
      "staged": copy_kernels.gather into a staging slot on the source device, one bulk copy to
      a slot on the destination device, copy_kernels.scatter, pipelined in chunks of about
      `staging_chunk_bytes` over `staging_slots` slots per device.
    Submits are serialised by one lock; every method is thread-safe.
    """

    def __init__(self, device: object = "cuda", *, staging_chunk_bytes: int = 256 << 20,
                 staging_slots: int = 3, direct_tiling=None) -> None:
        t = _device_modules()
        try:
            dev = t.device(device)
        except (RuntimeError, TypeError) as exc:
            raise DescriptorError(f"local: bad device {device!r}: {exc}") from None
        if dev.type == "cuda":
            if not t.cuda.is_available():
                raise TransferError("local: device mode on CUDA needs a CUDA device")
            if dev.index is None:
                dev = t.device("cuda", t.cuda.current_device())
        elif dev.type != "cpu":
            raise DescriptorError(f"local: device mode runs on cuda or cpu, not {dev.type}")
        if staging_chunk_bytes < 1 or staging_slots < 1:
            raise DescriptorError("local: staging_chunk_bytes and staging_slots must be >= 1")
        self.device = dev
        self.staging_chunk_bytes = int(staging_chunk_bytes)
        self.staging_slots = int(staging_slots)
        # copy_kernels.Tiling of the direct kernel; None: copy_kernels.default_tiling
        self.direct_tiling = direct_tiling
        self._cuda = dev.type == "cuda"
        self._regions = RegionTable()
        self._views: dict[int, object] = {}  # region start -> uint8 tensor over the region
        self._peers: dict[str, _DevicePeer] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._token = uuid.uuid4().hex
        self._streams: dict = {}
        self._slots: dict = {}  # (src dev, dst dev, side, slot) -> uint8 staging tensor
        self._slot_events: dict = {}  # (src dev, dst dev, slot) -> [copy done, scatter done]
        self._peer_access: dict = {}
        _LIVE[self._token] = self

    # -- memory -------------------------------------------------------------------------------


    def transport(self) -> TransportInfo:
        how = "cudaMemcpyAsync peer copies" if self._cuda else "torch copies"
        return TransportInfo(self.name, how, str(self.device), "one process")
    def register(self, addr: int, nbytes: int) -> None:
        """Registers device memory of this engine's device (host memory for device='cpu')."""
        addr, nbytes = check_region(addr, nbytes)
        if self._cuda:
            with torch.cuda.device(self.device):
                view = torch.as_tensor(_CudaArray(addr, nbytes), device=self.device)
        else:
            view = torch.frombuffer((ctypes.c_char * nbytes).from_address(addr),
                                    dtype=torch.uint8)
        self._add_region(addr, nbytes, view)

    def register_tensor(self, tensor) -> int:
        """Registers the bytes of a contiguous tensor on this engine's device and keeps it alive
        until `deregister(address)`; returns the address."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            raise DescriptorError("register_tensor needs a contiguous torch.Tensor")
        if tensor.device != self.device:
            raise DescriptorError(f"register_tensor: tensor is on {tensor.device}, this engine "
                                  f"owns {self.device}")
        nbytes = tensor.numel() * tensor.element_size()
        addr = tensor.data_ptr()
        check_region(addr, nbytes)
        self._add_region(addr, nbytes, tensor.reshape(-1).view(torch.uint8))
        return addr

    def _add_region(self, addr: int, nbytes: int, view) -> None:
        with self._lock:
            self._check_open()
            self._regions.add(addr, nbytes)
            self._views[addr] = view

    def deregister(self, addr: int) -> None:
        with self._lock:
            self._check_open()
            self._regions.remove(addr)
            self._views.pop(int(addr), None)

    # -- peers --------------------------------------------------------------------------------

    def agent_info(self) -> bytes:
        with self._lock:
            info = {
                "engine": self.name,
                "mode": "device",
                "pid": os.getpid(),
                "token": self._token,
                "device": str(self.device),
                "ranges": [[addr, nbytes] for addr, nbytes in self._regions.items()],
            }
        return json.dumps(info).encode()

    def connect(self, agent_info: bytes) -> str:
        try:
            info = json.loads(bytes(agent_info))
            if info.get("engine") != self.name or info.get("mode") != "device":
                raise ValueError(f"made by engine {info.get('engine')!r} in mode "
                                 f"{info.get('mode')!r}")
            token, pid = str(info["token"]), int(info["pid"])
            device = torch.device(info["device"])
            ranges = RegionTable([(int(a), int(n)) for a, n in info["ranges"]])
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise DescriptorError(f"local: agent_info is not a device-mode blob: {exc}") from None
        engine = _LIVE.get(token)
        if pid != os.getpid() or engine is None:
            raise TransferError(
                f"local: device-mode peer (pid {pid}) is not an engine of this process; device "
                "mode moves GPU memory within one process that owns both GPUs (CUDA IPC "
                "between processes is not implemented)")
        if device.type != self.device.type:
            raise DescriptorError(f"local: cannot connect a {self.device.type} engine to a "
                                  f"{device.type} engine")
        if self._cuda and device != self.device:
            self._enable_peer_access(self.device, device)
        peer = f"device:{token}"
        with self._lock:
            self._check_open()
            self._peers[peer] = _DevicePeer(engine, device, ranges)
        return peer

    def peer_device(self, peer: str):
        return self._peer(peer).device

    def _peer(self, peer: str) -> _DevicePeer:
        target = self._peers.get(peer)
        if target is None:
            raise TransferError(f"local: unknown peer {peer!r}; connect() it first")
        return target

    def _enable_peer_access(self, a, b) -> None:
        # torch turns peer access on (cudaDeviceEnablePeerAccess) for the copying direction the
        # first time it copies between two devices; a one-byte copy each way does that here, so
        # the direct kernel may then read and write the other device's memory.
        for x, y in ((a, b), (b, a)):
            ok = bool(torch.cuda.can_device_access_peer(x.index, y.index))
            if ok:
                torch.empty(1, dtype=torch.uint8, device=y).copy_(
                    torch.zeros(1, dtype=torch.uint8, device=x))
            self._peer_access[(x.index, y.index)] = ok
        torch.cuda.synchronize(a)
        torch.cuda.synchronize(b)

    def orders_after(self, device) -> bool:
        """Writes wait on an event recorded on the caller's current stream (`_ready_event`)."""
        import torch

        return self._cuda and device is not None and torch.device(device) == self.device

    # -- streams and events -------------------------------------------------------------------

    def _stream(self, device, role: str):
        key = (device, role)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = torch.cuda.Stream(device=device)
        return s

    def _ready_event(self, after):
        """The event the engine's streams wait for before reading the source pages."""
        if after is not None:
            return after
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    # -- copy engine: one copy per descriptor -------------------------------------------------

    def submit_write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, *, after=None
    ) -> Batch:
        src_u, dst_u, nbytes_u = as_descriptors(src, dst, nbytes)
        with self._lock:
            self._check_open()
            target = self._peer(peer)
            outside = self._regions.outside(src_u, nbytes_u)
            if outside.size:
                i = int(outside[0])
                raise DescriptorError(
                    f"local: source descriptor {i} [{int(src_u[i]):#x}, +{int(nbytes_u[i])}) is "
                    f"not inside memory registered in this engine ({outside.size} such)")
            outside = target.ranges.outside(dst_u, nbytes_u)
            if outside.size:
                i = int(outside[0])
                raise DescriptorError(
                    f"local: destination descriptor {i} [{int(dst_u[i]):#x}, "
                    f"+{int(nbytes_u[i])}) is not inside memory {peer} registered "
                    f"({outside.size} such); nothing was written")
            s_views, s_idx, s_off = _locate(self._views, self._regions, src_u)
            peer_engine = target.engine()
            if peer_engine is None:
                raise TransferError(f"local: peer {peer} is closed")
            d_views, d_idx, d_off = _locate(peer_engine._views, target.ranges, dst_u)
            batch = Batch(peer=peer, handles=[], nbytes=int(nbytes_u.sum()),
                          descriptors=int(src_u.size))
            jobs = zip(s_idx.tolist(), s_off.tolist(), d_idx.tolist(), d_off.tolist(),
                       nbytes_u.tolist(), strict=True)
            if not self._cuda:
                for si, so, di, do, n in jobs:
                    d_views[di][do:do + n].copy_(s_views[si][so:so + n])
                batch.state = BatchState.DONE
                return batch
            ready = self._ready_event(after)
            s0 = self._stream(self.device, "write")
            s1 = self._stream(target.device, "write")
            # torch copies across devices on the source device's current stream, fenced
            # against the destination device's current stream: make both the engine's.
            with torch.cuda.stream(s1), torch.cuda.stream(s0):
                s0.wait_event(ready)
                for si, so, di, do, n in jobs:
                    d_views[di][do:do + n].copy_(s_views[si][so:so + n], non_blocking=True)
                done = torch.cuda.Event()
                done.record(s0)
            batch.handles = [done]
            return batch

    # -- pages: direct peer kernel or staged --------------------------------------------------

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

    # -- completion ---------------------------------------------------------------------------

    def poll(self, batch: Batch) -> BatchState:
        if batch.state is BatchState.PENDING:
            try:
                if all(ev.query() for ev in batch.handles):
                    batch.state, batch.handles = BatchState.DONE, []
            except RuntimeError as exc:  # a CUDA error surfaces at the event
                batch.state, batch.reason = BatchState.FAILED, f"CUDA: {exc}"
        return batch.state

    def wait(self, batch: Batch, timeout_s: float) -> None:
        # Spins on the event (yielding the GIL) rather than sleeping: a GPU transfer ends in
        # microseconds to milliseconds, and a sleep would add its own granularity to each wait.
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.poll(batch)
            if state is BatchState.DONE:
                return
            if state is BatchState.FAILED:
                raise TransferError(f"{self.name}: write to {batch.peer} failed: {batch.reason}")
            if time.monotonic() > deadline:
                raise TransferError(
                    f"{self.name}: write to {batch.peer} timed out after {timeout_s:.1f} s")
            time.sleep(0)

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._cuda and not self._closed:
                for s in self._streams.values():
                    s.synchronize()  # nothing queued may outlive the slots it uses
            self._closed = True
            self._peers.clear()
            self._regions = RegionTable()
            self._views.clear()
            self._slots.clear()
            self._slot_events.clear()
            self._streams.clear()
            _LIVE.pop(self._token, None)


def _word_anchor(table, word: int):
    # A view of the table as the launch's word type: the kernel only reads its pointer type.
    return table.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[word])


def _locate(views: dict, regions: RegionTable, addr: np.ndarray):
    """(views in region order, region index and offset of every address); addresses are known
    to lie inside one region."""
    items = regions.items()
    starts = np.array([a for a, _ in items], np.uint64)
    idx = np.searchsorted(starts, addr, side="right") - 1
    try:
        ordered = [views[a] for a, _ in items]
    except KeyError as exc:
        raise TransferError(f"local: registered range {int(exc.args[0]):#x} was deregistered "
                            "since connect()") from None
    return ordered, idx, addr - starts[idx]


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
