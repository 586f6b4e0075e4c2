"""Mooncake Transfer Engine in P2PHANDSHAKE mode: no metadata server, peers named "ip:rpc_port".

Traps handled here (measured on the 0.3.13.post1 non-cuda wheel, see docs/engines.md):
- `get_batch_transfer_status` frees the batch ids it is given once they finish; asking twice
  about one id reads freed memory and segfaults. Each sub-batch id is queried exactly once and
  the terminal state is cached on the `Batch`.
- `get_batch_transfer_status` busy-spins in C++ until the batch ends. A per-peer worker thread
  makes that call, so `submit_write` and `poll` never block; when nothing is in flight the
  worker sleeps on a queue instead of spinning.
- The TCP transport rejects a batch when more than `MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`
  (default 1024) transfers to one peer are queued. Requests are split into sub-batches of at
  most that many entries and each peer's worker keeps one sub-batch in flight at a time.
- `MC_LOG_DIR` pointing at a directory aborts the whole process at import; it is refused with
  a TransferError before importing. `MC_LOG_LEVEL` defaults to ERROR (INFO logs a line per
  batch).
- A submit that fails returns batch id 0, or 2**64-1 when the peer's segment cannot be opened.

GPU memory (`device="cuda:N"`, the CUDA wheel, e.g. mooncake-transfer-engine-cuda13): each
region gets its own location (Note [Two memory kinds] in runtime/pools.py): "cuda:N" for memory
of that GPU, "*" (Mooncake finds the NUMA node) for host memory, which such an engine registers
too; memory of another GPU is refused. `protocol="auto"` then picks the first transport the
wheel installs of "nvlink_intra" (CUDA IPC handles in the segment metadata, one cudaMemcpy per
descriptor; MC_USE_NVLINK_IPC=1 is set so that it does not try fabric handles, which need an
IMEX channel) and "tcp" (the CUDA build stages device memory through host buffers).
`transport()` says which one initialize() accepted (Note [Reported transport]); `report()`
adds the wheel's SUPPORT_* flags.
nvlink_intra maps a peer's whole registration from its handle, so each device region must
start at its allocation (cudaMalloc block); `register` refuses an interior address, and host
memory, which nvlink_intra does not move (use protocol "tcp" for a rank with both kinds).
"""

from __future__ import annotations

import json
import os
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import knobs
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
    locate_address,
    region_device,
)

if TYPE_CHECKING:  # imported when a device region is first checked (it needs ctypes CUDA)
    from .cuda_ipc import CudaDriver

# Mooncake's own default for MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER.
DEFAULT_MAX_ENTRIES_PER_SUBMIT = 1024
# How long close() waits for a worker stuck in a transfer before leaking the engine instead.
CLOSE_JOIN_TIMEOUT_S = 5.0
_BAD_BATCH_IDS = (0, (1 << 64) - 1)  # 0: submit failed; -1 as uint64: openSegment failed
_SESSION_RE = re.compile(r"^[0-9A-Za-z.\-\[\]:]+:\d{1,5}$")


def _prepare_environment() -> None:
    """Sets logging defaults and refuses settings that crash Mooncake at import."""
    log_dir = os.environ.get("MC_LOG_DIR")
    if log_dir and os.path.isdir(log_dir) and "mooncake.engine" not in sys.modules:
        # glog is initialised twice and calls abort() inside `import mooncake.engine`.
        raise TransferError(
            "mooncake: MC_LOG_DIR is set to a directory, which aborts the process at import "
            "(glog initialised twice); unset it and redirect stderr instead"
        )
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def _cuda_index(device: object) -> int:
    text = str(device)
    try:
        value = int(text.split(":", 1)[1] if text.startswith("cuda:") else text)
    except ValueError:
        value = -1
    if value < 0:
        raise DescriptorError(f"mooncake: device must be 'cuda:N' or an index, not {device!r}")
    return value


