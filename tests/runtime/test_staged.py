"""The staged path through the endpoints, in one process: prefill tp=1 -> decode tp=2 of the
tiny family, so every KV page and conv slot moves as head slices and sub-blocks.

The oracle is the direct path: the same request moved both ways must leave the same bytes on
every decode rank. Pools are host memory (numpy, with an engine that memmoves), torch tensors
on the CPU, or tensors on two GPUs (the local engine's device mode; `-m gpu`).
tests/runtime/test_e2e.py runs the staged path over Mooncake and NIXL between processes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from pdc.runtime import knobs
from pdc.runtime.control import BootstrapServer
from pdc.runtime.endpoints import DecodeEndpoint, Faults, KVPoll, PageState, PrefillEndpoint
from pdc.runtime.engines import make_engine
from pdc.runtime.plan_types import RankId
from pdc.runtime.pools import Capacity, TensorPools

from .failure_tools import R0, Family, ManualEngine, tight_knobs, wait_for

POISON = 0xA5
PAGE = 4  # tokens per page of the tiny family


# Where the pools live: None = host numpy pools with ManualEngine; else (prefill device,
# decode device, the staging_copies knob) of TensorPools moved by the local engine's device
# mode. Copy kernels on CPU tensors run in the Triton interpreter.
POOLS = {"host": None, "torch-cpu": ("cpu", "cpu", "torch"),
         "kernels-cpu": ("cpu", "cpu", "kernels"), "cuda": ("cuda:0", "cuda:1", "auto"),
         "cuda-torch": ("cuda:0", "cuda:1", "torch"), "cuda-one": ("cuda:0", "cuda:0", "auto")}


class Split:
    """One prefill rank (tp=1) and two decode ranks (tp=2), each with its own engine."""

    def __init__(self, fam: Family, decode_arena_bytes: int | None = None, devices=None):
        self.fam = fam
        # Copy kernels expected: asked for, or "auto" on CUDA.
        self.kernels = devices is not None and (devices[2] == "kernels" or (
            devices[2] == "auto" and devices[0].startswith("cuda")))
        if devices is not None:
            knobs.override(staging_copies=devices[2])
        self.boot = BootstrapServer(1)
        if devices is None:
            self.peng = ManualEngine()
            self.ppools = fam.pools("prefill")
        else:
            self.peng = make_engine("local", device=devices[0])
            self.ppools = self._tensor_pools("prefill", R0, devices[0])
        self.pre = PrefillEndpoint(fam.layout, fam.wire, fam.plan, R0, 0, self.peng,
                                   self.ppools, self.boot.address)
        if decode_arena_bytes is not None:
            knobs.override(staging_arena_bytes=decode_arena_bytes)
        ranks = [RankId(0, t) for t in range(2)]
        if devices is None:
            self.dpools = [fam.pools("decode", r) for r in ranks]
            self.dengs = [ManualEngine() for _ in ranks]
        else:
            self.dpools = [self._tensor_pools("decode", r, devices[1]) for r in ranks]
            self.dengs = [make_engine("local", device=devices[1]) for _ in ranks]
        self.decs = [DecodeEndpoint(fam.layout, fam.wire, fam.plan, r, 0, eng, pools,
                                    self.boot.address)
                     for r, eng, pools in zip(ranks, self.dengs, self.dpools, strict=True)]
        for d in self.decs:
            d.wait_ready(5)
        fill = np.random.default_rng(7).integers(0, 256, self.ppools.nbytes, dtype=np.uint8)
        if devices is None:
            self.ppools.arena[:] = fill
            for p in self.dpools:
                p.arena[:] = POISON
        else:
            self.ppools.arena.copy_(torch.from_numpy(fill))
            for p in self.dpools:
                p.arena.fill_(POISON)
            self.ppools.sync()

    def _tensor_pools(self, side: str, rank, device) -> TensorPools:
        return TensorPools(self.fam.layout, self.fam.plan.registration(side, rank),
                           Capacity(pages=16, slots=4, aux_rows=4, window_pages=16), device)

    def request(self, room: int, dpages, dslot: int, prefix_tokens: int = 0, gen: int = 0):
        """Prefill pages 0..2 (chunks [0, 1] and [2]) and slot 0 into `dpages` / `dslot`."""
        rvs = [d.receiver(room, gen) for d in self.decs]
        for rv in rvs:
            rv.init(dpages, prefix_tokens, slot=dslot, aux_row=dslot)
        s = self.pre.sender(room, gen)
        s.send([0, 1], 0, False, 2 * PAGE)
        s.send([2], 2, True, 3 * PAGE - 1, slot=0, aux_row=0)
        return s, rvs

    def items(self, t: int, pages, slot: int) -> list[np.ndarray]:
        """Copies of a request's items on decode rank t, in a fixed order."""
        out = []
        for name, bufs in self.dpools[t].buffers.items():
            ids = list(pages) if name == "kv" else [slot]
            for pos in range(len(bufs)):
                rows = self.dpools[t].view(name, pos)[ids]
                out.append(rows.copy() if isinstance(rows, np.ndarray) else rows.cpu().numpy())
        return out

    def close(self) -> None:
        for d in self.decs:
            d.close()
        self.pre.close()
        self.boot.close()


