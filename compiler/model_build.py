"""Building the spec model, part two: the components of a spec (layers, index, item, pitch,
shard) and `build_spec`, which models a whole shape-valid document with the parser of
compiler/model_parser.py (params, dtypes, layers, sides).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from .diagnostics import Diagnostics
from .limits import MAX_COMPONENTS, MAX_DEPLOYMENTS, MAX_ENTRIES, MAX_ITEM_BYTES, MAX_SHARD_UNITS
from .model import (
    BackendRule,
    Component,
    Constraint,
    Deployment,
    IndexKind,
    Item,
    Layers,
    Send,
    Shard,
    Spec,
)
from .model_parity import build_parity
from .model_parser import LIMIT_HINT, ModelParser, draft_hint
from .yaml_loader import Located


class _SpecBuilder(ModelParser):
    """The parser of compiler/model_parser.py and the rules of components."""

    def component(self, name: str, raw: dict, layers: Layers) -> Component | None:
        base = ("components", name)
        loc = self.doc.key_loc(base)
        request_wide = raw["layers"] == "request"
        layer_ids: tuple[int, ...] = ()
        if raw["layers"] == "all":
            layer_ids = tuple(range(layers.count))
        elif not request_wide:
            sel = raw["layers"]
            known = self.known_kinds(layers)
            if "kind" in sel or "kinds" in sel:
                kinds = [sel["kind"]] if "kind" in sel else sel["kinds"]
                key = "kind" if "kind" in sel else "kinds"
                for k in kinds:
                    if k not in known:
                        self.diags.error(self.doc.loc(base + ("layers", key)),
                                         f"component '{name}' names unknown layer kind '{k}'",
                                         f"known kinds: {', '.join(sorted(known))}")
                layer_ids = tuple(i for i, k in layers.kind_of if k in kinds)
            else:
                ids = self.ids(sel["ids"], base + ("layers", "ids"))
                valid = set(layers.kinds())
                missing = next((i for i in ids if i not in valid), None)
                if missing is not None:
                    self.diags.error(self.doc.loc(base + ("layers", "ids")),
                                     f"component '{name}' names layer {missing}, which does "
                                     f"not exist", f"layer ids are 0..{layers.count - 1}"
                                     + draft_hint(layers.draft))
                if len(set(ids)) != len(ids):
                    self.diags.error(self.doc.loc(base + ("layers", "ids")),
                                     f"component '{name}' lists a layer id twice",
                                     "list each layer once")
                layer_ids = tuple(sorted(set(ids)))
        sentinel = None
        if "sentinel" in raw:
            sentinel = self.eval(raw["sentinel"], base + ("sentinel",), "sentinel")
            if not request_wide:
                self.diags.error(self.doc.key_loc(base + ("sentinel",)),
                                 f"component '{name}' has a sentinel but is not request-wide",
                                 "sentinels are for `layers: request`; remove it")
        elif request_wide:
            self.diags.error(loc, f"request-wide component '{name}' needs a sentinel layer id",
                             "add `sentinel: 0xFFFFFFFF` (or the next free id counting down)")

        idx = raw["index"]
        ring_rows, window = 1, 0
        if isinstance(idx, dict):
            if "ring" in idx:
                index = IndexKind.RING
                ring_rows = self.eval(idx["ring"], base + ("index", "ring"), "ring rows") or 0
                if ring_rows < 1:
                    self.diags.error(self.doc.loc(base + ("index", "ring")),
                                     f"ring of component '{name}' has {ring_rows} rows",
                                     "a ring needs at least one row")
            else:
                index = IndexKind.WINDOW
                window = self.eval(idx["window"], base + ("index", "window"), "window") or 0
                if window < 1:
                    self.diags.error(self.doc.loc(base + ("index", "window")),
                                     f"window of component '{name}' is {window} tokens",
                                     "a window holds at least one token")
        else:
            index = IndexKind(idx)

        item_raw = raw["item"]
        shape, texts = [], []
        shape_ok = True
        for i, s in enumerate(item_raw["shape"]):
            v = self.eval(s, base + ("item", "shape", i), f"item shape of '{name}'")
            texts.append(str(s))
            shape.append(v if v is not None else 1)
            shape_ok = shape_ok and v is not None
            if v is not None and v < 1:
                self.diags.error(self.doc.loc(base + ("item", "shape", i)),
                                 f"axis {i} ('{s}') of component '{name}' has size {v}",
                                 "every axis has at least one element")
        dtype, dtype_text = self.item_dtype(name, item_raw["dtype"], base + ("item", "dtype"))
        item = Item(tuple(shape), tuple(texts), dtype, self.doc.loc(base + ("item",)), dtype_text)
        if shape_ok and item.nbytes > MAX_ITEM_BYTES:
            self.diags.error(self.doc.loc(base + ("item", "shape")),
                             f"an item of component '{name}' holds {item.nbytes} bytes, beyond "
                             f"the limit of {MAX_ITEM_BYTES} (16 MiB)", LIMIT_HINT)
            shape_ok = False

        if "pitch" in item_raw:
            item = self.pitch(name, item_raw["pitch"], item, index, shape_ok,
                              base + ("item", "pitch"))

        shard = None
        if raw["tp"] != "replicated" and shape_ok:
            shard = self.shard(name, raw["tp"], item, base + ("tp",))

        default_send = Send.EVERY_CHUNK if index is IndexKind.PAGE else Send.LAST_CHUNK
        send = Send(raw.get("send", default_send.value))
        if send is Send.EVERY_CHUNK and index is not IndexKind.PAGE:
            self.diags.error(self.doc.loc(base + ("send",)),
                             f"component '{name}' is indexed by {index.value} but sent every chunk",
                             "only page-indexed state is final after each chunk; use last_chunk")

        stages = "all"
        if "stages" in raw:
            st = raw["stages"]
            stages = f"kind:{st['with_kind']}" if isinstance(st, dict) else st
            if not request_wide:
                self.diags.error(self.doc.key_loc(base + ("stages",)),
                                 f"component '{name}' sets `stages` but is not request-wide",
                                 "per-layer state lives on the stage that holds its layer; "
                                 "remove `stages`")
            if isinstance(st, dict) and st["with_kind"] not in self.known_kinds(layers):
                self.diags.error(self.doc.loc(base + ("stages", "with_kind")),
                                 f"component '{name}' names unknown layer kind "
                                 f"'{st['with_kind']}'",
                                 f"known kinds: {', '.join(sorted(self.known_kinds(layers)))}")
        if "present" in raw:  # Note [Present components] in runtime/binding.py
            if not request_wide:
                self.diags.error(self.doc.key_loc(base + ("present",)),
                                 f"component '{name}' sets `present` but is not request-wide",
                                 "a per-layer component is present where its layers are; "
                                 "remove `present`")
            elif self.eval(raw["present"], base + ("present",), "present") == 0:
                stages = "none"
        tensors = tuple(raw.get("tensors", ["data"]))
        if len(set(tensors)) != len(tensors):
            self.diags.error(self.doc.loc(base + ("tensors",)),
                             f"component '{name}' names a tensor twice", "tensor names are unique")
        # Note [Prefix skip]: a window is sent whole unless the spec says decode's cache
        # keeps the window pages of its prefix (SGLang's SWA radix cache does)
        on_prefix_hit = raw.get("on_prefix_hit",
                                "send" if index is IndexKind.WINDOW else "skip")
        if "on_prefix_hit" in raw and index not in (IndexKind.PAGE, IndexKind.WINDOW):
            self.diags.error(self.doc.key_loc(base + ("on_prefix_hit",)),
                             f"component '{name}' sets `on_prefix_hit` but is indexed by "
                             f"{index.value}",
                             "only page- and window-indexed state has pages that decode's "
                             "prefix cache can hold; remove `on_prefix_hit`")
        holds = raw.get("holds", "data")
        if holds == "kv_slots":
            wrong = []
            if not request_wide or index is not IndexKind.AUX:
                wrong.append("request-wide aux state (`layers: request`, `index: aux`)")
            if dtype not in ("int32", "int64"):
                wrong.append(f"integers (dtype int32 or int64, not {dtype})")
            if shard is not None:
                wrong.append("replicated (`tp: replicated`)")
            if wrong:
                self.diags.error(self.doc.loc(base + ("holds",)),
                                 f"component '{name}' holds KV slots but is not "
                                 + ", nor ".join(wrong),
                                 "prefill rewrites slot values as whole integer rows; only "
                                 "request-wide, replicated int32/int64 aux rows can hold them")
        return Component(name, layer_ids, request_wide, sentinel, index, ring_rows, window,
                         tensors, item, shard, send, stages, loc, raw.get("why", ""),
                         on_prefix_hit, holds)

    def pitch(self, name: str, raw, item: Item, index: IndexKind, shape_ok: bool,
              path: tuple) -> Item:
        """Note [Item pitch]: an engine may keep a slot's state inside a larger block, so
        that consecutive items start `pitch` bytes apart, not `item.nbytes` (vLLM's hybrid
        cache pads each mamba block to the attention page). The state still moves as one
        item of its own bytes; only the address of item i changes (base + i * pitch), on
        both sides, so the pitch is the spec's, never the wire's. Only slot-indexed state
        may have one: a request moves one slot item per layer, while runs of pages would
        stop being one descriptor."""
        loc = self.doc.loc(path)
        value = self.eval(raw, path, f"pitch of '{name}'")
        if value is None:
            return item
        if index is not IndexKind.SLOT:
            self.diags.error(loc, f"component '{name}' sets an item pitch but is indexed by "
                                  f"{index.value}",
                             "only slot-indexed state moves one item per request and layer; "
                             "a run of pitched pages would not be one descriptor; remove "
                             "`pitch`")
            return item
        if shape_ok and value < item.nbytes:
            self.diags.error(loc, f"pitch of component '{name}' is {value} bytes, less than "
                                  f"its item of {item.nbytes} bytes",
                             "the pitch is the distance from one item's start to the next "
                             "in the engine's memory, so at least one item")
            return item
        return dataclasses.replace(item, pitch=value)

    def shard(self, name: str, raw: dict, item: Item, path: tuple) -> Shard | None:
        target = raw["shard"]
        if isinstance(target, int):
            axis = target
            if axis >= len(item.shape):
                self.diags.error(self.doc.loc(path + ("shard",)),
                                 f"component '{name}' shards axis {axis}, but its item has "
                                 f"{len(item.shape)} axes", "name an axis of `item.shape`")
                return None
        else:
            matches = [i for i, t in enumerate(item.shape_text) if t.strip() == target.strip()]
            if len(matches) != 1:
                why = "no" if not matches else "more than one"
                self.diags.error(self.doc.loc(path + ("shard",)),
                                 f"component '{name}' shards '{target}', but {why} axis of its "
                                 f"item shape is written that way",
                                 f"item shape is [{', '.join(item.shape_text)}]; write one of "
                                 "those names or an axis number")
                return None
            axis = matches[0]
        size = item.shape[axis]
        groups: tuple[int, ...] = (size,)
        if "groups" in raw:
            evaluated = [self.eval(x, path + ("groups", i), f"shard group of '{name}'")
                         for i, x in enumerate(raw["groups"])]
            known = [x for x in evaluated if x is not None]
            if len(known) != len(evaluated):
                return None
            groups = tuple(known)
            if sum(groups) != size:
                self.diags.error(self.doc.loc(path + ("groups",)),
                                 f"shard groups of '{name}' add up to {sum(groups)}, but axis "
                                 f"'{item.shape_text[axis]}' has {size} elements",
                                 "the sub-blocks must tile the sharded axis exactly")
        units = self.units(name, raw, groups, path)
        if units is None:
            return None
        n_units = sum(g // u for g, u in zip(groups, units, strict=True))
        if n_units > MAX_SHARD_UNITS:
            self.diags.error(self.doc.loc(path + ("shard",)),
                             f"component '{name}' shards {n_units} units (heads), beyond the "
                             f"limit of {MAX_SHARD_UNITS}", "shard by head: give `unit` the "
                             "elements of one head; " + LIMIT_HINT)
            return None
        for i, (g, unit) in enumerate(zip(groups, units, strict=True)):
            if g % unit:
                where = path + ("groups", i) if "groups" in raw else path + ("shard",)
                self.diags.error(self.doc.loc(where),
                                 f"sharded axis '{item.shape_text[axis]}' of '{name}': sub-block "
                                 f"of {g} elements is not a multiple of the {unit}-element unit",
                                 "each sub-block must hold whole units (heads)")
        return Shard(axis, groups, units, self.doc.loc(path))

    def units(self, name: str, raw: dict, groups: tuple[int, ...],
              path: tuple) -> tuple[int, ...] | None:
        """`unit`: one size for every sub-block, or a list with one size per sub-block."""
        if "unit" not in raw:
            return (1,) * len(groups)
        given = raw["unit"]
        if not isinstance(given, list):
            one = self.eval(given, path + ("unit",), f"shard unit of '{name}'") or 1
            if one < 1:
                self.diags.error(self.doc.loc(path + ("unit",)),
                                 f"shard unit of '{name}' is {one}", "a unit is >= 1 element")
                one = 1
            return (one,) * len(groups)
        if len(given) != len(groups):
            self.diags.error(self.doc.loc(path + ("unit",)),
                             f"shard units of '{name}' give {len(given)} sizes for "
                             f"{len(groups)} sub-blocks",
                             "give one unit size per sub-block of `groups`, or a single size")
            return None
        units = []
        for i, x in enumerate(given):
            u = self.eval(x, path + ("unit", i), f"shard unit of '{name}'")
            if u is None:
                return None
            if u < 1:
                self.diags.error(self.doc.loc(path + ("unit", i)),
                                 f"shard unit of '{name}' is {u}", "a unit is >= 1 element")
                u = 1
            units.append(u)
        return tuple(units)


def build_spec(doc: Located, diags: Diagnostics) -> Spec | None:
    """Model a shape-valid document. Returns None only when nothing useful could be built."""
    # The schema has accepted the document, so its top level is a mapping.
    raw = cast(dict[str, Any], doc.data)
    p = _SpecBuilder(doc, diags)
    dtypes = p.dtypes(raw.get("dtypes", {}))
    params = p.params(raw["params"])
    layers = p.layers(raw["layers"])
    comps = []
    if len(raw["components"]) > MAX_COMPONENTS:
        diags.error(doc.loc(("components",)), f"the spec declares {len(raw['components'])} "
                    f"components, more than the limit of {MAX_COMPONENTS}", LIMIT_HINT)
        return None
    for name, c in raw["components"].items():
        comp = p.component(name, c, layers)
        if comp is not None:
            comps.append(comp)
    entries = sum(len(c.tensors) * max(1, len(c.layer_ids)) for c in comps)
    if entries > MAX_ENTRIES:
        diags.error(doc.loc(("components",)), f"the components register {entries} entries "
                    f"(tensors x layers), more than the limit of {MAX_ENTRIES}", LIMIT_HINT)
        return None
    if len(raw.get("deployments", [])) > MAX_DEPLOYMENTS:
        diags.error(doc.loc(("deployments",)), f"the spec lists {len(raw['deployments'])} "
                    f"deployments, more than the limit of {MAX_DEPLOYMENTS}", LIMIT_HINT)
        return None
    constraints = tuple(
        Constraint(c["expr"], c["why"], doc.loc(("constraints", i)))
        for i, c in enumerate(raw.get("constraints", []))
    )
    backends = tuple(
        BackendRule(name, b.get("hetero_attention_tp", True), b.get("max_pp"), b.get("why", ""),
                    doc.key_loc(("backends", name)))
        for name, b in raw.get("backends", {}).items()
    )
    deps = []
    for i, d in enumerate(raw.get("deployments", [])):
        path = ("deployments", i)
        deps.append(Deployment(
            p.side(d["prefill"], path + ("prefill",)), p.side(d["decode"], path + ("decode",)),
            d.get("backend", "mooncake"), d.get("expect", "accepted") == "rejected",
            d.get("error", ""), doc.loc(path)))
    serves = raw.get("serves")
    parity = None
    if "parity" in raw:
        parity = build_parity(doc, raw["parity"], {q.name for q in params},
                              {d.name for d in dtypes}, {c.name: c.tensors for c in comps},
                              diags)
    return Spec(raw["family"], params, layers, tuple(comps), constraints, backends, tuple(deps),
                doc.path, doc.loc(()), raw.get("description", ""), raw, dtypes,
                (serves["engine"], tuple(serves["architectures"])) if serves else None, parity)
