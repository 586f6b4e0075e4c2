"""Emit `generated/<family>/layout.py`: the family's layout as typed constants.

The module imports only pdc.runtime.layout_types and rebuilds, as literals, exactly the
`FamilyLayout` that `pdc.compiler.layout.build_layout` computes (a test compares them). The
runtime reads the layout from here and never runs the compiler.

Constructor arguments are taken from the runtime dataclasses' own fields, in order, so a
field added to `ComponentLayout` or `FamilyLayout` shows up here without a template change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdc.runtime.layout_types import ComponentLayout

from ..diagnostics import SpecErrors
from ..model import Component
from .binding_src import binding_source, serves_source
from .context import FamilyContext, GeneratedModule
from .header import spec_fingerprint, spec_sha256
from .naming import MODULE_CONSTANTS, component_constants
from .pysrc import Name, comment_lines, docstring_text, py_hex32, py_str, py_value, wrap
from .templates import render

TEMPLATE = "layout.py.j2"

# Scalar fields written in a form easier to read than repr().
_FIELD_FORMAT: dict[str, Callable[[Any], str]] = {"sentinel": py_hex32}


@dataclass(frozen=True, slots=True)
class Arg:
    name: str  # keyword argument name
    value: str  # Python source of its value (may span lines, already indented)


@dataclass(frozen=True, slots=True)
class ComponentView:
    const: str  # module-level name, UPPER_SNAKE
    comments: tuple[str, ...]  # `# ...` lines above the constant
    args: tuple[Arg, ...]  # ComponentLayout(...) keyword arguments


@dataclass(frozen=True, slots=True)
class LayoutModuleView:
    doc: tuple[str, ...]  # module docstring lines
    imports: str  # names imported from pdc.runtime.layout_types
    family: str
    spec_sha256: str
    fingerprint: str
    num_layers: str
    draft_ids: str
    default_page_size: str
    layer_kinds: str
    components: tuple[ComponentView, ...]
    component_tuple: str
    layout_args: tuple[Arg, ...]
    location_import: bool  # BACKENDS holds Locations (pdc.runtime.diagnostics)
    backends: str
    serves: str  # the SERVES constant ("" without `serves`)
    binding: str  # TEMPLATE and bind() of a bindable spec ("" otherwise)


def _args(obj: Any, literal_of: dict[str, str] | None = None) -> tuple[Arg, ...]:
    """Keyword arguments rebuilding `obj`; fields named in `literal_of` use that source."""
    out = []
    for f in dataclasses.fields(obj):
        if f.default is not dataclasses.MISSING and getattr(obj, f.name) == f.default:
            continue  # a field added with a default leaves existing modules unchanged
        if literal_of and f.name in literal_of:
            out.append(Arg(f.name, literal_of[f.name]))
            continue
        v = getattr(obj, f.name)
        if f.name in _FIELD_FORMAT and v is not None:
            out.append(Arg(f.name, _FIELD_FORMAT[f.name](v)))
        else:
            out.append(Arg(f.name, py_value(v, 1, len(f.name) + 1, _FIELD_FORMAT)))
    return tuple(out)


def _component_comments(c: Component, cl: ComponentLayout) -> tuple[str, ...]:
    lines = list(comment_lines(c.why)) if c.why else []
    lines.append(f"# spec: {c.loc}")
    shape_text = ", ".join(c.item.shape_text)
    shape = ", ".join(map(str, cl.shape))
    item = f"[{shape_text}]" if shape_text == shape else f"[{shape_text}] = [{shape}]"
    dtype = f"{c.item.dtype_text} = {cl.dtype}" if c.item.dtype_text else cl.dtype
    lines.append(f"# item: {item} {dtype}, {cl.item_bytes} bytes")
    return tuple(lines)


def layout_view(ctx: FamilyContext) -> LayoutModuleView:
    spec, layout = ctx.spec, ctx.layout
    consts, errors = component_constants(spec, MODULE_CONSTANTS)
    if errors:
        raise SpecErrors(errors)
    comps = []
    for c, cl in zip(spec.components, layout.components, strict=True):
        comps.append(ComponentView(consts[c.name], _component_comments(c, cl), _args(cl)))
    bound = {f: name for name, f in MODULE_CONSTANTS.items() if f is not None}
    imports = {"ComponentLayout", "FamilyLayout"}
    if any(cl.shard is not None for cl in layout.components):
        imports.add("ShardGeometry")
    if spec.backends:
        imports.add("BackendRule")
    doc = [f"Layout of the {spec.family} family.", ""]
    if spec.description:
        doc += [*wrap(docstring_text(spec.description)), ""]
    doc += wrap("Components are listed in spec order, which is the wire order. Sizes are in "
                "bytes unless a name says otherwise (shape: elements per axis).")
    return LayoutModuleView(
        doc=tuple(doc),
        imports=", ".join(sorted(imports)),
        family=py_str(layout.family),
        spec_sha256=py_str(spec_sha256(spec)),
        fingerprint=f"0x{spec_fingerprint(spec):016X}",
        num_layers=py_value(layout.num_layers),
        draft_ids=py_value(layout.draft_ids, 0, len("DRAFT_IDS = ")),
        default_page_size=py_value(layout.default_page_size),
        layer_kinds=py_value(layout.kind_of, 0, len("LAYER_KINDS = ")),
        components=tuple(comps),
        component_tuple=py_value(tuple(Name(v.const) for v in comps), 0, len("COMPONENTS = ")),
        layout_args=_args(layout, bound),
        location_import=bool(spec.backends),
        backends=py_value(spec.backends, 0, len("BACKENDS = ")),
        serves=serves_source(spec),
        binding=binding_source(spec, layout),
    )


def emit(ctx: FamilyContext) -> GeneratedModule:
    return GeneratedModule("layout", render(TEMPLATE, layout_view(ctx)))
