"""pdc's SGLang backend on GPU memory (Note [SGLang memory kinds] in
integrations/sglang/family.py): a request's pages move prefill -> decode between two processes
over Mooncake (its CUDA wheel) and NIXL (VRAM), every byte checked.

SGLang itself is not needed (nor installed on the GPU machine): each process allocates its
buffers on cuda:0 as SGLang 0.5.23's pool classes allocate them, with no custom memory pool
and the NHD layout,
- KV (`mem_cache/memory_pool.py:2624-2645`, MHATokenToKVPool._create_buffers_normal): per
  layer one [2, size + page_size, kv_heads, head_dim] tensor, K its first half and V its
  second; KVArgs list K of every layer then V, each `size + page_size` rows, a page's bytes per
  item (`get_contiguous_buf_infos`, memory_pool.py:2775-2789);
- metadata (`disaggregation/utils.py:436-494`, MetadataBuffers, in get_buf_infos order):
  plain `torch.zeros` on the host by default (`utils.py:416`), on the GPU as
  SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK puts them (`utils.py:425-426`).
The KVArgs built from them go through the backend's own code: `served_family` (binding, the
engine's GPU), `engine_pools`, and an engine made with `ServedFamily.engine_kwargs`, as
PdcKVManager does, which registers each buffer with its own memory kind (Note [Two memory
kinds] in runtime/pools.py); then pdc's endpoints move the request, in two chunks.
SGLang's default layout (metadata on the host) passed here on an H100 on 2026-12-05 over both
engines (BENCHMARKS.md (q)), which is why the backend accepts it.

    pytest -q tests/integrations/test_sglang_gpu.py   # on a CUDA machine with the engines
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 2, 2, 64, 16
PAGES = 24  # the pool's pages; SGLang adds one padding page (page 0)
ROWS = 4  # metadata rows (requests in flight)
CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": LAYERS,
          "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS}
SRC_PAGES, DST_PAGES = [3, 9, 1, 17, 12, 5, 20], [8, 2, 23, 4, 15, 11, 6]
SRC_ROW, DST_ROW = 1, 3
ROOM = 4242

_HAVE = {"mooncake": importlib.util.find_spec("mooncake") is not None,
         "nixl": any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl_cu13", "nixl"))}


def sglang_buffers(seed: int, metadata_device: str = "cpu"):
    """(KVArgs, tensors) as SGLang's MHATokenToKVPool and MetadataBuffers allocate them."""
    g = torch.Generator(device="cuda:0").manual_seed(seed)
    rows = PAGES * PAGE + PAGE
    fused = [torch.randint(-100, 100, (2, rows, KV_HEADS, HEAD_DIM), generator=g,
                           device="cuda:0").to(torch.bfloat16) for _ in range(LAYERS)]
    k, v = [f[0] for f in fused], [f[1] for f in fused]
    kv = k + v

    def meta(cols, dtype):
        t = torch.zeros((ROWS, cols), dtype=dtype, device=metadata_device)
        return t.random_(0, 100) if dtype != torch.uint64 else t.fill_(seed)

    aux = [meta(16, torch.int32), meta(16, torch.int32), meta(16, torch.float32),
           meta(16, torch.int32), meta(128, torch.float32), meta(128, torch.int32),
           meta(16, torch.float32), meta(16, torch.int64), meta(16, torch.float32),
           meta(8, torch.uint64)]
    args = SimpleNamespace(
        kv_data_ptrs=[t.data_ptr() for t in kv], kv_data_lens=[t.nbytes for t in kv],
        kv_item_lens=[t[0].nbytes * PAGE for t in kv], kv_layer_ids=list(range(LAYERS)) * 2,
        aux_data_ptrs=[t.data_ptr() for t in aux], aux_data_lens=[t.nbytes for t in aux],
        aux_item_lens=[t[0].nbytes for t in aux], page_size=PAGE, prefill_start_layer=0,
        kv_cache_dtype_str="auto", kv_head_num=KV_HEADS, total_kv_head_num=KV_HEADS, gpu_id=0)
    torch.cuda.synchronize()
    return args, {"kv": kv, "aux": aux, "fused": fused}


def _model(tmp: str) -> str:
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    return tmp


def _bind(tmp: str, seed: int, engine: str, side_name: str, metadata_device: str):
    """The backend's path: served family (the engine's GPU), plan, SGLang's pools, engine."""
    from pdc.integrations.sglang import family as F
    from pdc.runtime.engines import make_engine
    from pdc.runtime.plan_types import RankId

    args, bufs = sglang_buffers(seed, metadata_device)
    fam = F.served_family(_model(tmp), args, 1, 0, "bfloat16")
    one = F.side(1, 1, 1, PAGE)
    plan = F.make_plan(fam.family, one, one, engine)
    pools = F.engine_pools(fam.layout, plan, side_name, RankId(0, 0), args, fam.kv_dtype)
    kwargs = {"hostname": "127.0.0.1"} if engine == "mooncake" else {}
    eng = make_engine(engine, **kwargs, **fam.engine_kwargs)
    return fam, plan, pools, eng, bufs


def registered_kinds(eng) -> list[str]:
    """The memory kinds the engine registered its regions with (Mooncake: locations)."""
    if eng.name == "mooncake":
        return sorted(set(eng.report()["locations"].values()))
    return sorted({"VRAM" if a in eng._vram else "DRAM" for a, _ in eng._regions.items()})


def request_bytes(bufs, pages, row) -> bytes:
    """The request's KV pages (every layer's K then V) and its metadata row, as bytes."""
    idx = torch.tensor(pages, device="cuda:0")
    parts = [t.view(-1, PAGE, KV_HEADS * HEAD_DIM)[idx].view(torch.uint8).cpu()
             for t in bufs["kv"]]
    parts += [t[row].view(torch.uint8).cpu() for t in bufs["aux"]]
    return b"".join(p.numpy().tobytes() for p in parts)


