"""Note [Two memory kinds] (runtime/pools.py): the engine's memory kind and device come from
where a rank's buffers live; buffers on two GPUs, or in two kinds where the integration does
not allow it (`host_too`), are refused naming one of each. CUDA tensors cannot be made on a CPU machine; `engine_device` reads only `.device`, so
the GPU cases use stand-ins carrying a torch.device (the GPU test is
tests/integrations/test_sglang_gpu.py). Which kind an engine gives each region it registers
is test_region_kinds.py's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pdc.runtime.pools import RegistrationMismatch, address_device, device_name, engine_device


def on(device: str):
    return SimpleNamespace(device=torch.device(device))


def test_device_names():
    assert [device_name(x) for x in (np.zeros(2), torch.zeros(2), on("cuda"), on("cuda:3"),
                                     "cuda:1", "cpu")] == \
        ["cpu", "cpu", "cuda:0", "cuda:3", "cuda:1", "cpu"]


def test_host_buffers_make_a_host_engine():
    assert engine_device({"a": np.zeros(2), "b": torch.zeros(2)}, "s.yaml") == {}
    assert engine_device({}, "s.yaml") == {}


def test_buffers_of_one_gpu_make_an_engine_for_it():
    assert engine_device({"a": on("cuda:2"), "b": "cuda:2"}, "s.yaml") == {"device": "cuda:2"}


def test_host_and_gpu_buffers_are_refused_naming_one_of_each():
    tensors = {"K of layer 0": on("cuda:0"), "K of layer 1": on("cuda:0"), "row": np.zeros(2)}
    with pytest.raises(RegistrationMismatch) as e:
        engine_device(tensors, "specs/x.yaml", owner="the buffers of this rank",
                      hint="one kind per rank", label=str)
    assert str(e.value) == (
        "specs/x.yaml: error: the buffers of this rank are on 2 devices (cpu: row, cuda:0: K "
        "of layer 0)\n  hint: one kind per rank")


def test_host_beside_one_gpu_makes_an_engine_for_the_gpu_where_allowed():
    tensors = {"K of layer 0": on("cuda:1"), "row": np.zeros(2)}
    assert engine_device(tensors, "s.yaml", host_too=True) == {"device": "cuda:1"}
    assert engine_device({"row": np.zeros(2)}, "s.yaml", host_too=True) == {}
    with pytest.raises(RegistrationMismatch) as e:
        engine_device({**tensors, "K of layer 1": on("cuda:0")}, "s.yaml", host_too=True)
    assert str(e.value).splitlines()[0] == (
        "s.yaml: error: vLLM's cache tensors of this worker are on 3 devices (cpu, cuda:0, "
        "cuda:1)")


def test_two_gpus_are_refused_with_the_default_words():
    with pytest.raises(RegistrationMismatch) as e:
        engine_device({"l0": on("cuda:0"), "l1": on("cuda:1")}, "specs/vllm-llama.yaml")
    assert str(e.value) == (
        "specs/vllm-llama.yaml: error: vLLM's cache tensors of this worker are on 2 devices "
        "(cuda:0, cuda:1)\n  hint: pdc registers one worker's cache on one device; run one "
        "vLLM worker per device")


def test_host_memory_is_located_on_the_host():
    # without CUDA (or for memory CUDA never saw) every address is host memory
    a = np.zeros(64, np.uint8)
    assert address_device(a.ctypes.data) == "cpu"
    assert address_device(0) == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_memory_is_located_on_its_gpu():
    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    assert address_device(t.data_ptr()) == "cuda:0"
    assert address_device(t[4096:].data_ptr()) == "cuda:0"
    pinned = torch.zeros(64, dtype=torch.uint8).pin_memory()
    assert address_device(pinned.data_ptr()) == "cpu"
