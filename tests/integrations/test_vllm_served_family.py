"""PdcConnector's family without vLLM (integrations/vllm/plans.py served_family): the spec
that serves the model's architecture, bound at start to its HF config, vLLM's block size and
cache dtype (Note [Bound families] in runtime/binding.py); a config that breaks the spec is
refused naming the config key, its value and the spec line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pdc.integrations.vllm.plans import make_plan, served_family
from pdc.integrations.vllm.settings import parse_settings
from pdc.runtime.binding import BindError
from pdc.runtime.family import FamilyNotFound
from transformers import LlamaConfig


def _vllm_config(hf, block_size=32, cache_dtype="auto", dtype="torch.bfloat16"):
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf, dtype=dtype),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype=cache_dtype))


def _llama(**kw):
    cfg = dict(num_hidden_layers=3, hidden_size=512, num_attention_heads=8,
               num_key_value_heads=4, architectures=["LlamaForCausalLM"])
    cfg.update(kw)
    return LlamaConfig(**cfg)


def test_without_a_family_the_architectures_spec_is_bound_to_the_model():
    settings = parse_settings("kv_consumer", {"engine": "mooncake"})
    family = served_family(settings, _vllm_config(_llama(), block_size=64))
    kv = family.layout.component("kv")
    assert (family.name, family.layout.num_layers, kv.shape, kv.dtype) == \
        ("vllm-llama", 3, (2, 64, 4, 64), "bfloat16")
    plan = make_plan(family, 2, 1, "mooncake")
    assert plan.bound == family.bound.digest


def test_a_named_family_is_bound_too_and_the_cache_dtype_wins():
    settings = parse_settings("kv_producer", {"family": "vllm-llama"})
    family = served_family(settings, _vllm_config(_llama(), cache_dtype="float16"))
    assert family.layout.component("kv").dtype == "float16"


def test_a_config_that_breaks_the_spec_is_refused_at_start():
    settings = parse_settings("kv_consumer", {})
    with pytest.raises(BindError) as e:
        served_family(settings, _vllm_config(_llama(num_attention_heads=8,
                                                    num_key_value_heads=3)))
    assert str(e.value).splitlines()[0] == (
        "specs/vllm-llama.yaml:38:5: error: constraint 'heads % kv_heads == 0' does not hold "
        "(with config.num_attention_heads = 8, config.num_key_value_heads = 3): every KV head "
        "serves a whole group of query heads (GQA)")


def test_an_architecture_without_a_spec_names_where_pdc_looked(tmp_path, monkeypatch):
    monkeypatch.delenv("PDC_SPEC_PATH", raising=False)
    settings = parse_settings("kv_consumer", {"spec_path": str(tmp_path)})
    with pytest.raises(FamilyNotFound) as e:
        served_family(settings, _vllm_config(_llama(architectures=["FalconForCausalLM"])))
    assert str(e.value).splitlines()[0] == (
        f"pdc has no spec for architecture FalconForCausalLM served by vllm; looked in: "
        f"{tmp_path} (no vllm spec); pdc's package (vllm specs for DeepseekV2ForCausalLM, "
        "DeepseekV3ForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM, Qwen3NextForCausalLM)")


def test_a_bad_spec_path_setting_is_refused():
    from pdc.integrations.vllm.settings import SettingsError

    with pytest.raises(SettingsError, match=r"kv_connector_extra_config\['spec_path'\]: "
                                            r"expected a folder or a list of folders"):
        parse_settings("kv_consumer", {"spec_path": 3})
