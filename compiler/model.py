"""The spec model: one frozen dataclass per spec concept, built from validated YAML.

~~~ DATA MODEL ~~~
Every object carries `loc`, the place in the spec it came from, so that later stages
(check, lowering) can report errors at the user's line. Symbolic sizes are evaluated here
with the safe evaluator in expr.py, against the spec's params; the original text is kept
for messages and for the generated code's comments.

Parsing assumes the shape was already validated by schema.py; it still gathers (never
raises on) semantic problems it meets while evaluating expressions, because those need the
params environment that the schema cannot see.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

from pdc.runtime.layout_types import KNOWN_BACKENDS as KNOWN_BACKENDS
from pdc.runtime.layout_types import BackendRule as BackendRule

from .diagnostics import Diagnostics, Location
from .expr import ExprError, evaluate, names_in
from .limits import (
    MAX_COMPONENTS,
    MAX_DEPLOYMENTS,
    MAX_ENTRIES,
    MAX_ITEM_BYTES,
    MAX_LAYERS,
    MAX_PARAMS,
    MAX_SHARD_UNITS,
)
from .yaml_loader import Located

UINT32_MAX = 2**32 - 1

# Bytes per element of every dtype a spec may name.
DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
}  # fmt: skip


class IndexKind(enum.Enum):
    PAGE = "page"  # item = one KV page; request sends its page ids
    SLOT = "slot"  # item = one request's state (req_pool_idx / mamba slot)
    RING = "ring"  # R rows per request: row = slot * R + pos % R
    WINDOW = "window"  # pages of the last W tokens only
    AUX = "aux"  # one metadata row per request


class Send(enum.Enum):
    EVERY_CHUNK = "every_chunk"
    LAST_CHUNK = "last_chunk"


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    value: int
    text: str  # as written: "2 * key_dim + value_dim" or "48"
    loc: Location


@dataclass(frozen=True, slots=True)
class DraftBand:
    """MTP / EAGLE draft layers: their own band of global ids, after the real layers."""

    kind: str
    count: int
    first_id: int
    loc: Location

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(range(self.first_id, self.first_id + self.count))


@dataclass(frozen=True, slots=True)
class Layers:
    count: int  # real (non-draft) layers; global ids 0..count-1
    kind_of: tuple[tuple[int, str], ...]  # (global id, kind) for real and draft layers, sorted
    draft: DraftBand | None
    pattern: tuple[str, ...]  # empty when explicit `kinds` were given
    loc: Location

    def kinds(self) -> dict[int, str]:
        return dict(self.kind_of)

    def ids_of_kind(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in self.kind_of if k == kind)

    @property
    def all_kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for _, k in self.kind_of))


@dataclass(frozen=True, slots=True)
class DtypeName:
    """A dtype name of the spec's own (`dtypes:`), e.g. `model: bfloat16`: items may name it
    instead of a dtype, and a run may override it (`load_spec(path, dtypes={...})`)."""

    name: str
    dtype: str
    loc: Location


@dataclass(frozen=True, slots=True)
class Item:
    shape: tuple[int, ...]  # elements per axis
    shape_text: tuple[str, ...]  # each axis as written in the spec
    dtype: str  # resolved: always one of DTYPE_BYTES
    loc: Location
    dtype_text: str = ""  # as written, when it names a `dtypes` entry ("model")
    pitch: int = 0  # bytes between items' starts in the engine's memory at TP 1; 0 = nbytes

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = self.dtype_bytes
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class Shard:
    """TP rule `shard: dim`: the axis is split across attention-TP ranks.

    The axis holds `sum(groups)` elements made of independent sub-blocks (`groups`; a single
    group when none are given); each sub-block is split into units (a head) of its own size
    and sharded across ranks on its own, so a rank holds a slice of every sub-block and no
    slice ever crosses a sub-block boundary. When a sub-block has fewer units than TP ranks,
    units are replicated: rank r holds unit r // (tp / units) (GQA replication).
    """

    axis: int
    groups: tuple[int, ...]  # elements per sub-block, in item order
    units: tuple[int, ...]  # elements per shard unit of each sub-block (1 = per element/head)
    loc: Location


@dataclass(frozen=True, slots=True)
class Component:
    name: str
    layer_ids: tuple[int, ...]  # global layer ids, sorted; empty for request-wide state
    request_wide: bool
    sentinel: int | None  # uint32 id carried on the wire instead of a layer id
    index: IndexKind
    ring_rows: int  # rows per request for RING, else 1
    window_tokens: int  # W for WINDOW, else 0
    tensors: tuple[str, ...]
    item: Item
    shard: Shard | None  # None = replicated across attention TP
    send: Send
    stages: str  # "all" | "first" | "last" | "kind:<k>" (request-wide state only)
    loc: Location
    why: str = ""  # the spec's own explanation, copied into generated code as a comment
    on_prefix_hit: str = "skip"  # page state: "skip" or "send" (Note [Prefix skip])
    holds: str = "data"  # "data" or "kv_slots" (Note [Slot-valued state])


@dataclass(frozen=True, slots=True)
class Constraint:
    expr: str
    why: str
    loc: Location


@dataclass(frozen=True, slots=True)
class SideSpec:
    """One side of a deployment as written (defaults are applied by the topology stage)."""

    tp: int
    pp: int
    dp: int
    page_size: int | None
    stages: tuple[tuple[int, ...], ...] | None  # explicit per-stage layer lists
    loc: Location


@dataclass(frozen=True, slots=True)
class Deployment:
    prefill: SideSpec
    decode: SideSpec
    backend: str
    expect_rejected: bool
    error: str  # substring a rejection must contain
    loc: Location


@dataclass(frozen=True, slots=True)
class Spec:
    family: str
    params: tuple[Param, ...]
    layers: Layers
    components: tuple[Component, ...]  # spec order: the wire order
    constraints: tuple[Constraint, ...]
    backends: tuple[BackendRule, ...]
    deployments: tuple[Deployment, ...]
    path: str
    loc: Location
    description: str = ""
    raw: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    dtypes: tuple[DtypeName, ...] = ()

    @property
    def env(self) -> dict[str, int]:
        return {p.name: p.value for p in self.params}

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    def backend(self, name: str) -> BackendRule | None:
        for b in self.backends:
            if b.name == name:
                return b
        return None

    @property
    def py_name(self) -> str:
        """Python identifier of the family (generated/<py_name>/)."""
        return self.family.replace("-", "_")


# ~~~ PARSING ~~~


_LIMIT_HINT = "this is far beyond any real model (Note [Spec limits] in compiler/limits.py)"


# Layer ids all the lists of one spec may name together (kinds, selectors, stage lists).
MAX_LISTED_IDS = 16 * MAX_LAYERS


def _ids(items: list, doc: Located, path: tuple, diags: Diagnostics,
         budget: list[int] | None = None) -> list[int]:
    """The layer ids of a list of ids and inclusive ranges; at most MAX_LAYERS of them, each
    below MAX_LAYERS, and at most `budget[0]` (decremented) for the whole spec (Note [Spec
    limits]), so no range or pile of ranges can expand to billions."""
    budget = budget if budget is not None else [MAX_LISTED_IDS]
    out: list[int] = []
    for i, it in enumerate(items):
        lo, hi = (it["from"], it["to"]) if isinstance(it, dict) else (it, it)
        if hi < lo:
            diags.error(doc.loc(path + (i,)), f"layer range from {lo} to {hi} is empty",
                        "write `from` <= `to` (both inclusive)")
            continue
        if hi >= MAX_LAYERS:
            diags.error(doc.loc(path + (i,)), f"layer id {hi} is beyond the limit of "
                        f"{MAX_LAYERS} layers", _LIMIT_HINT)
            return out
        if len(out) + hi - lo + 1 > MAX_LAYERS:
            diags.error(doc.loc(path + (i,)), f"this list names more than {MAX_LAYERS} layer "
                        "ids", _LIMIT_HINT)
            return out
        if hi - lo + 1 > budget[0]:
            diags.error(doc.loc(path + (i,)), f"the spec's lists name more than "
                        f"{MAX_LISTED_IDS} layer ids in all", _LIMIT_HINT)
            budget[0] = -1  # report once
            return out
        budget[0] -= hi - lo + 1
        out.extend(range(lo, hi + 1))
    return out


class _Parser:
    def __init__(self, doc: Located, diags: Diagnostics):
        self.doc = doc
        self.diags = diags
        self.env: dict[str, int] = {}
        # Params whose own definition failed (already reported): an expression using one of
        # them is skipped silently instead of reporting "unknown name" a second time.
        self.failed: set[str] = set()
        # Layer kinds the spec declares (pattern entries, `kinds` keys, the draft kind), even
        # those left without layers; selectors may name them.
        self.declared_kinds: set[str] = set()
        self.dtype_names: dict[str, str] = {}  # the spec's `dtypes`: name -> dtype
        self.ids_budget = [MAX_LISTED_IDS]  # layer ids the spec's lists may still name

    def ids(self, items: list, path: tuple) -> list[int]:
        if self.ids_budget[0] < 0:
            return []
        return _ids(items, self.doc, path, self.diags, self.ids_budget)

    def eval(self, value, path: tuple, what: str, env: dict | None = None) -> int | None:
        try:
            if isinstance(value, str) and names_in(value) & self.failed:
                return None
            v = evaluate(value, self.env if env is None else env)
        except ExprError as e:
            self.diags.error(self.doc.loc(path), f"{what}: {e}",
                             "expressions use integer params, + - * // % ** and min/max")
            return None
        if isinstance(v, bool):
            self.diags.error(self.doc.loc(path), f"{what}: '{value}' is a condition, not a size",
                             "write an integer expression")
            return None
        return v

    def params(self, raw: dict) -> tuple[Param, ...]:
        if len(raw) > MAX_PARAMS:
            self.diags.error(self.doc.loc(("params",)), f"the spec declares {len(raw)} params, "
                             f"more than the limit of {MAX_PARAMS}", _LIMIT_HINT)
            self.failed.update(raw)
            return ()
        # Params may refer to each other in any order: resolve in dependency order (Kahn),
        # each param once, so the cost is linear in the params and their references.
        deps = {name: _param_deps(value) & raw.keys() for name, value in raw.items()}
        users: dict[str, list[str]] = {name: [] for name in raw}
        waiting = {name: len(d) for name, d in deps.items()}
        for name, d in deps.items():
            for used in d:
                users[used].append(name)
        ready = deque(name for name in raw if not waiting[name])
        out = []
        while ready:
            name = ready.popleft()
            value = raw[name]
            v = self.eval(value, ("params", name), f"param '{name}'")
            if v is None:
                self.failed.add(name)
            else:
                self.env[name] = v
                out.append(Param(name, v, str(value), self.doc.loc(("params", name))))
            for user in users[name]:
                waiting[user] -= 1
                if not waiting[user]:
                    ready.append(user)
        pending = {name: deps[name] for name in raw if waiting[name]}
        if pending:
            self.failed.update(pending)
            cycle = _cycle_members(pending)
            first = next(n for n in raw if n in cycle)
            if len(cycle) == 1:
                msg = f"param '{first}' refers to itself"
            else:
                msg = f"params refer to each other in a cycle: {', '.join(sorted(cycle))}"
            self.diags.error(self.doc.loc(("params", first)), msg,
                             "give it a literal value" if len(cycle) == 1
                             else "give one of them a literal value")
        order = {n: i for i, n in enumerate(raw)}
        return tuple(sorted(out, key=lambda p: order[p.name]))

    def dtypes(self, raw: dict) -> tuple[DtypeName, ...]:
        out = []
        for name, dtype in raw.items():
            loc = self.doc.key_loc(("dtypes", name))
            if name in DTYPE_BYTES:
                self.diags.error(loc, f"dtype name '{name}' is itself a dtype",
                                 "give the name a meaning of its own, e.g. `model`")
                continue
            self.dtype_names[name] = dtype
            out.append(DtypeName(name, dtype, loc))
        return tuple(out)

    def item_dtype(self, name: str, written: str, path: tuple) -> tuple[str, str]:
        """(resolved dtype, the name as written when it is one of the spec's `dtypes`)."""
        if written in DTYPE_BYTES:
            return written, ""
        if written in self.dtype_names:
            return self.dtype_names[written], written
        known = list(DTYPE_BYTES) + list(self.dtype_names)
        close = difflib.get_close_matches(written, known, n=1)
        own = f"; or a name declared in `dtypes` ({', '.join(self.dtype_names)})" \
            if self.dtype_names else "; or declare a name of your own under `dtypes`"
        self.diags.error(self.doc.loc(path), f"item dtype of '{name}' is '{written}', which is "
                         "neither a dtype nor declared in `dtypes`",
                         (f"did you mean '{close[0]}'? " if close else "")
                         + f"use one of: {', '.join(DTYPE_BYTES)}" + own)
        return "uint8", ""

    def layers(self, raw: dict) -> Layers:
        loc = self.doc.loc(("layers",))
        kind_of: dict[int, str] = {}
        pattern: tuple[str, ...] = ()
        count = 0
        if "pattern" in raw:
            evaluated = self.eval(raw["count"], ("layers", "count"), "layer count")
            count = evaluated or 0
            pattern = tuple(raw["pattern"])
            self.declared_kinds.update(pattern)
            if evaluated is None:
                pass  # already reported (or a param it uses was)
            elif count > MAX_LAYERS:
                self.diags.error(self.doc.loc(("layers", "count")), f"layer count {count} is "
                                 f"beyond the limit of {MAX_LAYERS} layers", _LIMIT_HINT)
                count = 0
            elif count < 1:
                self.diags.error(self.doc.loc(("layers", "count")),
                                 f"layer count must be at least 1, got {count}",
                                 "set `count` to the model's num_hidden_layers")
            if count % len(pattern):
                self.diags.error(self.doc.loc(("layers", "pattern")),
                                 f"pattern of {len(pattern)} kinds does not divide {count} layers",
                                 "make the layer count a multiple of the pattern length, or list "
                                 "`kinds` explicitly")
            kind_of = {i: pattern[i % len(pattern)] for i in range(max(count, 0))}
        else:
            self.declared_kinds.update(raw["kinds"])
            for kind, items in raw["kinds"].items():
                clash = None
                for i in self.ids(items, ("layers", "kinds", kind)):
                    if i not in kind_of:
                        kind_of[i] = kind
                    elif clash is None:
                        clash = i
                if clash is not None:  # once per kind: a range may overlap in thousands
                    self.diags.error(self.doc.loc(("layers", "kinds", kind)),
                                     f"layer {clash} has two kinds: '{kind_of[clash]}' and "
                                     f"'{kind}'", "every layer id has exactly one kind")
            count = max(kind_of) + 1 if kind_of else 0
            missing = sorted(set(range(count)) - set(kind_of))
            if missing:
                which = (f"layer {missing[0]} has" if len(missing) == 1
                         else f"layers {_ranges(missing)} have")
                self.diags.error(loc, f"{which} no kind",
                                 "every layer id from 0 to the last one needs exactly one kind")
        draft = None
        if "draft" in raw:
            d = raw["draft"]
            dpath = ("layers", "draft")
            n = self.eval(d["count"], dpath + ("count",), "draft layer count") or 0
            first = count
            if "first_id" in d:
                given = self.eval(d["first_id"], dpath + ("first_id",), "draft first_id")
                first = count if given is None else given
            if first + n > MAX_LAYERS:
                self.diags.error(self.doc.loc(dpath), f"draft layer ids reach {first + n - 1}, "
                                 f"beyond the limit of {MAX_LAYERS} layers", _LIMIT_HINT)
                n, first = 0, count
            draft = DraftBand(d["kind"], n, first, self.doc.loc(dpath))
            self.declared_kinds.add(draft.kind)
            if draft.kind in set(kind_of.values()):
                self.diags.error(self.doc.loc(dpath + ("kind",)),
                                 f"draft kind '{draft.kind}' is also a kind of real layers",
                                 "give draft (MTP/EAGLE) layers a kind of their own")
            if first < count:
                self.diags.error(self.doc.loc(dpath + ("first_id",)),
                                 f"draft layer ids start at {first}, inside the real layers "
                                 f"0..{count - 1}", f"start the draft band at {count} or later")
                draft = DraftBand(d["kind"], n, count, draft.loc)  # go on as if it did
            for i in draft.ids:
                kind_of.setdefault(i, draft.kind)
        return Layers(count, tuple(sorted(kind_of.items())), draft, pattern, loc)

    def known_kinds(self, layers: Layers) -> set[str]:
        """Kinds a selector may name: those of some layer and every declared one (a kind left
        without layers is reported by the check "selects no layers", not as unknown)."""
        return set(layers.all_kinds) | self.declared_kinds

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
                                     + _draft_hint(layers.draft))
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
                             f"the limit of {MAX_ITEM_BYTES} (16 MiB)", _LIMIT_HINT)
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
        tensors = tuple(raw.get("tensors", ["data"]))
        if len(set(tensors)) != len(tensors):
            self.diags.error(self.doc.loc(base + ("tensors",)),
                             f"component '{name}' names a tensor twice", "tensor names are unique")
        on_prefix_hit = raw.get("on_prefix_hit", "skip")
        if "on_prefix_hit" in raw and index is not IndexKind.PAGE:
            self.diags.error(self.doc.key_loc(base + ("on_prefix_hit",)),
                             f"component '{name}' sets `on_prefix_hit` but is indexed by "
                             f"{index.value}",
                             "only page-indexed state has pages that decode's prefix cache "
                             "can hold; remove `on_prefix_hit`")
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
                             "elements of one head; " + _LIMIT_HINT)
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

    def side(self, raw: dict, path: tuple) -> SideSpec:
        stages = None
        if "stages" in raw:
            stages = tuple(
                tuple(self.ids(s, path + ("stages", i)))
                for i, s in enumerate(raw["stages"])
            )
        pp = raw.get("pp", len(stages) if stages else 1)
        if stages is not None and len(stages) != pp:
            self.diags.error(self.doc.loc(path + ("stages",)),
                             f"{len(stages)} stage lists given for pp={pp}",
                             "give one layer list per pipeline stage")
        return SideSpec(raw.get("tp", 1), pp, raw.get("dp", 1), raw.get("page_size"), stages,
                        self.doc.loc(path))


