"""Sliding-window pools kept apart (docs/sglang.md "Sliding-window pools"): SGLang 0.5.23's own
`SWAKVPool` (mem_cache/swa_memory_pool.py) on both sides, driven through pdc's backend classes,
real Mooncake engines moving the bytes.

A prefill and a decode scheduler as SGLang builds them for a hybrid SWA model (Note [SGLang SWA
pools] in pdc/integrations/sglang/swa.py): a GPT-OSS-shaped config of 4 layers (sliding 0 and
2, full 1 and 3, a 32-token window), KVArgs filled as disaggregation/prefill.py fills them (the
full layers' pool in kv_data_ptrs, `build_kv_layer_ids` naming no layer for it; the sliding
layers' own pool by SGLang's own `setup_state_kv_args` as the "swa" state component) and
`MetadataBuffers`. pdc's PdcKVManager binds specs/sglang-swa.yaml and moves a request in two
chunks, SGLang's SWA page list (its `_swa_payload`: the window's pages in the SWA pool's own
page space) with the last; every byte of the full-layer pages, the window's SWA pages and the
metadata row is checked, and no other page.
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
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from pdc.serving.sglang_harness import free_port

PAGE = 16
WINDOW = 32  # tokens: SGLang sends the SWA pages of the last 32
FULL_PAGES, SWA_PAGES = 8, 6  # per pool, plus SGLang's padding page
ROWS = 8
ENV = {"SGLANG_HOST_IP": "127.0.0.1", "MOONCAKE_PROTOCOL": "tcp",
       "MC_TCP_ENABLE_CONNECTION_POOL": "true", "PDC_SGLANG_ENGINE": "mooncake"}
CONFIG = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=4,
              hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              sliding_window=WINDOW, vocab_size=512,
              layer_types=["sliding_attention", "full_attention"] * 2)
SPEC = "specs/sglang-swa.yaml"


def _pool(swa: bool = True):
    """The KV pool SGLang's model runner allocates for the tiny model on a CPU."""
    common = dict(page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=16, device="cpu")
    if not swa:
        return MHATokenToKVPool(size=FULL_PAGES * PAGE, layer_num=4, enable_memory_saver=False,
                                **common)
    return SWAKVPool(size=FULL_PAGES * PAGE, size_swa=SWA_PAGES * PAGE,
                     swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3], **common)


class Scheduler:
    """One SGLang scheduler's transfer state: its pool, KVArgs, pdc's manager."""

    def __init__(self, mode, model: str, bootstrap_port: int, swa: bool = True, **kv_extra):
        self.pool = _pool(swa)
        self.meta = MetadataBuffers(ROWS, hidden_size=16, hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=16)
        args = KVArgs()
        args.engine_rank = 0
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = \
            self.pool.get_contiguous_buf_infos()
        args.num_draft_entries = 0
        args.kv_layer_ids = build_kv_layer_ids(  # [] for a SWAKVPool: positions only
            token_to_kv_pool=self.pool, draft_token_to_kv_pool=None, num_draft_entries=0,
            num_hidden_layers=4)
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        setup_state_kv_args(args, self.pool)  # SGLang's own: the "swa" state component
        args.page_size, args.kv_cache_dtype_str, args.prefill_start_layer = PAGE, "auto", 0
        for k, v in kv_extra.items():
            setattr(args, k, v)
        self.kv_args = args
        server_args = SimpleNamespace(
            model_path=model, dtype="bfloat16", tp_size=1, port=30000,
            disaggregation_bootstrap_port=bootstrap_port, layout=ParallelLayout(1, 0, 1, 0),
            speculative_algorithm=None)
        self.mgr = C.PdcKVManager(args, mode, server_args, is_mla_backend=False)

    def full(self) -> list[tuple[str, torch.Tensor]]:
        """(name, [pages, bytes of a page]) of every full-layer buffer."""
        pool = self.pool.full_kv_pool
        return [(f"full {t} {layer}", b.view(torch.uint8).reshape(-1, PAGE * 2 * 16 * 2))
                for t, bufs in (("K", pool.k_buffer), ("V", pool.v_buffer))
                for layer, b in zip((1, 3), bufs, strict=True)]

    def window(self) -> list[tuple[str, torch.Tensor]]:
        """(name, [pages, bytes of a page]) of every sliding-window buffer."""
        pool = self.pool.swa_kv_pool
        return [(f"swa {t} {layer}", b.view(torch.uint8).reshape(-1, PAGE * 2 * 16 * 2))
                for t, bufs in (("K", pool.k_buffer), ("V", pool.v_buffer))
                for layer, b in zip((0, 2), bufs, strict=True)]


