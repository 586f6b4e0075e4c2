"""NIXL with its UCX backend, host (DRAM) or device (VRAM) memory.

`NixlEngine(device="cuda:0")` registers and moves GPU memory (NIXL's VRAM segments) through
UCX's CUDA transports: cuda_ipc between processes of one host (NVLink or the same GPU),
cuda_copy for staging; its environment default is UCX_TLS=cuda_ipc,cuda_copy,tcp (tcp carries
UCX's own wire-up and active messages and host memory). Its agent_info is NIXL's metadata
prefixed by the device index, which the writer needs to name the peer's memory.
Such an engine registers host memory too (Note [Two memory kinds] in runtime/pools.py): each
region is registered as DRAM or VRAM by where it lives (`register`), and since one NIXL
descriptor list holds one memory type, `submit_write` splits a write by its sources' kind,
one transfer per kind, each writing into memory of the same kind on the peer (a host region
to a host region, the GPU's to the peer's GPU), as the two sides of a plan mirror each other.

Environment defaults, applied with os.environ.setdefault when this engine is first constructed
(before NIXL is imported) and only for variables that are unset:
- UCX_TLS=tcp: stay on the TCP path. Without UCX_TLS, UCX quietly moves same-host bytes with
  CMA. On a GPU/RDMA host set it explicitly before creating the engine (e.g. UCX_TLS=rc,
  cuda_copy and the NIC names in UCX_NET_DEVICES).
- UCX_NET_DEVICES: the interface of the process's bind (or advertise) host, `lo` on loopback
  (Note [UCX device], `net_device`). Without it UCX listens on, and advertises, every
  interface; pinned to `lo` it cannot reach another host.
- NIXL_LOG_LEVEL=WARN and UCX_LOG_FILE=stderr: both libraries log to stdout by default.
- UCX_MODULES=^efa: with Debian's ibverbs-providers installed, UCX's efa module loads a second
  libnl and the process segfaults at exit.

Traps handled here:
- The Python API creates every agent with a progress-thread delay of 0, so each agent's UCX
  progress thread busy-polls one core even when idle. Agents are created with a short poll
  timeout instead (progress_delay_us). The thread itself stays: over TCP the target must
  progress UCX for a WRITE to complete.
- NIXL has no transfer timeout: a WRITE to a stopped (not dead) peer stays "PROC" forever.
  Every batch carries a deadline (transfer_timeout_s); poll() cancels it after that.
- check_xfer_state raises, rather than returning "ERR", when the peer disconnects; every NIXL
  call is wrapped and its exception becomes FAILED or TransferError.
- Transfer handles are released as soon as a batch ends (or at close()).
"""

from __future__ import annotations

import importlib
import os
import threading
import time
import uuid
from dataclasses import dataclass
from types import ModuleType
from typing import Any

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
    locate_address,
    region_device,
)

ENV_DEFAULTS = {
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "UCX_LOG_FILE": "stderr",
    "UCX_MODULES": "^efa",
    "NIXL_LOG_LEVEL": "WARN",
}
# 1 ms: measured idle cost ~0.03 s CPU per 3 s, and TCP throughput above stock busy-polling.
DEFAULT_PROGRESS_DELAY_US = 1000
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
# `nixl` is the meta package on GPU hosts (it picks the CUDA flavour); the wheels work alone.
_API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
# The progress-delay override swaps a module attribute for the duration of agent creation.
_AGENT_CREATE_LOCK = threading.Lock()


# UCX transports for VRAM: cuda_ipc moves the bytes between processes of one host.
DEVICE_UCX_TLS = "cuda_ipc,cuda_copy,tcp"
_VRAM_PREFIX = b"pdc-nixl-vram:"


# Marks a UCX_NET_DEVICES that pdc derived itself (Note [UCX device]): processes spawned
# later inherit the environment, and a derived `lo` must not pass for a setting by hand in a
# child that binds on another host (a network-namespace rank).
_DERIVED_MARK = "PDC_UCX_NET_DEVICES_DERIVED"


def _prepare_environment(device: bool = False) -> None:
    if os.environ.get(_DERIVED_MARK) == os.environ.get("UCX_NET_DEVICES", ""):
        os.environ.pop("UCX_NET_DEVICES", None)
    for key, value in ENV_DEFAULTS.items():
        if key == "UCX_NET_DEVICES" and key not in os.environ:
            value = net_device()
            os.environ[_DERIVED_MARK] = value
        os.environ.setdefault(key, DEVICE_UCX_TLS if device and key == "UCX_TLS" else value)


