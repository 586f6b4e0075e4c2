"""Adapter between a transformers cache state (pdc.verify.hf_state) and a spec's pools.

Note [HF bindings]: which state tensor a spec component carries is DATA, declared in the
spec's `parity` block (Note [Parity recipe] in compiler/model_parity.py) and read into a
`Binding`: the model that runs it and rows (component, tensor, hf_state tensor name). Nothing else is per family: where the bytes go
follows from the component's index kind, and how they are cut across attention-TP ranks
from its shard geometry (runtime.labels.project, Note [Shard ownership]) and merged back
(runtime.labels.merge). Global layer id i of a component carries hf_state's `L{i}.{name}`.
A new family needs a spec with a `parity` block and no Python; `check_binding` says what
disagrees when the spec and the model do not fit.

Layout rules by index kind (state tensor rows are token-major, Note [State layout] in
pdc.verify.hf_state):
- page: row t of `[T, ...]` is row t % page_size of the page at position t // page_size;
  item shape `[page_size, ...]`. The last page is partial; its rows from T on are not state.
- window: the `min(T, W)` rows of the last W tokens, at their absolute positions, in the
  pages of positions window_first_page(T, W, page_size) .. n_pages - 1 (the window's pages);
  rows of those pages before position T - min(T, W) are not state.
- slot: the tensor is the item, shape for shape.
- ring: `[R, ...]`, row j is ring row j (the position ≡ j mod R); items ring_slot * R + j.
- aux: the tensor is the aux row.

A page-indexed item of fewer rows than the page size (QSA compressed K: page_size // ratio
rows) holds one row per `page_size // rows` tokens; the tensor has one row per complete group
of tokens. Request-wide components (`layers: request`) carry `R.{name}` instead of
`L{i}.{name}`, under their sentinel in the plan.

This module is imported by the parent without torch (the tables and `check_binding`);
the conversions import torch when called, inside rank processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdc.runtime.indices import pages_of, window_first_page
from pdc.runtime.layout_types import ComponentLayout, FamilyLayout


@dataclass(frozen=True)
class Binding:
    """A spec's `parity` block as the parent plans with it (pdc.verify.recipe.binding_of).
    Rank processes read the model's recipe from the spec file it names."""

    spec_path: str  # as the user gave it (errors name it)
    path: str  # absolute, for processes with another working directory
    kind: str  # "transformers" | "toy"
    model: str  # the transformers model class, or the pdc.verify module of a toy
    tensors: tuple[tuple[str, str, str], ...]  # (component, tensor, hf_state tensor name)
    dtype_name: str = "model"  # the spec's `dtypes` name that `pdc parity --dtype` sets
    # Param overrides the toy runs under by default: the spec's own sizes, scaled down
    # (`pdc parity --param NAME=VALUE` overrides them in turn).
    params: tuple[tuple[str, int], ...] = ()
    dp_attention: bool = False  # the model pads a decode DP batch (decode dp > 1 allowed)
    loc: str = ""  # the spec's `parity` block, for errors

    def hf_name(self, component: str, tensor: str) -> str | None:
        for c, t, name in self.tensors:
            if (c, t) == (component, tensor):
                return name
        return None


# hf_state tensor kind each index kind carries.
_KIND_OF_INDEX = {"page": "token", "window": "window", "slot": "slot", "ring": "ring",
                  "aux": "aux"}


def state_key(layer_id: int, hf_name: str, comp: ComponentLayout | None = None) -> str:
    """`L{layer}.{name}`, or `R.{name}` for a request-wide component (layer_id: sentinel)."""
    if comp is not None and comp.request_wide:
        return f"R.{hf_name}"
    return f"L{layer_id}.{hf_name}"


