"""The one small interface every transfer engine implements.

An engine moves bytes from memory registered in this process to memory registered in a peer
process. Everything above it (plans, descriptors, control plane) is engine-agnostic.

Contract:
- `register(addr, nbytes)` before any byte of that range is read or written by a transfer,
  on both sides. `deregister(addr)` undoes it.
- `agent_info()` is an opaque blob the peer passes to `connect()`; it carries whatever the
  engine needs (a Mooncake session address, NIXL agent metadata with registered memory, a pid).
  Call it after registering memory, because NIXL's metadata includes registered regions.
- `submit_write(peer, src, dst, nbytes)` is non-blocking and returns a `Batch`. The three
  arrays are uint64 numpy arrays of equal length: local source addresses, remote destination
  addresses and byte counts. Engines split batches above their own per-submit limits.
- Errors come in two kinds. A request refused up front, before any byte moved (malformed
  arrays, zero lengths, an unknown peer, a range outside registered memory where the engine
  can check it, a permission error), raises `TransferError` from `submit_write`; malformed
  arrays raise its subclass `DescriptorError`. Anything that goes wrong once bytes are in
  flight, a dead peer included, is reported as `BatchState.FAILED` with `Batch.reason`.
- `poll(batch)` never blocks and returns PENDING, DONE or FAILED; `wait(batch, timeout_s)`
  blocks with a deadline and raises `TransferError` on failure or timeout.
- `close()` releases everything; it is idempotent.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


class TransferError(RuntimeError):
    """A transfer failed or timed out; the message names the peer and the reason."""


class DescriptorError(TransferError, ValueError):
    """The (src, dst, nbytes) arrays or a registration request are malformed.

    Raised before anything is sent. It is also a ValueError because it is a caller bug, and a
    TransferError so that a control plane catching TransferError sees every refusal.
    """


class BatchState(enum.IntEnum):
    PENDING = 0
    DONE = 1
    FAILED = 2


@dataclass
class Batch:
    """Handle of one submitted write batch (possibly several engine-level sub-batches)."""

    peer: str
    handles: list  # engine-specific sub-batch handles
    nbytes: int  # payload bytes in this batch
    descriptors: int  # number of (src, dst, len) entries
    state: BatchState = BatchState.PENDING
    reason: str = ""


@dataclass(frozen=True)
class TransportInfo:
    """What an engine really moves bytes with, as the engine itself reports it.

    Note [Reported transport]: a wrong NIC name or a missing transport can make an engine fall
    back silently (Mooncake to TCP, UCX to CMA or TCP), and then every figure measures the
    fallback. Each engine says what it runs on, read back from the library where the library
    tells (Mooncake's local topology, NIXL's created backends) and otherwise from the settings
    it was created with; endpoints log it at registration and the demo prints it.
    """

    engine: str
    transport: str  # e.g. "tcp", "rdma", "ucx(tls=tcp)", "process_vm_writev"
    devices: str = ""  # NICs / interfaces / GPUs, "" when none
    detail: str = ""

    def describe(self) -> str:
        text = f"{self.engine}: {self.transport}"
        if self.devices:
            text += f" on {self.devices}"
        return text + (f" ({self.detail})" if self.detail else "")


class TransferEngine(ABC):
    name: str = "abstract"
    # The backend whose rules a plan for this engine is lowered under (Note [Plan backend]):
    # the engine's own name, except for pdc's own engines that move any descriptor list the
    # way "local" does (cuda_ipc).
    plan_backend: str = ""

    @property
    def backend(self) -> str:
        return self.plan_backend or self.name

    def orders_after(self, device) -> bool:
        """True when `submit_write` queues its reads after the work already queued on the
        calling thread's current stream of `device` (engines that copy on CUDA streams), so
        a producer need not wait for its copies before submitting; False: the engine reads
        memory as soon as it is submitted, and the caller synchronizes first."""
        return False

    def transport(self) -> TransportInfo:
        """Note [Reported transport]; engines override this."""
        return TransportInfo(self.name, "unknown")

    @abstractmethod
    def register(self, addr: int, nbytes: int) -> None: ...

    @abstractmethod
    def deregister(self, addr: int) -> None: ...

    @abstractmethod
    def agent_info(self) -> bytes: ...

    @abstractmethod
    def connect(self, agent_info: bytes) -> str:
        """Make a peer reachable; returns the peer name used by submit_write."""

    @abstractmethod
    def submit_write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray
    ) -> Batch: ...

    # True where `submit_grids` does better than expanding the grids (Note [Descriptor grids])
    takes_grids: bool = False

    def submit_grids(self, peer: str, grids: list[DescriptorGrid]) -> Batch:
        """`submit_write` of the descriptors the grids stand for, in their order (Note
        [Descriptor grids]); engines that can address memory from a grid override it."""
        return self.submit_write(peer, *expand_grids(grids))

    @abstractmethod
    def poll(self, batch: Batch) -> BatchState: ...

    def written_event(self, batch: Batch) -> bytes:
        """Note [Success by event]: a handle another process can open (`open_written_event`)
        of an event that completes once `batch` and every write submitted before it have
        landed; b"" where the engine has none (every engine but cuda_ipc) or the batch ended."""
        return b""

    def open_written_event(self, handle: bytes):
        """The event of a peer's `written_event` handle (anything with `query()`, which may
        raise RuntimeError), or None where this engine cannot open one."""
        return None

    def watch_written(self, event, source: str, callback) -> bool:
        """Note [Landed wake-up] (runtime/engines/cuda_watch.py): calls `callback()`, from a
        thread of the driver's (so it must only set an event), once `event` (from
        `open_written_event`) of prefill rank `source` has completed, and returns True;
        False where the engine cannot, and decode's caller finds it at its next poll."""
        return False

    # True where `on_completion`'s callbacks run on a thread of the engine's own that does
    # nothing but wait for batches (cuda_ipc's completion thread), so a callback may do work
    # there (Note [Advance on the waking thread] in runtime/endpoints/prefill_worker.py);
    # False: a callback only sets an event (Mooncake calls it between its peers' writes).
    callbacks_may_work: bool = False

    def on_completion(self, callback) -> bool:
        """Note [Completion wake-up]: an engine whose batches end on a thread of its own calls
        `callback()` (from that thread, so it must only set an event unless
        `callbacks_may_work`) each time a batch ends, and returns True; the endpoints'
        transfer worker then sleeps until woken
        instead of polling in-flight batches every `poll_sleep_s`, which on a small host
        takes the GIL thousands of times a second from the serving engine's threads. An
        engine whose batches end only when polled (NIXL, whose poll drives UCX) returns
        False and is polled."""
        return False

    def wait(self, batch: Batch, timeout_s: float) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        delay = 0.0
        while True:
            state = self.poll(batch)
            if state is BatchState.DONE:
                return
            if state is BatchState.FAILED:
                raise TransferError(f"{self.name}: write to {batch.peer} failed: {batch.reason}")
            if time.monotonic() > deadline:
                raise TransferError(
                    f"{self.name}: write to {batch.peer} timed out after {timeout_s:.1f} s"
                )
            time.sleep(delay)
            delay = min(0.001, delay + 0.0001)

    @abstractmethod
    def close(self) -> None: ...


