"""pdc.integrations.sglang without SGLang: the served family, its refusals, SGLang's buffers as
pdc pools (Note [Served family], Note [SGLang aux row])."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from pdc.integrations.sglang import family as F
from pdc.runtime.plan_types import RankId

PAGES = 9  # SGLang allocates the pool plus one padding page


def _kv_args(page_size=16, heads=2, head_dim=16, layers=2, aux_fields=F.AUX_FIELDS,
             hidden_bytes=64, elem_bytes=2):
    """KVArgs as SGLang's prefill fills them for the tiny Llama, over real numpy buffers."""
    keep = []

    def buf(nbytes):
        a = np.zeros(nbytes, np.uint8)
        keep.append(a)
        return a.ctypes.data

    item = page_size * heads * head_dim * elem_bytes
    kv_ptrs = [buf(item * PAGES) for _ in range(2 * layers)]
    aux_items = {"output_top_logprobs_val": 512, "output_top_logprobs_idx": 512,
                 "output_topk_index": 128, "output_hidden_states": hidden_bytes}
    aux = [aux_items.get(f, 64) for f in aux_fields]
    rows = 4
    return SimpleNamespace(
        kv_data_ptrs=kv_ptrs, kv_data_lens=[item * PAGES] * len(kv_ptrs),
        kv_item_lens=[item] * len(kv_ptrs), kv_layer_ids=list(range(layers)) * 2,
        aux_data_ptrs=[buf(a * rows) for a in aux], aux_data_lens=[a * rows for a in aux],
        aux_item_lens=aux, page_size=page_size, prefill_start_layer=0, kv_cache_dtype_str="auto",
        kv_head_num=heads, total_kv_head_num=heads, keep=keep)


TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2}


@pytest.fixture
def model_dir(tmp_path):
    def write(arch, **config):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch],
                                                          **TINY, **config}))
        return str(tmp_path)
    return write


def test_the_tiny_llama_is_served_by_its_spec(model_dir):
    fam = F.served_family(model_dir("LlamaForCausalLM"), _kv_args(), 1, 0)
    assert (fam.layout.family, fam.architecture) == ("sglang-llama", "LlamaForCausalLM")
    assert fam.layout.component("kv").shape == (16, 2, 16)  # head_dim = hidden / heads


def test_the_tiny_qwen3_is_served_by_the_same_spec(model_dir):
    # Qwen3's head_dim comes from its config (32), not hidden / heads: twice Llama's bytes
    fam = F.served_family(model_dir("Qwen3ForCausalLM", head_dim=32), _kv_args(head_dim=32),
                          1, 0)
    assert (fam.layout.family, fam.architecture) == ("sglang-llama", "Qwen3ForCausalLM")
    assert fam.layout.component("kv").item_bytes == 2048


def test_a_qwen3_shard_of_tp2_is_served_on_either_rank(model_dir):
    path = model_dir("Qwen3ForCausalLM", head_dim=32)
    for rank in (0, 1):  # one KV head of two per rank
        fam = F.served_family(path, _kv_args(heads=1, head_dim=32), 2, rank)
        assert fam.layout.component("kv").item_bytes_at(2) == 1024


def test_llamas_of_other_sizes_and_pages_bind_the_one_spec(model_dir):
    # Note [Bound families]: layers, KV heads, head size and page size from the model and
    # the server; the two bindings are two families that refuse each other on the wire
    small = F.served_family(model_dir("LlamaForCausalLM"), _kv_args(), 1, 0)
    path = model_dir("LlamaForCausalLM", num_hidden_layers=3, hidden_size=128,
                     num_attention_heads=8, num_key_value_heads=4)
    big = F.served_family(path, _kv_args(page_size=32, heads=4, layers=3), 1, 0)
    assert (big.layout.num_layers, big.layout.default_page_size) == (3, 32)
    assert big.layout.component("kv").shape == (32, 4, 16)
    assert big.family.fingerprint != small.family.fingerprint
    one = F.side(1, 1, 1, 32)
    assert F.make_plan(big.family, one, one, "mooncake").bound == big.family.bound.digest


def test_a_config_that_breaks_a_constraint_is_refused_naming_key_value_and_line(model_dir):
    path = model_dir("LlamaForCausalLM", num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _kv_args(heads=4), 1, 0)
    assert str(e.value).splitlines()[:2] == [
        f"pdc: the served model ({path}) breaks specs/sglang-llama.yaml:",
        "specs/sglang-llama.yaml:104:5: error: constraint 'heads % kv_heads == 0' does not "
        "hold (with config.num_attention_heads = 6, config.num_key_value_heads = 4): every "
        "KV head serves a whole group of query heads (GQA)"]


