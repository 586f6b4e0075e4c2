"""The model interface of the parity harness (Note [Parity models] in pdc/verify/__init__.py).

A `ParityModel` is built inside a rank process (it imports torch); the parent only names it
(the spec's `parity` block, read into a `Binding`). State is a flat dict of tensors named as pdc.verify.hf_adapter.state_key says
(`L{layer}.{name}` per layer, `R.{name}` for request-wide state), rows token-major (Note
[State layout] in pdc/verify/hf_state.py). Logits rows are what the judge compares bit for bit;
`token_of` says which token a row produces.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol


class ParityModel(Protocol):
    vocab_size: int

    def chunked_prefill(self, prompt, bounds):
        """Yield (cache, logits row of the chunk's last position) after each (start, end)."""

    def export_state(self, cache) -> dict: ...

    def export_flags(self, cache) -> dict[str, int]: ...

    def import_state(self, state: dict, seq_len: int):
        """A cache holding `state` after `seq_len` tokens, ready to decode."""

    def greedy_decode(self, cache, first_token: int, steps: int, dp=(1, 0)):
        """(tokens [steps], logits [steps, row]) of `steps` greedy steps. hf models feed
        `first_token`; the seed toys read it from their transferred aux row instead.
        `dp` = (DP ranks, the request's rank): a model with `dp_padding` runs each step as
        a batch padded with one idle row per other DP rank and trims it to the request."""

    def token_of(self, logits) -> int: ...

    def describe_state(self, state: dict) -> list[dict[str, Any]]: ...


class HfModel:
    """A transformers model of a pdc.verify.hf_state recipe behind the ParityModel
    interface."""

    dp_padding = False

    def __init__(self, recipe, dtype: str, seed: int = 0):
        import torch

        from pdc.verify import hf_state as H

        self.H, self.family = H, recipe
        self.model = H.build_model(recipe, getattr(torch, dtype), seed)
        self.vocab_size = int(self.model.config.vocab_size)

    def chunked_prefill(self, prompt, bounds):
        return self.H.chunked_prefill(self.model, prompt, bounds)

    def export_state(self, cache) -> dict:
        return self.H.export_state(self.family, self.model, cache)

    def export_flags(self, cache) -> dict[str, int]:
        return self.H.export_flags(self.family, self.model, cache)

    def import_state(self, state: dict, seq_len: int):
        return self.H.import_state(self.family, self.model, state, seq_len)

    def greedy_decode(self, cache, first_token: int, steps: int, dp=(1, 0)):
        return self.H.greedy_decode(self.model, cache, first_token, steps)

    def token_of(self, logits) -> int:
        return int(logits.argmax())

    def describe_state(self, state: dict) -> list[dict[str, Any]]:
        return self.H.describe_state(self.family, self.model, state)


def build(binding, layout, params: dict[str, int], dtype: str,
          seed: int = 0) -> ParityModel:
    """The model of a spec's `parity` block (`binding`, a pdc.verify.hf_adapter.Binding): a
    transformers model from the recipe in the spec file it names, or a toy of pdc.verify,
    whose `build(layout, params, dtype, seed)` makes it from the family's (scaled) layout and
    the spec's evaluated params."""
    if binding.kind == "transformers":
        from pdc.verify.recipe import family_recipe

        return HfModel(family_recipe(binding), dtype, seed)
    if binding.kind == "toy":
        return importlib.import_module(f"pdc.verify.{binding.model}").build(
            layout, params, dtype, seed)
    raise ValueError(f"unknown parity model kind '{binding.kind}'")
