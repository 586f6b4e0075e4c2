"""Pools: one registered arena per rank, carved into one buffer per (component, entry).

A serving engine brings its own pools; the demo, the tests and the parity harness use
these. Capacity is counted in items of the component's index kind: pages (page, window),
slots (slot), rows (ring: slots * R) and aux rows. Every buffer starts on a 4 KiB boundary
of the arena so engines can register the arena once.

`RankPools` keeps the arena in host memory (numpy); `TensorPools` in a torch tensor on a
device (a GPU, or the CPU for tests), for engines that move device memory. `EnginePools`
registers memory a serving engine already owns, in place (Note [Engine-owned memory]). The
endpoints use any of them through the same few methods (regions, view, address, new_bytes,
sync).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .layout_types import ComponentLayout, FamilyLayout
from .plan_types import Registration

ALIGN = 4096


@dataclass(frozen=True)
class Capacity:
    pages: int = 64
    slots: int = 4
    aux_rows: int = 8
    window_pages: int = 16

    def items(self, comp: ComponentLayout) -> int:
        return {
            "page": self.pages,
            "window": self.window_pages,
            "slot": self.slots,
            "ring": self.slots * comp.ring_rows,
            "aux": self.aux_rows,
        }[comp.index]


@dataclass(frozen=True)
class Buffer:
    component: str
    tensor: str
    layer_id: int
    offset: int  # bytes from the arena start (EnginePools: the address; its base is 0)
    item_bytes: int
    capacity: int  # items
    pitch: int = 0  # bytes from item i to item i + 1 (Note [Item pitch]); 0: item_bytes

    @property
    def stride(self) -> int:
        return self.pitch or self.item_bytes


class RankPools:
    """The arena and buffer table of one rank, in registration (wire) order."""

    def __init__(self, layout: FamilyLayout, registration: Registration, capacity: Capacity):
        self.layout = layout
        self.capacity = capacity
        self.buffers: dict[str, list[Buffer]] = {}
        offset = 0
        for name, entries, item_bytes in registration.components:
            comp = layout.component(name)
            cap = capacity.items(comp)
            bufs = []
            pitch = comp.pitch_for(item_bytes)
            for tensor, layer_id in entries:
                bufs.append(Buffer(name, tensor, layer_id, offset, item_bytes, cap, pitch))
                offset += -(-(pitch * cap) // ALIGN) * ALIGN
            self.buffers[name] = bufs
        self.nbytes = max(offset, ALIGN)
        self.arena = self.new_bytes(self.nbytes)
        self.base = address(self.arena)

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every memory region the engine must register: one arena."""
        return [(self.base, self.nbytes)]

    def new_bytes(self, nbytes: int, zeroed: bool = True):
        """A byte buffer in the pools' memory (staging arenas and gather buffers). Staging
        buffers need no zeroing (every byte read was written first) and stay untouched, so
        their pages are only committed where they are used."""
        return np.zeros(nbytes, dtype=np.uint8) if zeroed else np.empty(nbytes, np.uint8)

    def sync(self) -> None:
        """Wait until copies issued on these pools' memory have finished (host: nothing)."""

    def view(self, component: str, pos: int) -> np.ndarray:
        """[capacity, item_bytes] uint8 view of one buffer (rows `stride` bytes apart)."""
        b = self.buffers[component][pos]
        flat = self.arena[b.offset:b.offset + b.stride * b.capacity]
        if b.stride == b.item_bytes:
            return flat.reshape(b.capacity, b.item_bytes)
        return _rows(flat, b.capacity, b.item_bytes, b.stride)

    def address(self, component: str, pos: int) -> int:
        return self.base + self.buffers[component][pos].offset


