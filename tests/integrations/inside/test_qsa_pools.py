"""The Qwen3.8 layout (SGLang 0.5.23's Qwen4-Exp: GDN slots, paged KV, QSA indexer state) with
SGLang's own pool classes driven through pdc's backend classes, real Mooncake engines moving
the bytes (issue 30; docs/sglang.md "QSA indexer state" says why no SGLang server runs it here).

A prefill and a decode scheduler as SGLang builds them for a QSA model (Note [SGLang QSA
state] in pdc/integrations/sglang/qsa.py): a `MambaPool` for the GDN layers inside a
`QSATokenToKVPool` (mem_cache/qsa_kv_pool.py) for the attention layer and its QSA pending ring
and compressed keys, KVArgs filled with SGLang's own `build_kv_layer_ids` and
`setup_state_kv_args` (state types mamba, qsa_pending, qsa_compressed), and `MetadataBuffers`.
pdc's PdcKVManager binds specs/sglang-qwen38.yaml and moves a request in two chunks, the
state lists with the last as SGLang's `_mamba_payload`, `_qsa_pending_payload` (the request's
req_pool_idx) and `_full_kv_pages_payload` (every page of the request) give them; every byte of
every buffer SGLang registered is checked: the request's pages, slot, ring rows and aux row
moved, nothing else changed.
"""

from __future__ import annotations

import ctypes
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
from sglang.srt.configs.qwen4_exp import Qwen4ExpConfig
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    MetadataBuffers,
    build_kv_layer_ids,
    setup_state_kv_args,
)
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool
from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool
from sglang.srt.runtime_context import get_parallel

from pdc.serving.sglang_harness import TINY_MODELS, free_port

PAGE = 64  # SGLang sets 64-token pages for compressed QSA (model_overrides/qwen4_exp.py)
PAGES = 6  # plus SGLang's padding page
ROWS = 5  # request-pool rows (the QSA ring's slots) = mamba slots + SGLang's slot 0
RATIO = 4
ENV = {"SGLANG_HOST_IP": "127.0.0.1", "MOONCAKE_PROTOCOL": "tcp",
       "MC_TCP_ENABLE_CONNECTION_POOL": "true", "PDC_SGLANG_ENGINE": "mooncake"}
QSA = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=2048,
           indexer_compress_ratio=RATIO)
LAYER_TYPES = ["linear_attention"] * 3 + ["qwen_sparse_attention"]
# SGLang's widths for a scheduler of attention TP 1 (the model runner publishes them)
WIDTHS = dict(attn_tp_size=1, tp_size=1, attn_dcp_size=1, enable_cp_tp_group_sharing=False)


def text_config(qsa: bool = True) -> dict:
    """The tiny Qwen3-Next text model of pdc's SGLang tests, every layer typed, with the
    compressed QSA indexer (layers/attention/qsa/config.py's fields) unless `qsa` is False."""
    keep = {k: v for k, v in TINY_MODELS["qwen3-next"][2].items()
            if k != "rope_parameters"}
    return dict(keep, full_attention_interval=4, layer_types=LAYER_TYPES,
                **(QSA if qsa else {}))


def _pool(qsa: bool = True, ratio: int = RATIO):
    """The pool SGLang's model runner builds for the model on a CPU
    (mem_cache/kv_cache_configurator.py: QSATokenToKVPool when the config has a QSA profile,
    else HybridLinearKVPool), its GDN layers' MambaPool inside."""
    config = Qwen4ExpConfig(text_config=text_config(qsa)).text_config
    with get_parallel().override(**WIDTHS):
        mamba = MambaPool(size=ROWS - 1, spec_state_size=ROWS - 1,
                          cache_params=config.mamba2_cache_params,
                          mamba_layer_ids=config.linear_layer_ids, device="cpu")
        common = dict(size=PAGES * PAGE, dtype=torch.float32, page_size=PAGE, head_num=2,
                      head_dim=32, full_attention_layer_ids=config.full_attention_layer_ids,
                      device="cpu", mamba_pool=mamba)
        if not qsa:
            return HybridLinearKVPool(**common)
        return QSATokenToKVPool(**common, qsa_index_kv_heads=1, qsa_index_head_dim=32,
                                qsa_compress_ratio=ratio, qsa_token_topk=2048,
                                num_request_slots=ROWS)