@pytest.fixture(scope="module")
def fam():
    return Family({"tp": 1}, {"tp": 2})


@pytest.fixture
def split(fam):
    tight_knobs()
    s = Split(fam)
    yield s
    s.close()
    knobs.reset()


def _pools_param(kind: str):
    marks = []
    if kind.startswith("cuda"):  # "cuda-one": prefill and decode on one device
        need = 1 if kind == "cuda-one" else 2
        marks = [pytest.mark.gpu, pytest.mark.skipif(
            torch.cuda.device_count() < need,
            reason="needs a CUDA device" if need == 1 else "needs two CUDA devices")]
    return pytest.param(POOLS[kind], id=kind, marks=marks)


@pytest.fixture(params=[_pools_param(k) for k in POOLS])
def any_split(fam, request):
    tight_knobs()
    s = Split(fam, devices=request.param)
    yield s
    s.close()
    knobs.reset()


def _done(rvs) -> bool:
    return all(rv.poll() == KVPoll.Success for rv in rvs)


def test_staged_request_lands_the_same_bytes_as_the_direct_path(any_split):
    split = any_split
    # Link checksums on: decode verifies the scattered bytes against prefill's digest.
    knobs.override(staged_min_descriptors=0, checksum=1)
    s_staged, staged = split.request(20, [9, 3, 11], 2, prefix_tokens=PAGE)
    wait_for(lambda: _done(staged), what="the staged request")
    knobs.override(staged_min_descriptors=10**9)
    s_direct, direct = split.request(21, [4, 12, 6], 3, prefix_tokens=PAGE)
    wait_for(lambda: _done(direct), what="the direct request")
    assert [rv.links for rv in staged] == [(1, 1), (1, 1)]
    assert [rv.links for rv in direct] == [(0, 1), (0, 1)]
    for t in range(2):
        # The prefix page (position 0) is decode's own: untouched on both paths.
        assert all(np.all(a == POISON) for a in split.items(t, [9, 4], 0)[:4])
        got = split.items(t, [3, 11], 2)
        want = split.items(t, [12, 6], 3)
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        assert not any(np.all(a == POISON) for a in got)
        # Each region went back to the arena after the scatter.
        arena = split.decs[t].arena
        assert arena.free == [(0, len(arena.buf))]
    assert s_staged.stats.descriptors < s_direct.stats.descriptors
    assert sum(d.stats().get("checksum_mismatches", 0) for d in split.decs) == 0
    # The staged copies went through the copy kernels exactly where expected.
    for ep in (split.pre, *split.decs):
        assert (ep.launches is not None and len(ep.launches.tables) > 0) == split.kernels
    assert split.pre.arena.free == [(0, len(split.pre.arena.buf))]


