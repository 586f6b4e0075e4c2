"""Specs bound to a served model's config at start (Note [Bound families] in
runtime/binding.py): the generated formulas give, for every shipped architecture spec and
two or more sizes of config made here (no weights), exactly the layout the compiler computes
from the same values; the bound values are the family's identity on the wire; a config that
breaks a rule is refused naming the config key, its value and the spec line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from pdc.compiler.frontend import load_spec
from pdc.compiler.layout import build_layout
from pdc.compiler.model import DTYPE_BYTES
from pdc.runtime import binding
from pdc.runtime.binding import BindError
from pdc.runtime.family import Family
from pdc.runtime.plan_types import RankId
from pdc.runtime.wire import Abort, WireError

# family -> (engine settings, configs of two or more sizes)
LLAMA = [dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2),
         dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
              num_key_value_heads=8),
         dict(num_hidden_layers=5, hidden_size=256, num_attention_heads=4, head_dim=128)]
QWEN3_NEXT = [dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=64,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                   linear_value_head_dim=64, linear_conv_kernel_dim=4,
                   layer_types=["linear_attention", "full_attention"] * 2),
              dict(num_hidden_layers=8, num_key_value_heads=2, head_dim=128,
                   linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                   linear_value_head_dim=64, linear_conv_kernel_dim=4,
                   layer_types=["linear_attention", "full_attention"] * 4)]
DEEPSEEK = [dict(num_hidden_layers=2, kv_lora_rank=32, qk_rope_head_dim=8, dtype="float32"),
            dict(num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64,
                 dtype="bfloat16"),
            dict(num_hidden_layers=27, kv_lora_rank=512, qk_rope_head_dim=64,
                 torch_dtype="bfloat16")]
MISTRAL = [dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                num_key_value_heads=2, sliding_window=8, dtype="float32"),
           dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, sliding_window=4096,
                dtype="bfloat16")]
CASES = {
    "vllm_llama": ({"page_size": 32, "kv_dtype": "bfloat16"}, LLAMA),
    "sglang_llama": ({"page_size": 16, "kv_dtype": "float32"}, LLAMA),
    "vllm_qwen3_next": ({"page_size": 160}, QWEN3_NEXT),
    "hf_deepseek_v3": ({"page_size": 4}, DEEPSEEK),
    "vllm_deepseek_mla": ({"page_size": 16, "kv_dtype": "bfloat16"}, DEEPSEEK),
    "hf_mistral_sw": ({"page_size": 8}, MISTRAL),
}


def _compiled(family: Family, bound: binding.Bound):
    """The layout the compiler computes from the spec with the bound values written in."""
    spec = load_spec(family.layout.spec_path, dict(bound.params), dict(bound.dtypes),
                     deployments=False)
    return build_layout(spec)


@pytest.mark.parametrize("py_name", list(CASES))
def test_every_size_binds_to_the_layout_the_compiler_computes(py_name):
    engine, configs = CASES[py_name]
    family = Family.load(py_name)
    assert family.bindable and family.serves is not None
    layouts = set()
    for config in configs:
        bound = family.bind(config, engine)
        assert bound.bound is not None
        assert dataclasses.replace(bound.layout, bound="") == _compiled(family, bound.bound)
        assert bound.layout.num_layers == config["num_hidden_layers"]
        assert bound.layout.default_page_size == engine["page_size"]
        layouts.add(bound.layout)
    assert len(layouts) == len(configs)


EAGLE_DRAFT = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1}


@pytest.mark.parametrize("py_name, draft, comp", [
    ("sglang_llama", EAGLE_DRAFT, "draft_kv"),
    ("sglang_deepseek_mla", {"hidden_size": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 8},
     "draft_latent")])
@pytest.mark.parametrize("layers", [0, 1, 2])
def test_a_draft_band_binds_to_the_layout_the_compiler_computes(py_name, draft, comp, layers):
    # Note [Draft components]: the engine's draft model; 0 layers when it does not speculate
    family = Family.load(py_name)
    config = LLAMA[0] if py_name == "sglang_llama" else DEEPSEEK[0]
    engine = {"page_size": 16, "kv_dtype": "bfloat16", "draft_layers": layers,
              "hidden_dtype": "bfloat16" if layers else "float32",
              **({"draft": draft} if layers else {})}
    bound = family.bind(config, engine)
    assert dataclasses.replace(bound.layout, bound="") == _compiled(family, bound.bound)
    n = config["num_hidden_layers"]
    assert bound.layout.draft_ids == bound.layout.component(comp).layer_ids == \
        tuple(range(n, n + layers))
    hidden = bound.layout.component("aux_hidden")
    assert (hidden.shape, hidden.dtype) == (((draft["hidden_size"],), "bfloat16") if layers
                                            else ((16,), "float32"))


@pytest.mark.parametrize("flag", [None, False, True])
def test_a_present_component_follows_the_configs_flag(flag):
    # Note [Present components]: SGLang's DSA top-k seed row, there only where the config
    # sets index_share_for_mtp_iteration (a JSON bool binds as 0 or 1)
    family = Family.load("sglang_deepseek_v32")
    config = dict(DEEPSEEK[0], index_head_dim=128, index_topk=2048)
    if flag is not None:
        config["index_share_for_mtp_iteration"] = flag
    bound = family.bind(config, {"page_size": 64, "kv_dtype": "bfloat16"})
    assert dataclasses.replace(bound.layout, bound="") == _compiled(family, bound.bound)
    seed = bound.layout.component("aux_dsa_topk")
    assert (seed.stages, seed.item_bytes) == ("last" if flag else "none", 2048 * 4)
    side = "tp=1,pp=1,dp=1,page_size=64"
    plan = bound.plan_for(side, side, "mooncake")
    entries = dict((n, e) for n, e, _ in plan.registration("prefill", RankId(0, 0)).components)
    assert entries["aux_dsa_topk"] == ((("data", 0xFFFFFFF8),) if flag else ())
    assert bound.fingerprint != family.bind(
        dict(config, index_share_for_mtp_iteration=not flag),
        {"page_size": 64, "kv_dtype": "bfloat16"}).fingerprint


def test_llama_sizes_follow_the_config():
    family = Family.load("vllm_llama")
    big = family.bind(LLAMA[1], {"page_size": 16, "kv_dtype": "float16"})
    kv = big.layout.component("kv")
    assert (kv.shape, kv.dtype, kv.item_bytes) == ((2, 16, 8, 128), "float16", 65536)
    assert kv.item_bytes_at(4) == 16384  # two of the eight KV heads per rank
    # head_dim from the config when it says (Qwen3 style), else hidden_size // heads
    assert family.bind(LLAMA[2], {"page_size": 32}).layout.component("kv").shape == \
        (2, 32, 4, 128)


def test_qwen3_next_takes_every_layer_kind_from_the_config():
    # the real model's full_attention_interval 4, where the spec's example pattern has 2
    config = dict(QWEN3_NEXT[1], layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    bound = Family.load("vllm_qwen3_next").bind(config, {"page_size": 160})
    assert [k for _, k in bound.layout.kind_of] == ["gdn", "gdn", "gdn", "attn"] * 2
    assert bound.layout.component("gdn_conv").layer_ids == (0, 1, 2, 4, 5, 6)
    assert bound.layout.component("gdn_ssm").shape == (8, 64, 64)
    # a state larger than vLLM's block breaks the spec's constraint, named with its inputs
    big = dict(config, linear_num_value_heads=32)
    with pytest.raises(BindError, match="config.linear_num_value_heads = 32"):
        Family.load("vllm_qwen3_next").bind(big, {"page_size": 160})


def test_mla_latent_follows_the_config_and_is_replicated():
    # DeepSeek-V3's 61 layers of one [block, 512 + 64] latent row a token; every TP rank
    # holds the whole latent, so a rank's item is the whole item at any TP
    family = Family.load("vllm_deepseek_mla")
    assert family.serves == ("vllm", ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"))
    big = family.bind(DEEPSEEK[1], {"page_size": 16, "kv_dtype": "float16"})
    kv = big.layout.component("kv")
    assert (big.layout.num_layers, kv.shape, kv.dtype, kv.item_bytes) == \
        (61, (16, 576), "float16", 18432)
    assert kv.item_bytes_at(8) == 18432
    small = family.bind(DEEPSEEK[0], {"page_size": 16, "kv_dtype": "bfloat16"})
    assert small.layout.component("kv").shape == (16, 40)
    assert small.fingerprint != big.fingerprint


def test_the_binder_knows_the_compilers_dtypes():
    assert binding.DTYPE_BYTES == DTYPE_BYTES


def test_two_bindings_are_two_families_on_the_wire():
    # Note [Bound families]: the fingerprint and the plan digest cover the bound values, so
    # two engines that bound one spec to different models refuse each other at the handshake
    family = Family.load("vllm_llama")
    a = family.bind(LLAMA[0], {"page_size": 32})
    b = family.bind(LLAMA[0], {"page_size": 32, "kv_dtype": "float16"})
    again = family.bind(dict(LLAMA[0]), {"page_size": 32})
    assert a.fingerprint == again.fingerprint != b.fingerprint != family.fingerprint
    one = "tp=1,page_size=32"
    assert a.plan_for(one, one, "mooncake").digest() == \
        again.plan_for(one, one, "mooncake").digest()
    assert a.plan_for(one, one, "mooncake").digest() != \
        b.plan_for(one, one, "mooncake").digest()
    msg = Abort(room=7, generation=1, decode_rank=RankId(0, 0))
    assert again.decode(a.encode(msg)) == msg
    with pytest.raises(WireError, match="fingerprint"):
        b.decode(a.encode(msg))


def test_a_broken_constraint_names_the_config_keys_their_values_and_the_line():
    family = Family.load("vllm_llama")
    with pytest.raises(BindError) as e:
        family.bind(dict(LLAMA[0], num_attention_heads=6, num_key_value_heads=4),
                    {"page_size": 32})
    (d,) = e.value.diagnostics
    assert (str(d.loc), d.message) == (
        "specs/vllm-llama.yaml:38:5",
        "constraint 'heads % kv_heads == 0' does not hold (with config.num_attention_heads = "
        "6, config.num_key_value_heads = 4): every KV head serves a whole group of query "
        "heads (GQA)")


def test_every_missing_or_wrong_value_is_reported_at_its_line():
    family = Family.load("vllm_llama")
    with pytest.raises(BindError) as e:
        family.bind({"num_hidden_layers": "two", "hidden_size": 64,
                     "num_attention_heads": 4}, {"kv_dtype": "int33"})
    assert [(str(d.loc), d.message) for d in e.value.diagnostics] == [
        ("specs/vllm-llama.yaml:18:3", "dtype 'model' takes engine.kv_dtype, which is "
                                       "'int33', not a dtype pdc moves"),
        ("specs/vllm-llama.yaml:20:15", "param 'num_layers' takes config.num_hidden_layers, "
                                        "which is 'two', not an integer"),
        ("specs/vllm-llama.yaml:21:14", "param 'page_size' takes engine.page_size, but the "
                                        "engine has no 'page_size'"),
    ]


def test_a_layer_type_the_spec_does_not_name_is_refused():
    config = dict(QWEN3_NEXT[0], layer_types=["linear_attention", "mamba"] * 2)
    with pytest.raises(BindError, match=r"config.layer_types\[1\] is 'mamba', which the "
                                        r"spec's `names` does not map to a kind"):
        Family.load("vllm_qwen3_next").bind(config, {"page_size": 160})


def test_a_zero_from_the_config_is_an_error_not_a_crash():
    with pytest.raises(BindError) as e:
        Family.load("vllm_llama").bind(dict(LLAMA[0], num_attention_heads=0,
                                            num_key_value_heads=0), {"page_size": 32})
    assert "division by zero" in str(e.value)


def test_a_concrete_family_binds_to_itself():
    family = Family.load("llama3_70b")
    assert not family.bindable and family.bind(LLAMA[0], {"page_size": 32}) is family


def test_binding_runs_without_the_compiler():
    code = ("import sys; from pdc.runtime.family import Family; "
            "f = Family.load('sglang_llama').bind({'num_hidden_layers': 3, 'hidden_size': 96, "
            "'num_attention_heads': 6, 'num_key_value_heads': 3}, {'page_size': 32}); "
            "f.plan_for('tp=3', 'tp=1', 'mooncake'); "
            "print([m for m in sys.modules if m.startswith('pdc.compiler') or m in "
            "('yaml', 'jsonschema', 'jinja2')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"
