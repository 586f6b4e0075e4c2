"""CUDA IPC: the local device engine across processes of one host.

`CudaIpcEngine(device="cuda:0")` is the local engine for device memory (a `LocalDeviceEngine`,
runtime/engines/local_device.py) that also reaches device engines of OTHER processes. A registered
region's allocation is exported as a CUDA IPC memory handle in `agent_info()`; a writer opens
each handle once in `connect()` and then addresses the peer's memory directly: `submit_write`
queues one descriptor-copy launch (runtime/descriptor_copy.py) for the small descriptors and a
copy-engine copy for each large one, on the engine's stream, and `poll` asks a CUDA event.
The benchmarks' page paths over CUDA IPC are `IpcPageEngine` (bench/page_engine.py). Peers of
the same process keep LocalDeviceEngine's path (a process cannot open its own handles).

Note [IPC mappings]: a handle names a whole allocation (cudaMalloc block), and a process may
open one allocation only once, so mappings are shared process-wide and counted: two engines of
one process (two prefill TP ranks) connecting to the same decode rank share one mapping. A
mapping is closed when its last user lets go: the peer's next agent_info no longer lists it
(the peer deregistered the region), the peer process is found dead at a submit, or the engine
closes. Before closing, the engine waits for its own queued copies, which may still write there.

The driver API is reached through ctypes (libcuda.so.1 is there wherever a GPU is); tests pass a
driver of their own (`driver=`) that maps memfd-backed host memory twice, which exercises the
same export / open / translate / close logic on the CPU.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import queue
import threading

import numpy as np

from .. import descriptor_copy, knobs
from ..cuda_streams import sleep_until
from .base import (
    ROWS_KEPT,
    Batch,
    BatchState,
    DescriptorError,
    DescriptorGrid,
    RegionTable,
    TransferError,
    TransportInfo,
    as_descriptors,
    check_grids,
)
from .cuda_watch import LandedWatch
from .local import ProcessWatch, _boot_id, _start_time_ticks
from .local_device import LocalDeviceEngine, _CudaArray, _device_modules, _locate

_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
_RANGE_START, _RANGE_SIZE = 11, 12  # CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, _RANGE_SIZE
_LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
# Done events whose handles went to a peer, kept alive after their batches ended: a peer opens
# a handle when its message arrives, milliseconds later (Note [Success by event])
_EXPORTED_EVENTS = 4096


class _IpcHandle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array reads back as bytes cut at the first NUL
    _fields_ = [("reserved", ctypes.c_ubyte * _HANDLE_BYTES)]


class CudaDriver:
    """The four driver calls CUDA IPC needs, each checked (TransferError names the call)."""

    def __init__(self) -> None:
        try:
            self._cu = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise TransferError(f"cuda_ipc: cannot load the CUDA driver (libcuda.so.1): {exc}") \
                from None
        self._check(self._cu.cuInit(0), "cuInit")
        self._open = getattr(self._cu, "cuIpcOpenMemHandle_v2", None) or \
            self._cu.cuIpcOpenMemHandle
        self._open.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._cu.cuGetErrorName(rc, ctypes.byref(name))
            raise TransferError(f"cuda_ipc: {call} failed: "
                                f"{(name.value or b'?').decode()} ({rc})")

    def ensure_context(self, device_index: int) -> None:
        """Makes the device's primary context current on this thread (torch's, normally)."""
        ctx = ctypes.c_void_p()
        self._check(self._cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            self._check(self._cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device_index),
                        "cuDevicePrimaryCtxRetain")
            self._check(self._cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def allocation(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding device address ptr."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(self._cu.cuPointerGetAttribute(ctypes.byref(base), _RANGE_START,
                                                   ctypes.c_uint64(ptr)), "cuPointerGetAttribute")
        self._check(self._cu.cuPointerGetAttribute(ctypes.byref(size), _RANGE_SIZE,
                                                   ctypes.c_uint64(ptr)), "cuPointerGetAttribute")
        return int(base.value), int(size.value)

    def export(self, base: int) -> bytes:
        handle = _IpcHandle()
        self._check(self._cu.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(base)),
                    "cuIpcGetMemHandle (memory from cudaMalloc is needed; torch's "
                    "expandable_segments allocations cannot be exported)")
        return bytes(bytearray(handle.reserved))

    def open(self, handle: bytes) -> int:
        h = _IpcHandle()
        ctypes.memmove(ctypes.addressof(h), handle, _HANDLE_BYTES)
        ptr = ctypes.c_uint64()
        self._check(self._open(ctypes.byref(ptr), h, _LAZY_PEER_ACCESS), "cuIpcOpenMemHandle")
        return int(ptr.value)

    def close(self, ptr: int) -> None:
        self._check(self._cu.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")


class _Mappings:
    """Opened handles of this process, counted (Note [IPC mappings])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[bytes, list] = {}  # handle -> [mapped base, users]
        self.opens = 0  # handles opened over the process's life (tests and stats read it)
        self.closes = 0

    def acquire(self, driver, handle: bytes) -> int:
        with self._lock:
            got = self._open.get(handle)
            if got is None:
                got = self._open[handle] = [driver.open(handle), 0]
                self.opens += 1
            got[1] += 1
            return got[0]

    def release(self, driver, handle: bytes) -> None:
        with self._lock:
            got = self._open.get(handle)
            if got is None:
                return
            got[1] -= 1
            if got[1] == 0:
                del self._open[handle]
                self.closes += 1
                driver.close(got[0])

    def live(self) -> int:
        with self._lock:
            return len(self._open)


