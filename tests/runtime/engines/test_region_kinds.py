"""Note [Two memory kinds] (runtime/pools.py), inside the engines: an engine made for a GPU
registers each region with the kind it lives in (Mooncake: location "*" for host memory,
"cuda:N" for the GPU's; NIXL: DRAM or VRAM), splits a NIXL write into one transfer per kind,
and refuses memory of another GPU. This CPU machine has neither GPU memory nor a CUDA build of
the libraries, so the engines run their own code over stand-ins: `locate` answers for the CUDA
driver, and a recording stand-in replaces the library object (Mooncake's TransferEngine,
NIXL's agent). The same engines move real host and GPU memory in
tests/integrations/test_sglang_gpu.py on a GPU."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
from pdc.runtime.engines import BatchState, DescriptorError, make_engine
from pdc.runtime.engines import nixl as nixl_engine

HOST, GPU, OTHER = 0x10000, 0x7F0000000000, 0x7F8000000000


def where(addr: int) -> str:
    """The CUDA driver's answer, stood in for: HOST's region on the host, GPU's on cuda:1,
    OTHER's on cuda:0."""
    return {GPU: "cuda:1", OTHER: "cuda:0"}.get(addr, "cpu")


def nowhere(addr: int) -> str:
    raise AssertionError("a host engine asks nobody where its memory lives")


class FakeMooncake:
    """Mooncake's TransferEngine as far as MooncakeEngine calls it, recording registrations."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int, str]] = []

    def initialize(self, *args) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 15001

    def register_memory(self, addr, nbytes, location) -> int:
        self.registered.append((addr, nbytes, location))
        return 0

    def unregister_memory(self, addr) -> int:
        return 0


@pytest.fixture
def mooncake(monkeypatch):
    engine = ModuleType("mooncake.engine")
    engine.TransferEngine = FakeMooncake  # type: ignore[attr-defined]
    engine.SUPPORT_CUDA = True  # type: ignore[attr-defined]
    package = ModuleType("mooncake")
    package.engine = engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mooncake", package)
    monkeypatch.setitem(sys.modules, "mooncake.engine", engine)
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")

    def make(**kwargs):
        eng = make_engine("mooncake", hostname="127.0.0.1", **kwargs)
        eng._locate = where if kwargs.get("device") else nowhere
        return eng

    return make


def test_mooncake_for_a_gpu_registers_host_memory_at_any_location_and_the_gpus_at_its_own(
        mooncake):
    eng = mooncake(device="cuda:1")
    eng.register(HOST, 4096)
    eng.register(GPU, 8192)
    assert eng._engine.registered == [(HOST, 4096, "*"), (GPU, 8192, "cuda:1")]
    assert eng.report()["locations"] == {HOST: "*", GPU: "cuda:1"}
    eng.close()


def test_mooncake_for_host_memory_registers_everything_at_any_location(mooncake):
    eng = mooncake()
    eng.register(HOST, 4096)
    assert eng._engine.registered == [(HOST, 4096, "*")]
    eng.close()


def test_mooncake_refuses_memory_of_another_gpu(mooncake):
    eng = mooncake(device="cuda:1")
    with pytest.raises(DescriptorError) as e:
        eng.register(OTHER, 4096)
    assert str(e.value) == (
        "mooncake: register(0x7f8000000000, 4096): the memory is on cuda:0, but this engine "
        "was made for cuda:1; hint: a rank registers host memory and one GPU's (Note [Two "
        "memory kinds]), so make one engine per GPU")
    assert eng._engine.registered == []
    eng.close()


def test_mooncake_over_nvlink_refuses_host_memory(mooncake):
    eng = mooncake(device="cuda:1")
    eng._protocol = "nvlink_intra"  # what protocol "auto" picks on a wheel with NVLink
    with pytest.raises(DescriptorError) as e:
        eng.register(HOST, 4096)
    assert str(e.value) == (
        "mooncake: register(0x10000, 4096): host memory, which nvlink_intra does not move; "
        "hint: make the engine with protocol 'tcp' for a rank with host and GPU memory (Note "
        "[Two memory kinds])")
    eng.close()


class FakeAgent:
    """NIXL's agent as far as NixlEngine calls it, recording registrations and transfers."""

    def __init__(self) -> None:
        self.registered: list[tuple[list, str]] = []
        self.xfers: list[tuple[str, list, str, list, str]] = []
        self.states: dict[int, str] = {}  # handle -> what check_xfer_state answers
        self.released: list[int] = []
        self.backends = ["UCX"]

    def register_memory(self, descs, mem):
        self.registered.append((descs, mem))
        return ("dlist", len(self.registered))

    def deregister_memory(self, dlist) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return b"meta"

    def add_remote_agent(self, metadata) -> bytes:
        return b"peer"

    def make_connection(self, peer) -> None:
        pass

    def remove_remote_agent(self, peer) -> None:
        pass

    def get_xfer_descs(self, rows, mem):
        return [tuple(int(x) for x in r) for r in rows], mem

    def initialize_xfer(self, op, local, remote, peer) -> int:
        self.xfers.append((local[1], local[0], remote[1], remote[0], peer))
        return len(self.xfers)

    def transfer(self, handle) -> str:
        return "PROC"

    def check_xfer_state(self, handle) -> str:
        return self.states.get(handle, "DONE")

    def release_xfer_handle(self, handle) -> None:
        self.released.append(handle)


