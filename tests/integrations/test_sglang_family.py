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
        "specs/sglang-llama.yaml:129:5: error: constraint 'heads % kv_heads == 0' does not "
        "hold (with config.num_attention_heads = 6, config.num_key_value_heads = 4): every "
        "KV head serves a whole group of query heads (GQA)"]


def test_a_qwen3_with_llama_sized_heads_is_refused_with_the_difference(model_dir):
    path = model_dir("Qwen3ForCausalLM", head_dim=32)
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _kv_args(head_dim=16), 1, 0)
    assert str(e.value).splitlines()[0] == (
        f"pdc: Qwen3ForCausalLM ({path}) does not fit its spec: sglang-llama does not fit "
        "the served model's buffers: specs/sglang-llama.yaml:56:3: error: SGLang's K buffer "
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
        "for DeepseekV2ForCausalLM, DeepseekV32ForCausalLM, DeepseekV3ForCausalLM, "
        "GlmMoeDsaForCausalLM, GptOssForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM, "
        "Qwen3NextForCausalLM, Qwen4ExpForConditionalGeneration)",
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
        "the served model's buffers: specs/sglang-llama.yaml:56:3: error: SGLang's K buffer "
        "of layer 0 holds items of [1024] bfloat16 = 2048 B; the spec's component 'kv' "
        "expects items of [16, 2, 16] bfloat16 = 1024 B on a rank of TP 1")


def test_extra_aux_buffers_are_refused_naming_the_settings(model_dir):
    fields = F.AUX_FIELDS + ("kv_checksum",)
    with pytest.raises(F.RefusedModel, match="SGLang registered 11 aux buffers, sglang-llama "
                                             "declares 10"):
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