def _max_entries_from_env() -> int:
    raw = os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER")
    if not raw:
        return DEFAULT_MAX_ENTRIES_PER_SUBMIT
    try:
        value = int(raw)
    except ValueError:
        return DEFAULT_MAX_ENTRIES_PER_SUBMIT
    # Mooncake clamps the setting to [1, 65535] itself.
    return min(max(value, 1), 65535)


@dataclass
class _Job:
    """One Batch as the peer worker sees it; it is the Batch's only handle."""

    batch: Batch
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    finished: threading.Event = field(default_factory=threading.Event)
    # Mooncake sub-batch ids in posting order; each is already freed once its query returned.
    batch_ids: list[int] = field(default_factory=list)


class _PeerWorker:
    """Owns every status query for one peer, so each batch id is asked about exactly once."""

    def __init__(self, engine: Any, peer: str, max_entries: int, notify) -> None:
        self._engine = engine
        self._notify = notify  # Note [Completion wake-up]
        self._peer = peer
        self._max_entries = max_entries
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name=f"pdc-mooncake-{peer}", daemon=True)
        self.thread.start()

    def put(self, job: _Job) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._stopping = True
        self._jobs.put(None)

    def _run(self) -> None:
        _lower_priority(knobs.get("mooncake_status_nice"))
        while True:
            job = self._jobs.get()  # blocks without spinning while idle
            if job is None:
                return
            if self._stopping:
                self._finish(job, BatchState.FAILED, "engine closed before the batch started")
                continue
            try:
                state, reason = self._transfer(job)
            except Exception as exc:  # noqa: BLE001 - a worker must never die silently
                state, reason = BatchState.FAILED, f"{type(exc).__name__}: {exc}"
            self._finish(job, state, reason)

    def _transfer(self, job: _Job) -> tuple[BatchState, str]:
        count = job.src.size
        for start in range(0, count, self._max_entries):
            stop = min(start + self._max_entries, count)
            if self._stopping:
                return BatchState.FAILED, f"engine closed after {start}/{count} descriptors"
            batch_id = self._engine.batch_transfer_async_write(
                self._peer,
                job.src[start:stop].tolist(),
                job.dst[start:stop].tolist(),
                job.nbytes[start:stop].tolist(),
            )
            if batch_id in _BAD_BATCH_IDS:
                return BatchState.FAILED, (
                    f"submit of descriptors [{start}, {stop}) was rejected (peer unreachable, "
                    "destination outside its registered memory, or queue full)"
                )
            job.batch_ids.append(batch_id)
            # Exactly one status query per id: Mooncake frees the id when it answers.
            rc = self._engine.get_batch_transfer_status([batch_id])
            if rc != 0:
                return BatchState.FAILED, (
                    f"descriptors [{start}, {stop}) failed (rc {rc}: peer died, rejected the "
                    "write, or MC_TRANSFER_TIMEOUT expired)"
                )
        return BatchState.DONE, ""

    def _finish(self, job: _Job, state: BatchState, reason: str) -> None:
        # reason first: a poller that sees FAILED must also see why.
        job.batch.reason = reason
        job.batch.state = state
        job.finished.set()
        self._notify()


def _lower_priority(nice: int) -> None:
    """Note [Status spin priority]: Mooncake's status call spins a core until the batch ends
    (GIL released), on the cores of the engine that writes: on an SGLang prefill server
    bound to one core it takes half that core from the next forward for as long as the
    writes last. With the knob mooncake_status_nice > 0 the peer worker that makes the call
    runs at that nice value (Linux sets it per thread; Mooncake's transport threads, started
    when the engine opened, keep theirs): the spin then yields to the engine's threads and
    the transport's, and sees the batch's end late only while those keep the core busy."""
    if nice > 0 and sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(nice))
        except OSError:
            pass  # not allowed here: the spin keeps the thread's priority


