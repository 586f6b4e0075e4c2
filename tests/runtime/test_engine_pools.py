"""Engine-owned memory (Note [Engine-owned memory]): buffers in a serving engine's own tensors,
many regions per rank, checked against the plan, moved in place by the endpoints.

The tensors have vLLM's cache layout, [num_blocks, 2, block_size, kv_heads * head_dim] per
layer (specs/vllm-llama.yaml); tests/vllm/ moves the same tensors between real vLLM engines.
"""

from __future__ import annotations

import importlib
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

SPEC = str(Path(__file__).parents[2] / "specs" / "vllm-llama.yaml")
WIRE = Family.load("vllm_llama")
LAYOUT = importlib.import_module("pdc.generated.vllm_llama.layout").LAYOUT


def vllm_caches(blocks: int, layers: int = 2, block_size: int = 32, heads_x_dim: int = 128,
                dtype=torch.bfloat16) -> dict[int, torch.Tensor]:
    return {i: torch.zeros(blocks, 2, block_size, heads_x_dim, dtype=dtype)
            for i in range(layers)}


def pools_for(side: str, caches: dict[int, torch.Tensor], tp: int = 1, rank=R0):
    _, plan = plan_for(SPEC, {"tp": tp}, {"tp": 1}, "local")  # ManualEngine is "local"
    layout = LAYOUT
    tensors = {("kv", "kv", i): t for i, t in caches.items()}
    return layout, plan, EnginePools(layout, plan.registration(side, rank), tp, tensors,
                                     label=lambda key: f"vLLM layer {key[2]} cache")


def test_each_engine_tensor_is_one_region_and_items_are_its_blocks():
    caches = vllm_caches(blocks=8)
    _, _, pools = pools_for("prefill", caches)
    assert pools.regions() == [(caches[i].data_ptr(), caches[i].nbytes)
                               for i in sorted(caches, key=lambda i: caches[i].data_ptr())]
    assert pools.address("kv", 1) == caches[1].data_ptr()
    assert pools.buffers["kv"][0].capacity == 8
    caches[0][3].fill_(1.0)  # block 3 of layer 0, K and V
    view = pools.view("kv", 0)
    assert view.shape == (8, 16384)
    assert view[3].any() and not view[2].any() and not view[4].any()


def test_views_into_one_engine_tensor_register_it_once():
    whole = torch.zeros(2, 8, 2, 32, 128, dtype=torch.bfloat16)  # [layer, block, ...]
    _, plan = plan_for(SPEC, {"tp": 1}, {"tp": 1}, "local")
    pools = EnginePools(LAYOUT, plan.registration("prefill", R0), 1,
                        {("kv", "kv", i): whole[i] for i in range(2)})
    assert pools.regions() == [(whole.data_ptr(), whole.nbytes)]


def test_a_cache_of_another_block_size_is_refused_naming_both_sides():
    with pytest.raises(RegistrationMismatch) as e:
        pools_for("decode", vllm_caches(blocks=8, block_size=16))
    assert str(e.value) == (
        "specs/vllm-llama.yaml:30:3: error: vLLM layer 0 cache holds items of [2, 16, 128] "
        "bfloat16 = 8192 B; the spec's component 'kv' expects items of "
        "[2, 32, 2, 64] bfloat16 = 16384 B on a rank of TP 1\n"
        "  hint: the engine's model config (heads, head size, block size, dtype) and the "
        "spec's params must agree, and so must both sides' TP")


def test_a_cache_of_another_dtype_is_refused():
    with pytest.raises(RegistrationMismatch, match=r"holds items of \[2, 32, 64\] float32 = "
                                                   r"16384 B; the spec's component"):
        pools_for("decode", vllm_caches(blocks=8, heads_x_dim=64, dtype=torch.float32))


def test_a_tp2_rank_holds_half_the_heads_of_every_block():
    _, _, pools = pools_for("prefill", vllm_caches(blocks=4, heads_x_dim=64), tp=2)
    assert pools.buffers["kv"][0].item_bytes == 8192
    with pytest.raises(RegistrationMismatch, match=r"expects items of \[2, 32, 1, 64\] "
                                                   r"bfloat16 = 8192 B on a rank of TP 2"):
        pools_for("prefill", vllm_caches(blocks=4), tp=2)


def test_a_missing_layer_and_strided_blocks_are_refused():
    caches = vllm_caches(blocks=8)
    del caches[1]
    with pytest.raises(RegistrationMismatch, match="the plan registers kv.kv of layer 1 on "
                                                   "this rank, but the engine gave no tensor"):
        pools_for("decode", caches)
    strided = {i: t[::2] for i, t in vllm_caches(blocks=8).items()}  # every other block
    with pytest.raises(RegistrationMismatch, match="is not a run of contiguous 16384 B items"):
        pools_for("decode", strided)


@pytest.fixture
def tight():
    tight_knobs()
    yield
    knobs.reset()


def test_endpoints_move_blocks_between_engine_tensors_in_place(tight):
    """Prefill blocks 1, 2, 5 land in decode blocks 6, 0, 3 of the same layer; nothing else
    of decode's caches changes."""
    pcache, dcache = vllm_caches(blocks=8), vllm_caches(blocks=8)
    for i, t in pcache.items():
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
    layout, plan, ppools = pools_for("prefill", pcache)
    _, _, dpools = pools_for("decode", dcache)
    boot = BootstrapServer(1)
    peng, deng = ManualEngine(), ManualEngine()
    pre = PrefillEndpoint(layout, WIRE, plan, R0, 0, peng, ppools, boot.address)
    dec = DecodeEndpoint(layout, WIRE, plan, R0, 0, deng, dpools, boot.address)
    try:
        dec.wait_ready(5)
        rv = dec.receiver(7)
        rv.init([6, 0, 3], 0)
        pre.sender(7).send([1, 2, 5], 0, True, 90)
        wait_for(lambda: rv.poll() == KVPoll.Success, what="the transfer")
        for i in range(2):
            assert torch.equal(dcache[i][[6, 0, 3]], pcache[i][[1, 2, 5]])
            assert not dcache[i][[1, 2, 4, 5, 7]].any()
    finally:
        dec.close()
        pre.close()
        boot.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pools_wait_for_their_stream_asleep():
    # Note [Sleeping waits] (TensorPools.sync, EnginePools.sync): behind ~50 ms of GPU work
    # the waiting thread sleeps; a stream synchronize would spin it for the whole wait.
    import resource
    import time

    from pdc.runtime.cuda_streams import sleep_until_idle

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    device = torch.device("cuda:0")
    x = torch.zeros(1, device=device)
    # Both kernels once first: a kernel's first launch loads its module, and that load waited
    # for the sleep queued before it (a first run spent its 50 ms there, the wait 0.2 ms).
    torch.cuda._sleep(1_000)
    x += 1
    x.zero_()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    x += 1
    wall, cpu = time.monotonic(), cpu_s()
    sleep_until_idle(device)
    wall, cpu = time.monotonic() - wall, cpu_s() - cpu
    assert x.item() == 1.0
    assert wall > 0.01, f"the wait did not wait for the GPU work ({wall * 1e3:.1f} ms)"
    assert cpu < 0.5 * wall, f"{cpu * 1e3:.1f} ms of CPU in a {wall * 1e3:.1f} ms wait"