def _draft_hint(draft: DraftBand | None) -> str:
    if draft is None or not draft.count:
        return ""
    ids = draft.ids
    return f" and {ids[0]} (draft)" if len(ids) == 1 else f" and {ids[0]}..{ids[-1]} (draft)"


def _param_deps(value: object) -> set[str]:
    try:
        return names_in(value) if isinstance(value, str) else set()
    except ExprError:
        return set()  # evaluate() reports the syntax error


def _cycle_members(deps: dict[str, set[str]]) -> set[str]:
    """Params of `deps` (name -> the params of `deps` it uses) that lie on a dependency cycle.

    Every name left unresolved either lies on a cycle or depends on one; the latter are
    peeled off, in linear time, by dropping names no remaining name depends on."""
    deps = {n: d & deps.keys() for n, d in deps.items()}
    dependents = {n: 0 for n in deps}
    for d in deps.values():
        for used in d:
            dependents[used] += 1
    drop = deque(n for n, k in dependents.items() if not k)
    left = set(deps)
    while drop:
        name = drop.popleft()
        left.discard(name)
        for used in deps[name]:
            dependents[used] -= 1
            if not dependents[used]:
                drop.append(used)
    return left


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def build_spec(doc: Located, diags: Diagnostics) -> Spec | None:
    """Model a shape-valid document. Returns None only when nothing useful could be built."""
    # The schema has accepted the document, so its top level is a mapping.
    raw = cast(dict[str, Any], doc.data)
    p = _Parser(doc, diags)
    dtypes = p.dtypes(raw.get("dtypes", {}))
    params = p.params(raw["params"])
    layers = p.layers(raw["layers"])
    comps = []
    if len(raw["components"]) > MAX_COMPONENTS:
        diags.error(doc.loc(("components",)), f"the spec declares {len(raw['components'])} "
                    f"components, more than the limit of {MAX_COMPONENTS}", _LIMIT_HINT)
        return None
    for name, c in raw["components"].items():
        comp = p.component(name, c, layers)
        if comp is not None:
            comps.append(comp)
    entries = sum(len(c.tensors) * max(1, len(c.layer_ids)) for c in comps)
    if entries > MAX_ENTRIES:
        diags.error(doc.loc(("components",)), f"the components register {entries} entries "
                    f"(tensors x layers), more than the limit of {MAX_ENTRIES}", _LIMIT_HINT)
        return None
    if len(raw.get("deployments", [])) > MAX_DEPLOYMENTS:
        diags.error(doc.loc(("deployments",)), f"the spec lists {len(raw['deployments'])} "
                    f"deployments, more than the limit of {MAX_DEPLOYMENTS}", _LIMIT_HINT)
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
    return Spec(raw["family"], params, layers, tuple(comps), constraints, backends, tuple(deps),
                doc.path, doc.loc(()), raw.get("description", ""), raw, dtypes)