# The seed families' tiny models (pdc.serving TINY_MODELS) as their config.json gives them
QWEN3_NEXT = {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 32,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 16, "linear_value_head_dim": 24,
              "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
MLA = {"num_hidden_layers": 2, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
       "qk_nope_head_dim": 16, "v_head_dim": 24, "q_lora_rank": 32}


def _seed_kv_args(kind, *, ssm_item=4 * 24 * 16 * 4, latent_dim=48, tp=1, gdn_layers=(0, 1, 2),
                  attn_layers=(3,)):
    """KVArgs as SGLang fills them for the seed families' tiny models (numpy buffers):
    "qwen3-next" a paged MHA pool of the attention layers and the mamba pool of the GDN
    layers (every conv state, then every temporal state, Note [SGLang mamba state]);
    "deepseek-mla" one latent buffer per layer (Note [SGLang KV buffers])."""
    args = _kv_args(heads=2 // tp, head_dim=32, layers=len(attn_layers))
    keep = args.keep

    def buf(nbytes):
        a = np.zeros(nbytes, np.uint8)
        keep.append(a)
        return a.ctypes.data

    slots = 5
    if kind == "qwen3-next":
        args.kv_layer_ids = list(attn_layers) * 2
        conv_item, ssm = 160 // tp * 3 * 2, ssm_item // tp
        n = len(gdn_layers)
        items = [conv_item] * n + [ssm] * n
        args.state_types = ["mamba"]
        args.state_data_ptrs = [[buf(i * slots) for i in items]]
        args.state_data_lens = [[i * slots for i in items]]
        args.state_item_lens = [items]
        args.state_layer_ids = [list(gdn_layers) * 2]
    else:
        item = 16 * latent_dim * 2
        args.kv_data_ptrs = [buf(item * PAGES) for _ in range(2)]
        args.kv_data_lens, args.kv_item_lens = [item * PAGES] * 2, [item] * 2
        args.kv_layer_ids = [0, 1]
    return args


def test_the_hybrid_qwen3_next_is_served_with_its_mamba_slots_in_place(model_dir):
    args = _seed_kv_args("qwen3-next")
    fam = F.served_family(model_dir("Qwen3NextForCausalLM", **QWEN3_NEXT), args, 1, 0,
                          "bfloat16")
    assert fam.layout.family == "sglang-qwen3-next"
    one = F.side(1, 1, 1, 16)
    pools = F.engine_pools(fam.layout, F.make_plan(fam.family, one, one, "mooncake"), "decode",
                           RankId(0, 0), args)
    assert [(b.layer_id, b.offset) for b in pools.buffers["gdn_ssm"]] == \
        [(i, args.state_data_ptrs[0][3 + i]) for i in range(3)]
    assert [b.layer_id for b in pools.buffers["kv"]] == [3, 3]
    assert pools.buffers["gdn_conv"][2].capacity == 5


def test_a_qwen3_next_of_another_shape_binds_the_one_spec_by_its_layer_types(model_dir):
    # Note [Bound families]: 6 layers, attention at 1 and 5 (layer_types, not the pattern)
    types = ["linear_attention", "full_attention"] + ["linear_attention"] * 3 + \
        ["full_attention"]
    path = model_dir("Qwen3NextForCausalLM", **dict(QWEN3_NEXT, num_hidden_layers=6,
                                                      layer_types=types))
    args = _seed_kv_args("qwen3-next", gdn_layers=(0, 2, 3, 4), attn_layers=(1, 5))
    fam = F.served_family(path, args, 1, 0, "bfloat16")
    assert fam.layout.component("kv").layer_ids == (1, 5)
    assert fam.layout.component("gdn_ssm").layer_ids == (0, 2, 3, 4)


def test_a_hybrid_state_of_another_dtype_is_refused_naming_both_sides(model_dir):
    path = model_dir("Qwen3NextForCausalLM", **QWEN3_NEXT)
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _seed_kv_args("qwen3-next", ssm_item=4 * 24 * 16 * 2), 1, 0)
    assert str(e.value).splitlines()[0] == (
        f"pdc: Qwen3NextForCausalLM ({path}) does not fit its spec: sglang-qwen3-next does "
        "not fit the served model's buffers: specs/sglang-qwen3-next.yaml:64:3: error: "
        "SGLang's mamba temporal state of layer 0 holds items of [768] float32 = 3072 B; the "
        "spec's component 'gdn_ssm' expects items of [4, 24, 16] float32 = 6144 B on a rank "
        "of TP 1")


def test_slot_state_beyond_the_gdn_layers_is_refused_naming_the_spec(model_dir):
    # Qwen3.8's PLE short-conv and n-gram state rides the mamba slot as extra entries
    # (MambaPool's slot siblings); the spec describes the GDN layers' conv and temporal only
    args = _seed_kv_args("qwen3-next")
    args.state_data_ptrs[0] += args.state_data_ptrs[0][:2]
    args.state_data_lens[0] += args.state_data_lens[0][:2]
    args.state_item_lens[0] += args.state_item_lens[0][:2]
    args.state_layer_ids[0] += [(1 << 32) - 1, (1 << 32) - 1]
    path = model_dir("Qwen3NextForCausalLM", **QWEN3_NEXT)
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, args, 1, 0)
    assert str(e.value) == (
        f"pdc: Qwen3NextForCausalLM ({path}) does not fit its spec: SGLang registered 8 mamba "
        "state buffers, sglang-qwen3-next's gdn_conv, gdn_ssm take 6 (2 per GDN layer, "
        "specs/sglang-qwen3-next.yaml:58:3); hint: slot state of other layers (Qwen3.8's PLE "
        "short-conv and n-gram state, ple_layer_ids) is not described by pdc's specs")


def test_a_state_type_without_a_spec_is_refused_by_name(model_dir):
    args = _seed_kv_args("qwen3-next")
    args.state_types = ["swa_ring"]
    with pytest.raises(F.RefusedModel, match="SGLang registered 'swa_ring' state buffers; "
                                             "pdc's SGLang specs carry mamba slot state, DSA "
                                             "indexer keys, QSA indexer state and "
                                             "sliding-window pages only so far"):
        F.served_family(model_dir("Qwen3NextForCausalLM", **QWEN3_NEXT), args, 1, 0)


