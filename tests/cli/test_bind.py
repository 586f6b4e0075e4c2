"""`pdc bind SPEC --config config.json`: a spec bound to a model's config without an engine
(Note [Bound families] in runtime/binding.py), and what binding catches that validation
cannot (Note [Config cross-check] in pdc/bind.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdc.cli import main

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
            "dtype": "bfloat16", "vocab_size": 128256}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


@pytest.fixture
def config(tmp_path):
    def write(data, name="config.json"):
        path = tmp_path / name
        path.write_text(data if isinstance(data, str) else json.dumps(data))
        return str(path)
    return write


def test_bind_prints_params_components_and_bytes_per_rank(capsys, config, monkeypatch):
    monkeypatch.chdir(REPO)
    rc, out, err = run(capsys, "bind", "specs/vllm-llama.yaml", "--config", config(LLAMA_8B),
                       "--engine-page-size", "16", "--tp", "4")
    assert (rc, err) == (0, "")
    lines = [ln.rstrip() for ln in out.splitlines()]
    assert lines[1].startswith("  32 layers (attn x32), pages of 16 tokens, fingerprint 0x")
    assert "  num_layers      32  config.num_hidden_layers" in lines
    assert "  head_dim       128  config.head_dim (absent: default hidden_size // heads)" in lines
    assert "  model  bfloat16  engine.kv_dtype" in lines
    # K|V block [2, 16, 8, 128] bf16 = 64 KiB; 2 of 8 KV heads per rank; 32 layers / 16 tokens
    assert lines[-1] == "  per rank at TP 4: 32,768 bytes per token, 0 bytes per request"


def test_bind_of_a_hybrid_counts_state_per_request(capsys, config, monkeypatch):
    monkeypatch.chdir(REPO)
    qwen3_next = {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 64,
                  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                  "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                  "linear_conv_kernel_dim": 4,
                  "layer_types": ["linear_attention", "full_attention"] * 2}
    rc, out, _ = run(capsys, "bind", "specs/vllm-qwen3-next.yaml", "--config",
                     config(qwen3_next), "--engine-page-size", "160")
    assert rc == 0
    # attention: 2 layers x 81,920 B per 160 tokens; GDN: 2 layers x (3,072 + 65,536) B
    assert out.splitlines()[-1] == ("  per rank at TP 1: 1,024 bytes per token, 137,216 bytes "
                                    "per request")


def test_a_config_that_breaks_the_spec_exits_1_naming_key_value_and_line(capsys, config,
                                                                         monkeypatch):
    monkeypatch.chdir(REPO)
    bad = dict(LLAMA_8B, num_attention_heads=30)
    rc, out, err = run(capsys, "bind", "specs/vllm-llama.yaml", "--config", config(bad),
                       "--engine-page-size", "16")
    assert (rc, out) == (1, "")
    assert err.splitlines()[0] == (
        "specs/vllm-llama.yaml:38:5: error: constraint 'heads % kv_heads == 0' does not hold "
        "(with config.num_attention_heads = 30, config.num_key_value_heads = 8): every KV head "
        "serves a whole group of query heads (GQA)")
    assert err.splitlines()[-1] == (f"pdc bind: 1 error; specs/vllm-llama.yaml does not bind "
                                    f"to {config(bad)}")


def test_an_unreadable_or_malformed_config_is_a_located_error(capsys, config, tmp_path):
    spec = str(REPO / "specs" / "vllm-llama.yaml")
    rc, _, err = run(capsys, "bind", spec, "--config", str(tmp_path / "none.json"),
                     "--engine-page-size", "16")
    assert rc == 1
    assert err.splitlines()[0] == (f"{tmp_path / 'none.json'}: error: cannot read the config: "
                                   "No such file or directory")
    path = config('{"num_hidden_layers": 2,\n "hidden_size": }')
    rc, _, err = run(capsys, "bind", spec, "--config", path, "--engine-page-size", "16")
    assert (rc, err.splitlines()[0]) == (1, f"{path}:2:17: error: invalid JSON: Expecting value")


# ~~~ what binding catches that validation cannot ~~~

# Eight deliberately wrong specs of families pdc does not ship (tests/cli/held_out/), each
# beside the config.json of the model it claims to describe: every one passes `pdc validate`,
# and would fail only when run (a parity run, or a served request): `pdc bind` names the spec
# line that disagrees. The SSM state declared replicated and the MLA latent declared sharded
# pass a parity run at TP 1 too (Note [Head axes] in pdc/bind.py); the float32 OLMo-2 passes
# one in float32 and fails only in bfloat16, which its config's dtype gives away.
HELD_OUT = {
    "gemma2-kinds": "15:3: error: layer 1 has kind 'swa' and layer 0 kind 'swa', but the "
                    "config's layer_types says 'full_attention' and 'sliding_attention'",
    "cohere2-window": "15:19: error: param 'sliding_window' is 512, but the config's "
                      "sliding_window is 4096",
    "bamba-conv-width": "17:16: error: param 'conv_kernel' is 3, but the config's "
                        "mamba_d_conv is 4",
    "bamba-ssm-replicated": "43:11: error: component 'ssm' is replicated across TP, but its "
                            "axis 0 'mamba_heads' counts the config's mamba_n_heads (128), "
                            "which a TP engine shards: each rank keeps its own heads",
    "minicpm3-latent-sharded": "22:9: error: component 'kv_nope' is sharded on axis 1 "
                               "'kv_lora_rank', the config's kv_lora_rank (256), which counts "
                               "no heads: a TP engine keeps it whole on every rank",
    "olmo2-dtype": "7:3: error: dtype 'model' is float32, but the config's dtype is bfloat16",
    "phi3-head-dim": "12:13: error: param 'head_dim' is 64, but the config's hidden_size // "
                     "num_attention_heads is 3072 // 32 = 96",
    "gpt-neox-heads": "12:10: error: param 'heads' is 8, but the config's num_attention_heads "
                      "is 32",
}


@pytest.mark.parametrize("name", list(HELD_OUT))
def test_binding_catches_a_wrong_spec_that_validates(capsys, monkeypatch, name):
    monkeypatch.chdir(REPO)
    spec = f"tests/cli/held_out/{name}.yaml"
    rc, out, err = run(capsys, "validate", spec)
    assert (rc, out, err) == (0, "pdc validate: 1 spec ok\n", "")
    rc, out, err = run(capsys, "bind", spec, "--config", f"tests/cli/held_out/{name}.json",
                       "--engine-page-size", "16")
    assert (rc, out) == (1, "")
    assert err.splitlines()[0] == f"{spec}:{HELD_OUT[name]}"
    assert err.splitlines()[-1] == (f"pdc bind: 1 error; {spec} does not bind to "
                                    f"tests/cli/held_out/{name}.json")


def test_the_same_specs_made_right_bind(capsys, monkeypatch, tmp_path):
    """The check is about the mistake, not the family: with the disagreeing line fixed as its
    hint says, each held-out spec binds to its config."""
    monkeypatch.chdir(REPO)
    fixes = {"gemma2-kinds": ("[swa, swa, swa, swa, swa, attn]", "[swa, attn]"),
             "cohere2-window": ("sliding_window: 512", "sliding_window: 4096"),
             "bamba-conv-width": ("conv_kernel: 3", "conv_kernel: 4"),
             "bamba-ssm-replicated": ("tp: replicated", "tp: {shard: mamba_heads}"),
             "minicpm3-latent-sharded": ("tp: {shard: kv_lora_rank}", "tp: replicated"),
             "olmo2-dtype": ("model: float32", "model: bfloat16"),
             "phi3-head-dim": ("head_dim: 64", "head_dim: 96"),
             "gpt-neox-heads": ("heads: 8", "heads: 32")}
    assert fixes.keys() == HELD_OUT.keys()
    for name, (wrong, right) in fixes.items():
        text = (REPO / "tests/cli/held_out" / f"{name}.yaml").read_text()
        assert text.count(wrong) == 1, name
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(text.replace(wrong, right))
        rc, out, err = run(capsys, "bind", str(spec), "--config",
                           f"tests/cli/held_out/{name}.json", "--engine-page-size", "16",
                           "--tp", "2")
        assert (rc, err) == (0, ""), name
