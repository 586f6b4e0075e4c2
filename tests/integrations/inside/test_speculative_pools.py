"""Speculative decoding's PD state with SGLang's own pool classes driven through pdc's backend
classes, real Mooncake engines moving the bytes (issue 30: SGLang cannot run a speculating
server on this CPU, docs/sglang.md "Speculative decoding", so the layout is proven with
SGLang's pool classes, not pdc's harness layouts).

A prefill and a decode scheduler of a speculating server, each as SGLang 0.5.23 builds it
(Note [SGLang draft state] in pdc/integrations/sglang/family.py): the target's KV pool, the
draft model's own pool (`MHATokenToKVPool` of the EAGLE draft beside the tiny Llama;
`MLATokenToKVPool` of the MTP layer beside the tiny DeepSeek MLA, mem_cache/memory_pool.py),
KVArgs filled as disaggregation/prefill.py fills them (the draft's buffers after the
target's, `num_draft_entries`, SGLang's own `build_kv_layer_ids`), and `MetadataBuffers` with
the hidden row as wide as the draft's hidden size in the model's dtype. pdc's PdcKVManager
binds the spec's draft band from the server's `--speculative-algorithm` and draft model and
moves a request; every byte of its target pages, draft pages and metadata row is checked.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
from pdc.integrations.sglang import conn as C
from pdc.integrations.sglang.family import ParallelLayout, RefusedModel
from pdc.runtime import knobs
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    MetadataBuffers,
    build_kv_layer_ids,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

from pdc.serving.sglang_harness import TINY_MODELS, free_port

PAGE = 16
PAGES = 12  # per pool, plus SGLang's padding page 0
ROWS = 8  # metadata rows
HIDDEN = 64  # the tiny models' hidden size: the draft's, and so the hidden row's width
ENV = {"SGLANG_HOST_IP": "127.0.0.1", "MOONCAKE_PROTOCOL": "tcp",
       "MC_TCP_ENABLE_CONNECTION_POOL": "true", "PDC_SGLANG_ENGINE": "mooncake"}
# the EAGLE draft of the tiny Llama: one layer of its own attention shape
EAGLE = {"architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1,
         "hidden_size": HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 512, "torch_dtype": "bfloat16"}


def _pools(family: str, draft_layers: int):
    """(target pool, draft pool) as SGLang's model runners allocate them on a CPU."""
    common = dict(size=PAGES * PAGE, page_size=PAGE, dtype=torch.bfloat16, device="cpu",
                  enable_memory_saver=False)
    if family == "llama":
        return (MHATokenToKVPool(head_num=2, head_dim=16, layer_num=2, **common),
                MHATokenToKVPool(head_num=2, head_dim=16, layer_num=draft_layers, **common))
    mla = dict(kv_lora_rank=32, qk_rope_head_dim=16, **common)
    return (MLATokenToKVPool(layer_num=2, **mla), MLATokenToKVPool(layer_num=draft_layers, **mla))


class Scheduler:
    """One speculating SGLang scheduler's transfer state: its pools, KVArgs, pdc's manager."""

    def __init__(self, mode, family: str, model: str, draft_path: str, bootstrap_port: int,
                 draft_layers: int = 1):
        self.family = family
        self.target, self.draft = _pools(family, draft_layers)
        self.meta = MetadataBuffers(ROWS, hidden_size=HIDDEN, hidden_states_dtype=torch.bfloat16,
                                    max_sampling_mask_tokens=16)
        args = KVArgs()
        args.engine_rank = 0
        ptrs, lens, items = self.target.get_contiguous_buf_infos()
        dptrs, dlens, ditems = self.draft.get_contiguous_buf_infos()
        args.kv_data_ptrs, args.kv_data_lens = ptrs + dptrs, lens + dlens
        args.kv_item_lens = items + ditems
        args.num_draft_entries = len(dptrs)
        args.kv_layer_ids = build_kv_layer_ids(
            token_to_kv_pool=self.target, draft_token_to_kv_pool=self.draft,
            num_draft_entries=len(dptrs), num_hidden_layers=2)
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        args.state_types, args.state_data_ptrs = [], []
        args.page_size, args.kv_cache_dtype_str, args.prefill_start_layer = PAGE, "auto", 0
        server_args = SimpleNamespace(
            model_path=model, dtype="bfloat16", tp_size=1, port=30000,
            disaggregation_bootstrap_port=bootstrap_port, layout=ParallelLayout(1, 0, 1, 0),
            speculative_algorithm="EAGLE", speculative_draft_model_path=draft_path)
        self.mgr = C.PdcKVManager(args, mode, server_args, is_mla_backend=family != "llama")

    def buffers(self) -> list[torch.Tensor]:
        """Every KV buffer, target's then draft's, in KVArgs order."""
        out = []
        for pool in (self.target, self.draft):
            out += list(pool.kv_buffer) if self.family != "llama" else \
                list(pool.k_buffer) + list(pool.v_buffer)
        return out

    def page(self, buf: torch.Tensor, page: int) -> torch.Tensor:
        return buf[page * PAGE:(page + 1) * PAGE]

    def row(self, row: int) -> dict[str, torch.Tensor]:
        """The metadata row's fields SGLang registers, by name."""
        names = ("output_ids", "cached_tokens", "output_token_logprobs_val",
                 "output_token_logprobs_idx", "output_top_logprobs_val",
                 "output_top_logprobs_idx", "output_topk_p", "output_topk_index",
                 "output_hidden_states", "bootstrap_room")
        return {n: getattr(self.meta, n)[row] for n in names}