def test_the_mla_model_is_served_by_its_latent_spec_on_every_tp_rank(model_dir):
    path = model_dir("DeepseekV3ForCausalLM", **MLA)
    for tp, rank in ((1, 0), (2, 0), (2, 1)):  # replicated: every rank holds the whole latent
        fam = F.served_family(path, _seed_kv_args("deepseek-mla"), tp, rank, "bfloat16")
        assert fam.layout.family == "sglang-deepseek-mla"
        assert fam.layout.component("latent").shape == (16, 1, 48)
    with pytest.raises(F.RefusedModel, match=r"SGLang's latent buffer of layer 0 holds items "
                                             r"of \[512\] bfloat16 = 1024 B; the spec's "
                                             r"component 'latent' expects items of "
                                             r"\[16, 1, 48\] bfloat16 = 1536 B"):
        F.served_family(path, _seed_kv_args("deepseek-mla", latent_dim=32), 1, 0)


def test_a_deepseek_v2_of_another_latent_width_binds_the_mla_spec(model_dir):
    path = model_dir("DeepseekV2ForCausalLM", **dict(MLA, kv_lora_rank=64))
    fam = F.served_family(path, _seed_kv_args("deepseek-mla", latent_dim=80), 1, 0,
                          "bfloat16")
    assert (fam.layout.family, fam.layout.component("latent").item_bytes) == \
        ("sglang-deepseek-mla", 16 * 80 * 2)


def test_the_negative_control_faults_read_another_page_or_slot(monkeypatch):
    from pdc.integrations.sglang import faults

    monkeypatch.setattr(faults, "_PLANNED", {5: "wrong_page", 6: "wrong_slot",
                                             7: "wrong_window_page"})
    # the last chunk only; its first page read from the pool page before it
    assert faults.apply(5, [40, 41, 42], last=False) == [40, 41, 42]
    assert faults.apply(5, [40, 41, 42], last=True) == [39, 41, 42]
    assert faults.apply(5, [0, 1], last=True) == [1, 1]
    assert faults.apply(6, [40, 41], last=True) == [40, 41]
    assert [faults.apply_slot(6, s) for s in (3, 0, -1)] == [2, 1, -1]
    assert faults.apply_slot(5, 3) == 3
    # the sliding-window list's first SWA page (Note [SGLang SWA pools]); None: no window
    assert [faults.apply_window(7, w) for w in ([4, 5], [0, 2], None)] == [[3, 5], [1, 2], None]
    assert faults.apply_window(5, [4, 5]) == [4, 5]
    monkeypatch.setattr(faults, "_PLANNED", {8: "wrong_ring"})  # the QSA ring's row only
    assert (faults.apply_slot(8, 3, "wrong_ring"), faults.apply_slot(8, 3)) == (2, 3)
    monkeypatch.setenv(faults.ENV, "wrong_state@7")
    with pytest.raises(ValueError) as e:
        faults.planned()
    assert str(e.value) == ("PDC_SGLANG_FAULTS: 'wrong_state@7' is not KIND@ROOM with KIND one "
                            "of page_out_of_range, extra_page, wrong_page, wrong_slot, "
                            "wrong_ring, wrong_window_page")


def test_decode_servers_are_named_by_advertised_address_and_port():
    """Note [Decode instances]: the name each decode server registers under with prefill."""
    names = {F.decode_instance(host, port) for host, port in
             (("10.77.0.2", 30001), ("10.77.0.2", 30002), ("10.77.0.3", 30001))}
    assert names == {"10.77.0.2:30001", "10.77.0.2:30002", "10.77.0.3:30001"}
    assert F.decode_instance("fd00::2", 30001) == "[fd00::2]:30001"
    # A restarted server on its port is the same instance (prefill fails its old requests).
    assert F.decode_instance("10.77.0.2", 30001) == F.decode_instance("10.77.0.2", "30001")


