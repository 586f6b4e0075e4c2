"""PdcConnector's scheduler side inside vLLM's real Scheduler (no model, no worker).

vLLM's own Scheduler and KV cache manager run the requests; only the model runner's output is
made here (the tokens sampled and what the worker side reports in `get_finished`), so every
block the tests count is one vLLM allocated, held or freed. The checks are those of
Note [PD request flow] in integrations/vllm/scheduler.py: a remote-prefill request waits in
WAITING_FOR_REMOTE_KVS until `get_finished` reports its load, a prefill request's blocks stay
(delay-free) until it is reported sent, an aborted transfer keeps its blocks until the worker
reports it drained and then frees them once, and a failed load goes through vLLM's
load-error hook.
"""

from __future__ import annotations

import pytest
import torch
from pdc.integrations.vllm.connector import PdcConnector
from pdc.integrations.vllm.metadata import CancelReq, PdcConnectorMetadata, RecvReq, SendReq
from pdc.integrations.vllm.scheduler import room_of
from pdc.integrations.vllm.settings import SettingsError
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 32
BLOCKS = 64
EOS = 2
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config-only Llama of the vllm-llama family's shape (the Scheduler reads no weights)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("model")
    LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1024,
                bos_token_id=1, eos_token_id=EOS, torch_dtype="bfloat16").save_pretrained(path)
    init_none_hash(sha256)
    return str(path)


def make_scheduler(model_dir: str, role: str, policy: str = "fail", pp: int = 1) -> Scheduler:
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0)
    config = VllmConfig(
        model_config=model,
        parallel_config=ParallelConfig(pipeline_parallel_size=pp),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                         max_model_len=1024, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9,
                                 enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdcConnector", kv_connector_module_path="pdc.integrations.vllm",
            kv_role=role, kv_connector_extra_config={"family": "vllm-llama"},
            kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"))
    config.cache_config.num_gpu_blocks = BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16)
    kv_config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
    return Scheduler(vllm_config=config, kv_cache_config=kv_config, log_stats=True,
                     structured_output_manager=StructuredOutputManager(config),
                     block_size=BLOCK)


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


def request(req_id: str, tokens: int, params: dict, max_tokens: int = 4) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    r = Request(request_id=req_id, prompt_token_ids=[3 + i % 900 for i in range(tokens)],
                sampling_params=sp, pooling_params=None, mm_features=None,
                block_hasher=get_request_block_hasher(BLOCK, sha256))
    r.kv_transfer_params = dict(params)
    return r


def remote_prefill_params(req_id: str) -> dict:
    """What PdcConnector's prefill side returns (NixlConnector's shape plus pdc's two keys)."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": "prefill-engine", "remote_request_id": req_id,
            "remote_block_ids": [1, 2, 3, 4], "tp_size": 1, "pdc_room": room_of(req_id),
            "pdc_bootstrap": "tcp://127.0.0.1:1"}


def step(s: Scheduler, sampled: dict[str, int] | None = None, sending=None, recving=None,
         invalid=None):
    """One engine step: schedule, then the model runner's output (`sampled` token per
    scheduled request, and what the worker side's get_finished reported)."""
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    kv = None
    if sending or recving or invalid:
        kv = KVConnectorOutput(finished_sending=set(sending or ()),
                               finished_recving=set(recving or ()),
                               invalid_block_ids=set(invalid or ()))
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[(sampled or {}).get(r, 7)] for r in ids],
                            logprobs=None, prompt_logprobs_dict={}, pooler_output=None,
                            kv_connector_output=kv)
    engine_out = s.update_from_output(out, mro)
    finished = {o.request_id: o for eco in engine_out.values() for o in eco.outputs
                if o.finish_reason is not None}
    return out, finished


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def blocks_of(s: Scheduler, req_id: str) -> list[int]:
    return list(s.kv_cache_manager.get_block_ids(req_id)[0])


def assert_empty(s: Scheduler) -> None:
    """No request and no block left: every block back in the free queue exactly once."""
    pool = s.kv_cache_manager.block_pool
    assert not s.requests and not s.waiting and not s.running
    assert not s.finished_recving_kv_req_ids
    assert not s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    assert free_blocks(s) == pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
    assert [b.ref_cnt for b in pool.blocks] == [0] * pool.num_gpu_blocks