def _dump_stacks_later() -> None:
    """PDC_TEST_STACKS_AFTER_S=N: every thread's stack to stderr after N s (a hang's place)."""
    after = float(os.environ.get("PDC_TEST_STACKS_AFTER_S", "0"))
    if after > 0:
        import faulthandler

        faulthandler.dump_traceback_later(after, exit=False)


def _prefill(conn, engine: str, tmp: str, metadata_device: str) -> None:
    _dump_stacks_later()
    try:
        import time

        from pdc.runtime.endpoints import KVPoll, PrefillEndpoint
        from pdc.runtime.plan_types import RankId

        boot = conn.recv()
        fam, plan, pools, eng, bufs = _bind(tmp, 11, engine, "prefill", metadata_device)
        ep = PrefillEndpoint(fam.layout, fam.wire, plan, RankId(0, 0), 0, eng, pools, boot)
        conn.send(("ready", fam.device, eng.transport().describe(), registered_kinds(eng)))
        if conn.recv() != "go":  # the parent failed before its receiver was ready
            ep.close()
            eng.close()
            return
        sender = ep.sender(ROOM)
        sender.send(SRC_PAGES[:3], 0, False, 3 * PAGE)
        sender.send(SRC_PAGES[3:], 3, True, len(SRC_PAGES) * PAGE - 5, aux_row=SRC_ROW)
        deadline = time.monotonic() + 120
        while sender.poll() not in (KVPoll.Success, KVPoll.Failed) and \
                time.monotonic() < deadline:
            time.sleep(0.001)
        conn.send(("sent", str(sender.poll()), sender.reason,
                   request_bytes(bufs, SRC_PAGES, SRC_ROW)))
        conn.recv()
        ep.close()
        eng.close()
    except Exception as e:  # noqa: BLE001 - the parent fails with it
        import traceback

        traceback.print_exc()
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _engine_param(name):
    marks = [] if _HAVE[name] else [pytest.mark.skip(reason=f"{name} not installed")]
    return pytest.param(name, marks=marks)


# the kinds each engine registers SGLang's buffers with: metadata on the host (SGLang's
# default) or on the GPU (SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK)
KINDS = {("mooncake", "cpu"): ["*", "cuda:0"], ("mooncake", "cuda:0"): ["cuda:0"],
         ("nixl", "cpu"): ["DRAM", "VRAM"], ("nixl", "cuda:0"): ["VRAM"]}


@pytest.mark.parametrize("metadata_device", ["cpu", "cuda:0"])
@pytest.mark.parametrize("engine", [_engine_param(n) for n in ("mooncake", "nixl")])
def test_a_request_moves_between_two_processes_on_gpu_memory(engine, metadata_device,
                                                              tmp_path):
    import time

    from pdc.runtime.control import BootstrapServer
    from pdc.runtime.endpoints import DecodeEndpoint, KVPoll
    from pdc.runtime.plan_types import RankId

    _dump_stacks_later()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    child = ctx.Process(target=_prefill, args=(b, engine, str(tmp_path / "p"),
                                               metadata_device), daemon=True)
    child.start()
    boot = BootstrapServer(1)
    ep = eng = None
    try:
        a.send(boot.address)
        assert a.poll(180), "prefill did not start"
        ready = a.recv()
        assert ready[0] == "ready", ready
        assert ready[1] == "cuda:0"  # the engine was made for the GPU's memory
        assert ready[3] == KINDS[(engine, metadata_device)]
        fam, plan, pools, eng, bufs = _bind(str(tmp_path / "d"), 22, engine, "decode",
                                            metadata_device)
        assert fam.device == "cuda:0"
        before = request_bytes(bufs, DST_PAGES, DST_ROW)
        ep = DecodeEndpoint(fam.layout, fam.wire, plan, RankId(0, 0), 0, eng, pools,
                            boot.address)
        assert registered_kinds(eng) == KINDS[(engine, metadata_device)]  # at the endpoint
        ep.wait_ready(60)
        rv = ep.receiver(ROOM)
        rv.init(DST_PAGES, 0, aux_row=DST_ROW)
        a.send("go")
        assert a.poll(180), "prefill did not answer"
        msg = a.recv()
        assert msg[:3] == ("sent", str(KVPoll.Success), ""), msg[:3]
        deadline = time.monotonic() + 60
        while rv.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert (rv.poll(), rv.reason) == (KVPoll.Success, "")
        torch.cuda.synchronize()
        got = request_bytes(bufs, DST_PAGES, DST_ROW)
        assert got != before
        assert got == msg[3]  # every byte of every page and of the metadata row
        print(f"{engine}, metadata on {metadata_device}: {len(got)} bytes checked; "
              f"registered as {ready[3]}; prefill {ready[2]}; decode "
              f"{eng.transport().describe()}")
    finally:
        a.send("stop")
        child.join(60)
        if ep is not None:
            ep.close()
        if eng is not None:
            eng.close()
        boot.close()


def test_sglang_default_gpu_layout_gets_an_engine_for_its_gpu(tmp_path):
    """SGLang's default on a GPU: KV on the GPU, metadata on the host (utils.py:416)."""
    from pdc.integrations.sglang import family as F
    from pdc.runtime.pools import address_device

    args, bufs = sglang_buffers(5)
    assert address_device(bufs["kv"][0].data_ptr()) == "cuda:0"
    assert address_device(bufs["aux"][0].data_ptr()) == "cpu"
    fam = F.served_family(_model(str(tmp_path)), args, 1, 0, "bfloat16")
    assert fam.engine_kwargs == {"device": "cuda:0"}
