"""Topology: parse and resolve both sides' parallel layouts (attention TP, PP, DP, page size).

A side comes from the CLI or a serving process (`tp=4,pp=2,dp=1,page_size=64`), or from a
spec deployment (pdc.compiler.topology.side_from_spec). Stage splits are resolved here into
explicit per-stage global layer id lists, so that everything downstream pairs layers by
global id and never by counting (Note [Pair by layer id]).

Even split: stage s gets `count // pp` real layers, the first `count % pp` stages one more;
draft (MTP/EAGLE) layers always go with the last stage, which runs the model head.
"""

from __future__ import annotations

from .diagnostics import Diagnostic, Location
from .layout_types import KNOWN_BACKENDS, FamilyLayout
from .limits import MAX_DP, MAX_LAYERS, MAX_PAGE_SIZE, MAX_PP, MAX_TP
from .plan_types import Side, Topology

SIDE_KEYS = ("tp", "pp", "dp", "page_size", "stages")
# The largest value of each key (Note [Spec limits] in compiler/limits.py): the plan has
# tp x pp ranks per side, `pdc demo` starts a process per rank and dp replica.
SIDE_MAX = {"tp": MAX_TP, "pp": MAX_PP, "dp": MAX_DP, "page_size": MAX_PAGE_SIZE}


def _parse_stages(value: str) -> tuple[tuple[int, ...], ...] | None:
    """`0-19/20-59/60-79` (stages split by '/', ids and inclusive ranges joined by '+')."""
    stages = []
    listed = 0
    for stage in value.split("/"):
        ids: list[int] = []
        for item in stage.split("+"):
            lo, dash, hi = item.partition("-")
            hi = hi if dash else lo
            if not (lo.isdigit() and hi.isdigit() and len(lo) < 8 and len(hi) < 8):
                return None
            first, last = int(lo), int(hi)
            listed += last - first + 1
            if last >= MAX_LAYERS or listed > MAX_LAYERS:  # ids beyond any spec's layers
                return None
            ids.extend(range(first, last + 1))
        stages.append(tuple(ids))
    return tuple(stages)


def parse_side_arg(text: str, flag: str) -> tuple[dict, list[Diagnostic]]:
    """`tp=4,pp=2` -> {"tp": 4, "pp": 2}; `stages=0-2/3-47` gives explicit per-stage layer
    lists (pp then defaults to their count); errors name the flag."""
    loc = Location(flag)
    out: dict = {}
    errors = []
    if not text.strip():
        return out, [Diagnostic(loc, f"{flag} is empty", "give the side's layout, e.g. "
                                f"{flag} tp=1 (or leave the flag out for its default)")]
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SIDE_KEYS:
            errors.append(Diagnostic(loc, f"cannot read '{part}' in {flag} {text}",
                                     f"write key=value pairs with keys {', '.join(SIDE_KEYS)}, "
                                     "e.g. tp=4,pp=2"))
            continue
        if key == "stages":
            stages = _parse_stages(value.strip())
            if stages is None:
                errors.append(Diagnostic(loc, f"cannot read stages '{value}' in {flag}",
                                         "write stages as 0-19/20-59/60-79: stages split by "
                                         "'/', ids (below the layer count) or inclusive ranges "
                                         "joined by '+'"))
            else:
                out["stages"] = stages
            continue
        value = value.strip()
        n = int(value) if value.isdigit() and len(value) < 8 else 0
        if n < 1:
            errors.append(Diagnostic(loc, f"{key} in {flag} must be a positive integer, got "
                                     f"'{value}'", f"e.g. {key}=2"))
            continue
        if n > SIDE_MAX[key]:
            errors.append(Diagnostic(loc, f"{key}={n} in {flag} is beyond the limit of "
                                     f"{SIDE_MAX[key]}", f"use {key} <= {SIDE_MAX[key]} (Note "
                                     "[Spec limits] in compiler/limits.py)"))
            continue
        if key in out:
            errors.append(Diagnostic(loc, f"{key} given twice in {flag}", "give it once"))
        out[key] = n
    return out, errors


def split_stages(layout: FamilyLayout, pp: int) -> tuple[tuple[int, ...], ...]:
    n = layout.num_layers
    base, extra = divmod(n, pp)
    stages, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        stages.append(tuple(range(start, start + size)))
        start += size
    stages[-1] = stages[-1] + tuple(layout.draft_ids)
    return tuple(stages)


def resolve_side(layout: FamilyLayout, tp: int = 1, pp: int = 1, dp: int = 1,
                 page_size: int | None = None, stages=None, *, what: str,
                 loc: Location) -> tuple[Side | None, list[Diagnostic]]:
    errors = []
    if pp > layout.num_layers:
        errors.append(Diagnostic(loc, f"{what} pp={pp} exceeds the {layout.num_layers} layers",
                                 "every pipeline stage needs at least one layer"))
        return None, errors
    if stages is None:
        resolved = split_stages(layout, pp)
    else:
        resolved = tuple(tuple(s) for s in stages)
        resolved = resolved[:-1] + (resolved[-1] + tuple(layout.draft_ids),)
        for s, ids in enumerate(resolved):
            if not ids:
                errors.append(Diagnostic(loc, f"{what} stage {s} holds no layers",
                                         "every pipeline stage needs at least one layer"))
    size = page_size if page_size is not None else layout.default_page_size
    return Side(tp, pp, dp, size, resolved), errors


def topology_from_args(layout: FamilyLayout, prefill: str, decode: str,
                       backend: str) -> tuple[Topology | None, list[Diagnostic]]:
    p, e1 = parse_side_arg(prefill, "--prefill")
    d, e2 = parse_side_arg(decode, "--decode")
    errors = e1 + e2
    if backend not in KNOWN_BACKENDS:
        errors.append(Diagnostic(Location("--backend"), f"unknown backend '{backend}'",
                                 f"known backends: {', '.join(KNOWN_BACKENDS)}"))
    if errors:
        return None, errors
    for side, flag in ((p, "--prefill"), (d, "--decode")):
        if "stages" in side:
            pp = side.setdefault("pp", len(side["stages"]))
            listed = sorted(i for s in side["stages"] for i in s)
            if pp != len(side["stages"]) or listed != list(range(layout.num_layers)):
                errors.append(Diagnostic(Location(flag), f"{flag} stages must give pp lists "
                                         f"that hold every real layer 0..{layout.num_layers - 1} "
                                         "exactly once", "draft layers go with the last stage "
                                         "and are not listed"))
    if errors:
        return None, errors
    ps, e1 = resolve_side(layout, **p, what="prefill", loc=Location("--prefill"))
    ds, e2 = resolve_side(layout, **d, what="decode", loc=Location("--decode"))
    if e1 or e2 or ps is None or ds is None:
        return None, e1 + e2
    return Topology(ps, ds, backend), []