def test_the_connector_is_pdcs(prefill, decode):
    assert isinstance(prefill.connector, PdcConnector)
    assert isinstance(decode.connector, PdcConnector)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_pipeline_parallel_is_refused_when_the_engine_starts(model_dir, role):
    """vLLM makes the connector with its Scheduler (and in every worker) at engine start: a
    PP engine stops there, not at its first request."""
    with pytest.raises(SettingsError) as e:
        make_scheduler(model_dir, role, pp=2)
    assert str(e.value) == (
        "PdcConnector: pipeline_parallel_size 2: pdc's vLLM connector moves the KV of one "
        "pipeline stage\n  hint: start the engine with pipeline_parallel_size=1 (spread the "
        "model with tensor_parallel_size, or run more engines)")


def test_prefill_holds_its_blocks_until_they_are_sent(prefill):
    prefill.add_request(request("a", 100, {"do_remote_decode": True}, max_tokens=1))
    out, finished = step(prefill)
    meta = out.kv_connector_metadata
    assert isinstance(meta, PdcConnectorMetadata)
    held = 4  # 100 tokens in blocks of 32
    blocks = tuple(blocks_of(prefill, "a"))
    assert meta.send == [SendReq("a", room_of("a"), blocks, 100)]
    assert meta.bootstrap == prefill.connector.sched.bootstrap != ""
    params = finished["a"].kv_transfer_params
    assert {k: params[k] for k in ("do_remote_prefill", "do_remote_decode",
                                   "remote_request_id", "remote_block_ids", "tp_size",
                                   "pdc_room", "pdc_bootstrap")} == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": "a",
        "remote_block_ids": list(blocks), "tp_size": 1, "pdc_room": room_of("a"),
        "pdc_bootstrap": meta.bootstrap}
    # Finished, but delay-free: the blocks stay while the worker sends them.
    assert "a" in prefill.requests
    assert free_blocks(prefill) == BLOCKS - 1 - held
    out, _ = step(prefill)
    assert "a" in out.finished_req_ids  # the worker learns the request finished
    assert free_blocks(prefill) == BLOCKS - 1 - held
    step(prefill, sending={"a"})
    assert_empty(prefill)


def test_prefill_abort_mid_transfer_keeps_blocks_until_drained_then_frees_once(prefill):
    prefill.add_request(request("a", 100, {"do_remote_decode": True}, max_tokens=3))
    out, _ = step(prefill)
    assert [s.req_id for s in out.kv_connector_metadata.send] == ["a"]
    prefill.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    prefill.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # a second abort: no-op
    assert free_blocks(prefill) == BLOCKS - 1 - 4
    out, _ = step(prefill)
    assert out.kv_connector_metadata.abort == ["a"]  # the worker aborts the pdc transfer
    assert free_blocks(prefill) == BLOCKS - 1 - 4
    out, _ = step(prefill)
    assert out.kv_connector_metadata.abort == []  # told once
    step(prefill, sending={"a"})  # the worker: drain-ack, nothing in flight
    assert_empty(prefill)


def test_prefill_request_aborted_before_it_was_scheduled_is_freed_at_once(prefill):
    prefill.add_request(request("a", 100, {"do_remote_decode": True}, max_tokens=1))
    prefill.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    out, _ = step(prefill)
    assert out.kv_connector_metadata.send == [] and out.kv_connector_metadata.abort == []
    assert_empty(prefill)


def test_a_request_without_transfer_params_runs_locally(prefill, decode):
    for s in (prefill, decode):
        s.add_request(request("l", 40, {}, max_tokens=1))
        out, finished = step(s)
        assert out.num_scheduled_tokens == {"l": 40}
        assert finished["l"].kv_transfer_params is None
        assert_empty(s)


