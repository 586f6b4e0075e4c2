"""Specs bound to the served model at start, inside real vLLM engines (Note [Bound families]
in runtime/binding.py, Note [Spec path] in runtime/spec_path.py).

PdcConnector is started without a family: it takes the spec whose `serves` names the served
model's architecture and binds it to the model's HF config and vLLM's block size and cache
dtype. One Llama spec (specs/vllm-llama.yaml) serves two tiny Llamas of different layer
counts, heads and block sizes (the 2-layer, 4-head one with 32-token blocks is
tests/vllm/test_vllm_faults.py's model, token-identical there over Mooncake and NIXL; this
module serves a 3-layer, 8-head one with 64-token blocks), and a user's spec in a folder named by PDC_SPEC_PATH (outside
pdc's package, compiled on first use into a cache) serves GPT-NeoX, which pdc does not ship.
Each model goes through one vLLM engine alone and a prefill and a decode engine over
Mooncake; every prompt must be token-identical, and move exactly the bytes of the bound
layout: blocks x layers x (2 x block x KV heads x head size x 2 bytes).
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from pdc.serving.vllm_env import HINT, vllm_python

pytestmark = pytest.mark.engines

if vllm_python() is None:
    pytest.skip(f"no vLLM environment: {HINT}", allow_module_level=True)

PROMPTS, TOKENS = 4, 8

# name -> (architecture, config, block size)
MODELS = {
    "llama-3x8": ("LlamaForCausalLM", dict(num_hidden_layers=3, hidden_size=512,
                                           num_attention_heads=8, num_key_value_heads=4), 64),
    "neox-2x4": ("GPTNeoXForCausalLM", dict(num_hidden_layers=2, hidden_size=256,
                                            num_attention_heads=4), 32),
}

# A user's spec for GPT-NeoX, which pdc's package does not ship: multi-head attention (one
# KV head per query head), head size hidden_size / heads, in vLLM's [K|V, block, heads,
# head_dim] block, as specs/vllm-llama.yaml describes Llama's.
NEOX_SPEC = """\
family: user-gpt-neox
description: GPT-NeoX in vLLM's paged KV layout, bound to the served model
serves: {engine: vllm, architectures: [GPTNeoXForCausalLM]}
dtypes:
  model: {from: engine.kv_dtype, example: bfloat16}
params:
  num_layers: {from: config.num_hidden_layers, example: 2}
  page_size: {from: engine.page_size, example: 32}
  hidden_size: {from: config.hidden_size, example: 256}
  heads: {from: config.num_attention_heads, example: 4}
  head_dim: hidden_size // heads
layers: {count: num_layers, pattern: [attn]}
components:
  kv:
    layers: all
    index: page
    tensors: [kv]
    item: {shape: [2, page_size, heads, head_dim], dtype: model}
    tp: {shard: heads}
constraints:
  - {expr: hidden_size % heads == 0, why: heads split the hidden size evenly}
"""

MAKE = textwrap.dedent("""\
    import json, sys, torch, transformers
    arch, config, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    name = {"LlamaForCausalLM": "LlamaConfig", "GPTNeoXForCausalLM": "GPTNeoXConfig"}[arch]
    heads = config["num_attention_heads"]
    cfg = getattr(transformers, name)(**config, intermediate_size=2 * config["hidden_size"],
                                      vocab_size=1024, max_position_embeddings=2048,
                                      bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(out)
""")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from pdc.serving.vllm_proxy import engine_env

    root = tmp_path_factory.mktemp("vllm-bound")
    specs = root / "user-specs"
    specs.mkdir()
    (specs / "gpt-neox.yaml").write_text(NEOX_SPEC)
    for name, (arch, config, _) in MODELS.items():
        r = subprocess.run([vllm_python(), "-c", MAKE, arch, json.dumps(config),
                            str(root / name)], capture_output=True, text=True,
                           env=engine_env(0), timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    return root


@pytest.mark.parametrize("name", list(MODELS))
def test_one_spec_per_architecture_serves_every_size_token_identical(work, name, monkeypatch):
    from pdc.serving.vllm_proxy import Engine, make_prompts, run_pd, run_single

    monkeypatch.setenv("PDC_SPEC_PATH", str(work / "user-specs"))
    monkeypatch.setenv("PDC_SPEC_CACHE", str(work / "spec-cache"))
    arch, config, block = MODELS[name]
    model = str(work / name)
    run = work / f"run-{name}"
    run.mkdir()
    prompts = make_prompts(PROMPTS, seed=0)
    engines = []
    try:
        ref = Engine(vllm_python(), run, "single", model, "", "mooncake", core=1,
                     block_size=block)
        engines.append(ref)
        ref.wait_up()
        want = run_single(ref, prompts, TOKENS)
        ref.stop()
        engines.remove(ref)
        pre = Engine(vllm_python(), run, "prefill", model, "", "mooncake", core=0,
                     block_size=block)
        engines.append(pre)
        dec = Engine(vllm_python(), run, "decode", model, "", "mooncake", core=1,
                     block_size=block)
        engines.append(dec)
        pre.wait_up()
        dec.wait_up()
        tokens, transfers, _, errors, _ = run_pd(pre, dec, prompts, TOKENS)
        free = pre.call({"op": "free_blocks"}), dec.call({"op": "free_blocks"})
    finally:
        for e in engines:
            e.stop()
    assert errors == [""] * PROMPTS
    assert tokens == want
    layers = config["num_hidden_layers"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    item = 2 * block * kv_heads * head_dim * 2
    for p, t in zip(prompts, transfers, strict=True):
        if t["prefix_tokens"]:
            continue  # a repeat: decode's prefix cache holds its first blocks
        assert t["bytes"] == -(-len(p) // block) * layers * item, (name, t)
    assert [f["requests"] for f in free] == [0, 0]
    if arch == "GPTNeoXForCausalLM":  # the user's spec was compiled into the cache, once
        assert len(list((work / "spec-cache").glob("*/user_gpt_neox/layout.py"))) == 1
