"""Device-memory options of the Mooncake and NIXL engines, and every engine moving GPU memory
between two real processes (the GPU tests; bench/run_gpu_engines.sh runs them there).

On the CPU only the refusals run: a device option is checked before any library call.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp

import numpy as np
import pytest
import torch
from pdc.runtime.engines import DescriptorError, TransferError, make_engine

_HAVE = {"mooncake": importlib.util.find_spec("mooncake") is not None,
         "nixl": any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl_cu13", "nixl"))}


@pytest.mark.skipif(not _HAVE["nixl"], reason="nixl not installed")
def test_nixl_device_option_refusals():
    with pytest.raises(DescriptorError, match=r"^nixl: device must be 'cuda:N' or an index, "
                                              r"not 'gpu7'$"):
        make_engine("nixl", device="gpu7")
    host = make_engine("nixl")
    try:
        vram_blob = b"pdc-nixl-vram:0:" + host.agent_info()
        with pytest.raises(DescriptorError, match="this engine moves DRAM memory and the peer's "
                                                  "agent_info is from an engine for VRAM"):
            host.connect(vram_blob)
    finally:
        host.close()


@pytest.mark.skipif(not _HAVE["mooncake"], reason="mooncake not installed")
def test_mooncake_device_option_refusals():
    with pytest.raises(DescriptorError, match="protocol 'auto' is for device memory"):
        make_engine("mooncake", protocol="auto")
    with pytest.raises(DescriptorError, match="device must be 'cuda:N'"):
        make_engine("mooncake", device="cuda:x")
    import mooncake.engine as mc

    if not mc.SUPPORT_CUDA:
        with pytest.raises(TransferError, match="needs the CUDA wheel"):
            make_engine("mooncake", device="cuda:0", protocol="auto")


# ~~~ GPU: two processes, one device ~~~

SIZE = 32 << 20
PAGE = 32768


def _make(name):
    if name == "mooncake":
        return make_engine("mooncake", device="cuda:0", protocol="auto")
    return make_engine(name, device="cuda:0")


def _peer(name, conn):
    eng = _make(name)
    dst = torch.full((SIZE,), 0xA5, dtype=torch.uint8, device="cuda:0")
    eng.register(dst.data_ptr(), SIZE)
    conn.send((eng.agent_info(), dst.data_ptr()))
    conn.recv()
    conn.send(dst.cpu().numpy().tobytes())
    conn.recv()
    eng.close()


def _gpu_param(name):
    marks = [pytest.mark.gpu]
    if not torch.cuda.is_available():
        marks.append(pytest.mark.skip(reason="needs a CUDA device"))
    elif name in _HAVE and not _HAVE[name]:
        marks.append(pytest.mark.skip(reason=f"{name} not installed"))
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_gpu_param(n) for n in ("cuda_ipc", "mooncake", "nixl")])
def test_gpu_memory_between_two_processes(name):
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_peer, args=(name, b), daemon=True)
    p.start()
    try:
        assert a.poll(120), "peer did not start"
        info, base = a.recv()
        eng = _make(name)
        src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device="cuda:0")
        eng.register(src.data_ptr(), SIZE)
        peer = eng.connect(info)
        pages = np.random.default_rng(1).permutation(SIZE // PAGE)
        s = src.data_ptr() + np.arange(len(pages), dtype=np.uint64) * PAGE
        d = base + pages.astype(np.uint64) * PAGE
        torch.cuda.synchronize()
        eng.wait(eng.submit_write(peer, s, d, np.full(len(pages), PAGE)), 120)
        a.send("read")
        assert a.poll(120)
        got = torch.frombuffer(bytearray(a.recv()), dtype=torch.uint8).view(-1, PAGE)
        assert torch.equal(got[torch.from_numpy(pages)], src.cpu().view(-1, PAGE))
        eng.close()
    finally:
        a.send("stop")
        p.join(60)