def _bytes(ptr: int, nbytes: int, item: int) -> torch.Tensor:
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(-1, item)


class Scheduler:
    """One SGLang scheduler's transfer state: its pools, KVArgs, pdc's manager."""

    def __init__(self, mode, model: str, bootstrap_port: int, qsa: bool = True,
                 ratio: int = RATIO):
        self.pool = _pool(qsa, ratio)
        self.meta = MetadataBuffers(ROWS, hidden_size=16, hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=16)
        args = KVArgs()
        args.engine_rank = 0
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = \
            self.pool.get_contiguous_buf_infos()
        args.num_draft_entries = 0
        args.kv_layer_ids = build_kv_layer_ids(
            token_to_kv_pool=self.pool, draft_token_to_kv_pool=None, num_draft_entries=0,
            num_hidden_layers=4)
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        setup_state_kv_args(args, self.pool, total_kv_layers=4)  # SGLang's own
        args.page_size, args.kv_cache_dtype_str, args.prefill_start_layer = PAGE, "auto", 0
        self.kv_args = args
        server_args = SimpleNamespace(
            model_path=model, dtype="float32", tp_size=1, port=30000,
            disaggregation_bootstrap_port=bootstrap_port, layout=ParallelLayout(1, 0, 1, 0),
            speculative_algorithm=None, speculative_draft_model_path=None)
        self.mgr = C.PdcKVManager(args, mode, server_args, is_mla_backend=False)

    def buffers(self) -> list[tuple[str, str, torch.Tensor]]:
        """(name, what indexes its items, [items, bytes of an item]) of every buffer SGLang
        registered: KV pages, each state type's items, aux rows."""
        a = self.kv_args
        out = [(f"kv {i}", "page", _bytes(p, n, it)) for i, (p, n, it) in
               enumerate(zip(a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens, strict=True))]
        for t, ptrs, lens, items, ids in zip(a.state_types, a.state_data_ptrs,
                                             a.state_data_lens, a.state_item_lens,
                                             a.state_layer_ids, strict=True):
            index = {"mamba": "slot", "qsa_pending": "row", "qsa_compressed": "page"}[t.value]
            out += [(f"{t.value} {layer}" + (f" {j}" if t.value == "mamba" else ""), index,
                     _bytes(p, n, it))
                    for j, (p, n, it, layer) in enumerate(zip(ptrs, lens, items, ids,
                                                               strict=True))]
        out += [(f"aux {i}", "aux", _bytes(p, n, it)) for i, (p, n, it) in
                enumerate(zip(a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens, strict=True))]
        return out