def as_descriptors(
    src: object, dst: object, nbytes: object
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Checks a write request and returns it as three contiguous uint64 arrays.

    Every engine calls this first, so a bad request fails the same way whatever the engine:
    with a DescriptorError naming the problem, never with an assert or a native crash.
    """
    arrays = []
    for label, value in (("src", src), ("dst", dst), ("nbytes", nbytes)):
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise DescriptorError(f"{label} must be a 1-D array, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "ui":
            # Floats would silently round addresses above 2**53; bools are not addresses.
            raise DescriptorError(f"{label} must hold integers, got dtype {arr.dtype}")
        if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
            raise DescriptorError(f"{label} has a negative entry ({int(arr.min())})")
        arrays.append(np.ascontiguousarray(arr, dtype=np.uint64))
    src_u, dst_u, nbytes_u = arrays
    if not (src_u.size == dst_u.size == nbytes_u.size):
        raise DescriptorError(
            f"src, dst and nbytes must have equal lengths, got "
            f"{src_u.size}, {dst_u.size} and {nbytes_u.size}"
        )
    if src_u.size == 0:
        raise DescriptorError("empty write request: no descriptors")
    if not nbytes_u.all():
        first = int(np.flatnonzero(nbytes_u == 0)[0])
        raise DescriptorError(f"nbytes[{first}] is 0; every descriptor must move at least 1 byte")
    ends_ok = (src_u + nbytes_u >= src_u) & (dst_u + nbytes_u >= dst_u)
    if not ends_ok.all():
        first = int(np.flatnonzero(~ends_ok)[0])
        raise DescriptorError(f"descriptor {first} wraps around the 64-bit address space")
    return src_u, dst_u, nbytes_u


# Note [Descriptor grids]: a direct-path chunk of a paged component is every plan entry (a
# layer's K or V buffer: one base address per side) times every run of contiguous items (an
# offset per side and a length): 160 x 64 = 10,240 descriptors for a 1K Llama-70B request and
# 81,920 at 8K, built, checked, translated and tabled in numpy per request (~1 ms of host time
# on the GPU box, BENCHMARKS.md (p)). A `DescriptorGrid` keeps that product unexpanded: rows
# (base addresses) and runs (offsets, lengths), descriptor (i, j) = (src_rows[i] +
# src_runs[j], dst_rows[i] + dst_runs[j], run_bytes[j]), row-major, the order the flat list
# has. An engine that computes addresses on the device (cuda_ipc) checks each row's span
# against the registrations and hands rows and runs to one kernel, so its host work is
# O(rows + runs); every other engine takes `expand_grids` of it through `submit_write`.
@dataclass(frozen=True)
class DescriptorGrid:
    src_rows: np.ndarray  # uint64 [rows]: a row's source base address
    dst_rows: np.ndarray  # uint64 [rows]: its destination base address
    src_runs: np.ndarray  # uint64 [runs]: a run's offset from the source row's base
    dst_runs: np.ndarray  # uint64 [runs]
    run_bytes: np.ndarray  # uint64 [runs]: bytes of each run

    @property
    def count(self) -> int:
        return len(self.src_rows) * len(self.src_runs)

    @property
    def total_bytes(self) -> int:
        return len(self.src_rows) * int(self.run_bytes.sum())

    def spans(self) -> tuple[int, int, int, int]:
        """(source low offset, source span, destination low offset, destination span) in
        bytes: every descriptor of row i lies in [row + low, row + low + span)."""
        s_lo, d_lo = int(self.src_runs.min()), int(self.dst_runs.min())
        return (s_lo, int((self.src_runs + self.run_bytes).max()) - s_lo,
                d_lo, int((self.dst_runs + self.run_bytes).max()) - d_lo)

    def expand(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = len(self.src_rows)
        return ((self.src_rows[:, None] + self.src_runs[None, :]).reshape(-1),
                (self.dst_rows[:, None] + self.dst_runs[None, :]).reshape(-1),
                np.broadcast_to(self.run_bytes, (rows, len(self.run_bytes))).reshape(-1))


def check_grids(grids: list[DescriptorGrid]) -> list[DescriptorGrid]:
    """The grids as contiguous uint64 arrays, checked the way `as_descriptors` checks a flat
    list (DescriptorError naming the grid and the problem), empty grids left out."""
    out = []
    for k, g in enumerate(grids):
        arrays = []
        for label in ("src_rows", "dst_rows", "src_runs", "dst_runs", "run_bytes"):
            arr = getattr(g, label)
            if type(arr) is np.ndarray and arr.dtype == np.uint64 and arr.ndim == 1 and \
                    arr.flags.c_contiguous:
                arrays.append(arr)  # as DescriptorTemplate.grids makes them: nothing to convert
                continue
            arr = np.asarray(arr)
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "ui"):
                raise DescriptorError(f"grid {k}: {label} must be a 1-D integer array, got "
                                      f"shape {arr.shape} of {arr.dtype}")
            if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
                raise DescriptorError(f"grid {k}: {label} has a negative entry "
                                      f"({int(arr.min())})")
            arrays.append(np.ascontiguousarray(arr, dtype=np.uint64))
        s_rows, d_rows, s_runs, d_runs, n = arrays
        if s_rows.size != d_rows.size or not (s_runs.size == d_runs.size == n.size):
            raise DescriptorError(f"grid {k}: rows ({s_rows.size}, {d_rows.size}) or runs "
                                  f"({s_runs.size}, {d_runs.size}, {n.size}) differ in length")
        if not s_rows.size or not n.size:
            continue
        if not n.all():
            raise DescriptorError(f"grid {k}: run_bytes[{int(np.flatnonzero(n == 0)[0])}] is 0; "
                                  "every run must move at least 1 byte")
        # Python ints: the largest row + largest offset + largest run bounds every
        # descriptor's end; only a grid near 2**64 takes the exact check
        top, n_hi = 1 << 64, int(n.max())
        if int(s_rows.max()) + int(s_runs.max()) + n_hi >= top or \
                int(d_rows.max()) + int(d_runs.max()) + n_hi >= top:
            s_end, d_end = s_runs + n, d_runs + n
            if int(s_rows.max()) + int(s_end.max()) >= top or \
                    int(d_rows.max()) + int(d_end.max()) >= top or \
                    bool((s_end < s_runs).any() or (d_end < d_runs).any()):
                raise DescriptorError(f"grid {k}: a descriptor wraps around the 64-bit address "
                                      "space")
        out.append(DescriptorGrid(s_rows, d_rows, s_runs, d_runs, n))
    if not out:
        raise DescriptorError("empty write request: no descriptors")
    return out


def expand_grids(grids: list[DescriptorGrid]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The flat (src, dst, nbytes) list the grids stand for, in order."""
    parts = [g.expand() for g in check_grids(grids)]
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def check_region(addr: object, nbytes: object) -> tuple[int, int]:
    """Checks one register() request; returns (addr, nbytes) as Python ints."""
    try:
        addr_i, nbytes_i = int(addr), int(nbytes)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise DescriptorError(f"register needs integer addr and nbytes: {exc}") from None
    if addr_i <= 0 or addr_i >= 1 << 64:
        raise DescriptorError(f"register: addr {addr_i:#x} is not a valid address")
    if nbytes_i <= 0 or addr_i + nbytes_i > 1 << 64:
        raise DescriptorError(f"register: nbytes {nbytes_i} is not a valid length at {addr_i:#x}")
    return addr_i, nbytes_i


def region_device(engine: str, device: int | None, addr: int, nbytes: int, locate) -> int | None:
    """Note [Two memory kinds] (runtime/pools.py): the memory kind of one region an engine
    registers, decided per registration. None: host memory; N: memory of GPU N. An engine
    made for host memory (`device` None) registers host memory only and asks nobody; an
    engine made for GPU N asks `locate(addr)` ("cpu" or "cuda:M", the CUDA driver's answer,
    `address_device`) and refuses memory of any other GPU."""
    if device is None:
        return None
    where = locate(addr)
    if where == "cpu":
        return None
    if where != f"cuda:{device}":
        raise DescriptorError(
            f"{engine}: register({addr:#x}, {nbytes}): the memory is on {where}, but this "
            f"engine was made for cuda:{device}; hint: a rank registers host memory and one "
            f"GPU's (Note [Two memory kinds]), so make one engine per GPU")
    return device


def locate_address(addr: int) -> str:
    """"cpu" or "cuda:N": where `addr` lives, as the CUDA driver says (runtime/pools.py)."""
    from ..pools import address_device

    return address_device(addr)


ROWS_KEPT = 256  # rows arrays whose answers a table keeps (a few per link: Note [Row room])


class RegionTable:
    """Registered (addr, nbytes) ranges of one process, with a vectorised containment check.

    Engines use it to refuse overlapping registrations (Mooncake rejects them, NIXL accepts
    them silently) and, where the engine cannot check remote ranges itself, to refuse a write
    that leaves the peer's registered memory before any byte moves.
    """

    def __init__(self, ranges: list[tuple[int, int]] | None = None) -> None:
        self._ranges: dict[int, int] = {}
        self._version = 0  # changes with every add and remove: `room` keeps answers per version
        self._rooms: dict[bytes, tuple[int, int]] = {}  # rows -> (version, room)
        for addr, nbytes in ranges or []:
            self.add(addr, nbytes)

    def add(self, addr: int, nbytes: int) -> None:
        addr, nbytes = check_region(addr, nbytes)
        for other, other_nbytes in self._ranges.items():
            if addr < other + other_nbytes and other < addr + nbytes:
                raise DescriptorError(
                    f"register: [{addr:#x}, +{nbytes}) overlaps the registered "
                    f"[{other:#x}, +{other_nbytes})"
                )
        self._ranges[addr] = nbytes
        self._version += 1

    def remove(self, addr: int) -> int:
        """Forgets the range starting at addr; returns its nbytes."""
        try:
            nbytes = self._ranges.pop(int(addr))
        except KeyError:
            raise DescriptorError(f"deregister: no registered range starts at {addr:#x}") from None
        self._version += 1
        return nbytes

    def room(self, rows: np.ndarray) -> int:
        """Note [Row room]: the bytes each row start has up to the end of the one range that
        holds it, least over the rows; 0 when a row lies in no range. A grid's row span
        [row + low, row + low + span) is then inside that range when low + span <= room
        (offsets are never negative), so a direct-path request of a link whose rows (its
        layers' buffer bases) are the same every time checks in O(1) instead of a search per
        row and side (50-80 µs of host time per grid on the H100 box,
        bench/results/2026-12-06-gpu-fine). Kept per rows and table version; a request
        beyond the room takes the full check (`outside`), which says which row and why."""
        key = rows.tobytes()
        version = self._version
        got = self._rooms.get(key)
        if got is not None and got[0] == version:
            return got[1]
        room = 0
        if self._ranges and rows.size:
            starts, ends = self._bounds()
            slot = np.searchsorted(starts, rows, side="right").astype(np.int64) - 1
            if (slot >= 0).all() and (rows < ends[slot]).all():
                room = int((ends[slot] - rows).min())
        if len(self._rooms) >= ROWS_KEPT:
            self._rooms.clear()
        self._rooms[key] = (version, room)
        return room

    def items(self) -> list[tuple[int, int]]:
        return sorted(self._ranges.items())

    def _bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends) of the ranges in address order, uint64."""
        items = self.items()
        return (np.array([a for a, _ in items], dtype=np.uint64),
                np.array([a + n for a, n in items], dtype=np.uint64))

    def __len__(self) -> int:
        return len(self._ranges)

    def starts_of(self, addr: np.ndarray) -> np.ndarray:
        """The start of the range holding each address (uint64; callers checked `outside`
        first, so every address lies in a range)."""
        starts = self._bounds()[0]
        slot = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
        return starts[np.maximum(slot, 0)]

    def outside(self, addr: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Indices of descriptors whose [addr, addr+nbytes) is not inside one single range.

        A descriptor straddling two adjacent registrations counts as outside, as it does for
        the engines themselves, which look up one registration per descriptor.
        """
        if not self._ranges:
            return np.arange(addr.size)
        starts, ends = self._bounds()
        if addr.size > 64:
            # Most writes lie inside one registration (a pool arena): three reductions then
            # decide for all, instead of a binary search per descriptor. (Descriptors that
            # wrap the address space were refused before, by as_descriptors.)
            lo, hi = int(addr.min()), int((addr + nbytes).max())
            k = int(np.searchsorted(starts, np.uint64(lo), side="right")) - 1
            if k >= 0 and hi <= int(ends[k]):
                return np.zeros(0, np.int64)
        # The only candidate range is the last one starting at or below addr.
        slot = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
        inside = slot >= 0
        safe = np.where(inside, slot, 0)
        inside &= addr + nbytes <= ends[safe]
        return np.flatnonzero(~inside)


class SharedRegistrations:
    """One transfer engine as each of several endpoints sees it: a decode server with
    endpoints to many prefill servers (Note [Many engines] in integrations/vllm/links.py)
    registers the same cache regions once per endpoint, which the engine registers once
    (Mooncake refuses a second registration of a range) and deregisters when the last
    endpoint that registered it lets go; everything else goes to the engine."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._holders: dict[tuple[int, int], int] = {}  # (addr, nbytes) -> registrations
        self._lock = threading.Lock()

    def register(self, addr: int, nbytes: int) -> None:
        with self._lock:
            held = self._holders.get((addr, nbytes), 0)
            if not held:
                self._engine.register(addr, nbytes)
            self._holders[(addr, nbytes)] = held + 1

    def deregister(self, addr: int) -> None:
        with self._lock:
            key = next((k for k in self._holders if k[0] == addr), None)
            if key is None:
                self._engine.deregister(addr)  # the engine's own error for an unknown range
                return
            self._holders[key] -= 1
            if not self._holders[key]:
                del self._holders[key]
                self._engine.deregister(addr)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)