# Note [SGLang DP attention]: SGLang's ParallelContext of one scheduler, as the fields read
def _parallel(tp=2, attn_dp=2, dp_rank=1, pp=1, cp=1, replicas=1):
    attn_tp = tp // attn_dp // cp
    return SimpleNamespace(tp_size=tp, attn_tp_size=attn_tp, attn_tp_rank=0,
                           attn_dp_size=attn_dp, attn_dp_rank=dp_rank, attn_cp_size=cp,
                           pp_size=pp, num_dp_ranks=replicas * attn_dp)


def test_a_dp_attention_scheduler_is_its_groups_attention_tp_rank():
    server_args = SimpleNamespace(tp_size=2, dp_size=1)
    assert F.parallel_layout_of(_parallel(), server_args) == F.ParallelLayout(1, 0, 2, 1)
    plain = _parallel(tp=2, attn_dp=1, dp_rank=0)
    plain.attn_tp_rank = 1
    assert F.parallel_layout_of(plain, server_args) == F.ParallelLayout(2, 1, 1, 0)


def test_widths_sglang_has_not_published_fall_back_to_the_server_args():
    class Unpublished:  # SGLang's ParallelContext before its groups are built
        def __getattr__(self, name):
            raise RuntimeError(f"derived parallel width {name!r} is not available")

    assert F.parallel_layout_of(Unpublished(), SimpleNamespace(tp_size=2)) == \
        F.ParallelLayout(2, 0, 1, 0)


@pytest.mark.parametrize("kw, got", [
    (dict(pp=2), "pp_size 2, attn_cp_size 1, 2 DP ranks of which 2"),
    (dict(attn_dp=1, dp_rank=0, replicas=2), "pp_size 1, attn_cp_size 1, 2 DP ranks of which 1"),
])
def test_pipeline_and_dp_replicas_are_refused_naming_the_sizes(kw, got):
    with pytest.raises(F.RefusedModel) as e:
        F.parallel_layout_of(_parallel(**kw), SimpleNamespace())
    assert str(e.value) == (
        "pdc's SGLang backend runs attention DP (--enable-dp-attention), not pipeline "
        f"parallelism, attention context parallelism or DP replicas (got {got} "
        "attention-DP groups)")


@pytest.mark.parametrize("spec", ["sglang_llama", "sglang_deepseek_mla", "sglang_qwen3_next"])
@pytest.mark.parametrize("prefill_dp, decode_dp", [(2, 2), (2, 1), (1, 2)])
def test_every_sglang_family_plans_between_dp_attention_groups(spec, prefill_dp, decode_dp):
    plan = F.make_plan(F.Family.load(spec), F.side(1, 1, prefill_dp, 16),
                       F.side(1, 1, decode_dp, 16), "mooncake")
    assert (plan.topology.prefill.dp, plan.topology.decode.dp) == (prefill_dp, decode_dp)
    # one plan serves every pair of groups: each decode rank reads one prefill rank
    assert [lk.prefill for lk in plan.links_to(RankId(0, 0))] == [RankId(0, 0)]


