"""The SGLang backend's engine memory (Note [SGLang memory kinds] in
integrations/sglang/family.py): host memory on a CPU server, the GPU's when a buffer SGLang
registers is on it, also when SGLang keeps KV on a GPU and its metadata on the host (its
default there; the engine registers each buffer with its own kind: Note [Two memory kinds]),
refused on two GPUs. KVArgs carry addresses only; on this CPU machine the addresses are numpy
buffers and `locate` stands in for the CUDA driver's answer (the real one runs in
tests/integrations/test_sglang_gpu.py on a GPU)."""

from __future__ import annotations

import pytest
from pdc.integrations.sglang import family as F

from .test_sglang_family import TINY, _kv_args, model_dir  # noqa: F401 - the fixture


@pytest.fixture
def served(model_dir):  # noqa: F811 - the fixture imported above
    args = _kv_args()
    return F.served_family(model_dir("LlamaForCausalLM"), args, 1, 0), args


def on(devices: dict[int, str]):
    """`locate` answering `devices` for the addresses listed, host memory elsewhere."""
    return lambda addr: devices.get(addr, "cpu")


def test_a_cpu_server_gets_a_host_engine(served):
    fam, args = served
    assert (fam.device, fam.engine_kwargs) == ("", {})
    assert F.served_device(fam.layout, args) == ""  # the CUDA driver's answer here


def test_buffers_all_on_one_gpu_get_an_engine_for_that_gpu(served):
    fam, args = served
    gpu = {a: "cuda:1" for a in args.kv_data_ptrs + args.aux_data_ptrs}
    assert F.served_device(fam.layout, args, on(gpu)) == "cuda:1"
    assert F.ServedFamily(fam.family, fam.wire, fam.architecture, device="cuda:1"
                          ).engine_kwargs == {"device": "cuda:1"}


def test_sglangs_default_gpu_layout_gets_an_engine_for_its_gpu(served):
    fam, args = served
    kv_on_gpu = {a: "cuda:0" for a in args.kv_data_ptrs}  # metadata stays on the host
    assert F.served_device(fam.layout, args, on(kv_on_gpu)) == "cuda:0"


def test_host_metadata_beside_kv_on_two_gpus_is_refused_naming_the_gpus(served):
    fam, args = served
    ptrs = args.kv_data_ptrs
    gpus = {a: "cuda:0" for a in ptrs[:2]} | {a: "cuda:1" for a in ptrs[2:]}
    with pytest.raises(F.RefusedModel) as e:
        F.served_device(fam.layout, args, on(gpus))
    assert str(e.value) == (
        "pdc: specs/sglang-llama.yaml: error: SGLang's buffers of this rank are on 3 devices "
        "(cpu: SGLang's aux buffer output_ids, cuda:0: SGLang's K buffer of layer 0, cuda:1: "
        "SGLang's V buffer of layer 0)\n  hint: a rank's one transfer engine registers host "
        "memory and one GPU's (Note [Two memory kinds]): keep each scheduler's KV pools and "
        "metadata buffers on its own GPU or on the host")


def test_kv_on_two_gpus_is_refused(served):
    fam, args = served
    ptrs = args.kv_data_ptrs
    gpus = {a: "cuda:0" for a in ptrs[:2]} | {a: "cuda:1" for a in ptrs[2:]} | \
        {a: "cuda:0" for a in args.aux_data_ptrs}
    with pytest.raises(F.RefusedModel) as e:
        F.served_device(fam.layout, args, on(gpus))
    assert str(e.value).splitlines()[0] == (
        "pdc: specs/sglang-llama.yaml: error: SGLang's buffers of this rank are on 2 devices "
        "(cuda:0: SGLang's K buffer of layer 0, cuda:1: SGLang's V buffer of layer 0)")


def test_mamba_state_buffers_count_too():
    args = _kv_args()
    args.state_types = ["mamba"]
    conv, ssm = 1000, 2000
    args.state_data_ptrs, args.state_data_lens = [[conv, ssm]], [[64, 64]]
    args.state_item_lens, args.state_layer_ids = [[16, 16]], [[0, 0]]
    regions = F.state_buffers_of(args, locate=on({ssm: "cuda:0"}))
    assert [(r.what, r.device) for r in regions.values()] == [
        ("SGLang's mamba conv state of layer 0", "cpu"),
        ("SGLang's mamba temporal state of layer 0", "cuda:0")]
