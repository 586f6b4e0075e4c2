"""PdcConnector's scheduler side with vLLM's hybrid KV cache manager (SupportsHMA), inside
vLLM's real Scheduler: the tiny Qwen3-Next of specs/vllm-qwen3-next.yaml, its GDN layers in
a state group (MambaSpec, one block per request) and its attention layers in a group of
160-token blocks, both drawing from one block pool.

Checked: prefill computes and sends all but the prompt's last token (Note [Hybrid last
token]), naming the attention blocks as pages and the state block as the slot; decode loads
those tokens into its own pages and slot and computes the last token itself; a failed load
reaches vLLM as a failed request (`failed_recving`), and every block of both groups is back
in the pool afterwards.
"""

from __future__ import annotations

import pytest
import torch
from pdc.integrations.vllm.metadata import RecvReq, SendReq
from pdc.integrations.vllm.scheduler import room_of
from pdc.integrations.vllm.settings import SettingsError
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

PAGE = 160
BLOCKS = 64
EOS = 2
GDN = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
ATTN = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config-only Qwen3-Next of the vllm-qwen3-next family's shape."""
    from transformers import Qwen3NextConfig

    path = tmp_path_factory.mktemp("qwen3-next")
    Qwen3NextConfig(
        num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, intermediate_size=512, vocab_size=1024, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=128,
        full_attention_interval=2, bos_token_id=1, eos_token_id=EOS,
        torch_dtype="bfloat16").save_pretrained(path)
    return str(path)


def make_scheduler(model_dir: str, role: str, policy: str = "fail",
                   prefix_caching: bool = False) -> Scheduler:
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                                 seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                         max_model_len=1024, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=PAGE, gpu_memory_utilization=0.9,
                                 enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdcConnector", kv_connector_module_path="pdc.integrations.vllm",
            kv_role=role, kv_connector_extra_config={"family": "vllm-qwen3-next"},
            kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"))
    config.cache_config.num_gpu_blocks = BLOCKS
    attn = FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16)
    gdn = MambaSpec(block_size=1024, shapes=((3, 512), (4, 64, 64)),
                    dtypes=(torch.bfloat16, torch.float32), page_size_padded=81920,
                    mamba_cache_mode=config.cache_config.mamba_cache_mode)
    kv = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(GDN, gdn), KVCacheGroupSpec(ATTN, attn)])
    block, hashed = resolve_kv_cache_block_sizes(kv, config)
    return Scheduler(vllm_config=config, kv_cache_config=kv, log_stats=True,
                     structured_output_manager=StructuredOutputManager(config),
                     block_size=block, hash_block_size=hashed)


@pytest.fixture
def prefill(model_dir):
    s = make_scheduler(model_dir, "kv_producer")
    yield s
    s.connector.shutdown()


@pytest.fixture
def decode(model_dir):
    s = make_scheduler(model_dir, "kv_consumer")
    yield s
    s.connector.shutdown()


def request(req_id: str, tokens: int, params: dict, max_tokens: int = 1) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    r = Request(request_id=req_id, prompt_token_ids=[3 + i % 900 for i in range(tokens)],
                sampling_params=sp, pooling_params=None, mm_features=None)
    r.kv_transfer_params = dict(params)
    return r


def step(s: Scheduler, sending=None, recving=None, failed=None):
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    kv = None
    if sending or recving or failed:
        kv = KVConnectorOutput(finished_sending=set(sending or ()),
                               finished_recving=set(recving or ()),
                               failed_recving=set(failed or ()))
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[7] for _ in ids], logprobs=None,
                            prompt_logprobs_dict={}, pooler_output=None,
                            kv_connector_output=kv)
    engine_out = s.update_from_output(out, mro)
    finished = {o.request_id: o for eco in engine_out.values() for o in eco.outputs
                if o.finish_reason is not None}
    return out, finished


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def assert_empty(s: Scheduler) -> None:
    pool = s.kv_cache_manager.block_pool
    assert not s.requests and not s.waiting and not s.running
    for manager in s.kv_cache_manager.coordinator.single_type_managers:
        assert not manager.req_to_blocks
    assert free_blocks(s) == BLOCKS - 1  # block 0 is vLLM's null block
    assert [b.ref_cnt for b in pool.blocks] == [0] * pool.num_gpu_blocks


