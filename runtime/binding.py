"""Binding: a family spec's params taken from the served model's config and the engine.

Note [Bound families]: a spec may leave a param to the model it serves
(`num_layers: {from: config.num_hidden_layers, example: 2}`, `page_size: {from:
engine.page_size, example: 16}`) and a dtype name to the engine (`model: {from:
engine.kv_dtype, example: bfloat16}`). The compiler checks and generates the family at the
`example` values (generated/<family>/layout.py keeps its LAYOUT constant, which `pdc check`
keeps fresh), and also emits the spec's formulas as Python: a `TEMPLATE` of lambdas over the
params, in the order the params depend on each other. A serving process calls the generated
`bind(config, engine)` at start; this module evaluates the formulas for the served model,
re-checks every rule whose inputs may now differ (sizes >= 1, the layer pattern, shard
sub-blocks and units, item limits, the spec's constraints) and returns a `Family` like any
other. It never imports the compiler.

An error names the spec line and, for a value that came from the model, the config key and
its value (`config.num_key_value_heads = 3`), so a user sees which number of which file
breaks which rule. The bound values are part of the family's identity: the fingerprint every
wire header carries and the plan digest the handshake compares are taken over the spec hash
and the bound values, so two engines that bound the same spec to different models (or page
sizes, or KV dtypes) refuse each other at registration.

Note [Draft components]: one spec describes the target model and, optionally, the draft model
a speculating engine runs beside it (EAGLE's own small model, DeepSeek's MTP layers). The
draft's layers are the spec's draft band (`layers: draft: {kind: eagle, count: draft_layers}`,
ids after the real layers), and its state the components that select the band's kind
(`layers: {kind: eagle}`). The engine says whether and what it speculates: `engine.draft_layers`
(the draft's KV layer count; 0 when it does not speculate), `engine.draft.KEY` (a key of the
draft model's config.json; absent when it does not speculate, so such params carry a
`default`) and `engine.hidden_dtype` (the dtype of the hidden state the engine hands from
prefill to decode for the draft's first step). While the band is empty its components hold no
layers, which the compiler and the binder accept for components that select only the draft
kind (any other component that selects nothing is still an error), so the same spec binds to
a server that speculates and to one that does not; the bound values are in the family's
identity, so a speculating prefill and a non-speculating decode refuse each other at
registration. An empty band is one way to say "optional component"; the other is Note
[Present components].

Note [Present components]: an engine may add request-wide state only when the model's config
sets a flag that has nothing to do with speculating (SGLang's DSA top-k seed row, present when
a DSA config sets `index_share_for_mtp_iteration`). A request-wide component may carry
`present: EXPR` over the params (a config flag binds as 0 or 1); where it is 0 its ownership
rule becomes "none": no stage owns it (runtime/lowering.py `owning_stages`), so no rank
registers or moves it, as a `stages: {with_kind: K}` component on a stage without K. The rule
is in the bound layout, hence in the family's identity: a server that has the state and one
that does not refuse each other at registration.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from .diagnostics import Diagnostic, Location, SpecErrors
from .layout_types import BackendRule, ComponentLayout, FamilyLayout, ShardGeometry
from .limits import MAX_ITEM_BYTES, MAX_LAYERS, MAX_MAGNITUDE

Formula = Callable[[Mapping[str, int]], object]

# Bytes per element of every dtype a spec may name (the compiler's DTYPE_BYTES, repeated
# here because the runtime never imports the compiler; tests/runtime/test_binding.py checks
# that they agree).
DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
}  # fmt: skip
# Engine and config spellings of a dtype (torch's, HF's `torch_dtype`, SGLang's and vLLM's
# flags) -> the spec language's name.
DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16",
                 "fp32": "float32", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                 "fp8_e5m2": "float8_e5m2"}
SOURCES = ("config", "engine")
ENGINE_KEYS = ("page_size", "kv_dtype", "ssm_dtype", "draft_layers", "draft", "hidden_dtype")


@dataclass(frozen=True, slots=True)
class BoundParam:
    """A param of a bindable spec: from the model's config or the engine (`source`, e.g.
    "config.num_hidden_layers", with an optional `default` formula when the config lacks the
    key), or a formula over other params (`f`)."""

    name: str
    loc: str
    text: str  # as written: "config.num_hidden_layers" or "hidden_size // heads"
    source: str = ""
    f: Formula | None = None
    default: Formula | None = None
    default_text: str = ""


@dataclass(frozen=True, slots=True)
class BoundDtype:
    name: str
    loc: str
    source: str  # "" for a fixed dtype
    value: str  # the fixed dtype, or the default when the source does not say


@dataclass(frozen=True, slots=True)
class BoundShard:
    axis: int
    groups: tuple[Formula, ...]  # empty: one group, the whole axis
    units: tuple[Formula, ...]  # one for every sub-block, or one per sub-block
    loc: str


@dataclass(frozen=True, slots=True)
class BoundComponent:
    """A component with its sizes as formulas; `fixed` is its layout at the example values
    (names, tensors, index, send, ...: what no param changes)."""

    fixed: ComponentLayout
    layers: str  # "all" | "request" | "kinds" | "ids"
    kinds: tuple[str, ...]
    shape: tuple[Formula, ...]
    shape_text: tuple[str, ...]
    dtype: str  # a dtype, or a name of the spec's `dtypes`
    shard: BoundShard | None
    ring: Formula | None
    window: Formula | None
    pitch: Formula | None
    sentinel: Formula | None
    present: Formula | None = None  # Note [Present components]
    present_stages: str = "all"  # its ownership rule where present


@dataclass(frozen=True, slots=True)
class BoundConstraint:
    text: str
    why: str
    loc: str
    f: Formula


@dataclass(frozen=True, slots=True)
class Template:
    example: FamilyLayout
    spec_sha256: str
    params: tuple[BoundParam, ...]  # in dependency order
    dtypes: tuple[BoundDtype, ...]
    count: Formula | None  # real layers, for a pattern; None: explicit kinds (fixed)
    count_loc: str
    pattern: tuple[str, ...]
    draft_count: Formula | None
    draft_first: Formula | None
    draft_kind: str
    components: tuple[BoundComponent, ...]
    constraints: tuple[BoundConstraint, ...]
    page_size_param: bool  # the spec has a `page_size` param
    # `layers: {from: config.layer_types, names: {...}}`: every layer's kind from a config
    # list (the pattern is then the example); "" when the pattern always holds.
    kinds_from: str = ""
    kind_names: tuple[tuple[str, str], ...] = ()


class BindError(SpecErrors):
    """The model's config or the engine's settings break the spec; every Diagnostic names
    the spec line, and the config key and value where one is involved."""


def _loc(text: str) -> Location:
    file, _, rest = text.rpartition(":")
    file2, _, line = file.rpartition(":")
    try:
        return Location(file2, int(line), int(rest))
    except ValueError:
        return Location(text)


def lookup(source: Mapping, path: str) -> object:
    """`path` ("text_config.num_hidden_layers") in a nested config mapping; None if absent."""
    cur: object = source
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def checked_pow(a: int, b: int) -> int:
    """`a ** b` of a spec formula: the exponent bounded like the compiler's (0..64)."""
    if not 0 <= b <= 64:
        raise ValueError(f"exponent {b} out of range 0..64")
    return a**b