EAGLE = {"architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1,
         "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "torch_dtype": "bfloat16"}


def _with_draft(args, layers=1, item=16 * 2 * 16 * 2, hidden_bytes=128):
    """KVArgs of a speculating server: the draft pool's K then V buffers after the target's
    (Note [SGLang draft state]) and the hidden row widened (64 bfloat16 values)."""
    keep = args.keep

    def buf(nbytes):
        a = np.zeros(nbytes, np.uint8)
        keep.append(a)
        return a.ctypes.data

    extra = [buf(item * PAGES) for _ in range(2 * layers)]
    args.kv_data_ptrs = list(args.kv_data_ptrs) + extra
    args.kv_data_lens = list(args.kv_data_lens) + [item * PAGES] * len(extra)
    args.kv_item_lens = list(args.kv_item_lens) + [item] * len(extra)
    args.kv_layer_ids = []  # an MHA pool reports none (disaggregation/utils.py)
    args.num_draft_entries = len(extra)
    i = F.AUX_FIELDS.index("output_hidden_states")
    args.aux_data_ptrs[i], args.aux_data_lens[i] = buf(hidden_bytes * 4), hidden_bytes * 4
    args.aux_item_lens[i] = hidden_bytes
    return args


def _eagle(tmp_path, **config):
    draft = tmp_path / "eagle"
    draft.mkdir(exist_ok=True)
    (draft / "config.json").write_text(json.dumps({**EAGLE, **config}))
    args = SimpleNamespace(speculative_algorithm="EAGLE",
                           speculative_draft_model_path=str(draft))
    return F.draft_model(args, "unused", "auto")


def test_a_speculating_llama_binds_its_eagle_draft_kv_and_hidden_row(model_dir, tmp_path):
    draft = _eagle(tmp_path)
    assert draft == F.DraftModel("EAGLE", EAGLE, 1, "bfloat16")
    fam = F.served_family(model_dir("LlamaForCausalLM"), _with_draft(_kv_args()), 1, 0,
                          "auto", draft)
    layout = fam.layout
    assert layout.draft_ids == (2,)
    assert (layout.component("draft_kv").layer_ids, layout.component("draft_kv").shape) == \
        ((2,), (16, 2, 16))
    aux = layout.component("aux_hidden")
    assert (aux.shape, aux.dtype) == ((64,), "bfloat16")
    plan = F.make_plan(fam.family, F.side(1, 1, 1, 16), F.side(1, 1, 1, 16), "mooncake")
    args = _with_draft(_kv_args())
    pools = F.engine_pools(layout, plan, "prefill", RankId(0, 0), args, "bfloat16")
    assert [(b.tensor, b.layer_id, b.offset) for b in pools.buffers["draft_kv"]] == \
        [("k", 2, args.kv_data_ptrs[4]), ("v", 2, args.kv_data_ptrs[5])]


def test_a_server_that_does_not_speculate_binds_an_empty_band(model_dir):
    layout = F.served_family(model_dir("LlamaForCausalLM"), _kv_args(), 1, 0).layout
    assert (layout.draft_ids, layout.component("draft_kv").layer_ids) == ((), ())
    assert (layout.component("aux_hidden").shape, layout.component("aux_hidden").dtype) == \
        ((16,), "float32")


def test_a_speculating_server_is_refused_by_a_spec_without_draft_components(model_dir):
    args = _with_draft(_seed_kv_args("qwen3-next"), item=16 * 2 * 32 * 2)
    path = model_dir("Qwen3NextForCausalLM", **QWEN3_NEXT)
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, args, 1, 0, "bfloat16")
    assert str(e.value) == (
        f"pdc: Qwen3NextForCausalLM ({path}) does not fit its spec: SGLang registered 2 "
        "draft-model KV buffers after the target's (the server speculates), but "
        "sglang-qwen3-next declares no draft components (specs/sglang-qwen3-next.yaml); "
        "hint: give the spec a draft band (`layers: draft: {kind: K, count: {from: "
        "engine.draft_layers, ...}}`) and page components of kind K (Note [Draft "
        "components]), or serve without --speculative-algorithm")


def test_a_draft_the_server_does_not_register_is_refused(model_dir, tmp_path):
    path = model_dir("LlamaForCausalLM")
    with pytest.raises(F.RefusedModel) as e:  # the spec bound to a draft, no draft buffers
        F.served_family(path, _kv_args(hidden_bytes=128), 1, 0, "auto", _eagle(tmp_path))
    assert str(e.value) == (
        f"pdc: LlamaForCausalLM ({path}) does not fit its spec: sglang-llama's draft "
        "components draft_kv (specs/sglang-llama.yaml:63:3) hold 1 draft layers, but SGLang "
        "registered no draft-model KV buffers (the server does not speculate); hint: start "
        "it with the --speculative-algorithm the spec describes, or bind the band's count to "
        "engine.draft_layers")
    with pytest.raises(F.RefusedModel) as e:  # SGLang's draft buffers, the band bound to 0
        F.served_family(path, _with_draft(_kv_args()), 1, 0)
    assert str(e.value) == (
        f"pdc: LlamaForCausalLM ({path}) does not fit its spec: SGLang registered 2 "
        "draft-model KV buffers after the target's (the server speculates), but sglang-llama "
        "was bound to no draft layers: its draft components draft_kv "
        "(specs/sglang-llama.yaml:63:3) hold none; hint: the band's count is "
        "engine.draft_layers, which pdc takes from the server's --speculative-algorithm and "
        "draft model")


