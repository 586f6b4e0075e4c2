"""The parity recipe declared in the spec (Note [Parity recipe] in compiler/model_parity.py):
a user's spec of an architecture pdc does not ship runs `pdc parity` from a folder of the
user's own with no pdc file edited, and a recipe or config mistake is one line naming the spec
line, never a traceback (the MHA model whose recipe read num_key_value_heads)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from pdc.compiler.diagnostics import SpecErrors
from pdc.compiler.frontend import parse_spec_text

from pdc.cli import main

pytest.importorskip("transformers")

from pdc.verify import hf_state as H  # noqa: E402
from pdc.verify.parity import ParityError, prepare  # noqa: E402
from pdc.verify.parity_workers import probe_error  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SPECS = REPO / "specs"
OK = "parity   OK: tokens and logits of all 10 steps bitwise equal to single-process generation"

# GPT-NeoX: MHA (no num_key_value_heads in its config), a family pdc does not ship.
GPT_NEOX = """\
family: my-gpt-neox
serves: {engine: transformers, architectures: [GPTNeoXForCausalLM]}
dtypes:
  model: {from: engine.kv_dtype, example: float32}
params:
  num_layers: {from: config.num_hidden_layers, example: 2}
  page_size: {from: engine.page_size, example: 4}
  hidden_size: {from: config.hidden_size, example: 64}
  heads: {from: config.num_attention_heads, example: 4}
  head_dim: hidden_size // heads
layers: {count: num_layers, pattern: [attn]}
components:
  kv:
    why: paged MHA KV, sharded by head
    layers: all
    index: page
    tensors: [k, v]
    item: {shape: [page_size, heads, head_dim], dtype: model}
    tp: {shard: heads}
parity:
  transformers: {model: GPTNeoXForCausalLM, config: GPTNeoXConfig}
  config: {vocab_size: 256, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
           intermediate_size: 128, max_position_embeddings: 256, bos_token_id: 1,
           eos_token_id: 2, pad_token_id: 0}
  cache:
    full_attention:
      class: DynamicLayer
      tensors:
        k: {attr: keys, kind: token, token_axis: 2, shard: {axis: 1, size: num_attention_heads}}
        v: {attr: values, kind: token, token_axis: 2, shard: {axis: 1, size: num_attention_heads}}
  carry:
    kv: {k: k, v: v}