def net_device() -> str:
    """Note [UCX device]: UCX listens on, and advertises, only the interfaces in
    UCX_NET_DEVICES. pdc's default is the interface that holds this process's bind host (else
    its advertise host; knobs bind_host/advertise_host, Note [Bind and advertise]), so the
    data path takes the interface the control plane uses: `lo` on one host, the NIC the
    peers reach across hosts. A UCX_NET_DEVICES set by hand wins."""
    from ..bringup import interface_of, is_loopback
    from ..control import HostSettings

    hosts = HostSettings.from_knobs()
    for host in (hosts.bind_host, hosts.advertise):
        if is_loopback(host):
            return "lo"
        dev = interface_of(host)
        if dev is not None:
            return dev
    raise TransferError(
        f"nixl: neither bind_host {hosts.bind_host} nor advertise_host {hosts.advertise} is an "
        "address of this host, so UCX's interface cannot be derived; hint: set UCX_NET_DEVICES "
        "to the interface that reaches the peers (e.g. eth0), or PDC_BIND_HOST to this host's "
        "address")


def _device_index(device: object) -> int:
    """The CUDA device index of `device` ("cuda:1", 1, a torch.device)."""
    text = str(device)
    index = text.split(":", 1)[1] if text.startswith("cuda:") else text
    try:
        value = int(index)
    except ValueError:
        raise DescriptorError(f"nixl: device must be 'cuda:N' or an index, not {device!r}") \
            from None
    if value < 0:
        raise DescriptorError(f"nixl: device index must be >= 0, not {value}")
    return value


def _import_api() -> ModuleType:
    errors = []
    for module in _API_MODULES:
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
    raise TransferError("nixl: no NIXL Python API importable (" + "; ".join(errors) + ")")


def _binding_errors(api: ModuleType) -> tuple[type[Exception], ...]:
    # The binding's errors share no base class other than Exception; catch exactly them.
    bindings = api.nixlBind
    return tuple(
        getattr(bindings, n) for n in dir(bindings) if n.startswith("nixl") and n.endswith("Error")
    )


def _create_agent(api: ModuleType, agent_name: str, progress_delay_us: int) -> Any:
    """nixl_agent with the UCX backend whose progress thread sleeps progress_delay_us per poll.

    nixl_agent.__init__ writes `pthrDelay = 0` into the binding's config object; a subclass of
    that config class turns exactly that write into progress_delay_us. The class is swapped in
    only while this agent is built, under a lock, and restored afterwards.
    """
    bindings = api.nixlBind
    original = bindings.nixlAgentConfig

    class _DelayedProgressConfig(original):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: object) -> None:
            if key == "pthrDelay" and value == 0:
                value = progress_delay_us
            super().__setattr__(key, value)

    with _AGENT_CREATE_LOCK:
        bindings.nixlAgentConfig = _DelayedProgressConfig
        try:
            config = api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
            agent = api.nixl_agent(agent_name, config)
        except _binding_errors(api) as exc:
            raise TransferError(
                f"nixl: cannot create agent {agent_name!r} with the UCX backend: {exc!r} "
                f"(UCX_TLS={os.environ.get('UCX_TLS')!r}, "
                f"UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES')!r}); hint: UCX found "
                "none of UCX_NET_DEVICES among the interfaces it lists in /sys/class/net "
                "(inside a network namespace /sys must be that namespace's, as `ip netns "
                "exec` mounts it); name an interface of this host, or unset it so pdc derives "
                "it from PDC_BIND_HOST (Note [UCX device])"
            ) from None
        finally:
            bindings.nixlAgentConfig = original
    if "UCX" not in agent.backends:
        raise TransferError("nixl: the UCX backend plugin is missing from this NIXL install")
    return agent


def _backend_hint(exc: Exception) -> str:
    """What a bare NIXL_ERR_BACKEND while connecting a peer most likely means."""
    if "NIXL_ERR_BACKEND" not in repr(exc):
        return ""
    dev = os.environ.get("UCX_NET_DEVICES", "all")
    return (f"; UCX cannot reach the peer's addresses from UCX_NET_DEVICES={dev}" + (
        " (loopback: it reaches no other host)" if dev == "lo" else "") +
        "; hint: set UCX_NET_DEVICES to the interface that reaches the peer's host, or unset "
        "it so pdc derives it from PDC_BIND_HOST (Note [UCX device], docs/deploy.md)")