def test_a_wrong_draft_layer_count_is_refused_naming_both(model_dir, tmp_path):
    path = model_dir("LlamaForCausalLM")
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _with_draft(_kv_args()), 1, 0, "auto",
                        _eagle(tmp_path, num_hidden_layers=2))
    assert str(e.value) == (
        f"pdc: LlamaForCausalLM ({path}) does not fit its spec: SGLang registered 2 "
        "draft-model KV buffers, sglang-llama's draft components draft_kv "
        "(specs/sglang-llama.yaml:63:3) take 4 (draft_kv.k, draft_kv.v of 2 draft layers); "
        "hint: the band's count is engine.draft_layers, the draft pool's layer count: check "
        "the draft model's config.json (num_nextn_predict_layers, else num_hidden_layers)")


def test_the_draft_model_follows_sglangs_rules(tmp_path):
    target = tmp_path / "v3"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(
        {**MLA, "num_nextn_predict_layers": 1, "torch_dtype": "float32"}))
    nextn = SimpleNamespace(speculative_algorithm="NEXTN", speculative_draft_model_path=None)
    draft = F.draft_model(nextn, str(target), "auto")
    assert (draft.layers, draft.dtype) == (1, "float16")  # MTP layers; float32 runs in fp16
    assert F.draft_model(nextn, str(target), "float").dtype == "float32"
    assert F.draft_model(SimpleNamespace(speculative_algorithm=None), str(target)) is None
    with pytest.raises(F.RefusedModel) as e:
        F.draft_model(SimpleNamespace(speculative_algorithm="ngram"), str(target))
    assert str(e.value) == ("pdc: --speculative-algorithm NGRAM: pdc's SGLang backend carries "
                            "the draft state of EAGLE, EAGLE3, NEXTN only")


def test_a_speculating_mla_binds_its_mtp_latent(model_dir, tmp_path):
    path = model_dir("DeepseekV3ForCausalLM", **MLA, num_nextn_predict_layers=1)
    draft = F.draft_model(SimpleNamespace(speculative_algorithm="EAGLE"), path, "bfloat16")
    args = _with_draft(_seed_kv_args("deepseek-mla"), layers=1, item=16 * 48 * 2)
    args.num_draft_entries = 1  # one latent buffer per MTP layer
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = (
        x[:-1] for x in (args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens))
    layout = F.served_family(path, args, 1, 0, "bfloat16", draft).layout
    assert (layout.draft_ids, layout.component("draft_latent").shape) == ((2,), (16, 1, 48))


def test_mla_at_prefill_tp2_leaves_one_prefill_rank_without_a_link(model_dir):
    # Note [SGLang idle prefill rank] in conn.py: the latent and the aux row are replicated, so
    # TP 2 -> 1 elects one prefill rank to write decode's copy and the other writes nothing; the
    # hybrid's sharded state links both ranks.
    mla = F.served_family(model_dir("DeepseekV3ForCausalLM", **MLA),
                          _seed_kv_args("deepseek-mla"), 2, 0, "bfloat16")
    plan = F.make_plan(mla.family, F.side(2, 1, 1, 16), F.side(1, 1, 1, 16), "mooncake")
    assert [len(plan.links_from(RankId(0, r))) for r in (0, 1)] == [1, 0]
    assert {c for lk in plan.links for c in lk.elected_for} >= {"latent", "aux_i32"}
    hybrid = F.served_family(model_dir("Qwen3NextForCausalLM", **QWEN3_NEXT),
                             _seed_kv_args("qwen3-next", tp=2), 2, 0, "bfloat16")
    plan = F.make_plan(hybrid.family, F.side(2, 1, 1, 16), F.side(1, 1, 1, 16), "mooncake")
    assert [len(plan.links_from(RankId(0, r))) for r in (0, 1)] == [1, 1]