def test_a_qwen3_with_llama_sized_heads_is_refused_with_the_difference(model_dir):
    path = model_dir("Qwen3ForCausalLM", head_dim=32)
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _kv_args(head_dim=16), 1, 0)
    assert str(e.value).splitlines()[0] == (
        f"pdc: Qwen3ForCausalLM ({path}) does not fit its spec: sglang-llama does not fit "
        "the served model's buffers: specs/sglang-llama.yaml:38:3: error: SGLang's K buffer "
        "of layer 0 holds items of [512] bfloat16 = 1024 B; the spec's component 'kv' "
        "expects items of [16, 2, 32] bfloat16 = 2048 B on a rank of TP 1")


def test_an_unknown_architecture_is_refused_naming_where_pdc_looked(model_dir, monkeypatch):
    monkeypatch.delenv("PDC_SPEC_PATH", raising=False)
    path = model_dir("MambaForCausalLM")
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _kv_args(), 1, 0)
    assert str(e.value).splitlines() == [
        f"pdc: the served model ({path}): pdc has no spec for architecture MambaForCausalLM "
        "served by sglang; looked in: PDC_SPEC_PATH is not set; pdc's package (sglang specs "
        "for LlamaForCausalLM, Qwen3ForCausalLM)",
        "  hint: write a spec with `serves: {engine: sglang, architectures: "
        "[MambaForCausalLM]}` (docs/adding-a-family.md) into a folder and name it in "
        "PDC_SPEC_PATH"]


def test_a_float32_llama_binds_the_float32_kv(model_dir):
    path = model_dir("LlamaForCausalLM")
    fam = F.served_family(path, _kv_args(elem_bytes=4), 1, 0, "float32")
    assert (fam.layout.family, fam.kv_dtype) == ("sglang-llama", "float32")
    assert fam.layout.component("kv").dtype == "float32"
    assert F.served_family(path, _kv_args(), 1, 0, "bfloat16").layout.component(
        "kv").dtype == "bfloat16"


def test_a_llama_whose_buffers_are_not_its_config_is_refused_with_the_difference(model_dir):
    path = model_dir("LlamaForCausalLM")
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _kv_args(head_dim=32), 1, 0, "bfloat16")
    assert str(e.value).splitlines()[0] == (
        f"pdc: LlamaForCausalLM ({path}) does not fit its spec: sglang-llama does not fit "
        "the served model's buffers: specs/sglang-llama.yaml:38:3: error: SGLang's K buffer "
        "of layer 0 holds items of [1024] bfloat16 = 2048 B; the spec's component 'kv' "
        "expects items of [16, 2, 16] bfloat16 = 1024 B on a rank of TP 1")


def test_extra_aux_buffers_are_refused_naming_the_settings(model_dir):
    fields = F.AUX_FIELDS + ("kv_checksum",)
    with pytest.raises(F.RefusedModel, match="SGLang registered 11 aux buffers, pdc's SGLang "
                                             "specs declare 10"):
        F.served_family(model_dir("LlamaForCausalLM"), _kv_args(aux_fields=fields), 1, 0)


def test_pools_are_sglang_buffers_in_place(model_dir):
    args = _kv_args()
    fam = F.served_family(model_dir("LlamaForCausalLM"), args, 1, 0)
    one = F.side(1, 1, 1, 16)
    plan = F.make_plan(fam.family, one, one, "mooncake")
    pools = F.engine_pools(fam.layout, plan, "decode", RankId(0, 0), args)
    k1 = [b for b in pools.buffers["kv"] if (b.tensor, b.layer_id) == ("k", 1)][0]
    pos = pools.buffers["kv"].index(k1)
    assert pools.address("kv", pos) == args.kv_data_ptrs[1]  # K of layer 1, no copy
    pools.view("kv", pos)[3, :4] = [1, 2, 3, 4]
    assert list(args.keep[1][3 * 1024:3 * 1024 + 4]) == [1, 2, 3, 4]
    room = pools.buffers["aux_room"][0]
    assert (room.offset, room.item_bytes, room.capacity) == (args.aux_data_ptrs[-1], 64, 4)
    spans = sorted((a, a + n) for a, n in pools.regions())
    assert sum(b - a for a, b in spans) == sum(args.kv_data_lens + args.aux_data_lens)


def test_the_backend_plans_without_the_compiler():
    import subprocess
    import sys

    code = ("import sys; import pdc.integrations.sglang.family as F; "
            "F.make_plan(F.Family.load('sglang_llama'), F.side(1, 1, 1, 16), "
            "F.side(1, 1, 1, 16), 'nixl'); "
            "bad = [m for m in sys.modules if m.startswith('pdc.compiler') or m in "
            "('yaml', 'jsonschema', 'jinja2')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"