def bound_entries(layout: FamilyLayout, binding: Binding):
    """(component, tensor, layer id, hf_state key) of every state tensor the spec moves."""
    for c in layout.components:
        for t in c.tensors:
            name = binding.hf_name(c.name, t)
            if name is None:
                continue
            if c.request_wide:
                yield c, t, c.sentinel, state_key(c.sentinel, name, c)
                continue
            for i in c.layer_ids:
                yield c, t, i, state_key(i, name)


# ~~~ positions of a request's items ~~~


def positions(comp: ComponentLayout, seq_len: int, page_size: int) -> list[int]:
    """Positions within the request of the items that hold `comp` (pages: absolute page
    positions; slot: [0])."""
    n = pages_of(seq_len, page_size)
    if comp.index == "page":
        return list(range(n))
    if comp.index == "window":
        return list(range(window_first_page(seq_len, comp.window_tokens, page_size), n))
    if comp.index in ("slot", "aux"):
        return [0]
    if comp.index == "ring":
        return list(range(comp.ring_rows))
    raise ValueError(f"component '{comp.name}': no hf_state rule for index '{comp.index}'")


def item_ids(comp: ComponentLayout, ids: dict) -> np.ndarray:
    """Pool ids of a request's items of `comp`, in the order of `positions`."""
    if comp.index == "page":
        return np.asarray(ids["pages"], np.int64)
    if comp.index == "window":
        return np.asarray(ids["window"], np.int64)
    if comp.index == "slot":
        return np.array([ids["slot"]], np.int64)
    if comp.index == "aux":
        return np.array([ids["aux"]], np.int64)
    if comp.index == "ring":
        return ids["ring"] * comp.ring_rows + np.arange(comp.ring_rows, dtype=np.int64)
    raise ValueError(f"component '{comp.name}': no hf_state rule for index '{comp.index}'")


def tokens_per_row(comp: ComponentLayout, page_size: int) -> int:
    """Tokens one row of a page-indexed item stands for (1 for KV; the compress ratio for a
    compressed page of page_size // ratio rows)."""
    return page_size // comp.shape[0]


def _window_rows(comp: ComponentLayout, seq_len: int, page_size: int) -> tuple[int, int]:
    """(first row, end row) of the state within the window pages' rows."""
    first = window_first_page(seq_len, comp.window_tokens, page_size) * page_size
    rows = min(seq_len, comp.window_tokens)
    return seq_len - rows - first, seq_len - first


# ~~~ state tensor <-> items (inside rank processes; torch) ~~~


def to_items(comp: ComponentLayout, x, seq_len: int, page_size: int) -> np.ndarray:
    """The full items `[n, item_bytes]` (uint8) holding state tensor `x` after `seq_len`
    tokens, one per position of `positions(comp, seq_len, page_size)`."""
    import torch

    x = x.detach().contiguous()
    if comp.index in ("slot", "aux", "ring"):
        rows = x.reshape(-1, *comp.shape)
    else:
        n = len(positions(comp, seq_len, page_size))
        buf = torch.zeros((n * comp.shape[0], *x.shape[1:]), dtype=x.dtype)
        if comp.index == "page":
            buf[:len(x)] = x
        else:
            lo, hi = _window_rows(comp, seq_len, page_size)
            buf[lo:hi] = x
        rows = buf.reshape(n, *comp.shape)
    return rows.reshape(rows.shape[0], -1).view(torch.uint8).numpy().copy()