# Note [SGLang DSA indexer keys]: a DSATokenToKVPool's latent in kv_data_ptrs, its indexer keys
# (one uint8 row of 64 x (128 + 4) bytes per page) as the "dsa" state component
DSA_CONFIG = {**MLA, "index_head_dim": 128, "index_n_heads": 2, "index_topk": 8}
INDEX_ITEM = 64 * (128 + 4)


def _dsa_kv_args(index_items=(INDEX_ITEM, INDEX_ITEM), extra_state=()):
    args = _kv_args(page_size=64)
    keep = args.keep

    def buf(nbytes):
        a = np.zeros(max(nbytes, 1), np.uint8)
        keep.append(a)
        return a.ctypes.data

    item = 64 * 48 * 2
    args.kv_data_ptrs = [buf(item * PAGES) for _ in range(2)]
    args.kv_data_lens, args.kv_item_lens = [item * PAGES] * 2, [item] * 2
    args.kv_layer_ids = [0, 1]
    args.state_types = ["dsa", *extra_state]
    args.state_data_ptrs = [[buf(i * PAGES) for i in index_items]] + [[buf(64)]] * len(extra_state)
    args.state_data_lens = [[i * PAGES for i in index_items]] + [[64]] * len(extra_state)
    args.state_item_lens = [list(index_items)] + [[64]] * len(extra_state)
    return args


def test_the_dsa_indexer_keys_are_served_as_page_components_in_place(model_dir):
    args = _dsa_kv_args()
    fam = F.served_family(model_dir("DeepseekV32ForCausalLM", **DSA_CONFIG), args, 1, 0,
                          "bfloat16")
    assert fam.layout.family == "sglang-deepseek-v32"
    one = F.side(1, 1, 1, 64)
    pools = F.engine_pools(fam.layout, F.make_plan(fam.family, one, one, "mooncake"), "decode",
                           RankId(0, 0), args)
    # SGLang's own buffers, in place, one item a page
    assert [(b.layer_id, b.offset, b.capacity) for b in pools.buffers["index_k"]] == \
        [(i, args.state_data_ptrs[0][i], PAGES) for i in range(2)]
    assert [b.offset for b in pools.buffers["latent"]] == args.kv_data_ptrs


def test_indexshare_placeholders_are_refused_by_name(model_dir):
    path = model_dir("DeepseekV32ForCausalLM", **DSA_CONFIG)
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _dsa_kv_args((INDEX_ITEM, 0)), 1, 0, "bfloat16")
    assert str(e.value) == (
        f"pdc: DeepseekV32ForCausalLM ({path}) does not fit its spec: SGLang registered 0-row "
        "DSA indexer buffers for KVArgs entries [1] (IndexShare: layers that reuse the "
        "previous layer's top-k, `indexer_types` in the config); sglang-deepseek-v32's "
        "index_k (specs/sglang-deepseek-v32.yaml:70:3) holds keys for every layer")


def test_a_dsa_buffer_count_off_the_spec_is_refused_naming_both(model_dir):
    path = model_dir("DeepseekV32ForCausalLM", **DSA_CONFIG)
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _dsa_kv_args((INDEX_ITEM,) * 3), 1, 0, "bfloat16")
    assert str(e.value) == (
        f"pdc: DeepseekV32ForCausalLM ({path}) does not fit its spec: SGLang registered 3 DSA "
        "indexer-key buffers, sglang-deepseek-v32's index_k "
        "(specs/sglang-deepseek-v32.yaml:70:3) and draft_index_k "
        "(specs/sglang-deepseek-v32.yaml:76:3) take 2 (2 target layers, 0 draft layers); "
        "hint: the target's come first, then the MTP draft pool's "
        "(disaggregation/utils.py setup_state_kv_args)")


