"""Specs from outside pdc's package (Note [Spec path] in runtime/spec_path.py): a folder
named by PDC_SPEC_PATH is searched before the package, its specs compiled on first use into
a cache keyed by the spec's hash (by `pdc compile`, in a subprocess), or ahead of time with
`pdc compile --out DIR`; an architecture found nowhere is refused naming where pdc looked."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pdc.runtime import spec_path as S
from pdc.runtime.family import FamilyNotFound

NEOX = """\
family: my-neox
serves: {engine: sglang, architectures: [GPTNeoXForCausalLM]}
dtypes:
  model: {from: engine.kv_dtype, example: bfloat16}
params:
  num_layers: {from: config.num_hidden_layers, example: 2}
  page_size: {from: engine.page_size, example: 16}
  hidden_size: {from: config.hidden_size, example: 64}
  heads: {from: config.num_attention_heads, example: 4}
  head_dim: hidden_size // heads
layers: {count: num_layers, pattern: [attn]}
components:
  kv:
    layers: all
    index: page
    tensors: [k, v]
    item: {shape: [page_size, heads, head_dim], dtype: model}
    tp: {shard: heads}
"""
CONFIG = {"num_hidden_layers": 6, "hidden_size": 512, "num_attention_heads": 8}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(S.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(S.ENV, raising=False)
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "neox.yaml").write_text(NEOX)
    return specs


def test_a_user_spec_is_compiled_once_into_the_cache_and_bound(folder, tmp_path, monkeypatch):
    family = S.find_family("sglang", "GPTNeoXForCausalLM", [folder])
    assert (family.name, family.serves) == ("my-neox", ("sglang", ("GPTNeoXForCausalLM",)))
    built = list((tmp_path / "cache").glob("*/my_neox/layout.py"))
    assert len(built) == 1
    bound = family.bind(CONFIG, {"page_size": 32, "kv_dtype": "bfloat16"})
    assert bound.layout.component("kv").shape == (32, 8, 64)
    assert bound.layout.num_layers == 6

    def no_compile(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(S.subprocess, "run", no_compile)  # the cache answers now
    monkeypatch.setenv(S.ENV, str(folder))
    assert S.find_family("sglang", "GPTNeoXForCausalLM").fingerprint == family.fingerprint


def test_an_edited_spec_is_compiled_again(folder, tmp_path):
    S.find_family("sglang", "GPTNeoXForCausalLM", [folder])
    (folder / "neox.yaml").write_text(NEOX.replace("family: my-neox", "family: my-neox2"))
    assert S.find_family("sglang", "GPTNeoXForCausalLM", [folder]).name == "my-neox2"
    assert len(list((tmp_path / "cache").glob("*/.complete"))) == 2


def test_a_folder_compiled_ahead_of_time_is_found(folder, tmp_path):
    out = tmp_path / "compiled"
    subprocess.run([sys.executable, "-m", "pdc", "compile", str(folder / "neox.yaml"),
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    family = S.find_family("sglang", "GPTNeoXForCausalLM", [out])
    assert family.name == "my-neox" and family.bindable
    assert not (tmp_path / "cache").exists()  # nothing compiled at start


def test_a_user_specs_declared_deployments_are_loaded_not_lowered(folder, tmp_path):
    (folder / "neox.yaml").write_text(NEOX + "deployments:\n  - {prefill: {tp: 2}, decode: "
                                      "{tp: 1}, backend: mooncake}\n")
    out = tmp_path / "compiled"
    subprocess.run([sys.executable, "-m", "pdc", "compile", str(folder / "neox.yaml"),
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    assert (out / "my_neox" / "plans.py").exists()
    family = S.find_family("sglang", "GPTNeoXForCausalLM", [out])
    declared = family.topology("tp=2", "tp=1", "mooncake")
    assert family.is_declared(declared)
    assert not family.is_declared(family.topology("tp=1", "tp=1", "mooncake"))
    assert len(family.plan(declared).links) == 2


def test_a_broken_user_spec_is_refused_with_its_located_errors(folder):
    (folder / "neox.yaml").write_text(NEOX.replace("head_dim: hidden_size // heads",
                                                   "head_dim: hidden_size // nheads"))
    with pytest.raises(S.SpecPathError) as e:
        S.find_family("sglang", "GPTNeoXForCausalLM", [folder])
    lines = str(e.value).splitlines()
    assert lines[0] == f"pdc: the spec {folder / 'neox.yaml'} (from PDC_SPEC_PATH) does not " \
                       "compile:"
    assert lines[1] == f"{folder / 'neox.yaml'}:10:13: error: param 'head_dim': unknown name " \
                       "'nheads' in 'hidden_size // nheads'"


def test_an_architecture_found_nowhere_names_every_place(folder, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FamilyNotFound) as e:
        S.find_family("sglang", "FalconForCausalLM", [folder, missing])
    assert str(e.value).splitlines()[0] == (
        f"pdc has no spec for architecture FalconForCausalLM served by sglang; looked in: "
        f"{folder} (sglang specs for GPTNeoXForCausalLM); {missing} (not a folder); pdc's "
        f"package (sglang specs for DeepseekV2ForCausalLM, DeepseekV32ForCausalLM, "
        f"DeepseekV3ForCausalLM, GlmMoeDsaForCausalLM, GptOssForCausalLM, LlamaForCausalLM, "
        f"Qwen3ForCausalLM, Qwen3NextForCausalLM, Qwen4ExpForConditionalGeneration)")


def test_the_package_serves_what_its_specs_say():
    served = {(f.serves[0], a): f.name for f in S.package_families() for a in f.serves[1]}
    assert served[("vllm", "LlamaForCausalLM")] == "vllm-llama"
    assert served[("vllm", "Qwen3NextForCausalLM")] == "vllm-qwen3-next"
    assert served[("sglang", "Qwen3ForCausalLM")] == "sglang-llama"
    assert served[("sglang", "Qwen3NextForCausalLM")] == "sglang-qwen3-next"
    assert served[("sglang", "DeepseekV3ForCausalLM")] == "sglang-deepseek-mla"
    assert served[("sglang", "DeepseekV32ForCausalLM")] == "sglang-deepseek-v32"
    assert served[("sglang", "GlmMoeDsaForCausalLM")] == "sglang-deepseek-v32"
    assert served[("sglang", "GptOssForCausalLM")] == "sglang-swa"
    assert served[("transformers", "DeepseekV2ForCausalLM")] == "hf-deepseek-v3"
