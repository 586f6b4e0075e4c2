"""The GLM-5.2 / DeepSeek-V3.2 layout (MLA latent + DSA indexer keys) with SGLang's own pool
classes driven through pdc's backend classes, real Mooncake engines moving the bytes (issue
30: SGLang has no CPU path for DSA attention, docs/sglang.md "DSA indexer keys", so the layout
is proven with SGLang's pool classes, not pdc's harness layouts).

A prefill and a decode scheduler as SGLang 0.5.23 builds them for a DSA model (Note [SGLang
DSA indexer keys] in pdc/integrations/sglang/dsa.py): `DSATokenToKVPool`
(mem_cache/memory_pool.py) for the target and, with the MTP draft, for the draft layer; KVArgs
filled as disaggregation/prefill.py fills them (the latents in kv_data_ptrs, the draft's after
the target's; the indexer keys by SGLang's own `setup_state_kv_args` as the "dsa" state
component), and `MetadataBuffers`. pdc's PdcKVManager binds specs/sglang-deepseek-v32.yaml
and moves a request in two chunks, SGLang's DSA page list (its `_dsa_pages_payload`: the
request's pages) with the last; every byte of its latent pages, indexer-key pages and
metadata row is checked.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
from pdc.integrations.sglang import conn as C
from pdc.integrations.sglang import faults
from pdc.integrations.sglang.family import ParallelLayout, RefusedModel
from pdc.runtime import knobs
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    MetadataBuffers,
    build_kv_layer_ids,
    setup_state_kv_args,
)
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool
from sglang.srt.runtime_context import get_parallel

from pdc.serving.sglang_harness import TINY_MODELS, free_port

PAGE = 64  # DSATokenToKVPool asserts 64-token pages
PAGES = 6  # per pool, plus SGLang's padding page
ROWS = 8
HIDDEN = 64
ENV = {"SGLANG_HOST_IP": "127.0.0.1", "MOONCAKE_PROTOCOL": "tcp",
       "MC_TCP_ENABLE_CONNECTION_POOL": "true", "PDC_SGLANG_ENGINE": "mooncake"}
DSA = dict(index_head_dim=128, index_n_heads=2, index_topk=8)


def _pool(layers: int, dsa: bool = True):
    """A KV pool as SGLang's model runner allocates it for the tiny model on a CPU
    (mem_cache/kv_cache_configurator.py `_build_dsa_kv_pool`); DSATokenToKVPool reads the
    decode-context-parallel width, which a scheduler publishes and a test states."""
    common = dict(size=PAGES * PAGE, page_size=PAGE, dtype=torch.float32, device="cpu",
                  kv_lora_rank=32, qk_rope_head_dim=16, layer_num=layers,
                  enable_memory_saver=False)
    if not dsa:
        return MLATokenToKVPool(**common)
    with get_parallel().override(attn_dcp_size=1):
        return DSATokenToKVPool(index_head_dim=128, kv_cache_dim=48, **common)


class Scheduler:
    """One SGLang scheduler's transfer state: its pools, KVArgs, pdc's manager."""

    def __init__(self, mode, model: str, bootstrap_port: int, draft: bool, dsa: bool = True,
                 topk_seed: int = 0):
        self.target = _pool(2, dsa)
        self.draft = _pool(1, dsa) if draft else None
        # topk_seed: the DSA top-k seed's width, scheduler.py's get_dsa_seed_metadata_dim
        self.meta = MetadataBuffers(ROWS, hidden_size=HIDDEN if draft else 16,
                                    hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=16,
                                    output_dsa_topk_indices_dim=topk_seed)
        args = KVArgs()
        args.engine_rank = 0
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = \
            self.target.get_contiguous_buf_infos()
        args.num_draft_entries = 0
        if draft:
            dptrs, dlens, ditems = self.draft.get_contiguous_buf_infos()
            args.kv_data_ptrs, args.kv_data_lens = args.kv_data_ptrs + dptrs, \
                args.kv_data_lens + dlens
            args.kv_item_lens = args.kv_item_lens + ditems
            args.num_draft_entries = len(dptrs)
        args.kv_layer_ids = build_kv_layer_ids(
            token_to_kv_pool=self.target, draft_token_to_kv_pool=self.draft,
            num_draft_entries=args.num_draft_entries, num_hidden_layers=2)
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        # SGLang's own: the "dsa" state component, the draft pool's after the target's
        setup_state_kv_args(args, self.target, draft_token_to_kv_pool=self.draft,
                            total_kv_layers=2)
        args.page_size, args.kv_cache_dtype_str, args.prefill_start_layer = PAGE, "auto", 0
        self.kv_args = args
        server_args = SimpleNamespace(
            model_path=model, dtype="float32", tp_size=1, port=30000,
            disaggregation_bootstrap_port=bootstrap_port, layout=ParallelLayout(1, 0, 1, 0),
            speculative_algorithm="EAGLE" if draft else None,
            speculative_draft_model_path=None)
        self.mgr = C.PdcKVManager(args, mode, server_args, is_mla_backend=True)

    def pools(self):
        return [self.target] + ([self.draft] if self.draft is not None else [])

    def pages(self) -> list[tuple[str, torch.Tensor]]:
        """(name, [pages, bytes of a page]) of every buffer pdc moves by page."""
        out = []
        for pool, who in zip(self.pools(), ("target", "draft"), strict=False):
            out += [(f"{who} latent {i}", b.view(-1, PAGE * 48 * 4 // 4).view(torch.uint8))
                    for i, b in enumerate(pool.kv_buffer)]
            out += [(f"{who} index_k {i}", b)
                    for i, b in enumerate(pool.index_k_with_scale_buffer)]
        return out


def _model(tmp, arch: str, draft: bool, dsa: bool = True, **extra) -> str:
    model = tmp / f"{arch}-{int(draft)}-{int(dsa)}{''.join(extra)}"
    model.mkdir()
    config = dict(TINY_MODELS["deepseek-mla"][2], architectures=[arch],
                  **(DSA if dsa else {}), **extra)
    if draft:
        config["num_nextn_predict_layers"] = 1
    (model / "config.json").write_text(json.dumps(config))
    return str(model)


SEED = 8  # index_topk + index_kpool - 1: the DSA top-k seed's width


@pytest.fixture(scope="module", params=["dsa", "dsa-mtp", "dsa-seed"])
def pair(request, tmp_path_factory):
    """"dsa-seed": GLM-5.2's IndexShare (index_share_for_mtp_iteration), whose metadata row
    SGLang extends with the DSA top-k seed (docs/sglang.md "DSA top-k seed")."""
    draft, seed = request.param == "dsa-mtp", request.param == "dsa-seed"
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    real_layout = C.parallel_layout
    C.parallel_layout = lambda server_args: server_args.layout  # SGLang's ParallelContext
    knobs.override(transfer_timeout_s=4.0, prefill_room_timeout_s=8.0)
    tmp = tmp_path_factory.mktemp("dsa")
    model = _model(tmp, "DeepseekV32ForCausalLM", draft,
                   **({"index_share_for_mtp_iteration": True} if seed else {}))
    port = free_port()
    table = C.PdcKVBootstrapServer("127.0.0.1", port)
    made = []
    try:
        prefill = Scheduler(DisaggregationMode.PREFILL, model, port, draft,
                            topk_seed=SEED * seed)
        made.append(prefill)
        decode = Scheduler(DisaggregationMode.DECODE, model, port, draft, topk_seed=SEED * seed)
        made.append(decode)
        gen = torch.Generator().manual_seed(5)
        for _, buf in prefill.pages():
            buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
        if seed:  # token positions of the target's top-k, a row per request
            prefill.meta.output_dsa_topk_indices.copy_(torch.randint(
                0, 1 << 20, (ROWS, SEED), generator=gen, dtype=torch.int32))
        addr = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not decode.mgr.try_ensure_parallel_info(addr):
            assert time.monotonic() < deadline, "decode endpoint never opened"
        assert decode.mgr.endpoint_errors == {}
        yield SimpleNamespace(prefill=prefill, decode=decode, addr=addr, model=model,
                              port=port, draft=draft, seed=seed, gen=gen, tmp=tmp)
    finally:
        knobs.reset()
        C.parallel_layout = real_layout
        for s in made:
            ep = getattr(s.mgr, "endpoint", None)
            for e in ([ep] if ep else []) + list(getattr(s.mgr, "endpoints", {}).values()):
                e.close()
        table.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait(*handles, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        states = [h.poll() for h in handles]
        if all(s in (KVPoll.Success, KVPoll.Failed) for s in states) or \
                time.monotonic() > deadline:
            return states
        time.sleep(0.01)


def transfer(p, room: int, src, dst, prefill_dsa=None, decode_dsa=None, prefill_row=1):
    """One request as SGLang's schedulers run it: decode's metadata with its DSA pages
    (`_dsa_pages_payload`: its own pages), prefill's pages in two chunks, its DSA pages (its
    own unless given) with the last. Returns (receiver, sender) states and errors."""
    rv = C.PdcKVReceiver(p.decode.mgr, p.addr, room)
    rv.init(0)
    tx = C.PdcKVSender(p.prefill.mgr, p.addr, room)
    deadline = time.monotonic() + 30
    while rv.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    rv.send_metadata(dst, aux_index=2, state_indices=[list(decode_dsa or dst)])
    while tx.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    p.prefill.meta.bootstrap_room[prefill_row].fill_(room)
    tx.init(len(src), aux_index=prefill_row)
    tx.send(src[:1], num_kv_tokens=PAGE)
    tx.send(src[1:], state_indices=[list(prefill_dsa or src)],
            num_kv_tokens=(len(src) - 1) * PAGE)
    states = _wait(rv, tx)
    rv.clear()
    return states, rv.error, tx.error


def differences(p, src, dst) -> list[str]:
    """Every page of every buffer (latent and indexer keys, target and draft) that decode
    does not hold byte for byte as prefill had it."""
    return [f"{name} page {d}"
            for (name, a), (_, b) in zip(p.prefill.pages(), p.decode.pages(), strict=True)
            for s, d in zip(src, dst, strict=True) if not torch.equal(a[s], b[d])]


def test_the_indexer_keys_are_bound_as_page_components(pair):
    layout = pair.decode.mgr.family.layout
    assert layout.family == "sglang-deepseek-v32"
    idx = layout.component("index_k")
    assert (idx.layer_ids, idx.item_bytes) == ((0, 1), PAGE * (128 + 4))
    assert layout.component("draft_index_k").layer_ids == ((2,) if pair.draft else ())
    # SGLang's own registration: one "dsa" state component, a buffer per layer, a row a page
    args = pair.decode.kv_args
    assert [str(t.value) for t in args.state_types] == ["dsa"]
    assert args.state_item_lens[0] == [PAGE * 132] * (3 if pair.draft else 2)


def test_latent_and_indexer_pages_move_byte_for_byte(pair):
    src, dst = [3, 5, 1], [4, 2, 6]
    before = [b.clone() for _, b in pair.decode.pages()]
    assert transfer(pair, 9_000_001, src, dst)[0] == [KVPoll.Success, KVPoll.Success]
    assert differences(pair, src, dst) == []
    keep = [pg for pg in range(PAGES + 1) if pg not in dst]
    for (name, b), was in zip(pair.decode.pages(), before, strict=True):
        assert torch.equal(b[keep], was[keep]), name  # nothing else moved
    assert int(pair.decode.meta.bootstrap_room[2][0]) == 9_000_001
    if pair.seed:  # the top-k seed row, byte for byte, and no other row
        seeds = pair.decode.meta.output_dsa_topk_indices
        assert torch.equal(seeds[2], pair.prefill.meta.output_dsa_topk_indices[1])
        assert bool((seeds[[r for r in range(ROWS) if r not in (2, 4)]] == -1).all())


def test_past_decodes_cached_prefix_only_the_suffix_pages_move(pair):
    # decode's radix cache holds the first page (decode_prefix_len 64): SGLang's DSA lists
    # are the suffix pages on both sides (`suffix_page_indices` from the prefix), as are the
    # KV pages prefill sends and decode allocates; pdc places them past the prefix
    room, src, dst = 9_000_005, [2, 6], [1, 3]
    before = [b.clone() for _, b in pair.decode.pages()]
    rv = C.PdcKVReceiver(pair.decode.mgr, pair.addr, room)
    rv.init(0)
    tx = C.PdcKVSender(pair.prefill.mgr, pair.addr, room)
    deadline = time.monotonic() + 30
    while rv.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    rv.send_metadata(dst, aux_index=4, state_indices=[dst], decode_prefix_len=PAGE)
    while tx.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tx.pop_decode_prefix_len() == PAGE
    pair.prefill.meta.bootstrap_room[1].fill_(room)
    tx.init(len(src), aux_index=1)
    tx.send(src, state_indices=[src], num_kv_tokens=len(src) * PAGE)
    assert _wait(rv, tx) == [KVPoll.Success, KVPoll.Success], (rv.error, tx.error)
    rv.clear()
    assert differences(pair, src, dst) == []
    keep = [pg for pg in range(PAGES + 1) if pg not in dst]
    for (name, b), was in zip(pair.decode.pages(), before, strict=True):
        assert torch.equal(b[keep], was[keep]), name


def test_a_wrong_indexer_page_is_detected(pair):
    # Negative control of the check above: the last chunk's first page is read from the page
    # before it (faults.py `wrong_page`); the request succeeds, and the byte check names that
    # page's latent and indexer keys in every layer.
    room, src, dst = 9_000_002, [2, 4], [5, 3]
    faults._PLANNED[room] = "wrong_page"
    try:
        assert transfer(pair, room, src, dst)[0] == [KVPoll.Success, KVPoll.Success]
    finally:
        del faults._PLANNED[room]
    layers = [("target", 0), ("target", 1)] + ([("draft", 0)] if pair.draft else [])
    assert sorted(differences(pair, src, dst)) == sorted(
        f"{who} {what} {i} page 3" for who, i in layers for what in ("latent", "index_k"))
    assert torch.equal(pair.decode.pages()[0][1][3], pair.prefill.pages()[0][1][3])


def test_a_dsa_page_list_that_is_not_the_requests_pages_fails_it(pair):
    states, rv_error, tx_error = transfer(pair, 9_000_003, [1, 2], [6, 5],
                                          prefill_dsa=[1, 3])
    assert states == [KVPoll.Failed, KVPoll.Failed]
    assert tx_error == ("SGLang's DSA indexer pages [1, 3] are not the request's KV pages "
                        "[1, 2]: pdc moves the indexer keys with the KV pages")
    rv = C.PdcKVReceiver(pair.decode.mgr, pair.addr, 9_000_004)
    rv.init(0)
    deadline = time.monotonic() + 30
    while rv.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    rv.send_metadata([6, 5], aux_index=3, state_indices=[[6, 4]])
    assert rv.poll() == KVPoll.Failed
    assert rv.error == ("SGLang's DSA indexer pages [6, 4] are not the request's KV pages "
                        "[6, 5]: pdc moves the indexer keys with the KV pages")


def test_a_dsa_server_against_the_mla_spec_is_refused_naming_both(pair):
    # DeepseekV3ForCausalLM with index_topk: SGLang serves it as DSA (configs/model_config.py
    # is_deepseek_dsa) and registers indexer keys; the architecture names sglang-deepseek-mla
    model = _model(pair.tmp, "DeepseekV3ForCausalLM", pair.draft)
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, model, pair.port, pair.draft)
    n = 3 if pair.draft else 2
    assert str(e.value) == (
        f"pdc: DeepseekV3ForCausalLM ({model}) does not fit its spec: SGLang registered {n} "
        "DSA indexer-key buffers (state type 'dsa': a DSATokenToKVPool's indexer keys; the "
        "model's config sets index_topk), but sglang-deepseek-mla declares no index_k "
        "component (specs/sglang-deepseek-mla.yaml); hint: serve it with a spec whose page "
        "component index_k takes them (specs/sglang-deepseek-v32.yaml)")


def test_the_v32_spec_against_a_plain_mla_pool_is_refused_naming_both(pair):
    # the reverse: the spec declares indexer keys, SGLang's pool has none (an MLA pool)
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, pair.model, pair.port, pair.draft, dsa=False)
    assert str(e.value) == (
        f"pdc: DeepseekV32ForCausalLM ({pair.model}) does not fit its spec: "
        "sglang-deepseek-v32's index_k (specs/sglang-deepseek-v32.yaml:70:3) holds the DSA "
        "indexer keys of 2 layers, but SGLang registered no DSA indexer-key buffers (its KV "
        "pool is not a DSATokenToKVPool: SGLang serves a model as DSA only when its "
        "config.json sets index_topk, configs/model_config.py is_deepseek_dsa); hint: serve "
        "a model without index_topk with specs/sglang-deepseek-mla.yaml")


def test_a_seed_row_read_from_another_request_is_detected(pair):
    # Negative control of the seed check: prefill's metadata row of another request (row 3,
    # its room rewritten, so that only the seed tells) reaches decode's row
    if not pair.seed:  # no flag in the config: SGLang's metadata row has no seed field
        assert pair.decode.meta.output_dsa_topk_indices is None
        assert pair.decode.mgr.family.layout.component("aux_dsa_topk").stages == "none"
        return
    src, dst = [2, 4], [5, 3]
    assert transfer(pair, 9_000_006, src, dst, prefill_row=3)[0] == \
        [KVPoll.Success, KVPoll.Success]
    seeds, sent = pair.decode.meta.output_dsa_topk_indices, pair.prefill.meta
    assert not torch.equal(seeds[2], sent.output_dsa_topk_indices[1])
    assert torch.equal(seeds[2], sent.output_dsa_topk_indices[3])


FIELDS = ("output_ids, cached_tokens, output_token_logprobs_val, output_token_logprobs_idx, "
          "output_top_logprobs_val, output_top_logprobs_idx, output_topk_p, output_topk_index, "
          "output_hidden_states, ")


@pytest.mark.parametrize("flag", [True, False])
def test_a_seed_field_and_a_config_that_disagree_are_refused(pair, flag):
    # the config's flag binds aux_dsa_topk (Note [Present components]); SGLang's metadata row
    # has the field or not on its own (here: the opposite)
    model = _model(pair.tmp, "GlmMoeDsaForCausalLM", pair.draft,
                   **({"index_share_for_mtp_iteration": flag} if flag else {}))
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, model, pair.port, pair.draft,
                  topk_seed=0 if flag else SEED)
    got, declared = (10, 11) if flag else (11, 10)
    seed = "output_dsa_topk_indices, " if flag else ""
    assert str(e.value) == (
        f"pdc: GlmMoeDsaForCausalLM ({model}) does not fit its spec: SGLang registered {got} "
        f"aux buffers, sglang-deepseek-v32 declares {declared} ({FIELDS}{seed}bootstrap_room); "
        "SGLang adds 3 for SGLANG_ENABLE_DISAGG_SAMPLING_MASK and 1 for "
        "--disaggregation-enable-kv-checksum, which pdc's specs do not carry, and 1 for the "
        "DSA top-k seed where a DSA model's config sets index_share_for_mtp_iteration; hint: "
        "turn off the first two (docs/sglang.md \"DSA top-k seed\")")