class _Binder:
    def __init__(self, t: Template, config: Mapping, engine: Mapping):
        self.t = t
        self.config = config
        self.engine = engine
        self.p: dict[str, int] = {}
        self.origin: dict[str, set[str]] = {}  # param -> "config.x = v" facts it came from
        self.errors: list[Diagnostic] = []
        self.failed: set[str] = set()
        self.draft_empty = False  # Note [Draft components]: the bound draft band holds none

    def error(self, loc: str, msg: str, hint: str = "") -> None:
        self.errors.append(Diagnostic(_loc(loc), msg, hint))

    def facts(self, names) -> str:
        facts = sorted(set().union(*(self.origin.get(n, set()) for n in names)))
        return ", ".join(facts)

    def where(self, names) -> str:
        f = self.facts(names)
        return f" (with {f})" if f else ""

    def eval(self, f: Formula, loc: str, what: str, used: tuple[str, ...] = ()) -> int | None:
        try:
            v = f(self.p)
        except KeyError:
            return None  # a param it uses failed, already reported
        except ZeroDivisionError:
            self.error(loc, f"{what}: division by zero{self.where(used or self.p)}",
                       "the model's config gives a zero where the spec divides")
            return None
        except (ValueError, OverflowError) as e:
            self.error(loc, f"{what}: {e}")
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self.error(loc, f"{what}: {v!r} is not an integer")
            return None
        if abs(v) > MAX_MAGNITUDE:
            self.error(loc, f"{what}: value out of range (more than 2**64 in magnitude)")
            return None
        return v

    def param(self, bp: BoundParam) -> None:
        if bp.f is not None:
            v = self.eval(bp.f, bp.loc, f"param '{bp.name}'")
            if v is None:
                self.failed.add(bp.name)
                return
            self.p[bp.name] = v
            # what it came from: every fact of every param it may use
            self.origin[bp.name] = {x for n in _names(bp.text) for x in self.origin.get(n, ())}
            return
        kind, _, key = bp.source.partition(".")
        where = self.config if kind == "config" else self.engine
        raw = lookup(where, key)
        label = "the model's config" if kind == "config" else "the engine"
        if raw is None:
            if bp.default is None:
                self.failed.add(bp.name)
                self.error(bp.loc, f"param '{bp.name}' takes {bp.source}, but {label} has no "
                           f"'{key}'", f"serve a model whose config.json sets '{key}', or give "
                           "the param a `default`" if kind == "config" else
                           f"the engine's {key}: `pdc bind --engine-{key.replace('_', '-')} "
                           "...`; a serving integration passes it at start")
                return
            v = self.eval(bp.default, bp.loc, f"default of param '{bp.name}'")
            if v is None:
                self.failed.add(bp.name)
                return
            self.p[bp.name] = v
            self.origin[bp.name] = {x for n in _names(bp.default_text)
                                    for x in self.origin.get(n, ())}
            return
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        if isinstance(raw, bool):  # a config's flag: 1 when set (Note [Present components])
            raw = int(raw)
        if not isinstance(raw, int):
            self.failed.add(bp.name)
            self.error(bp.loc, f"param '{bp.name}' takes {bp.source}, which is {raw!r}, not an "
                       "integer", "point `from` at an integer field of the config")
            return
        self.p[bp.name] = raw
        self.origin[bp.name] = {f"{bp.source} = {raw}"}

    def dtype(self, bd: BoundDtype) -> str:
        if not bd.source:
            return bd.value
        kind, _, key = bd.source.partition(".")
        raw = lookup(self.config if kind == "config" else self.engine, key)
        if raw in (None, "", "auto"):
            return bd.value
        name = DTYPE_ALIASES.get(str(raw).removeprefix("torch."), str(raw).removeprefix("torch."))
        if name not in DTYPE_BYTES:
            self.error(bd.loc, f"dtype '{bd.name}' takes {bd.source}, which is {raw!r}, not a "
                       "dtype pdc moves", f"one of: {', '.join(DTYPE_BYTES)}")
            return bd.value
        return name

    def size(self, f: Formula, text: str, loc: str, what: str, least: int = 1) -> int | None:
        v = self.eval(f, loc, what, tuple(_names(text)))
        if v is not None and v < least:
            self.error(loc, f"{what} '{text}' is {v}{self.where(_names(text))}, less than "
                       f"{least}", "the served model's config gives a size the spec cannot "
                       "hold; check the param's `from`")
            return None
        return v

    def run(self) -> tuple[FamilyLayout, dict[str, int], dict[str, str]]:
        t = self.t
        for bp in t.params:
            self.param(bp)
        dtypes = {bd.name: self.dtype(bd) for bd in t.dtypes}
        for c in t.constraints:
            try:
                ok = c.f(self.p)
            except KeyError:
                continue
            except ZeroDivisionError:
                ok = False
            if not ok:
                self.error(c.loc, f"constraint '{c.text}' does not hold"
                           f"{self.where(_names(c.text))}: {c.why}",
                           "the served model's config breaks a rule the spec relies on; "
                           "serve a model that keeps it, or write a spec for this one")
        kind_of = dict(t.example.kind_of)
        num_layers = t.example.num_layers
        if t.count is not None:
            n = self.size(t.count, "layers.count", t.count_loc, "layer count")
            if n is not None and n > MAX_LAYERS:
                self.error(t.count_loc, f"layer count {n}{self.where(self.p)} is beyond the "
                           f"limit of {MAX_LAYERS} layers")
                n = None
            listed = self.listed_kinds(n) if t.kinds_from and n is not None else None
            if listed is not None:
                num_layers = len(listed)
                kind_of = dict(enumerate(listed))
                n = None  # the config gave every layer's kind: the pattern does not apply
            if n is not None and n % len(t.pattern):
                self.error(t.count_loc, f"pattern of {len(t.pattern)} kinds does not divide "
                           f"{n} layers{self.where(self.p)}",
                           "the served model's layer count must be a multiple of the pattern")
            if n is not None:
                num_layers = n
                kind_of = {i: t.pattern[i % len(t.pattern)] for i in range(n)}
        draft_ids = t.example.draft_ids
        if t.draft_count is not None and t.draft_first is not None:
            dn = self.size(t.draft_count, "draft.count", t.count_loc, "draft layer count", 0)
            first = self.eval(t.draft_first, t.count_loc, "draft first_id")
            kind_of = {i: k for i, k in kind_of.items() if k != t.draft_kind}
            if dn is not None and first is not None:
                draft_ids = tuple(range(first, first + dn))
                self.draft_empty = dn == 0
                kind_of.update({i: t.draft_kind for i in draft_ids})
        kinds = tuple(sorted(kind_of.items()))
        comps = tuple(self.component(c, kinds, num_layers, dtypes) for c in t.components)
        page = self.p.get("page_size", 1) if t.page_size_param else 1
        if self.errors:
            raise BindError(sorted(self.errors, key=lambda d: d.loc))
        layout = replace(t.example, num_layers=num_layers, draft_ids=draft_ids, kind_of=kinds,
                         components=comps, default_page_size=page)
        return layout, dict(self.p), dtypes

    def listed_kinds(self, count: int) -> list[str] | None:
        """Every layer's kind from the config's list (None when the config has none)."""
        t = self.t
        key = t.kinds_from.removeprefix("config.")
        raw = lookup(self.config, key)
        if raw is None:
            return None
        names = dict(t.kind_names)
        if not isinstance(raw, list) or len(raw) != count:
            self.error(t.count_loc, f"{t.kinds_from} is {_short(raw)}, not a list of "
                       f"{count} layer types{self.where(self.p)}",
                       "the config's per-layer list must name one type per layer")
            return None
        out = []
        for i, typ in enumerate(raw):
            if typ not in names:
                self.error(t.count_loc, f"{t.kinds_from}[{i}] is {typ!r}, which the spec's "
                           f"`names` does not map to a kind (it maps "
                           f"{', '.join(repr(k) for k in names)})",
                           "add the type to `layers.names`, or write a spec for this model")
                return None
            out.append(names[typ])
        return out

    def component(self, c: BoundComponent, kind_of, num_layers: int,
                  dtypes: dict[str, str]) -> ComponentLayout:
        fx = c.fixed
        loc = fx.loc
        if c.layers == "all":
            layer_ids = tuple(range(num_layers))
        elif c.layers == "kinds":
            layer_ids = tuple(i for i, k in kind_of if k in c.kinds)
        else:
            layer_ids = fx.layer_ids
        if c.layers == "kinds" and not layer_ids and not (
                self.draft_empty and set(c.kinds) == {self.t.draft_kind}):
            self.error(loc, f"component '{fx.name}' selects no layers{self.where(self.p)}",
                       "the served model has no layer of the kinds it names")
        shape = []
        for i, (f, text) in enumerate(zip(c.shape, c.shape_text, strict=True)):
            v = self.size(f, text, loc, f"axis {i} of component '{fx.name}'")
            shape.append(v if v is not None else 1)
        dtype = dtypes.get(c.dtype, c.dtype)
        nbytes = DTYPE_BYTES[dtype] * math.prod(shape)
        if nbytes > MAX_ITEM_BYTES:
            self.error(loc, f"an item of component '{fx.name}' holds {nbytes} bytes"
                       f"{self.where(self.p)}, beyond the limit of {MAX_ITEM_BYTES} (16 MiB)")
        geom = None
        if c.shard is not None:
            geom = self.shard(c, fx.name, shape, dtype)
        ring = self.size(c.ring, "ring", loc, f"ring of component '{fx.name}'") \
            if c.ring is not None else fx.ring_rows
        window = self.size(c.window, "window", loc, f"window of component '{fx.name}'") \
            if c.window is not None else fx.window_tokens
        pitch = fx.pitch
        if c.pitch is not None:
            pitch = self.eval(c.pitch, loc, f"pitch of component '{fx.name}'") or 0
            if pitch and pitch < nbytes:
                self.error(loc, f"pitch of component '{fx.name}' is {pitch} bytes, less than "
                           f"its item of {nbytes} bytes{self.where(self.p)}")
        sentinel = fx.sentinel
        if c.sentinel is not None:
            sentinel = self.eval(c.sentinel, loc, f"sentinel of component '{fx.name}'")
        stages = fx.stages
        if c.present is not None:  # Note [Present components]
            stages = c.present_stages if self.eval(c.present, loc, f"present of component "
                                                   f"'{fx.name}'") else "none"
        return replace(fx, layer_ids=layer_ids, dtype=dtype, dtype_bytes=DTYPE_BYTES[dtype],
                       shape=tuple(shape), item_bytes=nbytes, shard=geom,
                       ring_rows=ring or 1, window_tokens=window or 0, pitch=pitch,
                       sentinel=sentinel, stages=stages)

    def shard(self, c: BoundComponent, name: str, shape: list[int],
              dtype: str) -> ShardGeometry | None:
        s = c.shard
        if s is None:
            return None
        size = shape[s.axis]
        axis_text = c.shape_text[s.axis]
        groups = [size]
        if s.groups:
            got = [self.eval(g, s.loc, f"shard group of '{name}'") for g in s.groups]
            if any(g is None for g in got):
                return None
            groups = [g for g in got if g is not None]
            if sum(groups) != size:
                self.error(s.loc, f"shard groups of '{name}' add up to {sum(groups)}, but axis "
                           f"'{axis_text}' has {size} elements{self.where(self.p)}")
                return None
        units = [self.eval(u, s.loc, f"shard unit of '{name}'") for u in s.units] or [1]
        if any(u is None or u < 1 for u in units):
            return None
        unit_sizes = [u for u in units if u is not None]
        if len(unit_sizes) == 1:
            unit_sizes *= len(groups)
        for g, u in zip(groups, unit_sizes, strict=True):
            if g % u:
                self.error(s.loc, f"sharded axis '{axis_text}' of '{name}': sub-block of {g} "
                           f"elements is not a multiple of the {u}-element unit"
                           f"{self.where(self.p)}", "each sub-block must hold whole units "
                           "(heads); the served model's sizes do not divide")
                return None
        outer = math.prod(shape[:s.axis])
        inner = DTYPE_BYTES[dtype] * math.prod(shape[s.axis + 1:])
        unit: int | tuple[int, ...] = unit_sizes[0] if len(set(unit_sizes)) == 1 \
            else tuple(unit_sizes)
        return ShardGeometry(s.axis, outer, inner,
                             tuple(g // u for g, u in zip(groups, unit_sizes, strict=True)), unit)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _names(text: str) -> set[str]:
    out, word = set(), ""
    for ch in text + " ":
        if ch.isalnum() or ch == "_":
            word += ch
        else:
            if word and not word[0].isdigit() and word not in ("and", "or", "not", "min",
                                                               "max"):
                out.add(word)
            word = ""
    return out


def binding_digest(spec_sha256: str, params: Mapping[str, int],
                   dtypes: Mapping[str, str]) -> str:
    """sha256 over the spec's hash and every bound value: the identity of a bound family."""
    data = {"spec": spec_sha256, "params": dict(sorted(params.items())),
            "dtypes": dict(sorted(dtypes.items()))}
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


@dataclass(frozen=True, slots=True)
class Bound:
    """What a bind produced: the layout, the values and the identity."""

    layout: FamilyLayout
    params: dict
    dtypes: dict
    digest: str  # binding_digest
    fingerprint: int


def bind(t: Template, config: Mapping | None, engine: Mapping | None) -> Bound:
    """Bind `t` to a model's config (its config.json as a mapping) and the engine's settings
    (`page_size`, `kv_dtype`, `ssm_dtype`, `draft_layers`, `draft`, `hidden_dtype`: Note
    [Draft components]); raises BindError naming every rule they break."""
    b = _Binder(t, config or {}, engine or {})
    layout, params, dtypes = b.run()
    digest = binding_digest(t.spec_sha256, params, dtypes)
    layout = replace(layout, bound=digest)
    return Bound(layout, params, dtypes, digest,
                 int.from_bytes(bytes.fromhex(digest)[:8], "little"))


def describe_sources(t: Template) -> tuple[tuple[str, str], ...]:
    """(param or dtype name, its source) for every value the spec takes from outside."""
    return tuple((p.name, p.source) for p in t.params if p.source) + \
        tuple((d.name, d.source) for d in t.dtypes if d.source)


__all__ = ["BackendRule", "BindError", "Bound", "BoundComponent", "BoundConstraint",
           "BoundDtype", "BoundParam", "BoundShard", "Template", "bind", "binding_digest",
           "checked_pow", "lookup"]
