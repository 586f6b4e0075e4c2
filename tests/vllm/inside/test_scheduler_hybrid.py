"""PdcConnector's scheduler side with vLLM's hybrid KV cache manager (SupportsHMA), inside
vLLM's real Scheduler: the tiny Qwen3-Next of specs/vllm-qwen3-next.yaml, its GDN layers in
a state group (MambaSpec, one block per request) and its attention layers in a group of
160-token blocks, both drawing from one block pool.

Checked: prefill computes and sends all but the prompt's last token (Note [Hybrid last
token]), naming the attention blocks as pages and the state block as the slot; decode loads
those tokens into its own pages and slot and computes the last token itself; a failed load
reaches vLLM as a failed request (`failed_recving`), and every block of both groups is back
in the pool afterwards. With prefix caching (mamba_cache_mode "align", Note [Hybrid prefix
caching]): prefill rehashes the prompt it computes and sends the state block its N - 1
tokens end in; decode loads past its own hit into the block its N - 1 tokens end in, and a
hit covering every sent token cancels the load; what pdc cannot move is refused naming it.
"""

from __future__ import annotations

import pytest
import torch
from pdc.integrations.vllm.metadata import CancelReq, RecvReq, SendReq
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
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
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
                   prefix_caching: bool = False, match_unit: int | None = None,
                   speculative: int = 0, mode: str = "") -> Scheduler:
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                                 seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                         max_model_len=1024, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=PAGE, gpu_memory_utilization=0.9,
                                 enable_prefix_caching=prefix_caching,
                                 prefix_match_unit=match_unit),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdcConnector", kv_connector_module_path="pdc.integrations.vllm",
            kv_role=role, kv_connector_extra_config={"family": "vllm-qwen3-next"},
            kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"))
    config.cache_config.num_gpu_blocks = BLOCKS
    if mode:
        config.cache_config.mamba_cache_mode = mode
    attn = FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16)
    # "align" keeps a state block per attention block (vLLM's own hybrid config does)
    gdn = MambaSpec(block_size=PAGE if prefix_caching else 1024,
                    shapes=((3, 512), (4, 64, 64)),
                    dtypes=(torch.bfloat16, torch.float32), page_size_padded=81920,
                    mamba_cache_mode=config.cache_config.mamba_cache_mode,
                    num_speculative_blocks=speculative)
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


