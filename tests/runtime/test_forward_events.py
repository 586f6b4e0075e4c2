"""Note [Forward events] (integrations/vllm/events.py): a layer's send never reads the layer
before the forward's kernels wrote it.

The vLLM worker's pattern without vLLM: vllm-llama cache tensors registered in place
(EnginePools), a prefill and a decode endpoint of this process over the local engine, a
streaming send, and a "forward" that writes each layer and reports it with
`layer_done(layer, event=ForwardEvents.record())`. On a GPU the forward runs on its own stream
and a deliberately slow kernel (`torch.cuda._sleep`) comes before each layer's write, so the
layer is reported while its kernels are still queued: without the event the engine's copy
reads the layer's old bytes (docs/vllm.md "GPU ordering" has the H200 run, and the run with
the wait removed). On a CPU no event is made and the same flow runs. Every byte of every
block is checked.
"""

from __future__ import annotations

import time

import pytest
import torch
from pdc.integrations.vllm.events import ForwardEvents
from pdc.integrations.vllm.plans import make_plan
from pdc.runtime import knobs
from pdc.runtime.control import BootstrapServer
from pdc.runtime.endpoints import DecodeEndpoint, KVPoll, PrefillEndpoint
from pdc.runtime.engines import make_engine
from pdc.runtime.family import Family
from pdc.runtime.plan_types import RankId
from pdc.runtime.pools import EnginePools

R0 = RankId(0, 0)
BLOCKS = 2048  # per request: 32 MiB of KV per layer, so a copy of the layer takes a while
SLEEP_CYCLES = 400_000_000  # the slow kernel before each layer's write: ~0.2-1 s of GPU time


def _cuda() -> bool:
    return torch.cuda.is_available()


DEVICES = ["cpu", pytest.param("cuda:0", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")])]


def test_no_event_is_made_for_host_memory():
    assert ForwardEvents.of({"l0": torch.empty(2), "l1": torch.empty(2)}).record() is None


class Side:
    """One side's vLLM-shaped caches, in place in EnginePools, and its endpoint."""

    def __init__(self, side: str, device: str, blocks: int, boot: str, fill: int):
        family = Family.load("vllm_llama")
        self.layout = family.layout
        plan = make_plan(family, 1, 1, "local")
        self.caches = {
            layer: torch.full((blocks, 2, 32, 128), fill, dtype=torch.bfloat16, device=device)
            for layer in (0, 1)}
        tensors = {("kv", "kv", layer): t for layer, t in self.caches.items()}
        self.engine = make_engine("local", device=device)
        pools = EnginePools(self.layout, plan.registration(side, R0), 1, tensors)
        cls = PrefillEndpoint if side == "prefill" else DecodeEndpoint
        self.ep = cls(self.layout, family, plan, R0, 0, self.engine, pools, boot)


def _wait(pred, what: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_leaves_only_after_the_kernels_that_write_it(device):
    knobs.override(transfer_timeout_s=60, prefill_room_timeout_s=120)
    boot = BootstrapServer(1)
    n_blocks = 2 * BLOCKS + 8
    pre = Side("prefill", device, n_blocks, boot.address, fill=1)  # 1.0: the old KV
    dec = Side("decode", device, n_blocks, boot.address, fill=-1)  # poisoned
    try:
        dec.ep.wait_ready(10)
        src_blocks = torch.arange(4, 4 + BLOCKS, device=device)  # other ids on each side
        dst_blocks = torch.arange(BLOCKS + 6, 2 * BLOCKS + 6, device=device)
        g = torch.Generator(device=device).manual_seed(7)
        new = {layer: torch.randn((BLOCKS, 2, 32, 128), generator=g, device=device)
               .to(torch.bfloat16) for layer in (0, 1)}
        rv = dec.ep.receiver(31)
        rv.init(dst_blocks.tolist(), 0)
        sender = pre.ep.sender(31)
        sender.send(src_blocks.tolist(), 0, True, BLOCKS * 32, stream=True)
        _wait(lambda: sender.poll() != KVPoll.Bootstrapping, "decode's transfer request")

        events = ForwardEvents.of(pre.caches)
        forward = torch.cuda.Stream(device) if device.startswith("cuda") else None
        if forward is not None:
            # A kernel's first launch loads its module and synchronizes the device (CUDA's
            # lazy loading): launch both kernels once before the forward is timed against.
            with torch.cuda.stream(forward):
                torch.cuda._sleep(1000)
                pre.caches[0][src_blocks[:1]] = new[0][:1]
                pre.caches[0][src_blocks[:1]] = 1
            torch.cuda.synchronize(device)
        still_running = []
        for layer in (0, 1):
            if forward is None:
                pre.caches[layer][src_blocks] = new[layer]
                pre.ep.layer_done(layer, event=events.record())
                continue
            with torch.cuda.stream(forward):
                torch.cuda._sleep(SLEEP_CYCLES)  # the forward's slow kernels ...
                pre.caches[layer][src_blocks] = new[layer]  # ... then the layer's KV
                event = events.record()
                still_running.append(not event.query())
                pre.ep.layer_done(layer, event=event)
        if forward is not None:
            with torch.cuda.stream(forward):
                pre.ep.forward_done(event=events.record())
        else:
            pre.ep.forward_done(event=events.record())
        _wait(lambda: rv.poll() in (KVPoll.Success, KVPoll.Failed), "the transfer")
        assert rv.poll() == KVPoll.Success, rv.reason
        if forward is not None:
            torch.cuda.synchronize(device)
        for layer in (0, 1):
            got = dec.caches[layer][dst_blocks].view(torch.int16)
            want = new[layer].view(torch.int16)
            wrong = int((got != want).sum())
            assert wrong == 0, (f"layer {layer}: {wrong} of {want.numel()} values differ from "
                                f"what the forward wrote (old KV read: "
                                f"{int((dec.caches[layer][dst_blocks] == 1).sum())})")
            # blocks outside the request untouched
            rest = torch.ones(n_blocks, dtype=torch.bool, device=device)
            rest[dst_blocks] = False
            assert bool((dec.caches[layer][rest] == -1).all())
        assert sender.poll() == KVPoll.Success
        # The hook ran while the layer's kernels were still queued: the race was real.
        assert still_running == ([True, True] if forward is not None else [])
    finally:
        dec.ep.close()
        pre.ep.close()
        boot.close()
        knobs.reset()
