"""The local engine for device memory: moves GPU memory between engines of ONE process.

Each engine owns one device (a rank's GPU); one process drives both GPUs, as the benchmarks
and the in-process staged tests do. `submit_write` queues one copy-engine copy per descriptor
(cudaMemcpyAsync, peer when the devices differ) on the engine's own CUDA streams. CPU tensors
take the same code with torch copies, which is how it is tested without a GPU. CUDA IPC across
processes is its subclass `CudaIpcEngine` (runtime/engines/cuda_ipc.py); the page paths the GPU
benchmarks compare (direct peer kernel, pipelined staged copy) are `PageEngine` beside them
(bench/page_engine.py). docs/engines.md has the details.

torch is imported on first use, so importing this module needs none.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

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

if TYPE_CHECKING:
    # Every use of `torch` below is in a method of an engine, whose __init__ loaded it.
    import torch
else:
    torch = None  # the torch module, set by _device_modules()

# Device engines of this process by token; connect() finds its peer here.
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _device_modules():
    global torch
    if torch is None:
        try:
            import torch as torch_module
        except ImportError as exc:
            raise TransferError(
                f"local: device mode needs torch (pip install 'pdc[kernels]'): {exc}"
            ) from None
        torch = torch_module
    return torch


class _Peer(Protocol):
    """What a device engine reads of a peer it writes to: a `_DevicePeer` (an engine of this
    process) or, in CudaIpcEngine (runtime/engines/cuda_ipc.py, which builds on this module),
    an engine of another process whose regions it opened."""

    device: Any
    ranges: RegionTable

    def engine(self) -> LocalDeviceEngine | None: ...


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


class LocalDeviceEngine(TransferEngine):
    """The local engine on device memory: moves memory of one device (a rank's GPU) into memory
    of another device engine of the same process. `make_engine("local", device="cuda:1")` or
    `LocalDeviceEngine("cuda:1")`.

    Memory is registered as usual (`register(addr, nbytes)`, on this engine's device) or with
    `register_tensor(t)`. Peers are engines of this process (agent_info carries a token; an
    engine of another process is refused: that is CudaIpcEngine's job). All work is queued on
    the engine's own streams after the producer's work: by default the work queued so far on
    the current stream of the source device, or the CUDA event given as `after`. `poll` asks a
    CUDA event, so submit never blocks. Submits are serialised by one lock; every method is
    thread-safe.
    """

    name = "local"

    def __init__(self, device: object = "cuda") -> None:
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
        self.device = dev
        self._cuda = dev.type == "cuda"
        self._regions = RegionTable()
        self._views: dict[int, object] = {}  # region start -> uint8 tensor over the region
        # Engines of this process; a CudaIpcEngine's also holds those of other processes.
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._token = uuid.uuid4().hex
        self._streams: dict = {}
        self._peer_access: dict = {}  # (device index, other index) -> may the first reach it
        _LIVE[self._token] = self

    def transport(self) -> TransportInfo:
        how = "cudaMemcpyAsync peer copies" if self._cuda else "torch copies"
        return TransportInfo(self.name, how, str(self.device), "one process")

    # -- memory -------------------------------------------------------------------------------

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

    def _peer(self, peer: str) -> _Peer:
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
        return self._cuda and device is not None and torch.device(device) == self.device

    # -- streams and events -------------------------------------------------------------------

    def _stream(self, device, role: str):
        key = (device, role)
        s = self._streams.get(key)
        if s is None:
            from ..cuda_streams import own_stream  # torch is loaded (this engine's __init__)

            s = self._streams[key] = own_stream(torch.device(device))  # Note [Own streams]
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
                    s.synchronize()  # nothing queued may outlive the memory it uses
            self._closed = True
            self._peers.clear()
            self._regions = RegionTable()
            self._views.clear()
            self._streams.clear()
            _LIVE.pop(self._token, None)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("local: engine is closed")


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