"""
# The guide's first recipe, copied from a GQA model: GPTNeoXConfig has no num_key_value_heads.
WRONG = GPT_NEOX.replace("k: {attr: keys, kind: token, token_axis: 2, shard: {axis: 1, size: "
                         "num_attention_heads}}", "k: {attr: keys, kind: token, token_axis: 2, "
                         "shard: {axis: 1, size: num_key_value_heads}}")
MHA = ("the parity recipe of 'my-gpt-neox', state tensor 'k', reads config.num_key_value_heads, "
       "which GPTNeoXConfig does not have")
HINT = ("name an attribute the config has (an MHA model has no num_key_value_heads: use "
        "num_attention_heads)")


def test_a_user_spec_of_an_architecture_pdc_does_not_ship_passes_parity(capsys, tmp_path,
                                                                         monkeypatch):
    """From a folder named by PDC_SPEC_PATH, outside pdc's package: the model, its cache and
    what each component carries are the spec's; a wrong recipe in a second spec of the same
    run is refused with the spec line that names the missing attribute. One set of worker
    processes runs both."""
    folder = tmp_path / "my-specs"
    folder.mkdir()
    (folder / "gpt-neox.yaml").write_text(GPT_NEOX)
    (folder / "gpt-neox-wrong.yaml").write_text(WRONG)
    monkeypatch.setenv("PDC_SPEC_PATH", str(folder))
    monkeypatch.chdir(tmp_path)
    before = sorted(p.relative_to(REPO) for p in (REPO / "generated").rglob("*.py"))
    rc = main(["parity", "my-specs/gpt-neox.yaml", "my-specs/gpt-neox-wrong.yaml",
               "--prefill", "tp=2"])
    out, err = capsys.readouterr()
    assert rc == 1  # the wrong one fails; the right one reached parity
    assert "Traceback" not in out + err
    assert out.splitlines()[0] == "pdc parity: my-gpt-neox (GPTNeoXForCausalLM, float32)"
    assert f"  {OK}\n" in out
    assert "  state    4 tensors, 20480 bytes received by 1 decode rank(s)" in out
    # the error names the line of the wrong tensor's shard, in the user's file
    assert err.splitlines()[-1] == f"my-specs/gpt-neox-wrong.yaml:29:76: error: {MHA}; hint: {HINT}"
    assert WRONG.splitlines()[28][75:] == "num_key_value_heads}}"
    # nothing was compiled into pdc's package
    assert sorted(p.relative_to(REPO) for p in (REPO / "generated").rglob("*.py")) == before


@pytest.mark.parametrize(("old", "new", "message"), [
    ("    kv: {k: k, v: v}", "    kv: {k: k, v: value}",
     "32:19: error: `parity.carry` binds kv.v to state tensor 'value', which no `cache` layer "
     "type holds"),
    ("    kv: {k: k, v: v}", "    kv: {k: k, w: v}",
     "32:16: error: component 'kv' has no tensor 'w'"),
    ("    kv: {k: k, v: v}", "    kv: {k: k, v: v}\n    gdn: {data: conv}",
     "33:5: error: `parity.carry` names component 'gdn', which the spec does not declare"),
    ("parity:\n", "parity:\n  toy: seed_x\n",
     "21:3: error: the `parity` block names both `transformers` and `toy`"),
    ("kind: token, token_axis: 2, shard: {axis: 1, size: num_attention_heads}}\n        v",
     "kind: tokens, token_axis: 2, shard: {axis: 1, size: num_attention_heads}}\n        v",
     "29:31: error: 'parity.cache.full_attention.tensors.k.kind' is 'tokens', not one of "
     "token, window, slot"),
])
def test_a_wrong_recipe_is_a_located_validation_error(old, new, message):
    """What the spec alone shows is refused by `pdc validate`, like any spec error."""
    assert GPT_NEOX.count(old) == 1
    text = GPT_NEOX.replace(old, new)
    with pytest.raises(SpecErrors) as e:
        parse_spec_text(text, "gpt-neox.yaml")
    assert e.value.diagnostics[0].render().splitlines()[0] == f"gpt-neox.yaml:{message}"


class GPTNeoXConfig(SimpleNamespace):
    """A config without num_key_value_heads, as an MHA model's is."""


def test_a_missing_config_attribute_names_the_spec_line_and_the_fix():
    recipe = H.FamilyRecipe("my-gpt-neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", (), (),
                            "gpt-neox.yaml:20:1")
    tensor = H.StateTensor("k", "keys", H.TOKEN, 2, 1, "num_key_value_heads",
                           loc="gpt-neox.yaml:29:76")
    with pytest.raises(H.RecipeError) as e:
        H._config_attr(GPTNeoXConfig(num_attention_heads=4), "num_key_value_heads", recipe,
                       tensor)
    assert str(e.value) == f"gpt-neox.yaml:29:76: error: {MHA}; hint: {HINT}"
    assert H._prod(GPTNeoXConfig(a=2, b=3), ("a", "b"), recipe, tensor) == 6


def test_other_probe_failures_name_the_recipe_line():
    def recipe():
        return {}["num_key_value_heads"]  # a line of user code in pdc/verify

    try:
        recipe()
    except KeyError as e:
        line = probe_error(e, "GPTNeoXForCausalLM")
    # this test file is not under pdc/verify/: no recipe line to name
    assert line == "the GPTNeoXForCausalLM model failed to build or export its cache: " \
                   "KeyError: 'num_key_value_heads'"


class _Workers:
    """Stands in for the worker processes: their probe came back with a recipe error."""

    def probe(self, *args):
        return {"error": f"gpt-neox.yaml:29:76: error: {MHA}; hint: {HINT}",
                "located": ("gpt-neox.yaml:29:76", MHA, HINT)}


def test_parity_refuses_the_case_with_the_located_recipe_error():
    with pytest.raises(ParityError) as e:
        prepare(str(SPECS / "hf-llama.yaml"), "tp=1", "tp=1", "mooncake", None, _Workers())
    assert str(e.value) == f"gpt-neox.yaml:29:76: error: {MHA}; hint: {HINT}"
    [d] = e.value.diagnostics
    assert (str(d.loc), d.message, d.hint) == ("gpt-neox.yaml:29:76", MHA, HINT)
