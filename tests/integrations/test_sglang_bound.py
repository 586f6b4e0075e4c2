"""Specs bound to the served model at start, inside real SGLang servers (Note [Bound
families] in runtime/binding.py, Note [Served family] in integrations/sglang/family.py).

One Llama spec (specs/sglang-llama.yaml) serves two tiny Llamas of different layer counts,
heads and page sizes (`--page-size` 16 and 32), and a user's spec in a folder named by
PDC_SPEC_PATH (outside pdc's package, compiled on first use into a cache) serves OLMo, an
architecture pdc does not ship. Each model runs on a plain server for the reference tokens
and through a prefill and a decode server behind SGLang's router over Mooncake; every
prompt must be token-identical, and each server's log names the bound family.

The README's pytest runs OLMo (the user's spec: binding, PDC_SPEC_PATH and the spec cache);
the two Llamas run with `PDC_SLOW=1 pytest tests/integrations/test_sglang_bound.py` (~4 min
more on the 2-core box): CI's other SGLang modules serve Llama through the same bound spec,
and tests/integrations/test_sglang_family.py binds it to both sizes without servers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import pytest

from pdc.serving import sglang_harness as H

PYTHON = H.sglang_python()
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1800),  # the first test of each model starts two servers and a router
    pytest.mark.skipif(PYTHON is None, reason="no SGLang environment: run "
                       "scripts/install-sglang.sh (CI does)"),
]

NEW_TOKENS = 8
PROMPTS = H.mixed_prompts(4, seed=3)

# name -> (config class, model class, config, page size)
MODELS = {
    "llama-2x4-p16": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2), 16),
    "llama-3x8-p32": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=3, hidden_size=128, num_attention_heads=8, num_key_value_heads=4),
        32),
    "olmo-2x4-p16": ("OlmoConfig", "OlmoForCausalLM", dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4),
        16),
}

# A user's spec for OLMo, which pdc's package does not ship, as SGLang's MHA pool holds it
# (one K and one V buffer per layer, token-major [tokens, kv_heads, head_dim]) with SGLang's
# aux row (Note [SGLang aux row] in integrations/sglang/family.py).
AUX = "".join(f"""
  {name}:
    layers: request
    sentinel: {sentinel}
    index: aux
{tensors}    item: {{shape: [{n}], dtype: {dtype}}}
    tp: replicated
    stages: last""" for name, sentinel, tensors, n, dtype in (
    ("aux_i32", "0xFFFFFFFF", "    tensors: [output_ids, cached_tokens, "
                              "output_token_logprobs_idx]\n", 16, "int32"),
    ("aux_f32", "0xFFFFFFFE", "    tensors: [output_token_logprobs_val, output_topk_p]\n", 16,
     "float32"),
    ("aux_top_val", "0xFFFFFFFD", "", 128, "float32"),
    ("aux_top_idx", "0xFFFFFFFC", "", 128, "int32"),
    ("aux_topk_index", "0xFFFFFFFB", "", 16, "int64"),
    ("aux_hidden", "0xFFFFFFFA", "", 16, "float32"),
    ("aux_room", "0xFFFFFFF9", "", 8, "uint64")))
OLMO_SPEC = """\
family: user-olmo
description: OLMo as SGLang serves it on a CPU, bound to the served model
serves: {engine: sglang, architectures: [OlmoForCausalLM]}
dtypes:
  model: {from: engine.kv_dtype, example: bfloat16}
params:
  num_layers: {from: config.num_hidden_layers, example: 2}
  page_size: {from: engine.page_size, example: 16}
  hidden_size: {from: config.hidden_size, example: 64}
  heads: {from: config.num_attention_heads, example: 4}
  kv_heads: {from: config.num_key_value_heads, example: 4, default: heads}
  head_dim: hidden_size // heads