def test_decode_waits_for_the_remote_kv_then_runs(decode):
    import time

    t_added = time.monotonic()
    decode.add_request(request("b", 100, remote_prefill_params("b"), max_tokens=2))
    out, _ = step(decode)
    r = decode.requests["b"]
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {}  # nothing computed here for the prompt
    assert out.kv_connector_metadata.recv == [RecvReq(
        "b", room_of("b"), tuple(blocks_of(decode, "b")), 0, "tcp://127.0.0.1:1", 1)]
    # when the scheduler first saw it, for the request's timeline (Note [Timeline stamps])
    assert t_added <= out.kv_connector_metadata.recv[0].t_arrived <= time.monotonic()
    out, _ = step(decode)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and out.kv_connector_metadata.recv == []
    step(decode, recving={"b"})  # the worker's get_finished: loaded
    out, _ = step(decode)
    assert r.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"b": 1}  # the last prompt token, to sample from
    out, finished = step(decode)
    assert finished["b"].new_token_ids == [7]
    assert finished["b"].kv_transfer_params is None
    assert_empty(decode)


def test_decode_prefix_cache_hit_is_not_loaded(decode):
    """A prompt decode already holds 3 of 4 blocks of loads only the last one."""
    decode.add_request(request("b", 100, remote_prefill_params("b"), max_tokens=1))
    step(decode)
    step(decode, recving={"b"})
    step(decode)
    assert "b" not in decode.requests
    decode.add_request(request("c", 100, remote_prefill_params("c"), max_tokens=1))
    out, _ = step(decode)
    (recv,) = out.kv_connector_metadata.recv
    assert recv.prefix_tokens == 96
    assert recv.block_ids == tuple(blocks_of(decode, "c"))


def test_decode_abort_while_loading_keeps_blocks_until_drained_then_frees_once(decode):
    decode.add_request(request("b", 100, remote_prefill_params("b"), max_tokens=2))
    step(decode)
    assert decode.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    decode.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(decode) == BLOCKS - 1 - 4  # prefill may still be writing them
    out, _ = step(decode)
    assert out.kv_connector_metadata.abort == ["b"]
    assert free_blocks(decode) == BLOCKS - 1 - 4
    step(decode, sending={"b"})  # the worker: prefill acked the abort, no write in flight
    assert_empty(decode)


def test_decode_request_aborted_before_its_load_started_frees_at_once(decode):
    """No decode block was named to prefill: vLLM frees them now, and the worker is told to
    cancel the room, so prefill frees the prompt's KV it holds for the request."""
    decode.add_request(request("b", 100, remote_prefill_params("b"), max_tokens=2))
    decode.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    out, _ = step(decode)
    meta = out.kv_connector_metadata
    assert meta.recv == [] and meta.abort == []
    assert meta.cancel == [CancelReq("b", room_of("b"), "tcp://127.0.0.1:1", 1)]
    assert step(decode)[0].kv_connector_metadata.cancel == []  # told once
    assert_empty(decode)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_load_goes_through_vllms_load_error_hook(model_dir, policy):
    """The worker reports the blocks it could not load (get_block_ids_with_load_errors);
    vLLM fails the request or recomputes the prompt, by its kv_load_failure_policy: it
    never decodes from the blocks."""
    s = make_scheduler(model_dir, "kv_consumer", policy)
    try:
        s.add_request(request("b", 100, remote_prefill_params("b"), max_tokens=1))
        step(s)
        _, finished = step(s, recving={"b"}, invalid=blocks_of(s, "b"))
        if policy == "fail":
            assert finished["b"].finish_reason.name == "ERROR"
        else:
            assert finished == {}
            out, finished = step(s)
            assert out.num_scheduled_tokens == {"b": 100}  # the whole prompt, locally
            assert finished["b"].finish_reason.name == "LENGTH"
        assert_empty(s)
    finally:
        s.connector.shutdown()


def test_a_load_failed_before_its_blocks_are_safe_fails_now_and_frees_later(decode):
    """Note [Failed load]: the worker reports the load error as soon as pdc says the load
    failed, while a prefill rank may still write the blocks; vLLM fails the request at once
    but keeps the blocks until the worker reports the request in finished_recving."""
    decode.add_request(request("b", 100, remote_prefill_params("b"), max_tokens=1))
    step(decode)
    _, finished = step(decode, invalid=blocks_of(decode, "b"))
    assert finished["b"].finish_reason.name == "ERROR"
    assert free_blocks(decode) == BLOCKS - 1 - 4
    step(decode)
    assert free_blocks(decode) == BLOCKS - 1 - 4
    step(decode, recving={"b"})
    assert_empty(decode)
