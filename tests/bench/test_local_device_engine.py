"""The local engine for device memory (runtime/engines/local_device.py) and the benchmarks' page
paths on it (bench/page_engine.py: PageEngine, IpcPageEngine), on CPU tensors through the Triton
interpreter, plus GPU tests that run where CUDA devices exist.

(Kept beside the benchmarks that drive this engine; tests/runtime/engines holds the host-memory
engines' process tests.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

# Only where no GPU is: set in a GPU run, it would turn every Triton kernel that a later test
# module imports into the interpreter's (which copies its tensors to the host).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import numpy as np
import pytest
from page_engine import IpcPageEngine, PageCopy, PageEngine, page_copies
from pdc.runtime.datapath import LocalBuffer, RemoteBuffer
from pdc.runtime.engines import BatchState, DescriptorError, TransferError, make_engine
from pdc.runtime.engines.local import LocalEngine
from pdc.runtime.engines.local_device import LocalDeviceEngine
from pdc.runtime.indices import IndexError_
from pdc.runtime.plan_types import Segment

from ..compiler.planning import ROOT, plan_for
from ..runtime.engines.test_cuda_ipc import _setup

CAP, ITEM = 8, 2048


def _pair(device_a="cpu", device_b="cpu", n_pools=3, seed=0):
    a, b = PageEngine(device_a), PageEngine(device_b)
    g = torch.Generator().manual_seed(seed)
    src = [torch.randint(0, 256, (CAP * ITEM,), dtype=torch.uint8, generator=g).to(a.device)
           for _ in range(n_pools)]
    dst = [torch.full((CAP * ITEM,), 0xA5, dtype=torch.uint8, device=b.device)
           for _ in range(n_pools)]
    for t in src:
        a.register_tensor(t)
    for t in dst:
        b.register_tensor(t)
    return a, b, a.connect(b.agent_info()), src, dst


def _items(t):
    return t.view(CAP, ITEM)


def test_device_kwarg_selects_the_device_engine():
    assert type(make_engine("local")) is LocalEngine
    assert type(make_engine("local", device=None)) is LocalEngine
    e = make_engine("local", device="cpu")
    assert type(e) is LocalDeviceEngine and e.device == torch.device("cpu")
    e.close()
    e.close()  # idempotent


@pytest.mark.parametrize("path,chunks", [("push", None), ("pull", None), ("staged", None),
                                         ("staged", 2), ("staged", 3)])
def test_whole_items_round_trip(path, chunks):
    a, b, peer, src, dst = _pair()
    copies = [PageCopy(s.data_ptr(), d.data_ptr(), ITEM, ITEM, CAP, CAP, Segment(0, 0, ITEM))
              for s, d in zip(src, dst, strict=True)]
    plan = a.plan_pages(peer, copies)
    s_ids, d_ids = np.array([5, 0, 7, 2]), np.array([1, 6, 3, 4])
    batch = a.submit_pages(plan, s_ids, d_ids, path=path, chunks=chunks)
    a.wait(batch, 30)
    assert batch.state is BatchState.DONE and batch.nbytes == 4 * 3 * ITEM
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(_items(d)[d_ids], _items(s)[s_ids])
        untouched = [i for i in range(CAP) if i not in d_ids]
        assert bool((_items(d)[untouched] == 0xA5).all())


@pytest.mark.parametrize("programs", [1, 2, 5])
def test_direct_kernel_with_capped_programs_and_tiling(programs):
    # fewer programs than work: each program loops over row blocks and column chunks
    from pdc.runtime.copy_kernels import Tiling

    a, b, peer, src, dst = _pair(n_pools=2)
    a.direct_tiling = Tiling(rows=2, block_bytes=512, iters=1, num_warps=4)
    copies = [PageCopy(s.data_ptr(), d.data_ptr(), ITEM, ITEM, CAP, CAP, Segment(0, 0, ITEM))
              for s, d in zip(src, dst, strict=True)]
    plan = a.plan_pages(peer, copies)
    s_ids, d_ids = np.array([5, 0, 7, 2, 1]), np.array([1, 6, 3, 4, 0])
    a.wait(a.submit_pages(plan, s_ids, d_ids, path="push", programs=programs), 30)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(_items(d)[d_ids], _items(s)[s_ids])
    with pytest.raises(DescriptorError, match="programs must be >= 1"):
        a.submit_pages(plan, s_ids, d_ids, programs=0)


@pytest.mark.parametrize("path", ["push", "staged"])
def test_head_slice_segments(path):
    # a source item of 4 pieces of 256 B lands as every other 256 B of the destination item
    a, b, peer, src, dst = _pair(n_pools=1)
    seg = Segment(src_offset=0, dst_offset=256, nbytes=256, repeat=4, src_stride=256,
                  dst_stride=512)
    plan = a.plan_pages(peer, [PageCopy(src[0].data_ptr(), dst[0].data_ptr(), ITEM, ITEM, CAP,
                                        CAP, seg)])
    a.wait(a.submit_pages(plan, [3, 4], [0, 7], path=path), 30)
    for si, di in ((3, 0), (4, 7)):
        got = _items(dst[0])[di].view(8, 256)
        want = _items(src[0])[si].view(8, 256)[:4]
        assert torch.equal(got[1::2], want)
        assert bool((got[0::2] == 0xA5).all())


def test_submit_write_copies_descriptors_and_checks_ranges():
    a, b, peer, src, dst = _pair(n_pools=2)
    batch = a.submit_write(peer, [src[0].data_ptr() + 100, src[1].data_ptr()],
                           [dst[1].data_ptr() + 7, dst[0].data_ptr() + 4096], [300, 2048])
    a.wait(batch, 5)
    assert batch.descriptors == 2 and batch.nbytes == 2348
    assert torch.equal(dst[1][7:307], src[0][100:400])
    assert torch.equal(dst[0][4096:6144], src[1][:2048])
    with pytest.raises(DescriptorError, match="not inside memory registered in this engine"):
        a.submit_write(peer, [src[0].data_ptr() + CAP * ITEM - 10], [dst[0].data_ptr()], [20])
    with pytest.raises(DescriptorError, match="destination descriptor 0"):
        a.submit_write(peer, [src[0].data_ptr()], [dst[0].data_ptr() + CAP * ITEM - 1], [2])
    with pytest.raises(TransferError, match="unknown peer"):
        a.submit_write("device:nobody", [src[0].data_ptr()], [dst[0].data_ptr()], [1])


def test_page_ids_and_plans_are_checked():
    a, b, peer, src, dst = _pair(n_pools=1)
    good = PageCopy(src[0].data_ptr(), dst[0].data_ptr(), ITEM, ITEM, CAP, CAP,
                    Segment(0, 0, ITEM))
    plan = a.plan_pages(peer, [good])
    with pytest.raises(DescriptorError, match="outside the pools' capacity"):
        a.submit_pages(plan, [0, CAP], [1, 2])
    with pytest.raises(DescriptorError, match="outside the pools' capacity"):
        a.submit_pages(plan, [0], [-1])
    with pytest.raises(DescriptorError, match="equal length"):
        a.submit_pages(plan, [0, 1], [1])
    with pytest.raises(DescriptorError, match="path must be"):
        a.submit_pages(plan, [0], [1], path="teleport")
    assert a.submit_pages(plan, [], []).state is BatchState.DONE
    too_big = PageCopy(src[0].data_ptr(), dst[0].data_ptr(), ITEM, ITEM, CAP + 1, CAP,
                       Segment(0, 0, ITEM))
    with pytest.raises(DescriptorError, match="source pool of copy 0"):
        a.plan_pages(peer, [too_big])
    with pytest.raises(DescriptorError, match="leaves the"):
        PageCopy(1, 1, ITEM, ITEM, 1, 1, Segment(0, ITEM - 8, 16))
    with pytest.raises(DescriptorError, match="overlapping pieces"):
        PageCopy(1, 1, ITEM, ITEM, 1, 1, Segment(0, 0, 64, repeat=2, src_stride=32,
                                                 dst_stride=64))


def test_connect_refuses_foreign_blobs():
    a, b, peer, src, dst = _pair(n_pools=1)
    with pytest.raises(DescriptorError, match="not a device-mode blob"):
        a.connect(LocalEngine().agent_info())
    with pytest.raises(DescriptorError, match="not a local-engine blob"):
        LocalEngine().connect(b.agent_info())
    info = json.loads(b.agent_info())
    info["token"] = "0" * 32  # an engine of another process
    with pytest.raises(TransferError, match="CUDA IPC between processes is not implemented"):
        a.connect(json.dumps(info).encode())
    gone = b.agent_info()
    b.close()
    with pytest.raises(TransferError, match="not an engine of this process"):
        a.connect(gone)


def test_page_copies_follow_the_plan_link():
    layout, plan = plan_for(ROOT / "specs" / "llama3-70b.yaml", {"tp": 2}, {"tp": 1},
                            backend="local")
    link = next(lk for lk in plan.links if lk.prefill.tp == 1)
    reg_p = plan.registration("prefill", link.prefill)
    reg_d = plan.registration("decode", link.decode)
    local = {"kv": [LocalBuffer(0x1000_0000 + (i << 20), reg_p.item_bytes("kv"), 4)
                    for i in range(len(reg_p.entries("kv")))]}
    remote = {"kv": [RemoteBuffer(lid, 0, 0x9000_0000 + (i << 20), reg_d.item_bytes("kv"), 4)
                     for i, (_t, lid) in enumerate(reg_d.entries("kv"))]}
    copies = page_copies(link, local, remote, "kv")
    assert len(copies) == 160
    assert copies[0].segment == Segment(0, 1024, 1024, 16, 1024, 2048)
    assert copies[0].unit_bytes == 16384
    assert len(page_copies(link, local, remote, "kv", {3})) == 2
    remote["kv"][0] = RemoteBuffer(5, 0, 0x9000_0000, reg_d.item_bytes("kv"), 4)
    with pytest.raises(IndexError_, match="plan expects layer 0"):
        page_copies(link, local, remote, "kv")


@pytest.fixture
def child():
    """A live process whose pid the CUDA IPC peer claims (test_cuda_ipc.py, module docstring)."""
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


@pytest.mark.parametrize("path", ["push", "staged"])
def test_page_plans_reach_the_pools_of_a_cuda_ipc_peer(child, path):
    drv, writer, peer, name, src, dst = _setup(child, n=1, size=8 * 2048,
                                               writer_class=IpcPageEngine)
    copies = [PageCopy(src.data_ptr(), dst[0].data_ptr(), 2048, 2048, 8, 8,
                       Segment(256, 512, 1024))]
    plan = writer.plan_pages(name, copies)
    s_ids, d_ids = np.array([5, 0, 7]), np.array([1, 6, 3])
    writer.wait(writer.submit_pages(plan, s_ids, d_ids, path=path), 30)
    got, want = dst[0].view(8, 2048), src.view(8, 2048)
    for s, d in zip(s_ids, d_ids, strict=True):
        assert torch.equal(got[d, 512:1536], want[s, 256:1280])
    assert int((got[[0, 2, 4, 5, 7]] != 0xA5).sum()) == 0
    writer.close()
    peer.close()


# ~~~ GPU ~~~

needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.parametrize("path", ["push", "pull", "staged"])
def test_cuda_peer_round_trip(path):
    a, b, peer, src, dst = _pair("cuda:0", "cuda:1")
    copies = [PageCopy(s.data_ptr(), d.data_ptr(), ITEM, ITEM, CAP, CAP, Segment(0, 0, ITEM))
              for s, d in zip(src, dst, strict=True)]
    plan = a.plan_pages(peer, copies)
    s_ids, d_ids = np.array([5, 0, 7, 2]), np.array([1, 6, 3, 4])
    a.wait(a.submit_pages(plan, s_ids, d_ids, path=path, chunks=2), 30)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(_items(d)[d_ids].cpu(), _items(s)[s_ids].cpu())
    batch = a.submit_write(peer, [src[0].data_ptr()], [dst[2].data_ptr() + 512], [4096])
    a.wait(batch, 30)
    assert torch.equal(dst[2][512:4608].cpu(), src[0][:4096].cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_register_raw_address():
    a, b = LocalDeviceEngine("cuda:0"), LocalDeviceEngine("cuda:0")
    x = torch.arange(4096, dtype=torch.uint8, device="cuda:0")
    y = torch.zeros(4096, dtype=torch.uint8, device="cuda:0")
    a.register(x.data_ptr(), 4096)
    b.register(y.data_ptr(), 4096)
    peer = a.connect(b.agent_info())
    a.wait(a.submit_write(peer, [x.data_ptr() + 16], [y.data_ptr()], [1000]), 30)
    assert torch.equal(y[:1000], x[16:1016])