layers: {count: num_layers, pattern: [attn]}
components:
  kv:
    layers: all
    index: page
    tensors: [k, v]
    item: {shape: [page_size, kv_heads, head_dim], dtype: model}
    tp: {shard: kv_heads}""" + AUX + "\n"

MAKE = (
    "import json, sys, torch, transformers\n"
    "cfg = getattr(transformers, sys.argv[1])(**json.loads(sys.argv[3]), vocab_size=512,\n"
    "    intermediate_size=128, max_position_embeddings=1024, torch_dtype='bfloat16',\n"
    "    bos_token_id=1, eos_token_id=2)\n"
    "torch.manual_seed(0)\n"
    "getattr(transformers, sys.argv[2])(cfg).to(torch.bfloat16).save_pretrained(sys.argv[4])\n"
)


@pytest.fixture(scope="module")
def workdir():
    d = tempfile.mkdtemp(prefix="pdc-sglang-bound-")
    with open(f"{d}/olmo.yaml", "w") as f:
        f.write(OLMO_SPEC)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _param(name: str):
    if name.startswith("olmo"):
        return name
    return pytest.param(name, marks=pytest.mark.skipif(
        os.environ.get("PDC_SLOW") != "1", reason="slow (three SGLang servers per model): "
        "PDC_SLOW=1 pytest tests/integrations/test_sglang_bound.py"))


@pytest.fixture(scope="module", params=[_param(name) for name in MODELS])
def served(request, workdir):
    """(name, reference tokens, PD tokens, prefill log, decode log) of one model; the
    servers are stopped before the next model's start (two cores)."""
    name = request.param
    config_class, model_class, config, page = MODELS[name]
    model = f"{workdir}/{name}"
    subprocess.run([PYTHON, "-c", MAKE, config_class, model_class, json.dumps(config), model],
                   check=True, capture_output=True, timeout=300)
    args = ("--page-size", str(page))
    mp = pytest.MonkeyPatch()
    mp.setenv("PDC_SPEC_PATH", workdir)
    mp.setenv("PDC_SPEC_CACHE", f"{workdir}/spec-cache")
    # Each chunk's pages as its forward ends: a CPU server holds them to the last chunk by
    # default (Note [SGLang held chunks]), which the other pairs cover.
    mp.setenv("PDC_SGLANG_HOLD_CHUNKS", "0")
    try:
        plain = H.start_plain(PYTHON, model, workdir, extra_args=args)
        try:
            ref = H.run_prompts(plain.url, PROMPTS, NEW_TOKENS, in_flight=3)
        finally:
            plain.stop()
        pair = H.PDPair.start(PYTHON, model, workdir, engine="mooncake", server_args=args)
        try:
            got = H.run_prompts(pair.router.url, PROMPTS, NEW_TOKENS, in_flight=3)
        finally:
            pair.stop()
    finally:
        mp.undo()
    with open(pair.prefill.log, errors="replace") as f:
        prefill = f.read()
    with open(pair.decode.log, errors="replace") as f:
        decode = f.read()
    return name, ref, got, prefill, decode


def test_every_model_is_token_identical_through_its_bound_spec(served):
    name, ref, got, prefill, decode = served
    assert [r.error for r in ref] == [""] * len(PROMPTS)
    assert [r.error for r in got] == [""] * len(PROMPTS), decode[-3000:]
    assert [i for i, (r, g) in enumerate(zip(ref, got, strict=True))
            if r.tokens != g.tokens] == [], name
    assert all(len(g.tokens) == NEW_TOKENS for g in got)


def test_each_server_names_the_spec_it_bound_and_the_models_sizes(served):
    name, _, _, prefill, decode = served
    _, arch, config, page = MODELS[name]
    spec = "user-olmo (" if arch == "OlmoForCausalLM" else \
        "sglang-llama (specs/sglang-llama.yaml)"
    bound = (f"bound to {config['num_hidden_layers']} layers, pages of {page} tokens, KV "
             "bfloat16")
    for log, mode in ((prefill, "prefill"), (decode, "decode")):
        line = next((ln for ln in log.splitlines() if "pdc SGLang backend:" in ln), "")
        assert f"{mode} {arch} rank pp0.tp0, family {spec}" in line, log[-3000:]
        assert bound in line, line