MAPPINGS = _Mappings()


class _IpcPeer:
    """A device engine of another process whose regions this engine opened."""

    def __init__(self, pid: int, start_ticks: int, device, ranges: RegionTable,
                 regions: list[tuple[int, int, int]], handles: list[bytes], views: dict):
        self.pid = pid
        self.start_ticks = start_ticks
        self.watch = ProcessWatch(pid, start_ticks)  # Note [Process watch] in local.py
        self.device = device
        self.ranges = ranges
        items = sorted(regions)  # (remote start, nbytes, mapped start)
        self.starts = np.array([r[0] for r in items], np.uint64)
        self.mapped = np.array([r[2] for r in items], np.uint64)
        self.handles = handles  # one entry per acquire
        self.views = views  # remote start -> uint8 tensor over the mapping
        self._rows: dict[bytes, np.ndarray] = {}  # `mapped_rows`

    def engine(self):  # a _DevicePeer's weak reference: no engine object in this process
        return None

    def mapped_rows(self, rows: np.ndarray) -> np.ndarray:
        """`translate(rows)`, kept per rows: a peer's regions never change (a new
        registration is a new peer), and a row span inside a row's range maps by the same
        offset as the row (Note [Row room] in base.py)."""
        key = rows.tobytes()
        got = self._rows.get(key)
        if got is None:
            if len(self._rows) >= ROWS_KEPT:
                self._rows.clear()
            got = self._rows[key] = self.translate(rows)
        return got

    def translate(self, addr: np.ndarray) -> np.ndarray:
        """Peer addresses (known to lie inside its ranges) -> addresses in this process."""
        if self.starts.size == 1:  # one region: one pass instead of a search per address
            return (addr - self.starts[0]) + self.mapped[0]
        i = np.searchsorted(self.starts, addr, side="right") - 1
        return addr - self.starts[i] + self.mapped[i]


