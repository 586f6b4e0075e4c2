"""Model-side half of pdc's parity harness: tiny random-weight transformers models whose cache is
exported as a flat dict of named per-layer tensors (the "state") and rebuilt in another process.

Pinned to transformers 5.24 (every model returns one `DynamicCache` whose `.layers[i]` class comes
from `config.layer_types`); see docs/hf-state.md for the anatomy of each family's cache.

Note [State layout]: names are `L{layer}.{tensor}`, the batch dim (always 1) is dropped, and
token-indexed tensors are token-major, `[T, heads, dim]`: row t is one token, which is what a
paged pool stores (a page = page_size consecutive rows). Per-request tensors (`SLOT`) keep the
layout of the cache minus the batch dim. A `WINDOW` tensor holds exactly what the sliding cache
holds: the last `min(seq_len, sliding_window - 1)` tokens, oldest first; row j is the token at
absolute position `seq_len - rows + j`. Keys are stored after RoPE, so a row is only valid at the
absolute position it was computed for; the absolute count travels as `seq_len`.

Note [Flags]: besides tensors, some layers carry scalars the model reads while decoding
(`cumulative_length` of sliding layers feeds positions and the mask offset; `has_previous_state`
of linear layers selects the decode path over the prefill path). They are not state tensors:
`import_state` derives them from `seq_len`, and `export_flags` reads them back for comparison.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Kinds of state tensor (what a pdc spec needs to know to place it).
TOKEN = "token"  # one row per token, grows with the sequence: lives in paged KV pools
WINDOW = "window"  # one row per token, but only the last sliding_window - 1 are kept
SLOT = "slot"  # fixed shape per request, overwritten in place each step

# Where a flag's value comes from on import.
FROM_SEQ_LEN = "seq_len"
TRUE = "true"


@dataclass(frozen=True)
class StateTensor:
    """One named state tensor of a cache layer.

    attr: attribute path on the transformers cache layer: `keys`, or `conv_states[0]` for a
        dict-held state (index = state_idx).
    token_axis: axis of the token dim in the cache tensor (batch included); moved to the front on
        export. None for SLOT tensors.
    shard_axis: axis of the EXPORTED tensor a tensor-parallel engine splits; None = replicated.
    shard_size: config attribute giving the size of shard_axis when it is a plain head axis.
    segments: when shard_axis is a concatenation of separately sharded sections (conv channels),
        (label, config attributes whose product is that section's size), in order. The first
        attribute counts the section's shard units (heads or groups), the rest size one unit.
    dtype: "model" (the model's dtype) or a fixed torch dtype name (recurrent states stay fp32).
    loc: the spec line that declares it (`file:line:col`), for errors.
    """

    name: str
    attr: str
    kind: str
    token_axis: int | None = None
    shard_axis: int | None = None
    shard_size: str | None = None
    segments: tuple[tuple[str, tuple[str, ...]], ...] = ()
    dtype: str = "model"
    loc: str = ""


@dataclass(frozen=True)
class LayerRecipe:
    cache_class: str  # transformers cache layer class expected for this layer kind
    tensors: tuple[StateTensor, ...]
    flags: tuple[tuple[str, str], ...] = ()  # (attribute path, FROM_SEQ_LEN | TRUE)


@dataclass(frozen=True)
class FamilyRecipe:
    """A transformers model and its cache, as a spec's `parity` block declares them (Note
    [Parity recipe] in compiler/model_parity.py; pdc.verify.recipe reads it)."""

    name: str  # the spec's family, for messages
    config_class: str
    model_class: str
    config_kwargs: tuple[tuple[str, Any], ...]
    layers: tuple[tuple[str, LayerRecipe], ...]  # (config layer type, its recipe)
    loc: str = ""  # the spec's `parity` block (`file:line:col`), for errors

    def layer(self, kind: str) -> LayerRecipe | None:
        return next((r for k, r in self.layers if k == kind), None)


# --------------------------------------------------------------------------- models


def _tf():
    import transformers

    return transformers


def make_config(recipe: FamilyRecipe):
    return getattr(_tf(), recipe.config_class)(**dict(recipe.config_kwargs))


def build_model(recipe: FamilyRecipe, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Random-weight model: init in float32 under `seed`, then cast (same bits in any process)."""
    config = make_config(recipe)
    torch.manual_seed(seed)
    model = getattr(_tf(), recipe.model_class)(config)
    return model.to(dtype).eval()


def layer_kinds(model) -> list[str]:
    """Per-layer cache kind, resolved exactly as `DynamicCache(config=...)` resolves it."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    return get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0]


def _layer_recipes(recipe: FamilyRecipe, model):
    kinds = layer_kinds(model)
    missing = sorted(set(kinds) - {k for k, _ in recipe.layers})
    if missing:
        raise RecipeError(recipe.loc, f"the parity recipe of '{recipe.name}' has no "
                          f"`cache` entry for the model's layer types {missing}",
                          "add one per config layer type (config.layer_types)")
    return [recipe.layer(k) for k in kinds]


# --------------------------------------------------------------------------- running


def _step(model, ids: torch.Tensor, cache):
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].clone(), out.cache


def prefill_logits(model, prompt_ids: torch.Tensor):
    """Prefill `prompt_ids` ([T] or [1, T]); returns (cache, logits of the last position [V])."""
    logits, cache = _step(model, prompt_ids.view(1, -1), None)
    return cache, logits


def prefill(model, prompt_ids: torch.Tensor):
    return prefill_logits(model, prompt_ids)[0]


def chunked_prefill(model, prompt_ids: torch.Tensor, bounds):
    """Chunked prefill: one forward per (start, end) token range of `bounds`, in order, on one
    cache. Yields (cache, logits of the chunk's last position [V]) after each chunk. With one
    chunk covering the prompt it is `prefill_logits`; more chunks are a different computation
    (other GEMM shapes), not bitwise equal to one forward."""
    ids = prompt_ids.view(-1)
    cache = None
    for start, end in bounds:
        logits, cache = _step(model, ids[start:end].view(1, -1), cache)
        yield cache, logits


def greedy_decode(model, cache, first_token: int | torch.Tensor, steps: int):
    """Feed `first_token`, then `steps - 1` argmax tokens. Returns (tokens [steps], logits
    [steps, V]) where tokens[i] = argmax(logits[i]) is the token produced by step i. The cache is
    updated in place."""
    tok = torch.as_tensor(first_token, dtype=torch.long).view(1, 1)
    tokens, logits = [], []
    for _ in range(steps):
        step_logits, cache = _step(model, tok, cache)
        tok = step_logits.argmax(-1).view(1, 1)
        tokens.append(tok.view(()))
        logits.append(step_logits)
    return torch.stack(tokens), torch.stack(logits)


def aggregate_generate(model, prompt: torch.Tensor, steps: int):
    """Single-process reference: `steps` new tokens (the first from the prefill logits). Returns
    (tokens [steps], logits [steps, V]); row 0 is the prefill, row i >= 1 decode step i."""
    cache, logits0 = prefill_logits(model, prompt)
    tok0 = logits0.argmax(-1)
    toks, logits = greedy_decode(model, cache, tok0, steps - 1)
    return torch.cat([tok0.view(1), toks]), torch.cat([logits0[None], logits])


# --------------------------------------------------------------------------- state


_INDEXED = re.compile(r"^(\w+)\[(\d+)\]$")


def _get(obj, path: str):
    m = _INDEXED.match(path)
    return getattr(obj, m[1])[int(m[2])] if m else getattr(obj, path)


def _set(obj, path: str, value) -> None:
    m = _INDEXED.match(path)
    if m:
        getattr(obj, m[1])[int(m[2])] = value
    else:
        setattr(obj, path, value)


def _check_class(i: int, layer, recipe: LayerRecipe) -> None:
    if type(layer).__name__ != recipe.cache_class:
        raise TypeError(f"layer {i}: cache holds {type(layer).__name__}, recipe {recipe.cache_class}")


def export_state(recipe: FamilyRecipe, model, cache) -> dict[str, torch.Tensor]:
    """Flat dict `L{i}.{name}` -> tensor (batch dim dropped, token-indexed ones token-major)."""
    state = {}
    for i, (layer, lr) in enumerate(zip(cache.layers, _layer_recipes(recipe, model),
                                         strict=True)):
        _check_class(i, layer, lr)
        for spec in lr.tensors:
            x = _get(layer, spec.attr)
            if x.shape[0] != 1:
                raise ValueError(f"L{i}.{spec.name}: batch {x.shape[0]}, only batch 1 is supported")
            x = x[0]
            if spec.token_axis is not None:
                x = x.movedim(spec.token_axis - 1, 0)
            state[f"L{i}.{spec.name}"] = x.contiguous().clone()
    return state


def export_flags(recipe: FamilyRecipe, model, cache) -> dict[str, int]:
    """The scalar flags the recipe restores, as read from `cache` (e.g. `L0.cumulative_length`)."""
    flags = {}
    for i, (layer, lr) in enumerate(zip(cache.layers, _layer_recipes(recipe, model),
                                         strict=True)):
        for path, _ in lr.flags:
            flags[f"L{i}.{path}"] = int(_get(layer, path))
    return flags


def _expected_rows(spec: StateTensor, layer, seq_len: int) -> int | None:
    if spec.kind == TOKEN:
        return seq_len
    if spec.kind == WINDOW:
        return min(seq_len, layer.sliding_window - 1)
    return None


def import_state(recipe: FamilyRecipe, model, state: dict[str, torch.Tensor], seq_len: int):
    """Build a fresh `DynamicCache` holding `state` after `seq_len` tokens, ready to decode."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model_dtype = next(model.parameters()).dtype
    used = set()
    for i, (layer, lr) in enumerate(zip(cache.layers, _layer_recipes(recipe, model),
                                         strict=True)):
        _check_class(i, layer, lr)
        pair = {}
        # Dict-held (linear) states first: in hybrid layer classes the attention lazy-init would
        # otherwise set the shared `.device` and the linear one would then leave `.dtype` unset.
        for spec in sorted(lr.tensors, key=lambda s: _INDEXED.match(s.attr) is None):
            key = f"L{i}.{spec.name}"
            x = state[key]
            used.add(key)
            want = model_dtype if spec.dtype == "model" else getattr(torch, spec.dtype)
            if x.dtype != want:
                raise TypeError(f"{key}: dtype {x.dtype}, expected {want}")
            rows = _expected_rows(spec, layer, seq_len)
            if rows is not None and x.shape[0] != rows:
                raise ValueError(f"{key}: {x.shape[0]} token rows, expected {rows} at {seq_len=}")
            if spec.token_axis is not None:
                x = x.movedim(0, spec.token_axis - 1)
            x = x.unsqueeze(0).contiguous().clone()
            m = _INDEXED.match(spec.attr)
            if m:  # conv_states[i] / recurrent_states[i]: allocate via lazy init, then fill
                layer.lazy_initialization(**{m[1]: x, "state_idx": int(m[2])})
                _get(layer, spec.attr).copy_(x)
            else:
                pair[spec.attr] = x
        if pair:
            keys, values = pair["keys"], pair["values"]
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        for path, source in lr.flags:
            _set(layer, path, seq_len if source == FROM_SEQ_LEN else True)
    extra = sorted(set(state) - used)
    if extra:
        raise KeyError(f"{recipe.name}: state has tensors no layer recipe consumes: {extra}")
    return cache


def describe_state(recipe: FamilyRecipe, model,
                   state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """One row per state tensor: name, shape, dtype, kind, shard axis/size, segment sizes and
    segment units (how many heads or groups a TP engine shards each segment into)."""
    config = model.config
    rows = []
    for i, lr in enumerate(_layer_recipes(recipe, model)):
        for spec in lr.tensors:
            x = state[f"L{i}.{spec.name}"]
            rows.append(
                dict(
                    name=f"L{i}.{spec.name}", shape=tuple(x.shape), dtype=str(x.dtype)[6:],
                    kind=spec.kind, attr=spec.attr, shard_axis=spec.shard_axis,
                    shard_size=(_config_attr(config, spec.shard_size, recipe, spec)
                                if spec.shard_size else None),
                    segments=[(label, _prod(config, attrs, recipe, spec))
                              for label, attrs in spec.segments],
                    segment_units=[_config_attr(config, attrs[0], recipe, spec)
                                   for _, attrs in spec.segments],
                )
            )
    return rows


class RecipeError(ValueError):
    """A parity recipe that does not fit its model's config: a user's mistake, reported by
    `pdc parity` as one line naming the spec line, never as a traceback. `loc` is the spec
    line (`file:line:col`), `message` and `hint` the rest."""

    def __init__(self, loc: str, message: str, hint: str = ""):
        super().__init__(f"{loc}: error: {message}" + (f"; hint: {hint}" if hint else ""))
        self.loc, self.message, self.hint = loc, message, hint


def _config_attr(config, attr: str, recipe: FamilyRecipe, tensor: StateTensor) -> int:
    if not hasattr(config, attr):
        raise RecipeError(
            tensor.loc or recipe.loc,
            f"the parity recipe of '{recipe.name}', state tensor '{tensor.name}', reads "
            f"config.{attr}, which {type(config).__name__} does not have",
            "name an attribute the config has (an MHA model has no num_key_value_heads: use "
            "num_attention_heads)")
    return getattr(config, attr)


def _prod(config, attrs: tuple[str, ...], recipe: FamilyRecipe, tensor: StateTensor) -> int:
    n = 1
    for a in attrs:
        n *= _config_attr(config, a, recipe, tensor)
    return n


# --------------------------------------------------------------------------- bytes

# Wire format: u64 little-endian header length, JSON header [[name, dtype, shape], ...], then the
# raw little-endian tensor bytes back to back in header order. No pickle of torch objects.


def state_to_bytes(state: dict[str, torch.Tensor]) -> bytes:
    header, blobs = [], []
    for name, t in state.items():
        header.append([name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        blobs.append(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def state_from_bytes(buf: bytes) -> dict[str, torch.Tensor]:
    (n,) = struct.unpack_from("<Q", buf)
    offset, state = 8 + n, {}
    for name, dtype_name, shape in json.loads(buf[8 : 8 + n]):
        dtype = getattr(torch, dtype_name)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=offset).copy()
        state[name] = torch.from_numpy(raw).view(dtype).reshape(shape)
        offset += nbytes
    if offset != len(buf):
        raise ValueError(f"{len(buf) - offset} trailing bytes")
    return state


def decode_from_payload(
    recipe: FamilyRecipe, dtype_name: str, payload: bytes, seq_len: int, first_token: int, steps: int,
    seed: int = 0, threads: int | None = None,
) -> bytes:
    """Decode-process entry point: fresh model (same family/dtype/seed), rebuild the cache from
    serialized state, greedy-decode `steps` steps. Returns serialized {tokens, logits, flags}."""
    if threads:
        torch.set_num_threads(threads)
    model = build_model(recipe, getattr(torch, dtype_name), seed)
    cache = import_state(recipe, model, state_from_bytes(payload), seq_len)
    flags = export_flags(recipe, model, cache)
    tokens, logits = greedy_decode(model, cache, first_token, steps)
    out = {"tokens": tokens, "logits": logits}
    out.update({f"flag:{k}": torch.tensor(v) for k, v in flags.items()})
    return state_to_bytes(out)