@dataclass
class _Xfer:
    handle: object  # nixl_xfer_handle
    deadline: float  # time.monotonic() after which the batch is cancelled
    peer: str
    status: str = "PROC"  # "PROC", "DONE" or a failure text


class NixlEngine(TransferEngine):
    """NIXL/UCX between processes; one agent per engine, any number per process, thread-safe.

    UCX opens one TCP listener on an ephemeral port per allowed device (only lo by default);
    there is no fixed port to open.
    """

    name = "nixl"

    def __init__(
        self,
        agent_name: str | None = None,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        device: object = None,
    ) -> None:
        """
        agent_name: must be unique among the agents that connect to each other; the default
          includes the pid and a random suffix.
        progress_delay_us: poll timeout of the UCX progress thread (0 = NIXL's busy-poll).
        transfer_timeout_s: a batch not finished after this long is cancelled and FAILED.
        device: None for host memory (DRAM); "cuda:N" to register and move memory of that GPU
          (VRAM), sources and destinations alike.
        """
        if progress_delay_us < 0 or transfer_timeout_s <= 0:
            raise DescriptorError("nixl: progress_delay_us >= 0 and transfer_timeout_s > 0")
        self._dev = None if device is None else _device_index(device)
        self._mem = "DRAM" if device is None else "VRAM"
        self._peer_dev: dict[str, int] = {}
        _prepare_environment(device is not None)
        api = _import_api()
        self._errors = _binding_errors(api)
        self._agent_name = agent_name or f"pdc-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = _create_agent(api, self._agent_name, int(progress_delay_us))
        self._transfer_timeout_s = float(transfer_timeout_s)
        self._regions = RegionTable()
        self._locate = locate_address  # where a region lives (unit tests stand in for CUDA)
        self._vram: set[int] = set()  # starts of the regions registered as VRAM
        self._reg_dlists: dict[int, object] = {}
        self._peers: set[str] = set()
        self._peer_info: dict[str, bytes] = {}  # the metadata each peer was last loaded from
        self._inflight: dict[int, _Xfer] = {}
        # The agent is created without NIXL's own locking (sync mode NONE); this lock is it.
        self._lock = threading.Lock()
        self._closed = False

    # -- memory -------------------------------------------------------------------------------

    def register(self, addr: int, nbytes: int) -> None:
        addr, nbytes = check_region(addr, nbytes)
        with self._lock:
            self._check_open()
            gpu = region_device(self.name, self._dev, addr, nbytes, self._locate)
            self._regions.add(addr, nbytes)
            mem = "DRAM" if gpu is None else "VRAM"
            try:
                dlist = self._agent.register_memory([(addr, nbytes, gpu or 0, "")], mem)
            except self._errors as exc:
                self._regions.remove(addr)
                raise TransferError(f"nixl: register({addr:#x}, {nbytes}) as {mem}: {exc!r}") \
                    from None
            self._reg_dlists[addr] = dlist
            if gpu is not None:
                self._vram.add(addr)

    def deregister(self, addr: int) -> None:
        with self._lock:
            self._check_open()
            self._regions.remove(addr)
            self._vram.discard(int(addr))
            dlist = self._reg_dlists.pop(int(addr))
            try:
                self._agent.deregister_memory(dlist)
            except self._errors as exc:
                raise TransferError(f"nixl: deregister({int(addr):#x}): {exc!r}") from None

    # -- peers --------------------------------------------------------------------------------

    def agent_info(self) -> bytes:
        # The metadata lists the registered regions; peers validate remote descriptors against
        # the copy they received, so register first and re-send after registering more.
        with self._lock:
            self._check_open()
            metadata = bytes(self._agent.get_agent_metadata())
        if self._dev is None:
            return metadata
        return _VRAM_PREFIX + str(self._dev).encode() + b":" + metadata

    # Note [Fresh peer metadata]: NIXL merges the regions of a known agent's new metadata into
    # the ones it already holds and keeps the old ones, so a region the peer deregistered
    # still shadows a newer one that overlaps it: a write into the newer region past the old
    # one's end is refused NOT_FOUND (a peer whose buffers of one request die and the next
    # request's are allocated over them: the parity workers, one engine per process for many
    # cases). So metadata that differs from what the peer was last loaded from replaces it:
    # the old is dropped (remove_remote_agent, which also disconnects) and the new loaded,
    # unless writes to that peer are in flight: the disconnect would fail them, so the new
    # metadata is then merged as NIXL does (pdc's peers send new metadata with a new endpoint,
    # before its first request, when nothing is in flight to them).
    def connect(self, agent_info: bytes) -> str:
        """Adds the peer, or replaces its registrations with the ones `agent_info` lists
        (Note [Fresh peer metadata]), and opens the UCX connection now."""
        try:
            metadata = bytes(agent_info)
        except TypeError:
            raise DescriptorError("nixl: agent_info must be bytes from agent_info()") from None
        peer_dev = None
        if metadata.startswith(_VRAM_PREFIX):
            head, _, metadata = metadata[len(_VRAM_PREFIX):].partition(b":")
            peer_dev = int(head) if head.isdigit() else -1
        if (peer_dev is None) != (self._dev is None) or peer_dev == -1:
            raise DescriptorError(
                f"nixl: this engine moves {self._mem} memory and the peer's agent_info is from "
                f"an engine for {'DRAM' if peer_dev is None else 'VRAM'}; make both engines "
                "with the same device= kind")
        with self._lock:
            self._check_open()
            peer = self._load_remote(metadata)
            busy = any(x.peer == peer for x in self._inflight.values())
            if self._peer_info.get(peer, metadata) != metadata and not busy:
                # Note [Fresh peer metadata]
                try:
                    self._agent.remove_remote_agent(peer)
                except self._errors as exc:
                    raise TransferError(f"nixl: cannot drop {peer}'s old registrations: "
                                        f"{exc!r}") from None
                self._load_remote(metadata)
            self._peer_info[peer] = metadata
            self._peers.add(peer)
            self._peer_dev[peer] = peer_dev or 0
            try:
                # Lazy otherwise: the first write would pay the connection setup.
                self._agent.make_connection(peer)
            except self._errors as exc:
                raise TransferError(f"nixl: cannot connect to {peer}: {exc!r}"
                                    f"{_backend_hint(exc)}") from None
        return peer

    def _load_remote(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except self._errors as exc:
            raise TransferError(f"nixl: add_remote_agent: {exc!r}{_backend_hint(exc)}") \
                from None
        return name.decode() if isinstance(name, bytes) else str(name)

    # -- transfers ----------------------------------------------------------------------------

    def submit_write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray
    ) -> Batch:
        src_u, dst_u, nbytes_u = as_descriptors(src, dst, nbytes)
        batch = Batch(
            peer=peer, handles=[], nbytes=int(nbytes_u.sum()), descriptors=int(src_u.size)
        )
        with self._lock:
            self._check_open()
            if peer not in self._peers:
                raise TransferError(f"nixl: unknown peer {peer!r}; connect() it first")
            outside = self._regions.outside(src_u, nbytes_u)
            if outside.size:
                i = int(outside[0])
                raise DescriptorError(
                    f"nixl: source descriptor {i} [{int(src_u[i]):#x}, +{int(nbytes_u[i])}) is "
                    f"not inside memory registered in this process ({outside.size} such)"
                )
            handles = []
            try:
                for mem, pick in self._by_kind(src_u):
                    handles.append(self._prepare(peer, mem, src_u[pick], dst_u[pick],
                                                 nbytes_u[pick]))
            except TransferError:
                for handle in handles:  # nothing was sent yet
                    self._release(handle)
                raise
            deadline = time.monotonic() + self._transfer_timeout_s
            for handle in handles:
                try:
                    status = self._agent.transfer(handle)
                except self._errors as exc:
                    status = f"{exc!r}"
                xfer = _Xfer(handle, deadline, peer, "PROC" if status == "PROC" else status)
                batch.handles.append(xfer)
                self._inflight[id(xfer)] = xfer
            self._settle(batch)
        return batch

    def kinds_of(self, src: object) -> list[tuple[str, int]]:
        """(memory type, descriptors) of each transfer a write from registered sources `src`
        becomes, in order (Note [Two memory kinds]): one per kind of their regions."""
        src_u = np.ascontiguousarray(src, dtype=np.uint64)
        with self._lock:
            return [(mem, src_u[pick].size) for mem, pick in self._by_kind(src_u)]

    def _by_kind(self, src_u: np.ndarray) -> list[tuple[str, Any]]:
        """(memory type, selector of src_u) per kind of the sources' regions, DRAM first."""
        if not self._vram:
            return [("DRAM", slice(None))]
        if len(self._vram) == len(self._regions):
            return [("VRAM", slice(None))]
        vram = np.isin(self._regions.starts_of(src_u),
                       np.fromiter(self._vram, np.uint64, len(self._vram)))
        if vram.all():
            return [("VRAM", slice(None))]
        if not vram.any():
            return [("DRAM", slice(None))]
        return [("DRAM", ~vram), ("VRAM", vram)]

    def _prepare(self, peer: str, mem: str, src: np.ndarray, dst: np.ndarray,
                 nbytes: np.ndarray) -> object:
        """An initialized WRITE of `mem` memory into the peer's memory of the same kind."""
        # device id column: 0 for host memory, the GPU index of each side for VRAM
        vram = mem == "VRAM"
        local_dev = np.full_like(src, (self._dev or 0) if vram else 0)
        remote_dev = np.full_like(src, self._peer_dev.get(peer, 0) if vram else 0)
        local = self._agent.get_xfer_descs(np.stack([src, nbytes, local_dev], 1), mem)
        remote = self._agent.get_xfer_descs(np.stack([dst, nbytes, remote_dev], 1), mem)
        try:
            return self._agent.initialize_xfer("WRITE", local, remote, peer)
        except self._errors as exc:
            # NOT_FOUND here means a destination outside what the peer registered (as of
            # the agent_info we hold) or a peer NIXL does not know.
            raise TransferError(
                f"nixl: write to {peer} refused: {exc!r}; every destination must lie inside "
                f"one region the peer registered as {mem} before its agent_info() was taken"
            ) from None

    def poll(self, batch: Batch) -> BatchState:
        if batch.state is not BatchState.PENDING:
            return batch.state
        with self._lock:
            if batch.state is not BatchState.PENDING:  # another thread finished it
                return batch.state
            xfers = [x for x in batch.handles if isinstance(x, _Xfer)]
            if not xfers:
                raise DescriptorError("nixl: this Batch was not submitted by a NixlEngine")
            if self._closed or any(id(x) not in self._inflight for x in xfers):
                batch.reason = "engine closed while the batch was in flight"
                batch.state = BatchState.FAILED
                return batch.state
            for xfer in xfers:
                if xfer.status != "PROC":
                    continue
                try:
                    xfer.status = self._agent.check_xfer_state(xfer.handle)
                except self._errors as exc:
                    xfer.status = f"{exc!r}"
                if xfer.status == "PROC" and time.monotonic() >= xfer.deadline:
                    xfer.status = (f"no completion within {self._transfer_timeout_s:.1f} s "
                                   "(peer hung or network stalled); cancelled")
            self._settle(batch)
        return batch.state

    def _settle(self, batch: Batch) -> None:
        """Ends the batch once each of its transfers is DONE or one failed (the others are
        then cancelled), releasing every handle; leaves it PENDING otherwise."""
        xfers = batch.handles
        failed = next((x.status for x in xfers if x.status not in ("PROC", "DONE")), None)
        if failed is None and any(x.status == "PROC" for x in xfers):
            return
        released = True
        for xfer in xfers:
            if self._inflight.pop(id(xfer), None) is not None:
                released &= self._release(xfer.handle)
        if failed is None:
            batch.state = BatchState.DONE
            return
        reason = "NIXL reported ERR" if failed == "ERR" else failed
        if not released:
            reason += "; the transfer handle could not be cancelled and was leaked"
        batch.reason = reason
        batch.state = BatchState.FAILED

    def _release(self, handle: object) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except self._errors:
            return False
        return True

    # -- teardown -----------------------------------------------------------------------------

    def transport(self) -> TransportInfo:
        """The backends NIXL created for this agent and the UCX transports and devices this
        process allows it (UCX picks among those; see ENV_DEFAULTS)."""
        try:
            backends = ",".join(sorted(self._agent.backends)) or "none"
        except Exception:  # noqa: BLE001
            backends = "unknown"
        tls = os.environ.get("UCX_TLS", "all")
        return TransportInfo(self.name, f"ucx(tls={tls})", os.environ.get("UCX_NET_DEVICES", "all"),
                             f"backends {backends}, {self._mem}"
                             + ("" if self._dev is None else f" of cuda:{self._dev}"))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for xfer in self._inflight.values():
                self._release(xfer.handle)
            self._inflight.clear()
            for peer in self._peers:
                try:
                    self._agent.remove_remote_agent(peer)
                except self._errors:
                    pass  # already gone; nothing to release
            self._peers.clear()
            self._peer_info.clear()
            for dlist in self._reg_dlists.values():
                try:
                    self._agent.deregister_memory(dlist)
                except self._errors:
                    pass
            self._reg_dlists.clear()
            self._vram.clear()
            self._regions = RegionTable()
            self._agent = None

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("nixl: engine is closed")