def _model(tmp, name: str = "gpt-oss", **changes) -> str:
    model = tmp / name
    model.mkdir()
    config = {k: v for k, v in dict(CONFIG, **changes).items() if v is not None}
    (model / "config.json").write_text(json.dumps(config))
    return str(model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    real_layout = C.parallel_layout
    C.parallel_layout = lambda server_args: server_args.layout  # SGLang's ParallelContext
    knobs.override(transfer_timeout_s=4.0, prefill_room_timeout_s=8.0)
    tmp = tmp_path_factory.mktemp("swa")
    model = _model(tmp)
    port = free_port()
    table = C.PdcKVBootstrapServer("127.0.0.1", port)
    made = []
    try:
        prefill = Scheduler(DisaggregationMode.PREFILL, model, port)
        made.append(prefill)
        decode = Scheduler(DisaggregationMode.DECODE, model, port)
        made.append(decode)
        gen = torch.Generator().manual_seed(7)
        for _, buf in prefill.full() + prefill.window():
            buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
        addr = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not decode.mgr.try_ensure_parallel_info(addr):
            assert time.monotonic() < deadline, "decode endpoint never opened"
        assert decode.mgr.endpoint_errors == {}
        yield SimpleNamespace(prefill=prefill, decode=decode, addr=addr, model=model,
                              port=port, tmp=tmp)
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


def transfer(p, room: int, tokens: int, src, dst, swa_src, swa_dst, prefix: int = 0):
    """One request as SGLang's schedulers run it: decode's metadata with its SWA pages
    (`_swa_payload`), prefill's pages past decode's prefix in two chunks, its SWA pages with
    the last. Returns (receiver, sender) states and errors."""
    rv = C.PdcKVReceiver(p.decode.mgr, p.addr, room)
    rv.init(0)
    tx = C.PdcKVSender(p.prefill.mgr, p.addr, room)
    deadline = time.monotonic() + 30
    while rv.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    rv.send_metadata(dst, aux_index=2, state_indices=[list(swa_dst)],
                     decode_prefix_len=prefix)
    while tx.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tx.pop_decode_prefix_len() == prefix
    p.prefill.meta.bootstrap_room[1].fill_(room)
    tx.init(len(src), aux_index=1)
    tx.send(src[:1], num_kv_tokens=PAGE)
    tx.send(src[1:], state_indices=[list(swa_src)], num_kv_tokens=tokens - prefix - PAGE)
    states = _wait(rv, tx)
    rv.clear()
    return states, rv.error, tx.error


def differences(p, src, dst, swa_src, swa_dst) -> list[str]:
    """Every full-layer page of the request and SWA page of its window that decode does not
    hold byte for byte as prefill had it."""
    out = []
    for side, s_ids, d_ids in (("full", src, dst), ("window", swa_src, swa_dst)):
        pre, dec = getattr(p.prefill, side)(), getattr(p.decode, side)()
        out += [f"{name} page {d}" for (name, a), (_, b) in zip(pre, dec, strict=True)
                for s, d in zip(s_ids, d_ids, strict=True) if not torch.equal(a[s], b[d])]
    return out


def untouched(p, before, dst, swa_dst) -> list[str]:
    """Every page decode holds that the request was not to write and that changed."""
    out = []
    for (name, b), was in zip(p.decode.full() + p.decode.window(), before, strict=True):
        mine = dst if name.startswith("full") else swa_dst
        out += [f"{name} page {pg}" for pg in range(len(b)) if pg not in mine
                and not torch.equal(b[pg], was[pg])]
    return out


def snapshot(p):
    return [b.clone() for _, b in p.decode.full() + p.decode.window()]


def test_the_window_pool_is_bound_as_the_window_component(pair):
    layout = pair.decode.mgr.family.layout
    assert layout.family == "sglang-swa"
    swa = layout.component("swa_kv")
    assert (swa.index, swa.window_tokens, swa.layer_ids, swa.on_prefix_hit) == \
        ("window", WINDOW, (0, 2), "skip")
    assert layout.component("kv").layer_ids == (1, 3)
    # SGLang's own registration: the full pool as KV (no layer ids), the SWA pool as one
    # "swa" state component, K of layers 0 and 2, then V, 7 pages of its own page space
    args, pool = pair.decode.kv_args, pair.decode.pool
    assert args.kv_layer_ids == []
    assert args.kv_data_ptrs == [b.data_ptr() for b in pool.full_kv_pool.k_buffer
                                 + pool.full_kv_pool.v_buffer]
    assert [str(t.value) for t in args.state_types] == ["swa"]
    assert args.state_data_ptrs == [[b.data_ptr() for b in pool.swa_kv_pool.k_buffer
                                     + pool.swa_kv_pool.v_buffer]]
    assert args.swa_kv_cache_layout == "nhd"
    assert (args.kv_data_lens[0] // args.kv_item_lens[0],
            args.state_data_lens[0][0] // args.state_item_lens[0][0]) == (9, 7)


def test_full_pages_and_the_windows_swa_pages_move_byte_for_byte(pair):
    # 60 tokens: 4 pages; the window is tokens 28..59, pages 1..3 (3 SWA pages)
    src, dst = [3, 5, 1, 7], [4, 2, 6, 8]
    swa_src, swa_dst = [2, 6, 4], [5, 1, 3]
    before = snapshot(pair)
    assert transfer(pair, 9_100_001, 60, src, dst, swa_src, swa_dst)[0] == \
        [KVPoll.Success, KVPoll.Success]
    assert differences(pair, src, dst, swa_src, swa_dst) == []
    assert untouched(pair, before, dst, swa_dst) == []  # nothing else moved
    assert int(pair.decode.meta.bootstrap_room[2][0]) == 9_100_001


def test_past_decodes_cached_prefix_the_window_starts_after_it(pair):
    # decode's radix cache holds the first 2 pages (decode_prefix_len 32): the window of
    # tokens 28..59 starts inside the prefix, so SGLang's lists hold pages 2..3 only (its
    # window_start = max(32, 28)), as do the KV pages prefill sends and decode allocates
    src, dst = [6, 2], [1, 3]
    swa_src, swa_dst = [1, 5], [6, 2]
    before = snapshot(pair)
    states, rv_error, tx_error = transfer(pair, 9_100_002, 60, src, dst, swa_src, swa_dst,
                                          prefix=2 * PAGE)
    assert states == [KVPoll.Success, KVPoll.Success], (rv_error, tx_error)
    assert differences(pair, src, dst, swa_src, swa_dst) == []
    assert untouched(pair, before, dst, swa_dst) == []


def test_a_wrong_swa_page_is_detected(pair):
    # Negative control of the check above: the window's first SWA page is read from the SWA
    # page before it (faults.py `wrong_window_page`); the request succeeds, and the byte check
    # names that page's K and V in both sliding layers, and nothing of the full layers.
    room = 9_100_003
    src, dst = [1, 2, 3, 4], [5, 6, 7, 8]
    swa_src, swa_dst = [3, 4, 5], [2, 3, 4]
    faults._PLANNED[room] = "wrong_window_page"
    try:
        assert transfer(pair, room, 60, src, dst, swa_src, swa_dst)[0] == \
            [KVPoll.Success, KVPoll.Success]
    finally:
        del faults._PLANNED[room]
    assert sorted(differences(pair, src, dst, swa_src, swa_dst)) == \
        ["swa K 0 page 2", "swa K 2 page 2", "swa V 0 page 2", "swa V 2 page 2"]
    assert torch.equal(pair.decode.window()[0][1][2], pair.prefill.window()[0][1][2])


def test_a_window_list_of_the_wrong_length_fails_the_request(pair):
    # prefill's SWA list covers 2 pages where the window of 60 tokens has 3
    states, rv_error, tx_error = transfer(pair, 9_100_004, 60, [1, 2, 3, 4], [5, 6, 7, 8],
                                          [3, 4], [2, 3, 4])
    assert states == [KVPoll.Failed, KVPoll.Failed]
    assert tx_error == "bad index: window needs 3 pages, prefill sent 2, decode holds 3"


def test_the_llama_spec_against_a_swa_pool_is_refused_naming_both(pair):
    # the architecture names sglang-llama, SGLang's pool keeps the sliding layers apart
    model = _model(pair.tmp, "llama", architectures=["LlamaForCausalLM"], layer_types=None,
                   sliding_window=None)
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, model, pair.port)
    assert str(e.value) == (
        f"pdc: LlamaForCausalLM ({model}) does not fit its spec: SGLang registered 4 "
        "sliding-window KV buffers (state type 'swa': SWAKVPool's sliding-window layers, a "
        "page space of their own), but sglang-llama declares no window-indexed component "
        "(specs/sglang-llama.yaml); hint: serve it with a spec whose window component takes "
        "them (specs/sglang-swa.yaml)")


def test_the_swa_spec_against_one_pool_is_refused_naming_both(pair):
    # the reverse: the spec declares the window component, SGLang keeps every layer in one
    # pool (--disable-hybrid-swa-memory)
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, pair.model, pair.port, swa=False)
    assert str(e.value) == (
        f"pdc: GptOssForCausalLM ({pair.model}) does not fit its spec: sglang-swa's swa_kv "
        f"({SPEC}:53:3) holds the window pages of sliding layers [0, 2], but SGLang "
        "registered no sliding-window pool (state type 'swa'): it keeps every layer in one "
        "pool unless it serves the architecture as hybrid SWA (configs/model_config.py "
        "is_hybrid_swa_model) without --disable-hybrid-swa-memory; hint: serve it with the "
        "hybrid SWA pool, or with a spec without a window component")


