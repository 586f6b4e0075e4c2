"""Pools: one registered arena per rank, carved into one buffer per (component, entry).

A serving engine brings its own pools; the demo, the tests and the parity harness use
these. Capacity is counted in items of the component's index kind: pages (page, window),
slots (slot), rows (ring: slots * R) and aux rows. Every buffer starts on a 4 KiB boundary
of the arena so engines can register the arena once.

`RankPools` keeps the arena in host memory (numpy); `TensorPools` in a torch tensor on a
device (a GPU, or the CPU for tests), for engines that move device memory. The endpoints use
either through the same few methods (view, address, new_bytes, sync).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    offset: int  # bytes from the arena start
    item_bytes: int
    capacity: int  # items


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
            for tensor, layer_id in entries:
                bufs.append(Buffer(name, tensor, layer_id, offset, item_bytes, cap))
                offset += -(-(item_bytes * cap) // ALIGN) * ALIGN
            self.buffers[name] = bufs
        self.nbytes = max(offset, ALIGN)
        self.arena = self.new_bytes(self.nbytes)
        self.base = address(self.arena)

    def new_bytes(self, nbytes: int, zeroed: bool = True):
        """A byte buffer in the pools' memory (staging arenas and gather buffers). Staging
        buffers need no zeroing (every byte read was written first) and stay untouched, so
        their pages are only committed where they are used."""
        return np.zeros(nbytes, dtype=np.uint8) if zeroed else np.empty(nbytes, np.uint8)

    def sync(self) -> None:
        """Wait until copies issued on these pools' memory have finished (host: nothing)."""

    def view(self, component: str, pos: int) -> np.ndarray:
        """[capacity, item_bytes] uint8 view of one buffer."""
        b = self.buffers[component][pos]
        flat = self.arena[b.offset:b.offset + b.item_bytes * b.capacity]
        return flat.reshape(b.capacity, b.item_bytes)

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
            import torch

            torch.cuda.current_stream(self.device).synchronize()


def address(buf) -> int:
    """Address of the first byte of a numpy array or a torch tensor."""
    return int(buf.ctypes.data) if isinstance(buf, np.ndarray) else int(buf.data_ptr())

    def sections(self) -> list[list[tuple[int, int, int, int, int]]]:
        """Per component: (layer id, tensor index, base address, item bytes, capacity)."""
        out = []
        for comp in self.layout.components:
            rows = []
            for pos, b in enumerate(self.buffers[comp.name]):
                rows.append((b.layer_id, comp.tensors.index(b.tensor), self.address(comp.name, pos),
                             b.item_bytes, b.capacity))
            out.append(rows)
        return out
