"""Sliding-window pools kept apart (docs/sglang.md "Sliding-window pools"): what SGLang 0.5.23
registers for PD with its own `SWAKVPool` (mem_cache/swa_memory_pool.py) and its own
`setup_state_kv_args` (disaggregation/utils.py), and pdc's refusal of it at start. pdc does
not carry the SWA pool yet: its pages live in a page space of their own and cover the window
only, a second page list pdc's runtime does not have.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from pdc.integrations.sglang import conn as C
from pdc.integrations.sglang.family import ParallelLayout, RefusedModel
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    MetadataBuffers,
    setup_state_kv_args,
)
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from pdc.serving.sglang_harness import TINY_MODELS

PAGE = 16


@pytest.fixture
def swa(tmp_path, monkeypatch):
    """A hybrid SWA pool of 4 layers (sliding 0 and 2, full 1 and 3: Gemma-3 / GPT-OSS style)
    and the KVArgs SGLang's prefill fills from it."""
    pool = SWAKVPool(size=8 * PAGE, size_swa=4 * PAGE, page_size=PAGE, dtype=torch.bfloat16,
                     head_num=2, head_dim=16, swa_attention_layer_ids=[0, 2],
                     full_attention_layer_ids=[1, 3], device="cpu")
    meta = MetadataBuffers(4, hidden_size=16, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=16)
    args = KVArgs()
    args.engine_rank = 0
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    args.kv_layer_ids, args.num_draft_entries = [1, 3, 1, 3], 0
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    setup_state_kv_args(args, pool)
    args.page_size, args.kv_cache_dtype_str, args.prefill_start_layer = PAGE, "auto", 0
    model = tmp_path / "model"
    model.mkdir()
    config = dict(TINY_MODELS["llama"][2], architectures=["LlamaForCausalLM"],
                  num_hidden_layers=4)
    (model / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(C, "parallel_layout", lambda server_args: server_args.layout)
    return SimpleNamespace(pool=pool, args=args, model=str(model), meta=meta)


def test_sglang_registers_the_full_layers_as_kv_and_the_window_pool_as_swa_state(swa):
    # kv_data_ptrs: the full-attention pool only (K of layers 1 and 3, then V), 9 pages
    full, window = swa.pool.full_kv_pool, swa.pool.swa_kv_pool
    assert swa.args.kv_data_ptrs == [b.data_ptr() for b in full.k_buffer + full.v_buffer]
    # the sliding layers' own pool: one "swa" state component, K of layers 0 and 2, then V,
    # 5 pages of its own page space
    assert [str(t.value) for t in swa.args.state_types] == ["swa"]
    assert swa.args.state_data_ptrs == [[b.data_ptr()
                                         for b in window.k_buffer + window.v_buffer]]
    assert swa.args.state_item_lens == [[PAGE * 2 * 16 * 2] * 4]
    assert (swa.args.kv_data_lens[0] // swa.args.kv_item_lens[0],
            swa.args.state_data_lens[0][0] // swa.args.state_item_lens[0][0]) == (9, 5)


def test_pdc_refuses_the_swa_pool_at_start_naming_it(swa):
    server_args = SimpleNamespace(
        model_path=swa.model, dtype="bfloat16", tp_size=1, port=30000,
        disaggregation_bootstrap_port=1, layout=ParallelLayout(1, 0, 1, 0),
        speculative_algorithm=None)
    with pytest.raises(RefusedModel) as e:
        C.PdcKVManager(swa.args, DisaggregationMode.PREFILL, server_args, is_mla_backend=False)
    assert str(e.value) == (
        f"pdc: LlamaForCausalLM ({swa.model}) does not fit its spec: SGLang registered 'swa' "
        "state buffers (the sliding-window layers' own pool, SWAKVPool: pages of its own page "
        "space, the window's only); pdc's SGLang specs carry mamba slot state, DSA indexer "
        "keys and QSA indexer state only so far")