class TensorPools(RankPools):
    """The same arena and buffers in a torch uint8 tensor on `device`; `view` returns a torch
    view. Copies the endpoints issue on it (staged gather and scatter) run on the calling
    thread's current stream; `sync` waits for them, before an engine reads or after it wrote."""

    def __init__(self, layout: FamilyLayout, registration: Registration, capacity: Capacity,
                 device):
        import torch

        self.device = torch.device(device)
        super().__init__(layout, registration, capacity)

    def new_bytes(self, nbytes: int, zeroed: bool = True):
        import torch

        make = torch.zeros if zeroed else torch.empty
        return make(nbytes, dtype=torch.uint8, device=self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            from .cuda_streams import sleep_until_idle

            sleep_until_idle(self.device)


def address(buf) -> int:
    """Address of the first byte of a numpy array or a torch tensor."""
    return int(buf.ctypes.data) if isinstance(buf, np.ndarray) else int(buf.data_ptr())


class RegistrationMismatch(ValueError):
    """An engine-owned tensor does not hold what the plan says its entry holds."""


# Note [Two memory kinds]: a rank has one transfer engine, made for host memory alone
# (make_engine's `device=`: nothing) or for one GPU ("cuda:N"). An engine for a GPU registers
# each region with the kind it lives in, decided per registration (engines/base.py
# `region_device`, asking the CUDA driver: `address_device`): NIXL as DRAM or VRAM of cuda:N,
# Mooncake at location "*" (host) or "cuda:N"; it refuses a region of another GPU. One NIXL
# transfer moves one memory type, so a write is split by its sources' kind and each part lands
# in memory of the same kind on the peer (the two sides of a plan mirror each other: host
# regions to host regions, the GPU's to the peer's GPU). The integrations pick the engine's
# device from the memory their serving engine's buffers live in (`engine_device`) and refuse
# buffers on two GPUs, naming one buffer on each and the spec. A rank with buffers in both
# kinds (host and one GPU) gets an engine for that GPU where the integration says it may
# (`host_too`): SGLang, which keeps its KV pools on the GPU and its metadata buffers (the aux
# row) on the host unless told otherwise (integrations/sglang/family.py); its layout moved
# every byte through both engines between two processes on an H100
# (tests/integrations/test_sglang_gpu.py, BENCHMARKS.md (q)). vLLM keeps one worker's caches
# on its GPU, so there both kinds are still refused. Engines that move one GPU's memory only
# (cuda_ipc, the local device engine) register no host memory.


def device_name(t) -> str:
    """"cpu" or "cuda:N" for a numpy array, a torch tensor, anything with a `.device`, or a
    device's name ("cuda" alone is cuda:0)."""
    if isinstance(t, np.ndarray):
        return "cpu"
    text = str(getattr(t, "device", t))
    if text.startswith("cuda"):
        return text if ":" in text else "cuda:0"
    return "cpu"


_CUDA: list = []  # [libcuda or None], loaded on first use


def address_device(addr: int) -> str:
    """"cuda:N" when `addr` is memory of GPU N, else "cpu" (host memory, also on a machine
    without CUDA): for engines that hand over addresses only (SGLang's KVArgs). Asks the CUDA
    driver (cuPointerGetAttribute), in the process that owns the memory."""
    import ctypes

    if not _CUDA:
        try:
            cu = ctypes.CDLL("libcuda.so.1")
            _CUDA.append(cu if cu.cuInit(0) == 0 else None)
        except OSError:
            _CUDA.append(None)
    cu = _CUDA[0]
    if cu is None or not addr:
        return "cpu"
    kind, ordinal = ctypes.c_uint(0), ctypes.c_int(-1)
    # CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2) is CU_MEMORYTYPE_DEVICE (2) for a GPU's memory;
    # host memory CUDA never saw answers an error, pinned host memory CU_MEMORYTYPE_HOST
    if cu.cuPointerGetAttribute(ctypes.byref(kind), 2, ctypes.c_uint64(addr)) != 0 or \
            kind.value != 2:
        return "cpu"
    # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL (9)
    if cu.cuPointerGetAttribute(ctypes.byref(ordinal), 9, ctypes.c_uint64(addr)) != 0:
        return "cuda:0"
    return f"cuda:{ordinal.value}"


def engine_device(tensors: Mapping[Any, Any], where: str,
                  owner: str = "vLLM's cache tensors of this worker",
                  hint: str = "pdc registers one worker's cache on one device; run one vLLM "
                              "worker per device",
                  label=None, host_too: bool = False) -> dict:
    """make_engine's `device=` for the memory `tensors` live in (Note [Two memory kinds]):
    nothing for host memory, {"device": "cuda:N"} for one GPU's, and with `host_too` also for
    host memory beside one GPU's. Tensors on several devices (host and a GPU count as two
    unless `host_too`) are refused: `where` locates the refusal (a spec), `owner` says whose
    buffers they are, `label(key)`, when given, names the first buffer on each device."""
    first: dict[str, Any] = {}
    for key, t in tensors.items():
        first.setdefault(device_name(t), key)
    devices = sorted(first)
    if host_too and len(devices) == 2 and devices[0] == "cpu":
        devices = devices[1:]  # the engine for the GPU registers the host regions as host's
    if len(devices) > 1:
        listed = ", ".join(d if label is None else f"{d}: {label(first[d])}" for d in devices)
        raise RegistrationMismatch(f"{where}: error: {owner} are on {len(devices)} devices "
                                   f"({listed})\n  hint: {hint}")
    if not devices or devices[0] == "cpu":
        return {}
    return {"device": devices[0]}


class EnginePools(RankPools):
    """Buffers that live in a serving engine's own tensors, registered in place (no copy).

    Note [Engine-owned memory]: a serving engine allocates its caches itself (vLLM one tensor
    per attention layer, SGLang a k and a v buffer per layer), so a rank has many memory
    regions instead of one arena. `tensors` maps every registered entry (component, tensor
    name, layer id) of this rank's Registration to a tensor whose first axis indexes items:
    item i is `t[i]`, contiguous, `item_bytes` bytes apart. Each tensor is checked against the
    plan (dtype, elements and bytes per item) and refused with a message naming both sides:
    `label(key)` says what the tensor is in the engine's own words (a layer name), and the
    spec location says where the plan's expectation comes from. Regions are the tensors'
    byte spans, merged where they overlap or touch (Mooncake refuses overlapping
    registrations), so views into one engine tensor register it once.
    """

    def __init__(self, layout: FamilyLayout, registration: Registration, tp: int,
                 tensors: Mapping[tuple[str, str, int], object], label=None):
        self.layout = layout
        self.capacity = None  # type: ignore[assignment]  # sized by the given tensors instead
        label = label or (lambda key: f"tensor {key[1]!r} of layer {key[2]}")
        self.buffers = {}
        self._tensors: dict[tuple[str, int], Any] = {}  # numpy arrays or torch tensors
        self.device = None
        wanted = set()
        spans = []
        for name, entries, item_bytes in registration.components:
            comp = layout.component(name)
            bufs: list[Buffer] = []
            for tensor, layer_id in entries:
                key = (name, tensor, layer_id)
                wanted.add(key)
                if key not in tensors:
                    raise RegistrationMismatch(
                        f"{comp.loc}: error: the plan registers {name}.{tensor} of layer "
                        f"{layer_id} on this rank, but the engine gave no tensor for it\n"
                        f"  hint: the engine's model must have the layers the spec declares "
                        f"({layout.spec_path})")
                t = tensors[key]
                pitch = comp.pitch_for(item_bytes)
                cap, base = _check_item_tensor(comp, item_bytes, pitch, tp, t, label(key))
                self._tensors[(name, len(bufs))] = t
                bufs.append(Buffer(name, tensor, layer_id, base, item_bytes, cap, pitch))
                spans.append((base, base + (cap - 1) * pitch + item_bytes))
                dev = _device_of(t)
                if self.device is None or dev.type != "cpu":
                    self.device = dev
            self.buffers[name] = bufs
        extra = sorted(set(tensors) - wanted)
        if extra:
            c, t, lid = extra[0]
            raise RegistrationMismatch(
                f"{layout.spec_path}: error: the engine gave {label(extra[0])} as {c}.{t} of "
                f"layer {lid}, which the plan does not register on this rank\n"
                f"  hint: the spec's layers and components must match the engine's model")
        self._regions = _merge(spans)
        self.base = 0  # buffers carry absolute addresses (Buffer.offset is the address)
        self.nbytes = sum(n for _, n in self._regions)

    def regions(self) -> list[tuple[int, int]]:
        return list(self._regions)

    def new_bytes(self, nbytes: int, zeroed: bool = True):
        if self.device is None or self.device.type == "cpu":
            return super().new_bytes(nbytes, zeroed)
        import torch

        make = torch.zeros if zeroed else torch.empty
        return make(nbytes, dtype=torch.uint8, device=self.device)

    def sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            from .cuda_streams import sleep_until_idle

            sleep_until_idle(self.device)

    def view(self, component: str, pos: int):
        """[capacity, item_bytes] uint8 view of the engine's tensor (numpy on the host)."""
        b = self.buffers[component][pos]
        t = self._tensors[(component, pos)]
        if isinstance(t, np.ndarray):
            if b.stride != b.item_bytes:  # numpy's reshape would copy a strided array
                return _rows(t, b.capacity, b.item_bytes, b.stride)
            return t.reshape(b.capacity, -1).view(np.uint8).reshape(b.capacity, b.item_bytes)
        import torch

        # Items are contiguous inside (checked at registration), so these stay views.
        u8 = t.reshape(b.capacity, -1).view(torch.uint8).reshape(b.capacity, b.item_bytes)
        return u8.numpy() if u8.device.type == "cpu" else u8

    def address(self, component: str, pos: int) -> int:
        return self.buffers[component][pos].offset


def _device_of(t):
    if isinstance(t, np.ndarray):
        import types

        return types.SimpleNamespace(type="cpu")
    return t.device


def _dtype_name(t) -> str:
    if isinstance(t, np.ndarray):
        return str(t.dtype)
    return str(t.dtype).removeprefix("torch.")


def _rows(buf: np.ndarray, rows: int, row_bytes: int, stride: int) -> np.ndarray:
    """[rows, row_bytes] uint8 view of the memory from `buf`'s first byte, rows `stride`
    bytes apart (its last axis is contiguous: checked at registration)."""
    return np.lib.stride_tricks.as_strided(buf.view(np.uint8), (rows, row_bytes), (stride, 1))


def _check_item_tensor(comp: ComponentLayout, item_bytes: int, pitch: int, tp: int, t,
                       what: str):
    """(capacity, address) of an engine tensor whose first axis indexes `comp`'s items,
    `pitch` bytes apart (Note [Item pitch])."""
    shape = tuple(int(n) for n in t.shape)
    local = list(comp.shape)
    if comp.shard is not None:
        local[comp.shard.axis] = comp.shard.local_axis(tp)
    plan_side = (f"the spec's component '{comp.name}' expects items of "
                 f"{list(local)} {comp.dtype} = {item_bytes} B on a rank of TP {tp}")
    if len(shape) < 1 or shape[0] < 1:
        raise RegistrationMismatch(f"{comp.loc}: error: {what} has shape {list(shape)}, no "
                                   f"items; {plan_side}")
    got_dtype = _dtype_name(t)
    elem = t.itemsize if isinstance(t, np.ndarray) else t.element_size()
    per_item = 1
    for n in shape[1:]:
        per_item *= n
    got = f"{what} holds items of {list(shape[1:])} {got_dtype} = {per_item * elem} B"
    if got_dtype != comp.dtype or per_item * elem != item_bytes:
        raise RegistrationMismatch(
            f"{comp.loc}: error: {got}; {plan_side}\n"
            f"  hint: the engine's model config (heads, head size, block size, dtype) and the "
            f"spec's params must agree, and so must both sides' TP")
    strides = t.strides if isinstance(t, np.ndarray) else tuple(s * elem for s in t.stride())
    contiguous = elem
    for n, st in zip(reversed(shape[1:]), reversed(strides[1:]), strict=True):
        if n > 1 and st != contiguous:
            break
        contiguous *= n
    else:
        if shape[0] == 1 or strides[0] == pitch:
            base = int(t.ctypes.data) if isinstance(t, np.ndarray) else int(t.data_ptr())
            return shape[0], base
    apart = f"{item_bytes} B items" if pitch == item_bytes else \
        f"{item_bytes} B items {pitch} B apart (the spec's pitch)"
    raise RegistrationMismatch(
        f"{comp.loc}: error: {what} is not a run of contiguous {apart} (byte "
        f"strides {list(strides)}); {plan_side}\n"
        f"  hint: register the engine's whole cache tensor, one item per block")


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, bytes) of the union of [start, end) spans."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b - a) for a, b in out]
