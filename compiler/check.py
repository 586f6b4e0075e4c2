"""Cross-entity semantic checks on a modelled spec. All problems are gathered, none raised.

Single-concept shape rules live in the schema and the parser; what is checked here needs
several concepts at once: ids against layers, sentinels against each other, constraints
against params, backends against the known engines, deployments against the layers.
"""

from __future__ import annotations

from .diagnostics import Diagnostics
from .expr import ExprError, evaluate
from .model import KNOWN_BACKENDS, UINT32_MAX, IndexKind, Spec


def check_spec(spec: Spec, diags: Diagnostics) -> None:
    _check_components(spec, diags)
    _check_sentinels(spec, diags)
    _check_constraints(spec, diags)
    _check_backends(spec, diags)
    _check_deployments(spec, diags)


def _check_components(spec: Spec, diags: Diagnostics) -> None:
    for c in spec.components:
        if not c.request_wide and not c.layer_ids and not _empty_draft(spec, c.name):
            diags.error(c.loc, f"component '{c.name}' selects no layers",
                        "check its `layers` selector against the layer kinds")
        if c.item.nbytes <= 0:
            diags.error(c.item.loc, f"item of component '{c.name}' has {c.item.nbytes} bytes",
                        "every axis of `item.shape` must be positive")
        if c.index is IndexKind.WINDOW and "page_size" not in spec.env:
            diags.error(c.loc, f"component '{c.name}' is window-indexed but the spec has no "
                        "`page_size` param", "add `page_size` to params")


def _empty_draft(spec: Spec, name: str) -> bool:
    """Note [Draft components] in runtime/binding.py: a component that selects only the draft
    band's kind holds no layers while the band is empty (an engine that does not speculate)."""
    draft = spec.layers.draft
    sel = spec.raw.get("components", {}).get(name, {}).get("layers")
    if draft is None or draft.count or not isinstance(sel, dict):
        return False
    kinds = [sel["kind"]] if "kind" in sel else sel.get("kinds", [])
    return bool(kinds) and set(kinds) == {draft.kind}


def _hex(v: int) -> str:
    """A sentinel as specs usually write it: 0xFFFFFFFF."""
    return f"0x{v:08X}" if v >= 0 else str(v)


def _check_sentinels(spec: Spec, diags: Diagnostics) -> None:
    layer_ids = spec.layers.kinds()
    seen: dict[int, str] = {}
    for c in spec.components:
        if c.sentinel is None:
            continue
        s = c.sentinel
        if not 0 <= s <= UINT32_MAX:
            diags.error(c.loc, f"sentinel {_hex(s)} of component '{c.name}' does not fit in uint32",
                        "sentinels count down from 0xFFFFFFFF (2**32 - 1)")
            continue
        if s in layer_ids:
            diags.error(c.loc, f"sentinel {_hex(s)} of component '{c.name}' collides with layer "
                        f"{s} ({layer_ids[s]})",
                        "pick a sentinel above every real and draft layer id, e.g. 0xFFFFFFFF")
        if s in seen:
            diags.error(c.loc, f"sentinel {_hex(s)} of component '{c.name}' is already used by "
                        f"'{seen[s]}'", "each request-wide component needs its own sentinel")
        else:
            seen[s] = c.name
    top = max(layer_ids, default=-1)
    if top > UINT32_MAX:
        diags.error(spec.layers.loc, f"layer id {top} does not fit in uint32",
                    "layer ids travel on the wire as uint32")


def _check_constraints(spec: Spec, diags: Diagnostics) -> None:
    for c in spec.constraints:
        try:
            ok = evaluate(c.expr, spec.env)
        except ExprError as e:
            diags.error(c.loc, f"constraint: {e}", "constraints are expressions over params")
            continue
        if not isinstance(ok, bool):
            diags.error(c.loc, f"constraint '{c.expr}' is a number, not a condition",
                        "write a comparison, e.g. `a % b == 0`")
        elif not ok:
            diags.error(c.loc, f"constraint '{c.expr}' does not hold: {c.why}",
                        "change the params so that it holds")


def _check_backends(spec: Spec, diags: Diagnostics) -> None:
    for b in spec.backends:
        if b.name not in KNOWN_BACKENDS:
            diags.error(b.loc, f"unknown backend '{b.name}'",
                        f"known backends: {', '.join(KNOWN_BACKENDS)}")


def _check_deployments(spec: Spec, diags: Diagnostics) -> None:
    named = {b.name for b in spec.backends}
    for d in spec.deployments:
        if d.backend not in KNOWN_BACKENDS:
            diags.error(d.loc, f"deployment names unknown backend '{d.backend}'",
                        f"known backends: {', '.join(KNOWN_BACKENDS)}")
        elif spec.backends and d.backend not in named:
            diags.error(d.loc, f"deployment uses backend '{d.backend}', which the spec's "
                        "`backends` matrix does not list", "add it to `backends` (or fix the name)")
        if d.error and not d.expect_rejected:
            diags.error(d.loc, "deployment gives an `error` but expects to be accepted",
                        "add `expect: rejected`, or remove `error`")
        for side_name, side in (("prefill", d.prefill), ("decode", d.decode)):
            if side.stages is None:
                continue
            listed = [i for s in side.stages for i in s]
            real = set(range(spec.layers.count))
            if sorted(listed) != sorted(set(listed)) or set(listed) != real:
                diags.error(side.loc, f"{side_name} stage lists must hold every real layer "
                            f"0..{spec.layers.count - 1} exactly once",
                            "draft layers go with the last stage and are not listed")