def _model(tmp, arch: str = "Qwen4ExpForConditionalGeneration", qsa: bool = True) -> str:
    model = tmp / f"{arch}-{int(qsa)}"
    model.mkdir()
    if arch == "Qwen4ExpForConditionalGeneration":
        config = dict(architectures=[arch], model_type="qwen4_exp",
                      text_config=text_config(qsa))
    else:  # a flat Qwen3-Next config.json, its attention layer named as Qwen3-Next names it
        config = dict(text_config(qsa), architectures=[arch],
                      layer_types=LAYER_TYPES[:3] + ["full_attention"])
    (model / "config.json").write_text(json.dumps(config))
    return str(model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    real_layout = C.parallel_layout
    C.parallel_layout = lambda server_args: server_args.layout  # SGLang's ParallelContext
    knobs.override(transfer_timeout_s=4.0, prefill_room_timeout_s=8.0)
    tmp = tmp_path_factory.mktemp("qsa")
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
        for _, _, buf in prefill.buffers():
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


def _bootstrapped(p, room):
    rv = C.PdcKVReceiver(p.decode.mgr, p.addr, room)
    rv.init(0)
    tx = C.PdcKVSender(p.prefill.mgr, p.addr, room)
    deadline = time.monotonic() + 30
    while rv.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    return rv, tx, deadline


def transfer(p, room: int, src: dict, dst: dict, prefill_pages=None, prefix: int = 0):
    """One request as SGLang's schedulers run it. `src` / `dst`: each side's pages (past
    decode's cached prefix), mamba slot, request-pool row and aux row; decode's metadata with
    its state lists (its mamba slot, its req_pool_idx, every page of the request), prefill's
    pages in two chunks, its state lists with the last. `prefix`: decode's cached pages, whose
    ids lead both sides' compressed-key lists. Returns the states and errors."""
    rv, tx, deadline = _bootstrapped(p, room)
    lead = list(range(1, prefix + 1))
    rv.send_metadata(dst["pages"], aux_index=dst["aux"], decode_prefix_len=prefix * PAGE,
                     state_indices=[[dst["slot"]], [dst["row"]], lead + dst["pages"]])
    while tx.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tx.pop_decode_prefix_len() == prefix * PAGE
    p.prefill.meta.bootstrap_room[src["aux"]].fill_(room)
    pages = src["pages"]
    tx.init(len(pages), aux_index=src["aux"])
    tx.send(pages[:1], num_kv_tokens=PAGE)
    tx.send(pages[1:], num_kv_tokens=(len(pages) - 1) * PAGE,
            state_indices=[[src["slot"]], [src["row"]], lead + (prefill_pages or pages)])
    states = _wait(rv, tx)
    rv.clear()
    return states, rv.error, tx.error


def _ids(side: dict, index: str) -> list[int]:
    return {"page": side["pages"], "slot": [side["slot"]], "row": [side["row"]],
            "aux": [side["aux"]]}[index]


def differences(p, src: dict, dst: dict) -> list[str]:
    """Every item of the request (its pages, slot, ring, aux row) that decode does not hold
    byte for byte as prefill had it."""
    return [f"{name} {index} {d}"
            for (name, index, a), (_, _, b) in zip(p.prefill.buffers(), p.decode.buffers(),
                                                   strict=True)
            for s, d in zip(_ids(src, index), _ids(dst, index), strict=True)
            if not torch.equal(a[s], b[d])]


def untouched(p, before, dst: dict) -> list[str]:
    """Buffers whose items other than the request's changed on decode."""
    out = []
    for (name, index, b), was in zip(p.decode.buffers(), before, strict=True):
        keep = [i for i in range(b.shape[0]) if i not in _ids(dst, index)]
        if not torch.equal(b[keep], was[keep]):
            out.append(name)
    return out


def _request(pages, slot, row, aux):
    return dict(pages=pages, slot=slot, row=row, aux=aux)


def test_sglang_registers_the_qsa_ring_and_pages_as_state(pair):
    args = pair.decode.kv_args
    assert [t.value for t in args.state_types] == ["mamba", "qsa_pending", "qsa_compressed"]
    # the pending ring of layer 3 (4 rows of 1 x 32 bfloat16 a request), the RoPE ring (4 rows
    # of 3 int64) under SGLang's request-wide id, the compressed keys (4 rows a page)
    assert args.state_layer_ids[1:] == [[3, (1 << 32) - 2], [3]]
    assert args.state_item_lens[1:] == [[RATIO * 64, RATIO * 24], [PAGE // RATIO * 64]]
    layout = pair.decode.mgr.family.layout
    assert layout.family == "sglang-qwen38"
    ring, rope = layout.component("qsa_pending"), layout.component("qsa_rope")
    assert (ring.index, ring.ring_rows, ring.item_bytes, ring.layer_ids) == ("ring", 4, 64, (3,))
    assert (rope.index, rope.ring_rows, rope.item_bytes, rope.sentinel) == \
        ("ring", 4, 24, (1 << 32) - 2)
    assert layout.component("qsa_compressed").item_bytes == PAGE // RATIO * 64


def test_the_qsa_ring_pages_slot_and_row_move_byte_for_byte(pair):
    src, dst = _request([3, 5, 1], 2, 3, 1), _request([4, 2, 6], 4, 1, 2)
    before = [b.clone() for _, _, b in pair.decode.buffers()]
    assert transfer(pair, 9_100_001, src, dst)[0] == [KVPoll.Success, KVPoll.Success]
    assert differences(pair, src, dst) == []
    assert untouched(pair, before, dst) == []
    assert int(pair.decode.meta.bootstrap_room[2][0]) == 9_100_001


def test_past_decodes_cached_prefix_the_compressed_list_leads_with_its_pages(pair):
    # decode holds the first page (decode_prefix_len 16): SGLang's compressed-key lists
    # (_full_kv_pages_payload) start at position 0 on both sides, the KV pages past it
    src, dst = _request([2, 6], 1, 4, 3), _request([5, 3], 3, 2, 4)
    before = [b.clone() for _, _, b in pair.decode.buffers()]
    states, rv_error, tx_error = transfer(pair, 9_100_002, src, dst, prefix=1)
    assert states == [KVPoll.Success, KVPoll.Success], (rv_error, tx_error)
    assert differences(pair, src, dst) == []
    assert untouched(pair, before, dst) == []


@pytest.mark.parametrize("fault", ["wrong_ring", "wrong_page"])
def test_a_wrong_ring_row_or_page_is_detected(pair, fault):
    # Negative controls of the checks above (faults.py): the ring read from the request-pool
    # row before the request's, or the last chunk's first page read from the page before it;
    # the request succeeds, and the byte check names exactly the QSA ring rows (pending keys
    # and RoPE positions), or that page's KV and compressed keys
    room = 9_100_003 if fault == "wrong_ring" else 9_100_004
    src, dst = _request([2, 4], 1, 3, 3), _request([5, 3], 2, 4, 4)
    faults._PLANNED[room] = fault
    try:
        assert transfer(pair, room, src, dst)[0] == [KVPoll.Success, KVPoll.Success]
    finally:
        del faults._PLANNED[room]
    assert sorted(differences(pair, src, dst)) == (
        ["qsa_pending 3 row 4", f"qsa_pending {(1 << 32) - 2} row 4"]
        if fault == "wrong_ring" else ["kv 0 page 3", "kv 1 page 3", "qsa_compressed 3 page 3"])


def test_a_compressed_page_list_that_is_not_the_requests_pages_fails_it(pair):
    states, rv_error, tx_error = transfer(pair, 9_100_005, _request([1, 2], 1, 1, 1),
                                          _request([6, 5], 1, 1, 1), prefill_pages=[1, 3])
    assert states == [KVPoll.Failed, KVPoll.Failed]
    assert tx_error == ("SGLang's QSA compressed-key pages [1, 3] (past decode's 0 prefix "
                        "pages) are not the request's KV pages [1, 2]: pdc moves the "
                        "compressed keys with the KV pages")
    rv, _, _ = _bootstrapped(pair, 9_100_006)
    rv.send_metadata([6, 5], aux_index=3, state_indices=[[1], [1], [1, 6, 4]],
                     decode_prefix_len=PAGE)
    assert rv.poll() == KVPoll.Failed
    assert rv.error == ("SGLang's QSA compressed-key pages [6, 4] (past decode's 1 prefix "
                        "pages) are not the request's KV pages [6, 5]: pdc moves the "
                        "compressed keys with the KV pages")


def test_a_qsa_pool_against_the_qwen3_next_spec_is_refused_naming_both(pair):
    # a flat Qwen3-Next config with the QSA fields: its architecture names sglang-qwen3-next,
    # whose spec has no QSA components, while SGLang's pool registers the QSA state
    model = _model(pair.tmp, "Qwen3NextForCausalLM")
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, model, pair.port)
    assert str(e.value) == (
        f"pdc: Qwen3NextForCausalLM ({model}) does not fit its spec: SGLang registered 2 QSA "
        "pending index-key ring buffers (state type 'qsa_pending': a QSATokenToKVPool's, the "
        "model's config sets the QSA indexer), but sglang-qwen3-next declares no ring "
        "component qsa_pending or ring component qsa_rope (specs/sglang-qwen3-next.yaml); "
        "hint: serve a model with the QSA indexer (indexer_n_heads in its config) with "
        "specs/sglang-qwen38.yaml")


def test_the_qwen38_spec_against_a_pool_without_qsa_is_refused_naming_both(pair):
    # the reverse: SGLang's pool has no QSA state (a plain HybridLinearKVPool) under a config
    # that sets the indexer (no SGLang 0.5.23 builds this pair; a stale or patched one could)
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, pair.model, pair.port, qsa=False)
    assert str(e.value) == (
        f"pdc: Qwen4ExpForConditionalGeneration ({pair.model}) does not fit its spec: "
        "sglang-qwen38's qsa_pending (specs/sglang-qwen38.yaml:71:3) holds the QSA pending "
        "index-key ring of 1 layers, but SGLang registered no 'qsa_pending' state (its KV "
        "pool is not a QSATokenToKVPool: SGLang builds one only when the model's config sets "
        "the QSA indexer fields, layers/attention/qsa/config.py parse_qsa_profile); hint: "
        "serve a hybrid model without the QSA indexer with specs/sglang-qwen3-next.yaml")


def test_a_qwen4_exp_config_without_the_indexer_breaks_the_spec_naming_its_keys(pair):
    # the model SGLang would serve with a plain hybrid pool: binding refuses it first
    model = _model(pair.tmp, qsa=False)
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, model, pair.port, qsa=False)
    errors = [
        (46, 14, "qsa_ratio", "indexer_compress_ratio", "example: 4"),
        (47, 14, "qsa_heads", "indexer_kv_heads", "example: 1"),
        (48, 17, "qsa_head_dim", "indexer_head_dim", "example: 32")]
    assert str(e.value) == f"pdc: the served model ({model}) breaks specs/sglang-qwen38.yaml:\n" \
        + "".join(
            f"specs/sglang-qwen38.yaml:{line}:{col}: error: param '{name}' takes "
            f"config.text_config.{key}, but the model's config has no 'text_config.{key}'\n"
            f"    {name}: {{from: config.text_config.{key}, {example}}}\n"
            f"{' ' * (col + 1)}^\n"
            f"  hint: serve a model whose config.json sets 'text_config.{key}', or give the "
            "param a `default`\n" for line, col, name, key, example in errors) + "3 errors"


def test_a_pool_of_another_compress_ratio_is_refused_naming_the_ring(pair):
    # the config says ratio 4, SGLang's pool rings 2 rows a request (8 rows a page compressed)
    with pytest.raises(RefusedModel) as e:
        Scheduler(DisaggregationMode.PREFILL, pair.model, pair.port, ratio=2)
    assert str(e.value) == (
        f"pdc: Qwen4ExpForConditionalGeneration ({pair.model}) does not fit its spec: "
        "sglang-qwen38 does not fit the served model's buffers: specs/sglang-qwen38.yaml:65:3: "
        "error: SGLang's QSA compressed index keys buffer of layer 3 holds items of [1024] "
        "bfloat16 = 2048 B; the spec's component 'qsa_compressed' expects items of [16, 1, 32] "
        "bfloat16 = 1024 B on a rank of TP 1\n"
        "  hint: the engine's model config (heads, head size, block size, dtype) and the "
        "spec's params must agree, and so must both sides' TP")
