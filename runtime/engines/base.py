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
- `poll(batch)` never blocks and returns PENDING, DONE or FAILED; `wait(batch, timeout_s)`
  blocks with a deadline and raises `TransferError` on failure or timeout.
- `close()` releases everything; it is idempotent.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


class TransferError(RuntimeError):
    """A transfer failed or timed out; the message names the peer and the reason."""


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


class TransferEngine(ABC):
    name: str = "abstract"

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

    @abstractmethod
    def poll(self, batch: Batch) -> BatchState: ...

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
