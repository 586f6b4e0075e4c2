"""A spec's `parity` block as the harness runs it (Note [Parity recipe] in
compiler/model_parity.py): the `Binding` the parent plans with and the transformers
`FamilyRecipe` a rank process builds its model from.

The parent reads both from the Spec it loaded; a rank process is given the Binding, which
names the spec by path, and reads the recipe from the spec file itself (`family_recipe`),
so no table in pdc's Python names a family. The spec is read by its absolute path and
reported under the path the user gave, so errors point at the user's file whatever the
worker's working directory.
"""

from __future__ import annotations

import os
from functools import lru_cache

from .hf_adapter import Binding
from .hf_state import FamilyRecipe, LayerRecipe, StateTensor


def binding_of(spec, spec_path: str) -> Binding | None:
    """The spec's Binding, or None when it has no `parity` block."""
    p = spec.parity
    if p is None:
        return None
    return Binding(spec_path, os.path.abspath(spec_path), p.kind, p.model, p.carry, p.dtype,
                   p.params, p.dp_attention, str(p.loc))


def family_recipe(binding: Binding) -> FamilyRecipe:
    """The transformers recipe of the spec the binding names (read once per file version)."""
    return _recipe(binding.spec_path, binding.path, os.stat(binding.path).st_mtime_ns)


@lru_cache(maxsize=32)
def _recipe(shown: str, path: str, mtime_ns: int) -> FamilyRecipe:
    from pdc.compiler.diagnostics import SpecErrors
    from pdc.compiler.frontend import parse_spec_text, read_spec_text

    from .hf_state import RecipeError

    text = read_spec_text(path, shown)
    try:
        if not isinstance(text, str):
            raise SpecErrors([text])
        spec = parse_spec_text(text, shown, deployments=False)
    except SpecErrors as e:  # the file changed under the run: say so, located
        d = e.diagnostics[0]
        raise RecipeError(str(d.loc), d.message, d.hint) from None
    p = spec.parity
    if p is None or p.kind != "transformers":
        raise RecipeError(shown, f"{shown} declares no transformers model in `parity`",
                          "the spec changed during the run; run pdc parity again")
    layers = tuple(
        (layer.type, LayerRecipe(layer.cache_class, tuple(
            StateTensor(t.name, t.attr, t.kind, t.token_axis, t.shard_axis, t.shard_size,
                        t.segments, t.dtype, str(t.loc)) for t in layer.tensors),
            layer.flags))
        for layer in p.layers)
    return FamilyRecipe(spec.family, p.config_class, p.model, p.config, layers, str(p.loc))


def load_binding(spec_path) -> Binding | None:
    """The Binding of the spec at `spec_path` (None without a `parity` block); raises the
    compiler's SpecErrors for a spec that does not load."""
    from pdc.compiler.frontend import load_spec

    return binding_of(load_spec(spec_path, deployments=False), str(spec_path))


def parity_specs(folder) -> dict[str, Binding]:
    """family -> Binding of every spec in `folder` with a `parity` block (pdc's own specs/
    in the tests)."""
    from pathlib import Path

    out = {}
    for path in sorted(Path(folder).glob("*.yaml")):
        b = load_binding(path)
        if b is not None:
            out[path.stem] = b
    return out