class MooncakeEngine(TransferEngine):
    """Mooncake over TCP (or "rdma" where the NICs exist), peers found by "ip:rpc_port".

    One engine per process is the intended use: it opens two listening ports (RPC and data,
    random in 15000-17000 unless MC_MIN_RPC_PORT/MC_MAX_RPC_PORT say otherwise; both bind all
    interfaces whatever `hostname` is). Methods may be called from several threads.
    """

    name = "mooncake"

    def __init__(
        self,
        hostname: str | None = None,
        protocol: str = "tcp",
        device_filter: str = "",
        max_entries_per_submit: int | None = None,
        transfer_timeout_s: int | None = None,
        device: object = None,
    ) -> None:
        """
        hostname: the address peers use to reach this process; use an IP, not a host name.
          Default: the process's advertise host (knobs bind_host/advertise_host, Note [Bind
          and advertise] in control.py), so control and data paths name one interface.
        protocol: "tcp" everywhere, "rdma" where RDMA NICs exist (device_filter picks them,
          comma-separated, e.g. "mlx5_0,mlx5_1").
        max_entries_per_submit: the split size; defaults to MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER
          or Mooncake's 1024. Larger values fail on TCP unless that variable is raised too.
        transfer_timeout_s: Mooncake's own per-batch timeout (MC_TRANSFER_TIMEOUT, default
          30 s, at least 5 s); it is what ends a batch to a peer that hangs without dying.
        device: None for host memory; "cuda:N" for memory of that GPU (needs the CUDA wheel);
          protocol "auto" then picks nvlink_intra or tcp (module docstring).
        """
        _prepare_environment()
        self._device = None if device is None else _cuda_index(device)
        if hostname is None:
            from ..control import HostSettings

            hostname = HostSettings.from_knobs().advertise
        if ":" in hostname:
            # Mooncake 0.3.13 takes the address, then fails every transfer to an IPv6 peer as
            # a bare "peer unreachable": say so before anything starts.
            raise TransferError(
                f"mooncake: hostname {hostname!r} is IPv6, and Mooncake (0.3.13) moves bytes "
                "over IPv4 only; hint: give this process an IPv4 address (PDC_BIND_HOST / "
                "PDC_ADVERTISE_HOST), or use the nixl engine for IPv6")
        if max_entries_per_submit is None:
            max_entries_per_submit = _max_entries_from_env()
        if max_entries_per_submit < 1:
            raise DescriptorError("max_entries_per_submit must be at least 1")
        self._max_entries = int(max_entries_per_submit)
        import mooncake.engine as _mc
        from mooncake.engine import TransferEngine as _MooncakeTE

        self._flags = {k: bool(getattr(_mc, k)) for k in dir(_mc) if k.startswith("SUPPORT_")}
        protocols = [protocol]
        if protocol == "auto":
            if self._device is None:
                raise DescriptorError("mooncake: protocol 'auto' is for device memory; pass "
                                      "device='cuda:N' or a protocol")
            if not self._flags.get("SUPPORT_CUDA"):
                raise TransferError("mooncake: device memory needs the CUDA wheel (this "
                                    "mooncake.engine has SUPPORT_CUDA false)")
            protocols = (["nvlink_intra"] if self._flags.get("SUPPORT_INTRA_NVLINK") else []) \
                + ["tcp"]
        if "nvlink_intra" in protocols:
            os.environ.setdefault("MC_USE_NVLINK_IPC", "1")

        saved_timeout = os.environ.get("MC_TRANSFER_TIMEOUT")
        if transfer_timeout_s is not None:
            # Read once, in the engine's constructor; restore so other engines are unaffected.
            os.environ["MC_TRANSFER_TIMEOUT"] = str(int(transfer_timeout_s))
        tried = []
        engine = None
        try:
            for proto in protocols:
                candidate = _MooncakeTE()
                rc = candidate.initialize(hostname, "P2PHANDSHAKE", proto, device_filter)
                if rc == 0:
                    engine, chosen = candidate, proto
                    break
                tried.append(f"{proto!r} returned {rc}")
        finally:
            if transfer_timeout_s is not None:
                if saved_timeout is None:
                    os.environ.pop("MC_TRANSFER_TIMEOUT", None)
                else:
                    os.environ["MC_TRANSFER_TIMEOUT"] = saved_timeout
        if engine is None:
            raise TransferError(
                f"mooncake: initialize({hostname!r}, P2PHANDSHAKE, ..., {device_filter!r}): "
                + "; ".join(tried)
            )
        self._engine = engine
        self._locate = locate_address  # where a region lives (unit tests stand in for CUDA)
        self._locations: dict[int, str] = {}  # region start -> the location it was given
        self._cuda_driver: CudaDriver | None = None
        self._session = f"{hostname}:{engine.get_rpc_port()}"
        self._protocol, self._hostname = chosen, hostname
        self._regions = RegionTable()
        self._workers: dict[str, _PeerWorker] = {}
        self._callbacks: list = []  # Note [Completion wake-up]
        self._lock = threading.Lock()
        self._closed = False
        self._transport: TransportInfo | None = None  # transport(): asked once

    # -- memory -------------------------------------------------------------------------------

    def register(self, addr: int, nbytes: int) -> None:
        addr, nbytes = check_region(addr, nbytes)
        with self._lock:
            self._check_open()
            gpu = region_device(self.name, self._device, addr, nbytes, self._locate)
            if self._device is not None and self._protocol == "nvlink_intra":
                if gpu is None:
                    raise DescriptorError(
                        f"mooncake: register({addr:#x}, {nbytes}): host memory, which "
                        f"nvlink_intra does not move; hint: make the engine with protocol "
                        f"'tcp' for a rank with host and GPU memory (Note [Two memory kinds])")
                self._check_allocation_start(addr)
            self._regions.add(addr, nbytes)
            location = "*" if gpu is None else f"cuda:{gpu}"
            rc = self._engine.register_memory(addr, nbytes, location)
            if rc != 0:
                self._regions.remove(addr)
                raise TransferError(f"mooncake: register_memory({addr:#x}, {nbytes}, "
                                    f"{location!r}) -> {rc}")
            self._locations[addr] = location

    def _check_allocation_start(self, addr: int) -> None:
        if self._cuda_driver is None:
            from .cuda_ipc import CudaDriver

            self._cuda_driver = CudaDriver()
        if self._device is not None:  # only device regions are checked
            self._cuda_driver.ensure_context(self._device)
        base, _ = self._cuda_driver.allocation(addr)
        if base != addr:
            raise DescriptorError(
                f"mooncake: nvlink_intra maps a registration from the IPC handle of its "
                f"allocation, so it must start there: {addr:#x} is {addr - base} B into the "
                f"allocation at {base:#x}; register the allocation (or use protocol='tcp')")

    def report(self) -> dict:
        """The protocol initialize() accepted, the wheel's SUPPORT_* flags and the location
        each registered region was given."""
        return {"transport": self._protocol, "device": self._device, **self._flags,
                "locations": dict(sorted(self._locations.items()))}

    def deregister(self, addr: int) -> None:
        with self._lock:
            self._check_open()
            self._regions.remove(addr)
            self._locations.pop(int(addr), None)
            rc = self._engine.unregister_memory(int(addr))
            if rc != 0:
                raise TransferError(f"mooncake: unregister_memory({int(addr):#x}) -> {rc}")

    # -- peers --------------------------------------------------------------------------------

    def agent_info(self) -> bytes:
        # The peer fetches our segment itself at first use, and this process checks every
        # incoming write against its registrations of the moment, so memory registered after
        # agent_info() was sent is writable without reconnecting.
        return self._session.encode()

    def connect(self, agent_info: bytes) -> str:
        try:
            peer = bytes(agent_info).decode("ascii")
        except (TypeError, UnicodeDecodeError):
            raise DescriptorError(
                f"mooncake: agent_info is not an ip:port session: {agent_info!r}"
            ) from None
        if not _SESSION_RE.match(peer):
            raise DescriptorError(f"mooncake: agent_info is not an ip:port session: {peer!r}")
        with self._lock:
            self._check_open()
            if peer not in self._workers:
                self._workers[peer] = _PeerWorker(self._engine, peer, self._max_entries,
                                                  self._notify)
        return peer

    # -- transfers ----------------------------------------------------------------------------

    def submit_write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray
    ) -> Batch:
        src_u, dst_u, nbytes_u = as_descriptors(src, dst, nbytes)
        with self._lock:
            self._check_open()
            worker = self._workers.get(peer)
            if worker is None:
                raise TransferError(f"mooncake: unknown peer {peer!r}; connect() it first")
            # TCP would send from unregistered memory, RDMA would not; refuse it everywhere.
            outside = self._regions.outside(src_u, nbytes_u)
            if outside.size:
                i = int(outside[0])
                raise DescriptorError(
                    f"mooncake: source descriptor {i} [{int(src_u[i]):#x}, +{int(nbytes_u[i])}) "
                    f"is not inside memory registered in this process ({outside.size} such)"
                )
            batch = Batch(
                peer=peer, handles=[], nbytes=int(nbytes_u.sum()), descriptors=int(src_u.size)
            )
            job = _Job(batch, src_u, dst_u, nbytes_u)
            batch.handles.append(job)
            worker.put(job)
        return batch

    def poll(self, batch: Batch) -> BatchState:
        # The worker is the only writer of batch.state; reading it never touches Mooncake.
        return batch.state

    def on_completion(self, callback) -> bool:
        """Note [Completion wake-up]: the peer workers end every batch on their threads."""
        self._callbacks.append(callback)
        return True

    def _notify(self) -> None:
        for cb in list(self._callbacks):
            cb()

    def wait(self, batch: Batch, timeout_s: float) -> None:
        job = batch.handles[0] if batch.handles else None
        if not isinstance(job, _Job):
            raise DescriptorError("mooncake: this Batch was not submitted by a MooncakeEngine")
        # The worker sets the event when the batch ends, so waiting costs no polling.
        if not job.finished.wait(max(float(timeout_s), 0.0)):
            raise TransferError(
                f"mooncake: write to {batch.peer} timed out after {timeout_s:.1f} s "
                f"({batch.descriptors} descriptors, {batch.nbytes} bytes); it is still in "
                "flight and ends by itself within MC_TRANSFER_TIMEOUT"
            )
        if batch.state is BatchState.FAILED:
            raise TransferError(f"mooncake: write to {batch.peer} failed: {batch.reason}")

    # -- teardown -----------------------------------------------------------------------------

    def transport(self) -> TransportInfo:
        """The protocol Mooncake initialised with, and the NICs its local topology lists
        (none on TCP: bytes go through the kernel's socket on `hostname`). Mooncake's
        topology query takes about 1 s (measured on the CPU box), and every endpoint reports
        its transport when it opens, so the answer is kept: a serving engine that opens an
        endpoint at its first request to a new peer asks once, at start (integrations)."""
        if self._transport is None:
            self._transport = self._query_transport()
        return self._transport

    def _query_transport(self) -> TransportInfo:
        nics: list[str] = []
        try:
            topo = json.loads(self._engine.get_local_topology())
            for lists in topo.values():
                for group in lists:
                    nics += [str(n) for n in group if str(n) not in nics]
        except Exception:  # noqa: BLE001 - a topology it cannot give is reported as such
            return TransportInfo(self.name, self._protocol, self._hostname,
                                 "local topology unavailable")
        return TransportInfo(self.name, self._protocol,
                             ",".join(nics) if nics else self._hostname,
                             "RDMA NICs from the local topology" if nics else
                             "no RDMA NIC in the local topology")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.stop()
        deadline = time.monotonic() + CLOSE_JOIN_TIMEOUT_S
        stuck = False
        for worker in workers:
            worker.thread.join(max(deadline - time.monotonic(), 0.0))
            stuck |= worker.thread.is_alive()
        if stuck:
            # A worker is still inside get_batch_transfer_status; freeing the engine under it
            # would crash. Leak it: the process is usually about to exit anyway.
            return
        for addr, _ in self._regions.items():
            self._engine.unregister_memory(addr)
        self._regions = RegionTable()
        # Takes about 1 s: Mooncake joins its own threads.
        self._engine = None

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("mooncake: engine is closed")