def test_the_dsa_kpool_tail_is_refused_by_name(model_dir):
    path = model_dir("DeepseekV32ForCausalLM", **DSA_CONFIG)
    with pytest.raises(F.RefusedModel) as e:
        F.served_family(path, _dsa_kv_args(extra_state=("dsa_tail",)), 1, 0, "bfloat16")
    assert str(e.value) == (
        f"pdc: DeepseekV32ForCausalLM ({path}) does not fit its spec: SGLang registered "
        "'dsa_tail' state buffers (the DSA indexer's kpool-compress tail, index_kpool > 1); "
        "pdc's SGLang specs carry mamba slot state, DSA indexer keys, QSA indexer state and "
        "sliding-window pages only so far")


def test_sglangs_dsa_page_list_must_be_the_requests_pages():
    from pdc.integrations.sglang.dsa import dsa_pages, page_list_error

    types = ["mamba", "dsa"]
    assert dsa_pages([np.array([3]), np.array([4, 7])], types) == [4, 7]
    assert dsa_pages([np.array([3])], ["mamba"]) is None
    assert page_list_error([4, 7], [4, 7]) == "" and page_list_error(None, [1]) == ""
    assert page_list_error(list(range(10)), list(range(1, 11))) == (
        "SGLang's DSA indexer pages [0, 1, 2, 3, 4, 5, 6, 7]... (10 pages) are not the "
        "request's KV pages [1, 2, 3, 4, 5, 6, 7, 8]... (10 pages): pdc moves the indexer "
        "keys with the KV pages")


def test_the_swa_spec_is_checked_against_sglangs_window_and_layer_split():
    # Note [SGLang SWA pools]: the window SGLang reads from the config, and its layer split
    # (given here; at start SGLang's own get_hybrid_layer_ids, tested inside SGLang's env)
    from pdc.generated.sglang_swa.layout import LAYOUT
    from pdc.integrations.sglang import swa

    assert swa.sglang_window({"sliding_window": 32}) == ("sliding_window", 32)
    assert swa.sglang_window({"sliding_window_size": 16, "sliding_window": 32}) == \
        ("sliding_window_size", 16)
    assert swa.sglang_window({"text_config": {"window_size": 8}}) == ("window_size", 8)
    assert swa.sglang_window({}) is None
    swa.check_served(LAYOUT, {"sliding_window": 32}, split=([2, 0], [1, 3]))  # fits
    with pytest.raises(F.RefusedModel) as e:
        swa.check_served(LAYOUT, {"sliding_window": 32}, split=([1, 3], [0, 2]))
    assert str(e.value) == (
        "pdc: sglang-swa (specs/sglang-swa.yaml) holds sliding-window layers [0, 2] (swa_kv) "
        "and full-attention layers [1, 3], but SGLang splits the served model into sliding "
        "[1, 3] and full [0, 2] (configs/model_config.py get_hybrid_layer_ids); hint: bind "
        "the layer kinds to the config's layer_types (`layers: {from: config.layer_types, "
        "names: ...}`)")
    with pytest.raises(F.RefusedModel) as e:
        swa.check_served(LAYOUT, {"window_size": 64}, split=([0, 2], [1, 3]))
    assert str(e.value) == (
        "pdc: sglang-swa's swa_kv (specs/sglang-swa.yaml:53:3) moves the pages of the last 32 "
        "tokens, but SGLang's sliding window is 64 tokens (config.json window_size), the "
        "window whose SWA pages it sends; hint: bind the component's window to "
        "config.window_size")
    assert swa.window_pages([np.array([3]), np.array([4, 7])], ["mamba", "swa"]) == [4, 7]
    assert swa.window_pages([np.array([3])], ["mamba"]) is None
