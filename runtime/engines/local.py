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

Device memory is the other local engine, `LocalDeviceEngine` (runtime/engines/local_device.py);
`make_engine("local", device=...)` makes that one (Note [Device engines] in
runtime/engines/__init__.py).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import threading
import weakref

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


class ProcessWatch:
    """Whether a peer process, named by pid and start time, still runs.

    Note [Process watch]: the engines check their peer before every write. Reading
    /proc/<pid>/stat costs 50-80 µs of host time per submit on the H100 box
    (bench/results/2026-12-06-gpu-fine); a pidfd (Linux 5.3+) turns readable when its process
    exits, so a check is one poll(2) that does not wait. The pidfd is opened at connect and its
    process confirmed by start time then (a pid reused before the open names another
    process). It is closed when the watch is collected, never while a check may run on it.
    Each check makes its own poll object: one object polled by two threads at once raises,
    and select(2) refuses descriptors above 1023, which a serving process may well hold.
    Where pidfd_open is refused (older kernels, seccomp), every check reads /proc as before.
    """

    def __init__(self, pid: int, start_ticks: int) -> None:
        self.pid, self.start_ticks = pid, start_ticks
        self._fd = -1
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        weakref.finalize(self, os.close, fd)
        if _start_time_ticks(pid) == start_ticks:
            self._fd = fd  # else the pid names another process now: /proc says exited

    def alive(self) -> bool:
        if self._fd < 0:
            return _start_time_ticks(self.pid) == self.start_ticks
        poll = select.poll()
        poll.register(self._fd, select.POLLIN)
        return not poll.poll(0)


class _Peer:
    def __init__(self, pid: int, start_ticks: int, ranges: RegionTable) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.ranges = ranges
        self.watch = ProcessWatch(pid, start_ticks)


class LocalEngine(TransferEngine):
    """process_vm_writev between processes of one host; any number per process, thread-safe."""

    name = "local"

    def __init__(self) -> None:
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
        if not target.watch.alive():
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
