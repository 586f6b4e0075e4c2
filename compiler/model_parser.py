"""Building the spec model, part one: the parser of a shape-valid document's scalars, params,
dtypes, layers and deployment sides (the components are parsed by compiler/model_build.py,
which extends this parser).

Parsing assumes the shape was already validated by schema.py; it still gathers (never
raises on) semantic problems it meets while evaluating expressions, because those need the
params environment that the schema cannot see. Symbolic sizes are evaluated here with the
safe evaluator in expr.py, against the spec's params.
"""

from __future__ import annotations

import difflib
from collections import deque

from .diagnostics import Diagnostics
from .expr import ExprError, evaluate, names_in
from .limits import MAX_LAYERS, MAX_PARAMS
from .model import DTYPE_BYTES, DraftBand, DtypeName, Layers, Param, SideSpec
from .yaml_loader import Located

LIMIT_HINT = "this is far beyond any real model (Note [Spec limits] in compiler/limits.py)"


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
                        f"{MAX_LAYERS} layers", LIMIT_HINT)
            return out
        if len(out) + hi - lo + 1 > MAX_LAYERS:
            diags.error(doc.loc(path + (i,)), f"this list names more than {MAX_LAYERS} layer "
                        "ids", LIMIT_HINT)
            return out
        if hi - lo + 1 > budget[0]:
            diags.error(doc.loc(path + (i,)), f"the spec's lists name more than "
                        f"{MAX_LISTED_IDS} layer ids in all", LIMIT_HINT)
            budget[0] = -1  # report once
            return out
        budget[0] -= hi - lo + 1
        out.extend(range(lo, hi + 1))
    return out


class ModelParser:
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
                             f"more than the limit of {MAX_PARAMS}", LIMIT_HINT)
            self.failed.update(raw)
            return ()
        # Params may refer to each other in any order: resolve in dependency order (Kahn),
        # each param once, so the cost is linear in the params and their references.
        deps = {name: _param_deps(value.get("default") if isinstance(value, dict) else value)
                & raw.keys() for name, value in raw.items()}
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
            bound = value if isinstance(value, dict) else None
            if bound is not None:  # Note [Bound families]: checked at its example value
                value = bound["example"]
            v = self.eval(value, ("params", name), f"param '{name}'")
            if v is None:
                self.failed.add(name)
            elif bound is not None:
                if "default" in bound:  # checked now, evaluated at bind time
                    self.eval(bound["default"], ("params", name, "default"),
                              f"default of param '{name}'")
                self.env[name] = v
                out.append(Param(name, v, str(value), self.doc.loc(("params", name)),
                                 bound["from"], bound.get("default")))
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
            source = ""
            if isinstance(dtype, dict):  # Note [Bound families]: checked at its example
                source, dtype = dtype["from"], dtype["example"]
            self.dtype_names[name] = dtype
            out.append(DtypeName(name, dtype, loc, source))
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
                                 f"beyond the limit of {MAX_LAYERS} layers", LIMIT_HINT)
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
            for typ, kind in raw.get("names", {}).items():
                if kind not in pattern:  # Note [Bound families]: kinds from the config
                    self.diags.error(self.doc.loc(("layers", "names", typ)),
                                     f"layer type '{typ}' is named kind '{kind}', which the "
                                     "pattern does not have", f"name one of the pattern's "
                                     f"kinds: {', '.join(dict.fromkeys(pattern))}")
            if ("from" in raw) != ("names" in raw):
                self.diags.error(loc, "`layers.from` and `layers.names` go together",
                                 "`from` names the config's per-layer list, `names` maps its "
                                 "types to the spec's kinds")
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
                         else f"layers {ranges_text(missing)} have")
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
                                 f"beyond the limit of {MAX_LAYERS} layers", LIMIT_HINT)
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


def draft_hint(draft: DraftBand | None) -> str:
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


def ranges_text(ids: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)
