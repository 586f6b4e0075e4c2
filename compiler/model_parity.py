"""The spec's `parity` block: how `pdc parity` runs the family on a tiny model.

Note [Parity recipe]: parity needs two pieces of data per family, and both are declared in
the spec, next to the components they check: the model (a tiny random-weight transformers
model, with its config values and what each cache layer type holds, or a toy of pdc.verify
for the seed systems) and `carry`, which state tensor of that model each component tensor
moves. The compiler only models and cross-checks the block (every name it uses is one the
spec declares, located errors like the rest of the spec); pdc/verify interprets it, in the
parent and in every rank process, which load it from the spec's path. Nothing of the block
reaches generated code, and it is left out of the spec hash (Note [Spec hash]): the harness
that checks a family is not part of its identity on the wire, so a recipe may change without
a recompile and without two engines refusing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .diagnostics import Diagnostics, Location
from .yaml_loader import Located


@dataclass(frozen=True, slots=True)
class ParityTensor:
    """One state tensor of a cache layer type (pdc.verify.hf_state.StateTensor)."""

    name: str
    attr: str
    kind: str  # "token" | "window" | "slot"
    token_axis: int | None
    shard_axis: int | None
    shard_size: str | None  # config attribute counting the axis's heads
    segments: tuple[tuple[str, tuple[str, ...]], ...]
    dtype: str  # "model" or a fixed dtype
    loc: Location  # where config attributes are named (the shard), else the tensor


@dataclass(frozen=True, slots=True)
class ParityLayer:
    type: str  # the config's layer type ("full_attention")
    cache_class: str
    tensors: tuple[ParityTensor, ...]
    flags: tuple[tuple[str, str], ...]  # (attribute path, "seq_len" | "true")
    loc: Location


@dataclass(frozen=True, slots=True)
class Parity:
    kind: str  # "transformers" | "toy"
    model: str  # the transformers model class, or the pdc.verify module of a toy
    config_class: str  # "" for a toy
    config: tuple[tuple[str, Any], ...]
    layers: tuple[ParityLayer, ...]
    carry: tuple[tuple[str, str, str], ...]  # (component, tensor, state tensor)
    params: tuple[tuple[str, int], ...]
    dtype: str
    dp_attention: bool
    loc: Location


def build_parity(doc: Located, raw: dict, params: set[str], dtypes: set[str],
                 tensors: dict[str, tuple[str, ...]], diags: Diagnostics) -> Parity | None:
    """Model a shape-valid `parity` block against the spec's params, dtypes and components
    (`tensors`: component -> its tensor names)."""
    base = ("parity",)
    if ("transformers" in raw) == ("toy" in raw):
        diags.error(doc.loc(base), "the `parity` block names "
                    + ("both `transformers` and `toy`" if "toy" in raw else "no model"),
                    "give `transformers: {model: CLASS, config: CLASS}` with `config` and "
                    "`cache`, or `toy: MODULE` (a model of pdc.verify)")
        return None
    hf = "transformers" in raw
    for key in ("config", "cache"):
        if hf and key not in raw:
            diags.error(doc.loc(base), f"the `parity` block of a transformers model has no "
                        f"`{key}`", "give the tiny model's `config` values and what each "
                        "`cache` layer type holds")
        if not hf and key in raw:
            diags.error(doc.key_loc(base + (key,)), f"`parity.{key}` is for a transformers "
                        "model; a toy builds itself from the spec's layout",
                        f"remove `{key}`")
    if hf and ("config" not in raw or "cache" not in raw):
        return None
    for name in raw.get("params", {}):
        if name not in params:
            diags.error(doc.key_loc(base + ("params", name)), f"`parity.params` names "
                        f"'{name}', which the spec's `params` does not declare",
                        f"declared params: {', '.join(sorted(params))}")
    dtype = raw.get("dtype", "model")
    if "dtype" in raw and dtype not in dtypes:
        diags.error(doc.loc(base + ("dtype",)), f"`parity.dtype` names '{dtype}', which the "
                    "spec's `dtypes` does not declare",
                    "name the `dtypes` entry `pdc parity --dtype` sets (usually `model`)")
    layers = tuple(_layer(doc, typ, layer, base + ("cache", typ))
                   for typ, layer in raw.get("cache", {}).items())
    state = {t.name for layer in layers for t in layer.tensors}
    carry = []
    for comp, rows in raw["carry"].items():
        if comp not in tensors:
            diags.error(doc.key_loc(base + ("carry", comp)), f"`parity.carry` names "
                        f"component '{comp}', which the spec does not declare",
                        f"components: {', '.join(tensors)}")
            continue
        for tensor, name in rows.items():
            if tensor not in tensors[comp]:
                diags.error(doc.key_loc(base + ("carry", comp, tensor)), f"component "
                            f"'{comp}' has no tensor '{tensor}'",
                            f"its tensors: {', '.join(tensors[comp])}")
            elif hf and name not in state:
                diags.error(doc.loc(base + ("carry", comp, tensor)), f"`parity.carry` binds "
                            f"{comp}.{tensor} to state tensor '{name}', which no `cache` "
                            "layer type holds", f"state tensors: {', '.join(sorted(state))}")
            else:
                carry.append((comp, tensor, name))
    model = raw["transformers"]["model"] if hf else raw["toy"]
    return Parity("transformers" if hf else "toy", model,
                  raw["transformers"]["config"] if hf else "",
                  tuple(raw.get("config", {}).items()), layers, tuple(carry),
                  tuple(raw.get("params", {}).items()), dtype,
                  bool(raw.get("dp_attention", False)), doc.key_loc(base))


def _named_attrs(where: tuple, shard: dict | None) -> tuple:
    """The path of what names config attributes (a RecipeError points there)."""
    if not shard:
        return where
    return where + ("shard", "size" if "size" in shard else "segments")


def _layer(doc: Located, typ: str, raw: dict, path: tuple) -> ParityLayer:
    tensors = []
    for name, t in raw["tensors"].items():
        shard = t.get("shard")
        where = path + ("tensors", name)
        tensors.append(ParityTensor(
            name, t["attr"], t["kind"], t.get("token_axis"),
            shard["axis"] if shard else None, shard.get("size") if shard else None,
            tuple((label, tuple(attrs)) for label, attrs in shard.get("segments", {}).items())
            if shard else (),
            t.get("dtype", "model"), doc.loc(_named_attrs(where, shard))))
    flags = tuple((attr, "true" if value is True else value)
                  for attr, value in raw.get("flags", {}).items())
    return ParityLayer(typ, raw["class"], tuple(tensors), flags, doc.key_loc(path))