def test_a_full_decode_arena_falls_back_to_the_direct_path(fam):
    # With rings off (tests/runtime/test_staged_ring.py has them on).
    tight_knobs(staged_min_descriptors=0, staging_ring_slots=0)
    split = Split(fam, decode_arena_bytes=64)
    try:
        _, rvs = split.request(22, [1, 2, 3], 1)
        wait_for(lambda: _done(rvs), what="the request")
        assert [rv.links for rv in rvs] == [(0, 1), (0, 1)]
        assert split.decs[0].stats()["staging_full"] == 1
    finally:
        split.close()
        knobs.reset()


def test_prefill_without_an_arena_gathers_into_a_buffer_of_its_own(fam):
    tight_knobs(staged_min_descriptors=0, staging_arena_bytes=0)  # prefill: no arena
    split = Split(fam, decode_arena_bytes=1 << 20)
    try:
        _, rvs = split.request(23, [1, 2, 3], 1)
        wait_for(lambda: _done(rvs), what="the request")
        assert [rv.links for rv in rvs] == [(1, 1), (1, 1)]
        assert split.pre.stats()["staging_own_buffers"] == 2  # one per decode rank
        knobs.override(staged_min_descriptors=10**9)
        _, direct = split.request(24, [5, 6, 7], 2)
        wait_for(lambda: _done(direct), what="the direct request")
        for t in range(2):
            got, want = split.items(t, [1, 2, 3], 1), split.items(t, [5, 6, 7], 2)
            assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        split.close()
        knobs.reset()


@pytest.mark.parametrize("region,reason", [
    ("outside", "staging region {addr:#x}+{n} is outside the staging arena decode registered "
                "({base:#x}+{size})"),
    ("short", "staging region of {n} bytes; this request's staging layout needs {need} (both "
              "sides must lower the same plan)"),
])
def test_a_bad_staging_region_fails_that_request_before_any_write(split, region, reason):
    """A decode rank that names memory outside its registered arena, or a region of another
    size than the plan's staging layout, gets its request refused; nothing is written."""
    knobs.override(staged_min_descriptors=0)
    dec = split.decs[1]
    seen = {}

    def bad_region(addr, n):
        seen["need"] = n
        if region == "outside":
            addr = dec.arena.base + len(dec.arena.buf) - n + 64
        else:
            n -= 1
        seen["addr"], seen["n"] = addr, n
        return addr, n

    dec.faults = Faults(staging_region=bad_region)  # Note [Fault hooks]
    s, rvs = split.request(25, [1, 2, 3], 1)
    wait_for(lambda: all(rv.poll() == KVPoll.Failed for rv in rvs), what="the refusal")
    why = reason.format(base=dec.arena.base, size=len(dec.arena.buf), **seen)
    assert rvs[1].reason == f"prefill.dp0.pp0.tp0: bad index from decode pp0.tp1: {why}"
    assert split.peng.submitted == 0
    for t in range(2):
        assert all(np.all(a == POISON) for a in split.items(t, [1, 2, 3], 1))
    wait_for(lambda: all(rv.page_state == PageState.REUSABLE for rv in rvs), what="reusable")
    for d in split.decs:
        d._tick()  # frees regions of failed requests whose sources are quiet
        assert d.arena.free == [(0, len(d.arena.buf))]


def test_an_aborted_staged_request_frees_its_region_only_after_the_drain(split):
    knobs.override(staged_min_descriptors=0)
    split.peng.hold = True
    s, rvs = split.request(26, [1, 2, 3], 1)
    wait_for(lambda: len(split.peng.held) >= 2, what="writes in flight")
    arena = split.decs[0].arena
    assert arena.free != [(0, len(arena.buf))]
    assert rvs[0].abort(wait=False) is False
    time.sleep(0.2)
    split.decs[0]._tick()
    assert arena.free != [(0, len(arena.buf))]  # prefill may still write into it
    split.peng.release()
    wait_for(lambda: rvs[0].page_state == PageState.REUSABLE, what="the drain ack")
    wait_for(lambda: arena.free == [(0, len(arena.buf))], what="the region freed")
    wait_for(lambda: split.pre.arena.free == [(0, len(split.pre.arena.buf))],
             what="the gather buffers freed")