def remote_prefill_params(req_id: str, sent_tokens: int) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": "prefill-engine", "remote_request_id": req_id,
            "remote_block_ids": [2, 3], "tp_size": 1, "pdc_room": room_of(req_id),
            "pdc_bootstrap": "tcp://127.0.0.1:1", "pdc_tokens": sent_tokens}


def test_prefill_sends_the_pages_and_state_of_all_but_the_last_prompt_token(prefill):
    r = request("a", 200, {"do_remote_decode": True})
    prefill.add_request(r)
    assert r.num_prompt_tokens == 199 and r.kv_transfer_params["pdc_tokens"] == 199
    out, finished = step(prefill)
    assert out.num_scheduled_tokens == {"a": 199}
    (state,), pages = prefill.kv_cache_manager.get_block_ids("a")
    assert len(pages) == 2  # 199 tokens in blocks of 160
    assert out.kv_connector_metadata.send == [SendReq("a", room_of("a"), tuple(pages), 199,
                                                      state)]
    params = finished["a"].kv_transfer_params
    assert params["pdc_tokens"] == 199 and params["remote_block_ids"] == list(pages)
    assert free_blocks(prefill) == BLOCKS - 1 - 3  # held (delay-free) while sent
    step(prefill)
    step(prefill, sending={"a"})
    assert_empty(prefill)


def test_decode_loads_them_into_its_pages_and_slot_then_computes_the_last_token(decode):
    decode.add_request(request("b", 200, remote_prefill_params("b", 199), max_tokens=2))
    out, _ = step(decode)
    r = decode.requests["b"]
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and out.num_scheduled_tokens == {}
    (state,), pages = decode.kv_cache_manager.get_block_ids("b")
    assert out.kv_connector_metadata.recv == [RecvReq(
        "b", room_of("b"), tuple(pages), 0, "tcp://127.0.0.1:1", 1, state)]
    step(decode, recving={"b"})
    out, _ = step(decode)
    assert out.num_scheduled_tokens == {"b": 1}  # token 200, from the loaded state
    _, finished = step(decode)
    assert finished["b"].finish_reason.name == "LENGTH"
    assert_empty(decode)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_hybrid_load_reaches_vllm_as_a_failed_request(model_dir, policy):
    s = make_scheduler(model_dir, "kv_consumer", policy)
    try:
        s.add_request(request("b", 200, remote_prefill_params("b", 199)))
        step(s)
        _, finished = step(s, recving={"b"}, failed={"b"})
        if policy == "fail":
            assert finished["b"].finish_reason.name == "ERROR"
        else:
            assert finished == {}
            out, finished = step(s)
            assert out.num_scheduled_tokens == {"b": 200}  # the whole prompt, locally
            assert finished["b"].finish_reason.name == "LENGTH"
        assert_empty(s)
    finally:
        s.connector.shutdown()


def test_a_hybrid_engine_with_prefix_caching_is_refused_naming_the_fix(model_dir):
    with pytest.raises(SettingsError) as e:
        make_scheduler(model_dir, "kv_consumer", prefix_caching=True)
    assert str(e.value) == (
        "PdcConnector moves one state block per request, but vLLM keeps mamba_cache_mode "
        "'align' (a state block per cached prefix block)\n  hint: start a hybrid engine with "
        "enable_prefix_caching=False (mamba_cache_mode 'none')")


def test_a_hybrid_load_failed_before_its_blocks_are_safe_fails_now_and_frees_later(decode):
    """Note [Failed load] with several groups: the failed request is reported at once
    (failed_recving); vLLM keeps its blocks of both groups until finished_recving."""
    decode.add_request(request("b", 200, remote_prefill_params("b", 199)))
    step(decode)
    _, finished = step(decode, failed={"b"})
    assert finished["b"].finish_reason.name == "ERROR"
    assert free_blocks(decode) == BLOCKS - 1 - 3  # 2 pages and the state block
    step(decode)
    assert free_blocks(decode) == BLOCKS - 1 - 3
    step(decode, recving={"b"})
    assert_empty(decode)


def test_a_one_token_prompt_has_nothing_to_send(prefill):
    r = request("a", 1, {"do_remote_decode": True})
    prefill.add_request(r)
    out, finished = step(prefill)
    assert r.num_prompt_tokens == 1 and out.kv_connector_metadata.send == []
    assert finished["a"].kv_transfer_params is None
    assert_empty(prefill)