def request(req_id: str, tokens: int | list[int], params: dict, max_tokens: int = 1,
            hashed: bool = False) -> Request:
    """A request of `tokens` prompt tokens (a count, or the tokens); `hashed`: with vLLM's
    block hasher (prefix caching), hashing every PAGE tokens."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    prompt = [3 + i % 900 for i in range(tokens)] if isinstance(tokens, int) else list(tokens)
    r = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=sp,
                pooling_params=None, mm_features=None,
                block_hasher=get_request_block_hasher(PAGE, sha256) if hashed else None)
    r.kv_transfer_params = dict(params)
    return r


def done(r: Request) -> bool:
    """The scheduled chunk completes the prompt (a partial chunk samples no token)."""
    return r.num_computed_tokens >= r.num_prompt_tokens


def step(s: Scheduler, sending=None, recving=None, failed=None):
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    kv = None
    if sending or recving or failed:
        kv = KVConnectorOutput(finished_sending=set(sending or ()),
                               finished_recving=set(recving or ()),
                               failed_recving=set(failed or ()))
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[7] if done(s.requests[r]) else [] for r in ids],
                            logprobs=None,
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
    # vLLM's null block (0) is shared and not counted: "align" leaves it below 0
    assert [b.ref_cnt for b in pool.blocks[1:]] == [0] * (pool.num_gpu_blocks - 1)


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


def test_with_the_first_token_from_prefill_prefill_computes_and_sends_every_token(prefill):
    """Note [First token from prefill]: decode computes the first token, not the last prompt
    token, so prefill computes all N tokens and sends the state after them."""
    r = request("f", 200, {"do_remote_decode": True, "pdc_first_token": True})
    prefill.add_request(r)
    assert r.num_prompt_tokens == 200 and "pdc_tokens" not in r.kv_transfer_params
    out, finished = step(prefill)
    assert out.num_scheduled_tokens == {"f": 200}
    (state,), pages = prefill.kv_cache_manager.get_block_ids("f")
    assert out.kv_connector_metadata.send == [SendReq("f", room_of("f"), tuple(pages), 200,
                                                      state)]
    assert finished["f"].kv_transfer_params["pdc_tokens"] == 200
    step(prefill)
    step(prefill, sending={"f"})
    assert_empty(prefill)


def test_decode_continues_from_prefills_first_token_computing_only_it(decode):
    """Decode's request is the prompt and prefill's first token (321 tokens, a block more
    than prefill's 320): vLLM gives it the blocks of the 320 it loads while it waits, then
    the block of the one it computes."""
    decode.add_request(request("g", 320 + 1, remote_prefill_params("g", 320), max_tokens=2))
    out, _ = step(decode)
    (state,), pages = decode.kv_cache_manager.get_block_ids("g")
    assert len(pages) == 2
    assert out.kv_connector_metadata.recv == [RecvReq(
        "g", room_of("g"), tuple(pages), 0, "tcp://127.0.0.1:1", 1, state)]
    step(decode, recving={"g"})
    out, _ = step(decode)
    assert out.num_scheduled_tokens == {"g": 1}  # the first token, from the loaded state
    assert len(decode.kv_cache_manager.get_block_ids("g")[1]) == 3
    _, finished = step(decode)
    assert finished["g"].finish_reason.name == "LENGTH"
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


def test_a_prefix_match_unit_finer_than_a_state_block_is_refused_naming_the_fix(model_dir):
    with pytest.raises(SettingsError) as e:
        make_scheduler(model_dir, "kv_consumer", prefix_caching=True, match_unit=32)
    assert str(e.value) == (
        "PdcConnector loads a hybrid request past a prefix hit that ends on a state block "
        "(160 tokens), but vLLM matches prefixes every 32 tokens (prefix_match_unit)\n  hint: "
        "leave prefix_match_unit unset or set it to 160 (Note [Hybrid prefix caching] in "
        "integrations/vllm/scheduler.py)")


def test_a_mamba_cache_mode_other_than_none_or_align_is_refused_naming_the_fix(model_dir):
    with pytest.raises(SettingsError) as e:
        make_scheduler(model_dir, "kv_consumer", mode="all")
    assert str(e.value) == (
        "PdcConnector moves a request's state from the state block its tokens end in, but "
        "vLLM keeps mamba_cache_mode 'all'\n  hint: start a hybrid engine with "
        "mamba_cache_mode 'none' (no prefix caching) or 'align' (Note [Hybrid prefix "
        "caching] in integrations/vllm/scheduler.py)")


def test_speculative_state_blocks_are_refused_naming_the_fix(model_dir):
    with pytest.raises(SettingsError) as e:
        make_scheduler(model_dir, "kv_consumer", speculative=1)
    assert str(e.value) == (
        "PdcConnector moves one state block per request, but vLLM keeps 1 speculative state "
        "blocks per request\n  hint: start a hybrid engine without speculative decoding")


@pytest.fixture
def prefill_pc(model_dir):
    init_none_hash(sha256)
    s = make_scheduler(model_dir, "kv_producer", prefix_caching=True)
    yield s
    s.connector.shutdown()


@pytest.fixture
def decode_pc(model_dir):
    init_none_hash(sha256)
    s = make_scheduler(model_dir, "kv_consumer", prefix_caching=True)
    yield s
    s.connector.shutdown()


def states(s: Scheduler, req_id: str) -> list[int]:
    return list(s.kv_cache_manager.get_block_ids(req_id)[0])


def test_prefill_with_prefix_caching_rehashes_and_sends_the_state_after_n_minus_1(prefill_pc):
    """A 320-token prompt: prefill computes 319 tokens, so it hashes one full block, not
    two (its second block never holds token 320's KV and state), and sends the state block
    its 319 tokens end in: block (319 - 1) // 160 = 1 of the state group."""
    r = request("a", 2 * PAGE, {"do_remote_decode": True}, hashed=True)
    assert len(r.block_hashes) == 2
    prefill_pc.add_request(r)
    assert r.num_prompt_tokens == 2 * PAGE - 1
    assert r.block_hashes == request("x", 2 * PAGE - 1, {}, hashed=True).block_hashes
    assert len(r.block_hashes) == 1
    out, _ = step(prefill_pc)  # "align" ends a prefill chunk on a block
    assert out.num_scheduled_tokens == {"a": PAGE} and out.kv_connector_metadata.send == []
    out, finished = step(prefill_pc)
    assert out.num_scheduled_tokens == {"a": PAGE - 1}
    (send,) = out.kv_connector_metadata.send
    state = states(prefill_pc, "a")
    assert len(state) == 2 and send.slot == state[1] != 0  # 0: vLLM's null block
    assert finished["a"].kv_transfer_params["pdc_tokens"] == 2 * PAGE - 1
    step(prefill_pc)
    step(prefill_pc, sending={"a"})
    assert_empty(prefill_pc)


def test_decode_with_prefix_caching_loads_past_its_hit_or_cancels_a_whole_hit(decode_pc):
    shared = [5 + i % 700 for i in range(2 * PAGE)]
    # x: 321 tokens, 320 loaded; decode then holds their pages and the state after them
    decode_pc.add_request(request("x", shared + [9], remote_prefill_params("x", 2 * PAGE),
                                  hashed=True))
    out, _ = step(decode_pc)
    (recv,) = out.kv_connector_metadata.recv
    assert recv.prefix_tokens == 0 and recv.slot == states(decode_pc, "x")[1] != 0
    step(decode_pc, recving={"x"})
    _, finished = step(decode_pc)
    assert "x" in finished
    # y: the same 320 tokens and 49 more: pages past 320 and the state after 368 tokens
    decode_pc.add_request(request("y", shared + [11] * 49,
                                  remote_prefill_params("y", 2 * PAGE + 48), hashed=True))
    out, _ = step(decode_pc)
    (recv,) = out.kv_connector_metadata.recv
    assert recv.prefix_tokens == 2 * PAGE
    assert len(recv.block_ids) == 3 and recv.slot == states(decode_pc, "y")[2] != 0
    step(decode_pc, recving={"y"})
    _, finished = step(decode_pc)
    assert "y" in finished
    # z: x with another last token: decode's hit covers the 320 tokens prefill sends
    decode_pc.add_request(request("z", shared + [13], remote_prefill_params("z", 2 * PAGE),
                                  hashed=True))
    out, finished = step(decode_pc)
    meta = out.kv_connector_metadata
    assert meta.recv == [] and out.num_scheduled_tokens == {"z": 1}
    assert meta.cancel == [CancelReq("z", room_of("z"), "tcp://127.0.0.1:1", 1, 2 * PAGE)]
    assert "z" in finished
    assert_empty(decode_pc)


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
