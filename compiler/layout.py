"""Layout: per family, what each component looks like on a rank, independent of topology.

This is the last topology-free stage. For every component it fixes the entry order (the
wire order: tensor-major, then global layer id), the full item bytes, and the shard
geometry reduced to three numbers the lowering needs: `outer` (elements before the sharded
axis), `inner_bytes` (bytes of one element of the sharded axis including all trailing
axes) and the sub-block sizes in units. See Note [Shard ownership] in
pdc.runtime.layout_types for who holds which unit.
"""

from __future__ import annotations

from pdc.runtime.layout_types import ComponentLayout, EntryKey, FamilyLayout, ShardGeometry

from .model import Component, Spec

__all__ = ["ComponentLayout", "EntryKey", "FamilyLayout", "ShardGeometry", "build_layout"]


def _component_layout(c: Component) -> ComponentLayout:
    geom = None
    if c.shard is not None:
        s = c.shard
        outer = 1
        for d in c.item.shape[: s.axis]:
            outer *= d
        inner = c.item.dtype_bytes
        for d in c.item.shape[s.axis + 1 :]:
            inner *= d
        units = tuple(g // u for g, u in zip(s.groups, s.units, strict=True))
        # One int when every sub-block has the same unit size (the common case), else one
        # size per sub-block (see ShardGeometry.unit_elems).
        unit = s.units[0] if len(set(s.units)) == 1 else s.units
        geom = ShardGeometry(s.axis, outer, inner, units, unit)
    return ComponentLayout(
        c.name, c.index.value, c.ring_rows, c.window_tokens, c.tensors, c.layer_ids, c.sentinel,
        c.request_wide, c.item.dtype, c.item.dtype_bytes, c.item.shape, c.item.nbytes, geom,
        c.send.value, c.stages, str(c.loc), on_prefix_hit=c.on_prefix_hit, holds=c.holds,
        pitch=c.item.pitch,
    )


def build_layout(spec: Spec) -> FamilyLayout:
    return FamilyLayout(
        spec.family, spec.py_name, spec.layers.count,
        spec.layers.draft.ids if spec.layers.draft else (), spec.layers.kind_of,
        tuple(_component_layout(c) for c in spec.components),
        spec.env.get("page_size", 1), spec.path,
    )