def from_items(comp: ComponentLayout, items: np.ndarray, seq_len: int, page_size: int):
    """The state tensor held by full items `[n, item_bytes]`: the inverse of `to_items`."""
    import torch

    dtype = getattr(torch, comp.dtype)
    t = torch.from_numpy(np.ascontiguousarray(items)).view(dtype).reshape(len(items),
                                                                         *comp.shape)
    if comp.index in ("slot", "aux"):
        return t[0].clone()
    if comp.index == "ring":
        return t.clone()
    rows = t.reshape(-1, *comp.shape[1:])
    if comp.index == "page":
        return rows[:seq_len // tokens_per_row(comp, page_size)].clone()
    lo, hi = _window_rows(comp, seq_len, page_size)
    return rows[lo:hi].clone()


# ~~~ does the spec fit the model? (parent; no torch) ~~~


def check_binding(layout: FamilyLayout, binding: Binding, described: list[dict],
                  seq_len: int, page_size: int) -> list[str]:
    """Every disagreement between the spec's bound components and the state the model
    exports (`described`: pdc.verify.hf_state.describe_state rows, with `segment_units` added)."""
    rows = {r["name"]: r for r in described}
    errors, used = [], set()
    for c in layout.components:
        for t in c.tensors:
            if binding.hf_name(c.name, t) is None:
                errors.append(f"component '{c.name}' tensor '{t}' has no state tensor in "
                              f"`parity.carry` ({binding.loc})")
    for c, t, layer_id, key in bound_entries(layout, binding):
        where = f"component '{c.name}' tensor '{t}' of layer {layer_id} ({key})"
        r = rows.get(key)
        if r is None:
            errors.append(f"{where}: the model exports no such tensor")
            continue
        used.add(key)
        want = _KIND_OF_INDEX.get(c.index)
        if want is None:
            errors.append(f"{where}: index '{c.index}' has no hf_state rule")
            continue
        if r["kind"] != want:
            errors.append(f"{where}: index '{c.index}' carries {want} state, the model "
                          f"exports {r['kind']} state")
            continue
        if r["dtype"] != c.dtype:
            errors.append(f"{where}: the spec says {c.dtype}, the model exports {r['dtype']}")
        shape = tuple(r["shape"])
        if c.index in ("slot", "aux"):
            item_ok = shape == c.shape
        elif c.index == "ring":
            item_ok = shape == (c.ring_rows, *c.shape)
        elif c.index == "page":
            item_ok = (shape[1:] == c.shape[1:] and page_size % c.shape[0] == 0
                       and shape[0] == seq_len // tokens_per_row(c, page_size))
        else:
            item_ok = (shape[1:] == c.shape[1:] and c.shape[0] == page_size
                       and shape[0] == min(seq_len, c.window_tokens))
        if not item_ok:
            errors.append(f"{where}: the model exports {list(shape)}, the spec's item is "
                          f"{list(c.shape)} ({c.index}-indexed, page_size {page_size}, "
                          f"{seq_len} tokens)")
            continue
        errors += _check_shard(where, c, r)
    missing = sorted(set(rows) - used)
    if missing:
        errors.append(f"the model exports {', '.join(missing)}, which no bound component "
                      "carries: decode could not rebuild its cache")
    return errors


def _check_shard(where: str, c: ComponentLayout, r: dict) -> list[str]:
    s = c.shard
    if s is None or r["shard_axis"] is None:
        if (s is None) != (r["shard_axis"] is None):
            spec = "replicated" if s is None else f"sharded on axis {s.axis}"
            model = "replicated" if r["shard_axis"] is None else \
                f"sharded on axis {r['shard_axis']}"
            return [f"{where}: the spec says {spec}, a TP engine keeps it {model}"]
        return []
    if s.axis != r["shard_axis"]:
        return [f"{where}: the spec shards axis {s.axis}, a TP engine axis {r['shard_axis']}"]
    sizes = s.unit_sizes
    spec = [(n * u, n) for n, u in zip(s.group_units, sizes, strict=True)]
    if r["segments"]:
        model = [(elems, units) for (_, elems), units in
                 zip(r["segments"], r["segment_units"], strict=True)]
    else:
        model = [(c.shape[s.axis], r["shard_size"])]
    if spec != model:
        show = ", ".join(f"{e} elements in {n} units" for e, n in spec)
        want = ", ".join(f"{e} elements in {n} units" for e, n in model)
        return [f"{where}: the spec shards sub-blocks of {show}; a TP engine shards {want}"]
    return []
