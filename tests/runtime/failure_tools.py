"""Tools for in-process failure tests: an engine whose writes stay in flight until the test
releases them, a prefill/decode pair of the tiny family, and message gates."""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path

import numpy as np
from pdc.compiler.frontend import load_spec
from pdc.runtime import knobs
from pdc.runtime.control import BootstrapServer
from pdc.runtime.endpoints import DecodeEndpoint, PrefillEndpoint
from pdc.runtime.engines.base import (
    Batch,
    BatchState,
    TransferEngine,
    as_descriptors,
)
from pdc.runtime.plan_types import RankId
from pdc.runtime.pools import Capacity, RankPools

from pdc.verify.reliability_ranks import family_sources, load_family

from ..compiler.planning import plan_for

TINY = str(Path(__file__).parent / "specs" / "tiny.yaml")
R0 = RankId(0, 0)


class ManualEngine(TransferEngine):
    """Same-process engine: a write is a memmove, done at once, or held in flight (with
    `hold = True`) until `release()` lands it (or `release(fail=True)` fails it unwritten).
    It stands in for the local engine, so the tests' plans are lowered for `local` (an
    endpoint refuses a plan for another engine, Note [Plan backend])."""

    name = "local"

    def __init__(self) -> None:
        self.hold = False
        self.held: list = []
        self.submitted = 0
        self._lock = threading.Lock()

    def register(self, addr: int, nbytes: int) -> None:
        pass

    def deregister(self, addr: int) -> None:
        pass

    def agent_info(self) -> bytes:
        return b"manual"

    def connect(self, agent_info: bytes) -> str:
        return "peer"

    def submit_write(self, peer, src, dst, nbytes) -> Batch:
        s, d, n = as_descriptors(src, dst, nbytes)
        b = Batch(peer, [], int(n.sum()), int(s.size))
        with self._lock:
            self.submitted += 1
            if self.hold:
                self.held.append((b, s, d, n))
                return b
        _copy(s, d, n)
        b.state = BatchState.DONE
        return b

    def release(self, fail: bool = False) -> int:
        with self._lock:
            held, self.held = self.held, []
        for b, s, d, n in held:
            if fail:
                b.reason, b.state = "peer died", BatchState.FAILED
            else:
                _copy(s, d, n)
                b.state = BatchState.DONE
        return len(held)

    def poll(self, batch: Batch) -> BatchState:
        return batch.state

    def close(self) -> None:
        pass


def _copy(s, d, n) -> None:
    for a, b, k in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
        ctypes.memmove(b, a, k)


class Family:
    def __init__(self, prefill=None, decode=None, spec_path: str = TINY):
        spec = load_spec(spec_path)
        self.layout, self.plan = plan_for(spec_path, prefill or {"tp": 1}, decode or {"tp": 1},
                                          backend="local")
        self.sources = family_sources(spec)
        _, self.wire = load_family(self.sources)

    def pools(self, side: str, rank=R0) -> RankPools:
        return RankPools(self.layout, self.plan.registration(side, rank),
                         Capacity(pages=16, slots=4, aux_rows=4, window_pages=16))


class Pair:
    """One prefill and one decode endpoint of the tiny family in this process."""

    def __init__(self, fam: Family, boot: BootstrapServer | None = None,
                 engine: type[ManualEngine] | None = None):
        self.fam = fam
        self.boot = boot or BootstrapServer(1)
        self.peng, self.deng = (engine or ManualEngine)(), ManualEngine()
        self.ppools, self.dpools = fam.pools("prefill"), fam.pools("decode")
        self.pre = PrefillEndpoint(fam.layout, fam.wire, fam.plan, R0, 0, self.peng,
                                   self.ppools, self.boot.address)
        self.dec = self.decode_endpoint()

    def decode_endpoint(self, pools=None) -> DecodeEndpoint:
        dec = DecodeEndpoint(self.fam.layout, self.fam.wire, self.fam.plan, R0, 0,
                             self.deng, pools or self.dpools, self.boot.address)
        dec.wait_ready(5)
        return dec

    def close(self) -> None:
        self.dec.close()
        self.pre.close()
        self.boot.close()


def fill(pools: RankPools, pages, slot: int, value: int) -> None:
    """Give a request's items (kv pages, conv slot, aux row) one byte value."""
    for pos in range(len(pools.buffers["kv"])):
        pools.view("kv", pos)[list(pages)] = value
    for pos in range(len(pools.buffers["conv"])):
        pools.view("conv", pos)[slot] = value
    pools.view("aux_first_token", 0)[slot] = value


def values(pools: RankPools, pages, slot: int) -> set[int]:
    """The distinct byte values a request's items hold."""
    out = set()
    for pos in range(len(pools.buffers["kv"])):
        out |= set(np.unique(pools.view("kv", pos)[list(pages)]).tolist())
    for pos in range(len(pools.buffers["conv"])):
        out |= set(np.unique(pools.view("conv", pos)[slot]).tolist())
    out |= set(np.unique(pools.view("aux_first_token", 0)[slot]).tolist())
    return out


def send_all(sender, pages, slot: int, page_size: int = 4) -> None:
    sender.send(pages, 0, True, len(pages) * page_size, slot=slot, aux_row=slot)


def wait_for(pred, timeout: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.002)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Gate:
    """Holds the messages a hub hands to its endpoint until `open()`."""

    def __init__(self, hub):
        self.hub = hub
        self.real = hub.handler
        self.buffered: list = []
        hub.handler = self._hold

    def _hold(self, peer, payload):
        self.buffered.append((peer, payload))

    def open(self) -> None:
        """Replay what was held (on the caller's thread), then let messages through."""
        for peer, payload in self.buffered:
            self.real(peer, payload)
        self.buffered = []
        self.hub.handler = self.real


def tight_knobs(**extra) -> None:
    knobs.override(heartbeat_interval_s=0.05, peer_dead_after_s=0.6, abort_ack_timeout_s=0.6,
                   transfer_timeout_s=5.0, prefill_room_timeout_s=5.0, drain_timeout_s=5.0,
                   reconnect_interval_s=0.2, **extra)