@pytest.fixture
def nixl(monkeypatch):
    for key, value in nixl_engine.ENV_DEFAULTS.items():  # the engine changes none of them
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(nixl_engine._DERIVED_MARK, raising=False)
    api = SimpleNamespace(nixlBind=SimpleNamespace())
    monkeypatch.setattr(nixl_engine, "_import_api", lambda: api)
    monkeypatch.setattr(nixl_engine, "_create_agent", lambda api, name, delay: FakeAgent())

    def make(**kwargs):
        eng = make_engine("nixl", **kwargs)
        eng._locate = where if kwargs.get("device") else nowhere
        return eng

    return make


def test_nixl_for_a_gpu_registers_host_memory_as_dram_and_the_gpus_as_vram(nixl):
    eng = nixl(device="cuda:1")
    eng.register(HOST, 4096)
    eng.register(GPU, 8192)
    assert eng._agent.registered == [([(HOST, 4096, 0, "")], "DRAM"),
                                     ([(GPU, 8192, 1, "")], "VRAM")]
    eng.close()


def test_nixl_for_host_memory_registers_dram(nixl):
    eng = nixl()
    eng.register(HOST, 4096)
    assert eng._agent.registered == [([(HOST, 4096, 0, "")], "DRAM")]
    eng.close()


def test_nixl_refuses_memory_of_another_gpu(nixl):
    eng = nixl(device="cuda:1")
    with pytest.raises(DescriptorError) as e:
        eng.register(OTHER, 4096)
    assert str(e.value) == (
        "nixl: register(0x7f8000000000, 4096): the memory is on cuda:0, but this engine was "
        "made for cuda:1; hint: a rank registers host memory and one GPU's (Note [Two memory "
        "kinds]), so make one engine per GPU")
    assert eng._agent.registered == []
    eng.close()


def _mixed(nixl):
    eng = nixl(device="cuda:1")
    eng.register(HOST, 4096)
    eng.register(GPU, 8192)
    peer = eng.connect(b"pdc-nixl-vram:2:meta")  # the peer's GPU is its cuda:2
    src = np.array([GPU, HOST + 64, GPU + 4096, HOST], np.uint64)
    dst = np.array([0xA000, 0xB040, 0xA100, 0xB000], np.uint64)
    return eng, peer, src, dst, np.array([256, 32, 512, 64], np.uint64)


def test_a_nixl_write_from_both_kinds_is_one_transfer_per_kind_each_into_the_same_kind(nixl):
    eng, peer, src, dst, nbytes = _mixed(nixl)
    assert eng.kinds_of(src) == [("DRAM", 2), ("VRAM", 2)]
    batch = eng.submit_write(peer, src, dst, nbytes)
    # host sources to the peer's host memory (device column 0), the GPU's to its GPU
    assert eng._agent.xfers == [
        ("DRAM", [(HOST + 64, 32, 0), (HOST, 64, 0)],
         "DRAM", [(0xB040, 32, 0), (0xB000, 64, 0)], "peer"),
        ("VRAM", [(GPU, 256, 1), (GPU + 4096, 512, 1)],
         "VRAM", [(0xA000, 256, 2), (0xA100, 512, 2)], "peer")]
    assert (eng.poll(batch), batch.reason) == (BatchState.DONE, "")
    assert sorted(eng._agent.released) == [1, 2]
    eng.close()


def test_a_nixl_write_of_one_kind_is_one_transfer(nixl):
    eng, peer, src, dst, nbytes = _mixed(nixl)
    assert eng.kinds_of(src[[0, 2]]) == [("VRAM", 2)]
    eng.submit_write(peer, src[[1, 3]], dst[[1, 3]], nbytes[[1, 3]])
    assert [x[0] for x in eng._agent.xfers] == ["DRAM"]
    eng.close()


def test_a_nixl_write_fails_when_one_kinds_transfer_fails_and_releases_both(nixl):
    eng, peer, src, dst, nbytes = _mixed(nixl)
    eng._agent.states = {1: "ERR", 2: "PROC"}
    batch = eng.submit_write(peer, src, dst, nbytes)
    assert (eng.poll(batch), batch.reason) == (BatchState.FAILED, "NIXL reported ERR")
    assert sorted(eng._agent.released) == [1, 2]
    eng.close()