def test_a_window_other_than_sglangs_is_refused_naming_both(pair):
    # SGLang reads sliding_window_size before sliding_window; the spec binds sliding_window
    model = _model(pair.tmp, "window", sliding_window_size=16)
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, model, pair.port)
    assert str(e.value) == (
        f"pdc: GptOssForCausalLM ({model}) does not fit its spec: sglang-swa's swa_kv "
        f"({SPEC}:53:3) moves the pages of the last 32 tokens, but SGLang's sliding window is "
        "16 tokens (config.json sliding_window_size), the window whose SWA pages it sends; "
        "hint: bind the component's window to config.sliding_window_size")


def test_a_layer_split_other_than_sglangs_is_refused_naming_both(pair):
    # without layer_types the spec falls back to its pattern (sliding 0 and 2); SGLang reads
    # GPT-OSS's split from layer_types only, and finds no sliding layer
    model = _model(pair.tmp, "split", layer_types=None)
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, model, pair.port)
    assert str(e.value) == (
        f"pdc: GptOssForCausalLM ({model}) does not fit its spec: sglang-swa ({SPEC}) holds "
        "sliding-window layers [0, 2] (swa_kv) and full-attention layers [1, 3], but SGLang "
        "splits the served model into sliding [] and full [] (configs/model_config.py "
        "get_hybrid_layer_ids); hint: bind the layer kinds to the config's layer_types "
        "(`layers: {from: config.layer_types, names: ...}`)")


def test_a_swa_pool_in_another_element_order_is_refused_naming_both(pair):
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, pair.model, pair.port, swa_kv_cache_layout="hnd")
    assert str(e.value) == (
        f"pdc: GptOssForCausalLM ({pair.model}) does not fit its spec: SGLang's "
        "sliding-window pool is laid out 'hnd' (KVArgs.swa_kv_cache_layout), but "
        f"sglang-swa's swa_kv ({SPEC}:53:3) holds token-major pages [page_size, kv_heads, "
        "head_dim] ('nhd'), sharded by KV head; hint: serve without SGLANG_USE_HND_KVCACHE")
