"""Emit `generated/<family>/kernels.py`: the family's copy kernels, bound to its geometry.

The Triton kernels are generic and hand-written (pdc.runtime.copy_kernels: every entry of a
transfer in one launch, int64 addressing, word-size fast path). What is specific to a family
is computed here and emitted as literals:

- per component, the word alignment its copies may promise the compiler: the largest power
  of two (at most 16 bytes) dividing every piece offset, length and stride the component can
  produce under any attention TP (the unit slice for sharded state, the item for replicated
  state). Launches then never test alignment at run time;
- per component, its segment geometry, and a function that turns a plan's byte segments into
  kernel `SegmentSpec`s for either side of a link.

The staged path (pdc.runtime.staging) uses these for device pools; a test runs them under the
Triton interpreter against the numpy gather/scatter the host path uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .context import FamilyContext, GeneratedModule
from .naming import family_import
from .pysrc import py_str
from .templates import render

TEMPLATE = "kernels.py.j2"
MODULE = "kernels"
MAX_WORD_BYTES = 16  # widest vector the kernels use


def pow2_alignment(*values: int) -> int:
    align = MAX_WORD_BYTES
    for v in values:
        while align > 1 and v % align:
            align //= 2
    return align


@dataclass(frozen=True, slots=True)
class KernelComponentView:
    name: str  # string literal
    align: int
    item_bytes: int  # full (unsharded) item
    unit_bytes: int  # bytes of one shard unit along the sharded axis; item_bytes if replicated
    why: str  # one-line reason for the alignment, for the comment


@dataclass(frozen=True, slots=True)
class KernelsModuleView:
    family: str
    import_path: str
    components: tuple[KernelComponentView, ...]


def kernels_view(ctx: FamilyContext) -> KernelsModuleView:
    comps = []
    for c in ctx.layout.components:
        if c.shard is None:
            unit = c.item_bytes
            why = "replicated: whole items"
        else:
            # With units of several sizes (one per sub-block) every piece is a multiple of
            # their greatest common divisor.
            unit = math.gcd(*c.shard.unit_sizes) * c.shard.inner_bytes
            why = f"sharded: pieces are multiples of {unit}-byte units"
        comps.append(KernelComponentView(py_str(c.name), pow2_alignment(unit, c.item_bytes),
                                         c.item_bytes, unit, why))
    return KernelsModuleView(ctx.spec.family, family_import(ctx.spec, MODULE), tuple(comps))


def emit(ctx: FamilyContext) -> GeneratedModule:
    return GeneratedModule(MODULE, render(TEMPLATE, kernels_view(ctx)))
