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


@pytest.fixture
def model_dir(tmp_path):
    def write(arch):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
        return str(tmp_path)
    return write


def test_the_tiny_llama_is_served_by_its_spec(model_dir):
    fam = F.served_family(model_dir("LlamaForCausalLM"), _kv_args(), 1, 0)
    assert (fam.layout.family, fam.architecture) == ("sglang-tiny-llama", "LlamaForCausalLM")


def test_the_tiny_qwen3_is_served_by_its_spec(model_dir):
    # Qwen3's head_dim comes from its config (32), not hidden / heads: twice Llama's bytes
    fam = F.served_family(model_dir("Qwen3ForCausalLM"), _kv_args(head_dim=32), 1, 0)
    assert (fam.layout.family, fam.architecture) == ("sglang-tiny-qwen3", "Qwen3ForCausalLM")
    assert fam.layout.component("kv").item_bytes == 2048


def test_a_qwen3_shard_of_tp2_is_served_on_either_rank(model_dir):
    path = model_dir("Qwen3ForCausalLM")
    for rank in (0, 1):  # one KV head of two per rank
        fam = F.served_family(path, _kv_args(heads=1, head_dim=32), 2, rank)
        assert fam.layout.family == "sglang-tiny-qwen3"


def test_a_qwen3_with_llama_sized_heads_is_refused_with_the_difference(model_dir):
    path = model_dir("Qwen3ForCausalLM")
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _kv_args(head_dim=16), 1, 0)
    assert str(e.value).splitlines()[0] == (
        f"pdc: no spec for Qwen3ForCausalLM fits the served model ({path}): sglang-tiny-qwen3 "
        "does not fit the served model's buffers: specs/sglang-tiny-qwen3.yaml:25:3: error: "
        "SGLang's K buffer of layer 0 holds items of [512] bfloat16 = 1024 B; the spec's "
        "component 'kv' expects items of [16, 2, 32] bfloat16 = 2048 B on a rank of TP 1")


def test_an_unknown_architecture_is_refused_by_name(model_dir):
    path = model_dir("MambaForCausalLM")
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _kv_args(), 1, 0)
    assert str(e.value) == (
        f"pdc has no spec for architecture MambaForCausalLM (served from {path}); pdc's "
        "SGLang backend knows: LlamaForCausalLM, Qwen3ForCausalLM. Write a spec (specs/<family>.yaml) and list "
        "it in pdc.integrations.sglang.family.ARCHITECTURES")


def test_a_float32_llama_is_served_by_the_float32_spec(model_dir):
    path = model_dir("LlamaForCausalLM")
    fam = F.served_family(path, _kv_args(elem_bytes=4), 1, 0, "float32")
    assert (fam.layout.family, fam.kv_dtype) == ("sglang-tiny-llama-f32", "float32")
    assert F.served_family(path, _kv_args(), 1, 0, "bfloat16").layout.family == \
        "sglang-tiny-llama"


def test_a_llama_of_another_shape_is_refused_with_the_difference(model_dir):
    # head_dim 32 in bfloat16 has the bytes of the float32 spec's items: the server's dtype
    # tells them apart (Note [Served family])
    path = model_dir("LlamaForCausalLM")
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _kv_args(head_dim=32), 1, 0, "bfloat16")
    assert str(e.value).splitlines()[0] == (
        f"pdc: no spec for LlamaForCausalLM fits the served model ({path}): sglang-tiny-llama "
        "does not fit the served model's buffers: specs/sglang-tiny-llama.yaml:24:3: error: "
        "SGLang's K buffer of layer 0 holds items of [1024] bfloat16 = 2048 B; the spec's "
        "component 'kv' expects items of [16, 2, 16] bfloat16 = 1024 B on a rank of TP 1")
    assert str(e.value).endswith(
        "; sglang-tiny-llama-f32 (specs/sglang-tiny-llama-f32.yaml:22:3) holds kv in float32, "
        "the server's KV cache is bfloat16")


def test_another_page_size_is_refused(model_dir):
    path = model_dir("LlamaForCausalLM")
    with pytest.raises(F.RefusedModel, match="sglang-tiny-llama pages hold 16 tokens, the "
                                             "server's --page-size is 32"):
        F.served_family(path, _kv_args(page_size=32), 1, 0)


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
            "F.make_plan(F.Family.load('sglang_tiny_llama'), F.side(1, 1, 1, 16), "
            "F.side(1, 1, 1, 16), 'nixl'); "
            "bad = [m for m in sys.modules if m.startswith('pdc.compiler') or m in "
            "('yaml', 'jsonschema', 'jinja2')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"