class CudaIpcEngine(LocalDeviceEngine):
    """The local device engine, also across processes through CUDA IPC (module docstring)."""

    name = "cuda_ipc"
    takes_grids = True  # Note [Descriptor grids]
    callbacks_may_work = True  # its completion thread only waits on events
    # The same copies as the local device engine, only across processes: plans are lowered
    # under local's rules (no backend limits), Note [Plan backend].
    plan_backend = "local"

    def __init__(self, device: object = "cuda", *, driver=None,
                 copy_engine_bytes: int = descriptor_copy.COPY_ENGINE_BYTES, **kwargs) -> None:
        super().__init__(device, **kwargs)
        if driver is None and self._cuda:
            driver = CudaDriver()
        self._driver = driver  # None: CPU without a test driver, same-process peers only
        self._copy_engine_bytes = int(copy_engine_bytes)
        self._exports: dict[int, tuple[int, str]] = {}  # region start -> (alloc base, handle)
        self._ipc_lock = threading.Lock()
        self._boot = _boot_id()
        self._start_ticks = _start_time_ticks(os.getpid())
        self._callbacks: list = []  # Note [Completion wake-up]
        self._ended: queue.SimpleQueue | None = None  # done events for the completion thread
        self._waiter: threading.Thread | None = None
        self._ready = None  # the ready event `_queue` records again per write
        # Note [Success by event]: done events made interprocess, and those whose handles went
        # out kept alive (bounded) past their batches, for the peer that opened them
        self._export_events = bool(knobs.get("success_by_event")) and self._cuda
        self._exported: collections.deque = collections.deque(maxlen=_EXPORTED_EVENTS)
        self._landed: LandedWatch | None = None  # Note [Landed wake-up] in cuda_watch.py

    # -- completion: a thread of the engine's own waits on each batch's event -------------------

    def on_completion(self, callback) -> bool:
        """Note [Completion wake-up] on a GPU: one thread of the engine waits on each batch's
        CUDA event and calls the callbacks when it has completed, so the endpoints' worker
        sleeps until then instead of polling every poll_sleep_s. It waits asleep (Note
        [Sleeping waits] in runtime/cuda_streams.py: a synchronise on the batch's own event,
        interprocess for Note [Success by event], would spin a core for the whole transfer).
        Without CUDA (the memfd test driver) batches end inside submit_write, and nobody
        needs waking."""
        if not self._cuda:
            return False
        with self._ipc_lock:
            self._callbacks.append(callback)
            if self._waiter is None:
                self._ended = queue.SimpleQueue()
                self._waiter = threading.Thread(target=self._wait_events, args=(self._ended,),
                                                name="pdc-cuda-ipc-completion", daemon=True)
                self._waiter.start()
        return True

    def _wait_events(self, ended: queue.SimpleQueue) -> None:
        while True:
            events = ended.get()
            if events is None:
                return
            for ev in events:
                try:
                    sleep_until(ev, self.device)
                except RuntimeError:
                    pass  # poll() reports the CUDA error on the batch
            for cb in list(self._callbacks):
                cb()

    def _watch(self, batch: Batch) -> Batch:
        if self._ended is not None and batch.state is BatchState.PENDING and batch.handles:
            self._ended.put(list(batch.handles))
        return batch

    # -- memory: each region's allocation is exported once, at registration ------------------

    def _add_region(self, addr: int, nbytes: int, view) -> None:
        export = None
        if self._driver is not None:
            if self._cuda:
                self._driver.ensure_context(self.device.index)
            base, size = self._driver.allocation(addr)
            if addr + nbytes > base + size:
                raise DescriptorError(f"cuda_ipc: [{addr:#x}, +{nbytes}) spans more than one "
                                      "allocation; register each allocation on its own")
            export = (base, self._driver.export(base).hex())
        super()._add_region(addr, nbytes, view)
        if export is not None:
            self._exports[addr] = export

    def deregister(self, addr: int) -> None:
        super().deregister(addr)
        self._exports.pop(int(addr), None)

    # -- peers --------------------------------------------------------------------------------

    def agent_info(self) -> bytes:
        info = json.loads(super().agent_info())
        info.update(boot_id=self._boot, start_ticks=self._start_ticks,
                    ipc={str(a): list(e) for a, e in self._exports.items()})
        return json.dumps(info).encode()

    def connect(self, agent_info: bytes) -> str:
        try:
            info = json.loads(bytes(agent_info))
            pid = int(info["pid"])
        except (ValueError, TypeError, KeyError) as exc:
            raise DescriptorError(f"cuda_ipc: agent_info is not a device-mode blob: {exc}") \
                from None
        if pid == os.getpid():
            return super().connect(agent_info)
        try:
            if info.get("engine") != self.name or info.get("mode") != "device":
                raise ValueError(f"made by engine {info.get('engine')!r}")
            token, start_ticks = str(info["token"]), int(info["start_ticks"])
            device = _device_modules().device(info["device"])
            ranges = [(int(a), int(n)) for a, n in info["ranges"]]
            exports = {int(a): (int(b), bytes.fromhex(h)) for a, (b, h) in info["ipc"].items()}
            if info["boot_id"] != self._boot:
                raise ValueError("it runs on another host (boot ids differ)")
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise DescriptorError(f"cuda_ipc: agent_info is not a CUDA IPC blob: {exc}") \
                from None
        if self._driver is None:
            raise TransferError("cuda_ipc: this engine has no CUDA driver; peers of other "
                                "processes need CUDA devices")
        if device.type != self.device.type:
            raise DescriptorError(f"cuda_ipc: cannot connect a {self.device.type} engine to a "
                                  f"{device.type} engine")
        missing = [a for a, _ in ranges if a not in exports or len(exports[a][1]) !=
                   _HANDLE_BYTES or exports[a][0] > a]
        if missing:
            raise DescriptorError(f"cuda_ipc: peer range {missing[0]:#x} carries no valid IPC "
                                  "handle")
        if _start_time_ticks(pid) != start_ticks:
            raise TransferError(f"cuda_ipc: peer pid {pid} has exited")
        if self._cuda:
            self._driver.ensure_context(self.device.index)
            if device != self.device and device.index < _device_modules().cuda.device_count():
                self._enable_peer_access(self.device, device)
        peer = f"ipc:{pid}:{token}"
        handles, regions, views = [], [], {}
        try:
            for addr, nbytes in ranges:
                base, handle = exports[addr]
                mapped = MAPPINGS.acquire(self._driver, handle) + (addr - base)
                handles.append(handle)
                regions.append((addr, nbytes, mapped))
                views[addr] = self._view(mapped, nbytes)
        except TransferError:
            for h in handles:
                MAPPINGS.release(self._driver, h)
            raise
        new = _IpcPeer(pid, start_ticks, device, RegionTable(ranges), regions, handles, views)
        with self._lock:
            self._check_open()
            old = self._peers.get(peer)
            self._peers[peer] = new
        if isinstance(old, _IpcPeer):
            self._release(old)  # after acquiring the new set: unchanged handles stay open
        return peer

    def _view(self, addr: int, nbytes: int):
        torch = _device_modules()
        if self._cuda:
            with torch.cuda.device(self.device):
                return torch.as_tensor(_CudaArray(addr, nbytes), device=self.device)
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)

    def _release(self, peer: _IpcPeer) -> None:
        if self._cuda:
            for s in list(self._streams.values()):
                s.synchronize()  # queued copies may still write into the mappings
        handles, peer.handles, peer.views = peer.handles, [], {}
        for h in handles:
            MAPPINGS.release(self._driver, h)

    def _alive(self, peer: str, target: _IpcPeer) -> bool:
        if target.watch.alive():
            return True
        with self._lock:
            if self._peers.get(peer) is target:
                del self._peers[peer]
        self._release(target)
        return False

    # -- transfers ----------------------------------------------------------------------------

    def submit_write(self, peer: str, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, *,
                     after=None) -> Batch:
        target = self._peers.get(peer)
        if not isinstance(target, _IpcPeer):
            return self._watch(super().submit_write(peer, src, dst, nbytes, after=after))
        src_u, dst_u, nbytes_u = as_descriptors(src, dst, nbytes)
        batch = Batch(peer=peer, handles=[], nbytes=int(nbytes_u.sum()),
                      descriptors=int(src_u.size))
        if not self._alive(peer, target):
            batch.state, batch.reason = BatchState.FAILED, "peer process has exited"
            return batch
        with self._lock:
            self._check_open()
            self._check_ranges(peer, target, src_u, dst_u, nbytes_u)
            mdst = target.translate(dst_u)
            small, big = descriptor_copy.split(nbytes_u, self._copy_engine_bytes)
            jobs = []
            if big.size:
                s_views, s_idx, s_off = _locate(self._views, self._regions, src_u[big])
                d_views = [target.views[int(a)] for a in target.starts]
                d_idx = np.searchsorted(target.starts, dst_u[big], side="right") - 1
                d_off = dst_u[big] - target.starts[d_idx]
                jobs = list(zip(s_idx.tolist(), s_off.tolist(), d_idx.tolist(), d_off.tolist(),
                                nbytes_u[big].tolist(), strict=True))
            if not self._cuda:
                descriptor_copy.launch(src_u[small], mdst[small], nbytes_u[small], self.device)
                for si, so, di, do, n in jobs:
                    d_views[di][do:do + n].copy_(s_views[si][so:so + n])
                batch.state = BatchState.DONE
                return batch
            if not big.size:  # the usual case: no copy of the arrays for an all-small split
                s_small, d_small, n_small = src_u, mdst, nbytes_u
            else:
                s_small, d_small, n_small = src_u[small], mdst[small], nbytes_u[small]

            def queue_copies() -> None:
                descriptor_copy.launch(s_small, d_small, n_small, self.device)
                for si, so, di, do, n in jobs:
                    d_views[di][do:do + n].copy_(s_views[si][so:so + n], non_blocking=True)

            return self._queue(batch, after, queue_copies)

    def submit_grids(self, peer: str, grids: list[DescriptorGrid]) -> Batch:
        """Note [Descriptor grids]: each row's span is checked against both sides'
        registrations and its destination translated once, and one kernel computes every
        descriptor's addresses on the device."""
        target = self._peers.get(peer)
        if not isinstance(target, _IpcPeer):
            return super().submit_grids(peer, grids)
        grids = check_grids(grids)
        batch = Batch(peer=peer, handles=[], nbytes=sum(g.total_bytes for g in grids),
                      descriptors=sum(g.count for g in grids))
        if not self._alive(peer, target):
            batch.state, batch.reason = BatchState.FAILED, "peer process has exited"
            return batch
        with self._lock:
            self._check_open()
            mapped = [self._mapped_grid(peer, target, k, g) for k, g in enumerate(grids)]
            if not self._cuda:
                descriptor_copy.launch_grids(mapped, self.device)
                batch.state = BatchState.DONE
                return batch
            return self._queue(batch, None,
                               lambda: descriptor_copy.launch_grids(mapped, self.device))

    def _mapped_grid(self, peer: str, target: _IpcPeer, k: int,
                     g: DescriptorGrid) -> DescriptorGrid:
        """`g` with its destination rows in this process's mapping, once every row's span
        lies inside one registration on each side."""
        s_lo, s_span, d_lo, d_span = g.spans()
        if s_lo + s_span <= self._regions.room(g.src_rows) and \
                d_lo + d_span <= target.ranges.room(g.dst_rows):  # Note [Row room]
            return DescriptorGrid(g.src_rows, target.mapped_rows(g.dst_rows), g.src_runs,
                                  g.dst_runs, g.run_bytes)
        rows = len(g.src_rows)
        for side, table, at, lo, span in (("source", self._regions, g.src_rows, s_lo, s_span),
                                          ("destination", target.ranges, g.dst_rows, d_lo,
                                           d_span)):
            starts = at + np.uint64(lo)
            outside = table.outside(starts, np.full(rows, span, np.uint64))
            if outside.size:
                i = int(outside[0])
                owner = "this engine" if side == "source" else peer
                raise DescriptorError(
                    f"cuda_ipc: grid {k}, {side} row {i} [{int(starts[i]):#x}, +{span}) is not "
                    f"inside memory {owner} registered ({outside.size} such); nothing was "
                    "written")
        low = g.dst_rows + np.uint64(d_lo)
        return DescriptorGrid(g.src_rows, target.translate(low) - np.uint64(d_lo), g.src_runs,
                              g.dst_runs, g.run_bytes)

    def _queue(self, batch: Batch, after, queue_copies) -> Batch:
        """Runs `queue_copies()` on the engine's write stream after `after` (None: the
        caller's current stream) and gives the batch its completion event. Caller holds
        `_lock`, which also guards the reused ready event."""
        torch = _device_modules()
        if torch.cuda.current_device() != self.device.index:
            with torch.cuda.device(self.device):
                return self._queue(batch, after, queue_copies)
        # One ready event, recorded again per write: a wait takes the event's last record at
        # the time it is queued, so a later record cannot move an earlier write's wait. No
        # context objects for the device and the stream (10-15 µs of host time a submit on
        # the H200 box, bench/submit_host.py).
        ready = after
        if ready is None:
            ready = self._ready
            if ready is None:
                ready = self._ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        stream = self._stream(self.device, "write")
        caller = torch.cuda.current_stream()
        torch.cuda.set_stream(stream)
        try:
            stream.wait_event(ready)
            queue_copies()
            # blocking: the completion thread sleeps on it rather than spinning a core
            done = torch.cuda.Event(blocking=self._ended is not None,
                                    interprocess=self._export_events)
            done.record(stream)
        finally:
            torch.cuda.set_stream(caller)
        batch.handles = [done]
        return self._watch(batch)

    def written_event(self, batch: Batch) -> bytes:
        """Note [Success by event]: the IPC handle of the batch's done event. The engine's
        writes run in order on its one write stream, so that event completes after every
        write submitted before it too."""
        if not self._export_events or batch.state is not BatchState.PENDING or \
                not batch.handles:
            return b""
        ev = batch.handles[-1]
        try:
            handle = ev.ipc_handle()
        except RuntimeError:
            return b""
        self._exported.append(ev)
        return bytes(handle)

    def open_written_event(self, handle: bytes):
        if not self._cuda:
            return None
        torch = _device_modules()
        return torch.cuda.Event.from_ipc_handle(self.device, bytes(handle))

    def watch_written(self, event, source: str, callback) -> bool:
        if not self._cuda or self._driver is None or not knobs.get("landed_wakeup"):
            return False
        if self._landed is None:
            with self._ipc_lock:
                if self._landed is None:
                    self._landed = LandedWatch(self._driver._cu, self._driver.ensure_context,
                                               self.device.index)
        return self._landed.watch(event, source, callback)

    def _check_ranges(self, peer, target, src_u, dst_u, nbytes_u) -> None:
        outside = self._regions.outside(src_u, nbytes_u)
        if outside.size:
            i = int(outside[0])
            raise DescriptorError(
                f"cuda_ipc: source descriptor {i} [{int(src_u[i]):#x}, +{int(nbytes_u[i])}) is "
                f"not inside memory registered in this engine ({outside.size} such)")
        outside = target.ranges.outside(dst_u, nbytes_u)
        if outside.size:
            i = int(outside[0])
            raise DescriptorError(
                f"cuda_ipc: destination descriptor {i} [{int(dst_u[i]):#x}, "
                f"+{int(nbytes_u[i])}) is not inside memory {peer} registered "
                f"({outside.size} such); nothing was written")

    def transport(self) -> TransportInfo:
        """Note [Reported transport]: CUDA IPC mappings written by this process's own launches."""
        with self._lock:
            n = sum(isinstance(p, _IpcPeer) for p in self._peers.values())
        how = ("CUDA IPC (descriptor-copy kernel, cudaMemcpyAsync for large descriptors)"
               if self._driver is not None else "torch copies, one process")
        return TransportInfo(self.name, how, str(self.device),
                             f"{n} peer(s) of other processes, {MAPPINGS.live()} open mapping(s)")

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        with self._ipc_lock:
            waiter, ended, self._waiter, self._ended = self._waiter, self._ended, None, None
        if ended is not None and waiter is not None:
            ended.put(None)
            waiter.join(timeout=5)
        if self._landed is not None:
            self._landed.close()
        with self._lock:
            ipc = [p for p in self._peers.values() if isinstance(p, _IpcPeer)]
            closed = self._closed
        if not closed:
            for p in ipc:
                self._release(p)
        super().close()
        self._exports.clear()
