"""Emit `generated/<family>/wire.py`: the family's bindings of the wire format.

The codec itself is family-independent and hand-written (pdc.runtime.wire). What a decoder
needs to know about one family is small and is all emitted here as literals: the spec
fingerprint every header carries, the components in spec order (the order of a Register
message's sections), each component's tensor names (a registered entry carries a tensor
index into them) and the ids its entries may carry (global layer ids, or the request-wide
sentinel). The module then wraps `encode`, `decode` and `registration_sections` with those
constants, so runtime code never passes a family's constants by hand.

The generated module imports only pdc.runtime.wire; a test exec's it for every spec and
round-trips every message type through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdc.runtime.layout_types import ComponentLayout, FamilyLayout

from ..diagnostics import SpecErrors
from ..model import Spec
from .context import FamilyContext, GeneratedModule
from .header import generated_header, spec_fingerprint
from .naming import component_constants, family_import, family_module
from .pysrc import comment_lines, py_hex32, py_str, py_value
from .templates import render

TEMPLATE = "wire.py.j2"
MODULE = "wire"
# A component's tensor-name constant is its UPPER_SNAKE name plus this suffix. No other
# module-level name of the generated module ends in it, so only components can clash.
TENSORS_SUFFIX = "_TENSORS"


@dataclass(frozen=True, slots=True)
class WireComponentView:
    comments: tuple[str, ...]  # `# ...` lines above the WireComponent, indented one level
    name: str  # the component name as a string literal
    tensors_const: str  # module-level name of its tensor-name tuple, e.g. KV_TENSORS
    tensors: str  # the tuple literal of tensor names
    layer_ids: str  # the tuple literal of ids its entries may carry (layer ids or sentinel)


@dataclass(frozen=True, slots=True)
class WireModuleView:
    family: str  # the family name as written in the spec
    family_literal: str
    import_path: str  # where the runtime imports this module from
    fingerprint: str  # hex literal of the u64 fingerprint
    component_names: str  # tuple literal of component names, spec order
    components: tuple[WireComponentView, ...]


def _entry_ids(cl: ComponentLayout) -> str:
    """Ids a registered entry of `cl` may carry, as a tuple literal at 2 levels of indent."""
    if cl.request_wide and cl.sentinel is not None:
        return f"({py_hex32(cl.sentinel)},)"
    return py_value(cl.layer_ids, 2, len("layer_ids="))


def wire_view(spec: Spec, layout: FamilyLayout) -> WireModuleView:
    consts, errors = component_constants(spec, ())
    if errors:
        raise SpecErrors(errors)
    comps = []
    for c, cl in zip(spec.components, layout.components, strict=True):
        comments = [*comment_lines(c.why, 1)] if c.why else []
        comments.append(f"# spec: {c.loc}")
        comps.append(WireComponentView(
            comments=tuple(comments),
            name=py_str(cl.name),
            tensors_const=consts[c.name] + TENSORS_SUFFIX,
            tensors=py_value(cl.tensors, 0, len(consts[c.name] + TENSORS_SUFFIX + " = ")),
            layer_ids=_entry_ids(cl),
        ))
    names = tuple(cl.name for cl in layout.components)
    return WireModuleView(
        family=spec.family,
        family_literal=py_str(spec.family),
        import_path=family_import(spec, MODULE),
        fingerprint=f"0x{spec_fingerprint(spec):016X}",
        component_names=py_value(names, 0, len("COMPONENTS = ")),
        components=tuple(comps),
    )


def wire_body(spec: Spec, layout: FamilyLayout) -> str:
    """The module text without the @generated header."""
    return render(TEMPLATE, wire_view(spec, layout))


def emit(ctx: FamilyContext) -> GeneratedModule:
    """Module emitter for FAMILY_MODULES (compile_specs puts the header on top)."""
    return GeneratedModule(MODULE, wire_body(ctx.spec, ctx.layout))


def wire_module(spec: Spec, layout: FamilyLayout) -> tuple[str, str]:
    """(path relative to generated/, full text with the @generated header)."""
    return family_module(spec, MODULE), generated_header(spec) + wire_body(spec, layout)


__all__ = ["WireComponentView", "WireModuleView", "emit", "wire_body", "wire_module", "wire_view"]
