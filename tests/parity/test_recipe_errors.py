"""A recipe or config mistake in a new family is one located line from `pdc parity`, never a
traceback (the MHA model whose recipe read num_key_value_heads)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from pdc.verify import hf_state as H  # noqa: E402
from pdc.verify.parity import ParityError, prepare  # noqa: E402
from pdc.verify.parity_workers import probe_error  # noqa: E402

SPECS = Path(__file__).resolve().parents[2] / "specs"
MHA = "the recipe of 'gpt_neox' (FAMILIES['gpt_neox'] in pdc/verify/hf_state.py), state " \
      "tensor 'k', reads config.num_key_value_heads, which GPTNeoXConfig does not have; " \
      "hint: name an attribute the config has (an MHA model has no num_key_value_heads: use " \
      "num_attention_heads)"


class GPTNeoXConfig(SimpleNamespace):
    """A config without num_key_value_heads, as an MHA model's is."""


def test_a_missing_config_attribute_names_the_recipe_and_the_fix():
    with pytest.raises(H.RecipeError) as e:
        H._config_attr(GPTNeoXConfig(num_attention_heads=4), "num_key_value_heads",
                       "gpt_neox", "k")
    assert str(e.value) == MHA
    assert H._prod(GPTNeoXConfig(a=2, b=3), ("a", "b"), "f", "t") == 6


def test_other_probe_failures_name_the_recipe_line():
    def recipe():
        return {}["num_key_value_heads"]  # a line of user code in pdc/verify

    try:
        recipe()
    except KeyError as e:
        line = probe_error(e, "gpt_neox")
    # this test file is not under pdc/verify/: no recipe line to name
    assert line == "the gpt_neox model failed to build or export its cache: KeyError: " \
                   "'num_key_value_heads'"
    assert probe_error(H.RecipeError(MHA), "gpt_neox") == MHA


class _Workers:
    """Stands in for the worker processes: their probe came back with a recipe error."""

    def probe(self, *args):
        return {"error": MHA}


def test_parity_refuses_the_case_with_the_recipe_error():
    with pytest.raises(ParityError) as e:
        prepare(str(SPECS / "hf-llama.yaml"), "tp=1", "tp=1", "mooncake", None, _Workers())
    assert str(e.value) == f"{SPECS / 'hf-llama.yaml'}: {MHA}"
