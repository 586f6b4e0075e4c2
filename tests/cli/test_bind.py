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

# Eight deliberately wrong specs of families pdc does not ship, each with the config of the
# model it claims to describe: every one passes `pdc validate`, and would fail only when run
# (a parity run, or a served request); `pdc bind` names the spec line that disagrees.
HELD_OUT = {
    # name: (config, spec text, the error's message)
    "gemma2_kinds": (
        {"num_hidden_layers": 6, "layer_types": ["sliding_attention", "full_attention"] * 3},
        "params: {num_layers: 6, window: 4096}\n"
        "layers: {count: num_layers, pattern: [swa, swa, attn]}\n",
        "layer 1 has kind 'swa' and layer 0 kind 'swa', but the config's layer_types says "
        "'full_attention' and 'sliding_attention'"),
    "gemma2_window": (
        {"num_hidden_layers": 2, "sliding_window": 4096},
        "params: {num_layers: 2, window: 512}\nlayers: {count: num_layers, pattern: [swa]}\n",
        "param 'window' is 512, but the config's sliding_window is 4096"),
    "mamba2_conv_width": (
        {"num_hidden_layers": 2, "conv_kernel": 4},
        "params: {num_layers: 2, conv_kernel: 3}\nlayers: {count: num_layers, pattern: [ssm]}\n",
        "param 'conv_kernel' is 3, but the config's conv_kernel is 4"),
    "gdn_conv_width": (
        {"num_hidden_layers": 2, "linear_conv_kernel_dim": 4},
        "params: {num_layers: 2, conv_kernel: 3}\nlayers: {count: num_layers, pattern: [gdn]}\n",
        "param 'conv_kernel' is 3, but the config's linear_conv_kernel_dim is 4"),
    "mamba2_state_size": (
        {"num_hidden_layers": 2, "state_size": 128},
        "params: {num_layers: 2, state_size: 64}\nlayers: {count: num_layers, pattern: [ssm]}\n",
        "param 'state_size' is 64, but the config's state_size is 128"),
    "phi3_kv_heads": (
        {"num_hidden_layers": 2, "num_key_value_heads": 8},
        "params: {num_layers: 2, kv_heads: 32}\nlayers: {count: num_layers, pattern: [attn]}\n",
        "param 'kv_heads' is 32, but the config's num_key_value_heads is 8"),
    "olmo_layers": (
        {"num_hidden_layers": 16},
        "params: {num_layers: 12}\nlayers: {count: num_layers, pattern: [attn]}\n",
        "param 'num_layers' is 12, but the config's num_hidden_layers is 16"),
    "falcon_dtype": (  # caught by a parity run only in bfloat16 (float32 items, bf16 cache)
        {"num_hidden_layers": 2, "dtype": "bfloat16"},
        "params: {num_layers: 2}\nlayers: {count: num_layers, pattern: [attn]}\n",
        "dtype 'model' is float32, but the config's dtype is bfloat16"),
}
BODY = """\
dtypes: {model: float32}
components:
  state:
    layers: all
    index: slot
    item: {shape: [8], dtype: model}
    tp: replicated
"""


@pytest.mark.parametrize("name", list(HELD_OUT))
def test_binding_catches_a_wrong_spec_that_validates(capsys, config, tmp_path, name):
    data, head, message = HELD_OUT[name]
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(f"family: {name.replace('_', '-')}\n{head}{BODY}")
    rc, out, err = run(capsys, "validate", str(spec))
    assert (rc, out, err) == (0, "pdc validate: 1 spec ok\n", "")
    rc, out, err = run(capsys, "bind", str(spec), "--config", config(data))
    assert (rc, out) == (1, "")
    assert err.splitlines()[0].split(": error: ", 1)[1] == message