def test_a_quarantined_staged_request_keeps_its_region(split):
    knobs.override(staged_min_descriptors=0)
    split.peng.hold = True
    _, rvs = split.request(27, [1, 2, 3], 1)
    wait_for(lambda: len(split.peng.held) >= 2, what="writes in flight")
    assert rvs[0].abort() is False  # no ack within abort_ack_timeout_s: quarantined
    dec = split.decs[0]
    rvs[0].release()
    assert dec.stats()["staging_bytes_quarantined"] > 0
    assert dec.arena.free != [(0, len(dec.arena.buf))]  # never handed out again
    split.peng.release()


class _ScatterEvent:
    """A CUDA event stand-in for decode's queued scatter (Note [Scatter by event])."""

    def __init__(self):
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


@pytest.fixture
def event_split(fam, monkeypatch):
    # The copy kernels on CPU tensors (Triton interpreter), and a controllable event after
    # decode's scatter launches instead of the CUDA one.
    from pdc.runtime.endpoints import staged

    events = []  # (the decode rank's pools, its scatter's event), in the order queued

    def make(pools):
        events.append((pools, _ScatterEvent()))
        return events[-1][1]

    monkeypatch.setattr(staged, "_scatter_event", make)
    tight_knobs(staged_min_descriptors=0, checksum=1)
    s = Split(fam, devices=POOLS["kernels-cpu"])
    s.events = events
    # The decode ranks' control threads queue their scatters in either order.
    s.event_of = lambda i: next(ev for pools, ev in events if pools is s.decs[i].pools)
    yield s
    s.close()
    knobs.reset()


def test_a_queued_scatter_turns_success_only_once_its_event_completes(event_split):
    split = event_split
    s, rvs = split.request(30, [9, 3, 11], 2)
    wait_for(lambda: len(split.events) == 2 and s.poll() == KVPoll.Success,
             what="every source's Success and both scatters queued")
    time.sleep(0.1)
    for rv, dec in zip(rvs, split.decs, strict=True):
        dec._tick()
        assert rv.poll() == KVPoll.WaitingForInput  # the scatter is only queued
        assert rv.page_state == PageState.IN_USE
        assert dec.arena.free != [(0, len(dec.arena.buf))]  # the scatter reads its region
    split.event_of(0).done = True
    assert rvs[0].poll() == KVPoll.Success  # at the next poll, without a wait
    assert split.event_of(0).waited == 0
    split.event_of(1).done = True
    split.decs[1]._tick()  # or at the control thread's next tick
    assert rvs[1].poll() == KVPoll.Success
    for dec in split.decs:
        assert dec.arena.free == [(0, len(dec.arena.buf))]
        assert dec.stats().get("checksum_mismatches", 0) == 0


def test_an_abort_during_a_queued_scatter_waits_for_it_first(event_split):
    split = event_split
    s, rvs = split.request(31, [9, 3, 11], 2)
    wait_for(lambda: len(split.events) == 2 and s.poll() == KVPoll.Success,
             what="every source's Success and both scatters queued")
    assert rvs[0].abort() is True  # every source is quiet: the pages are reusable
    assert split.event_of(0).waited == 1  # ... but only after the scatter into them ended
    assert rvs[0].poll() == KVPoll.Failed and rvs[0].reason == "aborted by decode"
    rvs[1].release()  # released while queued: waits, ends, gives the region back
    assert split.event_of(1).waited == 1
    for dec in split.decs:
        assert dec.arena.free == [(0, len(dec.arena.buf))]