def _model(tmp, family: str) -> tuple[str, str]:
    """(target model folder, draft model folder) of `family`'s tiny model."""
    model = tmp / family
    model.mkdir()
    arch = "LlamaForCausalLM" if family == "llama" else "DeepseekV3ForCausalLM"
    config = dict(TINY_MODELS[family][2], architectures=[arch])
    if family == "llama":
        draft = tmp / "eagle"
        draft.mkdir()
        (draft / "config.json").write_text(json.dumps(EAGLE))
    else:  # NEXTN: the target's own checkpoint holds the MTP layer
        config["num_nextn_predict_layers"] = 1
        draft = model
    (model / "config.json").write_text(json.dumps(config))
    return str(model), str(draft)


@pytest.fixture(scope="module", params=["llama", "deepseek-mla"],
                ids=["eagle-llama", "mtp-deepseek-mla"])
def pair(request, tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    real_layout = C.parallel_layout
    C.parallel_layout = lambda server_args: server_args.layout  # SGLang's ParallelContext
    knobs.override(transfer_timeout_s=4.0, prefill_room_timeout_s=8.0)
    tmp = tmp_path_factory.mktemp("spec")
    model, draft = _model(tmp, request.param)
    port = free_port()
    table = C.PdcKVBootstrapServer("127.0.0.1", port)
    made = []
    try:
        prefill = Scheduler(DisaggregationMode.PREFILL, request.param, model, draft, port)
        made.append(prefill)
        decode = Scheduler(DisaggregationMode.DECODE, request.param, model, draft, port)
        made.append(decode)
        gen = torch.Generator().manual_seed(11)
        for buf in prefill.buffers():
            buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
        addr = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not decode.mgr.try_ensure_parallel_info(addr):
            assert time.monotonic() < deadline, "decode endpoint never opened"
        assert decode.mgr.endpoint_errors == {}
        yield SimpleNamespace(prefill=prefill, decode=decode, addr=addr, model=model,
                              draft=draft, port=port, family=request.param, gen=gen)
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


def _fill_row(s: Scheduler, row: int, room: int, gen) -> None:
    """What SGLang's prefill writes into the row (MetadataBuffers.set_buf): first token,
    EAGLE's top-k and the draft's hidden state, and the room."""
    m = s.meta
    m.output_ids[row].copy_(torch.randint(0, 512, (16,), generator=gen, dtype=torch.int32))
    m.output_topk_p[row].copy_(torch.rand(16, generator=gen))
    m.output_topk_index[row].copy_(torch.randint(0, 512, (16,), generator=gen))
    m.output_hidden_states[row].copy_(torch.randn(HIDDEN, generator=gen).to(torch.bfloat16))
    m.bootstrap_room[row].fill_(room)


def _wait(*handles, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        states = [h.poll() for h in handles]
        if all(s in (KVPoll.Success, KVPoll.Failed) for s in states) or \
                time.monotonic() > deadline:
            return states
        time.sleep(0.01)


def transfer(p, room: int, src, dst, prefill_row: int, decode_row: int):
    """One request as SGLang's schedulers run it, prefill reading its metadata row
    `prefill_row` (its own, or on purpose another request's)."""
    rv = C.PdcKVReceiver(p.decode.mgr, p.addr, room)
    rv.init(0)
    tx = C.PdcKVSender(p.prefill.mgr, p.addr, room)
    deadline = time.monotonic() + 30
    while rv.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    rv.send_metadata(dst, aux_index=decode_row)
    while tx.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    tx.init(len(src), aux_index=prefill_row)
    tx.send(src, num_kv_tokens=len(src) * PAGE)
    assert _wait(rv, tx) == [KVPoll.Success, KVPoll.Success], (rv.error, tx.error)
    rv.clear()


def differences(p, src, dst, prefill_row: int, decode_row: int) -> list[str]:
    """Every KV buffer page and metadata field of the request that decode does not hold
    byte for byte as prefill had it."""
    out = []
    pre, dec = p.prefill, p.decode
    n_target = len(pre.buffers()) - len(pre.draft.get_contiguous_buf_infos()[0])
    for i, (a, b) in enumerate(zip(pre.buffers(), dec.buffers(), strict=True)):
        for s, d in zip(src, dst, strict=True):
            if not torch.equal(pre.page(a, s).view(torch.uint8), dec.page(b, d).view(torch.uint8)):
                out.append(f"{'draft' if i >= n_target else 'target'} buffer {i} page {d}")
    want, got = pre.row(prefill_row), dec.row(decode_row)
    out += [f"row field {n}" for n in want
            if not torch.equal(want[n].view(torch.uint8), got[n].view(torch.uint8))]
    return out


def test_the_draft_band_is_bound_from_the_speculating_server(pair):
    layout = pair.decode.mgr.family.layout
    draft = "draft_kv" if pair.family == "llama" else "draft_latent"
    assert (layout.draft_ids, layout.component(draft).layer_ids) == ((2,), (2,))
    hidden = layout.component("aux_hidden")
    assert (hidden.shape, hidden.dtype, hidden.item_bytes) == ((HIDDEN,), "bfloat16", 128)
    # SGLang numbers a plain pool's entries by position: pdc puts the draft's after the target
    assert pair.decode.mgr.kv_args.kv_layer_ids == []


def test_a_requests_target_and_draft_pages_and_hidden_row_move_byte_for_byte(pair):
    src, dst = [3, 5, 6], [8, 2, 10]
    _fill_row(pair.prefill, 1, 7_000_001, pair.gen)
    before = [b.clone() for b in pair.decode.buffers()]
    transfer(pair, 7_000_001, src, dst, prefill_row=1, decode_row=4)
    assert differences(pair, src, dst, prefill_row=1, decode_row=4) == []
    # nothing else moved: every other page of every buffer is as it was
    for b, was in zip(pair.decode.buffers(), before, strict=True):
        keep = [pg for pg in range(PAGES) if pg not in dst]
        assert all(torch.equal(pair.decode.page(b, pg), pair.decode.page(was, pg))
                   for pg in keep)
    assert int(pair.decode.meta.bootstrap_room[4][0]) == 7_000_001


def test_a_corrupted_row_is_detected(pair):
    # Negative control of the check above and of SGLang's own: prefill reads another
    # request's metadata row. Every page still moves, but the hidden row and the room are
    # the other request's: decode's room check (disaggregation/decode.py
    # `_commit_transfer_to_req`, "Context corruption detected") sees it, and so does ours.
    _fill_row(pair.prefill, 2, 7_000_002, pair.gen)
    _fill_row(pair.prefill, 3, 7_000_099, pair.gen)
    src, dst = [4], [9]
    transfer(pair, 7_000_002, src, dst, prefill_row=3, decode_row=5)
    assert int(pair.decode.meta.bootstrap_room[5][0]) == 7_000_099 != 7_000_002
    diff = differences(pair, src, dst, prefill_row=2, decode_row=5)
    assert "row field output_hidden_states" in diff and "row field bootstrap_room" in diff
    assert not [d for d in diff if "buffer" in d]  # the pages are right


def test_a_wrong_draft_layer_count_is_refused_naming_spec_and_sglang(pair, tmp_path):
    # a draft pool of 2 layers against a draft model that says 1 (SGLang sizes the pool
    # from the same config, so only a mismatched spec or config gets here)
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, pair.family, pair.model, pair.draft, pair.port,
                  draft_layers=2)
    fam, comp, line, tensors, n = {
        "llama": ("sglang-llama", "draft_kv", 63, "draft_kv.k, draft_kv.v", 4),
        "deepseek-mla": ("sglang-deepseek-mla", "draft_latent", 57, "draft_latent.data", 2),
    }[pair.family]
    arch = "LlamaForCausalLM" if pair.family == "llama" else "DeepseekV3ForCausalLM"
    assert str(e.value) == (
        f"pdc: {arch} ({pair.model}) does not fit its spec: SGLang registered {n} "
        f"draft-model KV buffers, {fam}'s draft components {comp} (specs/{fam}.yaml:{line}:3) "
        f"take {n // 2} ({tensors} of 1 draft layers); hint: the band's count is "
        "engine.draft_layers, the draft pool's layer count: check the draft model's "
        "config.json (num_nextn_predict_layers, else num_hidden_layers)")
