"""The coverage proof: every decode byte is written exactly once, with the right byte.

`prove(layout, plan)` simulates aggregate (non-PD) state as byte-labelled arrays: the full
item of every (component, tensor, layer) gets labels 1..item_bytes offset by a per-entry
base, each rank holds its own projection of that array, the plan's segments are applied,
and every decode item is compared with its projection of the aggregate array.

The projection here is written independently of the lowering (array slicing of the full
item, not `ShardGeometry.local_units`), so a mapping rule broken in the lowering shows up as
wrong or missing bytes instead of agreeing with itself. Items are built one at a time, so
memory stays at a few item sizes even for large families.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pdc.runtime.plan_types import Plan, RankId

from .layout import ComponentLayout, FamilyLayout


@dataclass(frozen=True, slots=True)
class CoverageProblem:
    component: str
    decode: RankId
    entry: tuple[str, int]
    message: str

    def __str__(self) -> str:
        return f"{self.component} {self.entry[0]}@{self.entry[1]} on decode {self.decode}: {self.message}"


def full_labels(base: int, nbytes: int) -> np.ndarray:
    return np.arange(1, nbytes + 1, dtype=np.int64) + base


def project(comp: ComponentLayout, full: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """The bytes of `full` that attention-TP rank `rank` of `tp` holds, in its local order."""
    s = comp.shard
    if s is None:
        return full
    sizes = s.unit_elems if isinstance(s.unit_elems, tuple) else \
        (s.unit_elems,) * len(s.group_units)
    axis = sum(g * u for g, u in zip(s.group_units, sizes, strict=True))
    a = full.reshape(s.outer, axis, s.inner_bytes)
    parts, start = [], 0
    for g, u in zip(s.group_units, sizes, strict=True):
        block = a[:, start:start + g * u, :]
        block = block.reshape(s.outer, g, u * s.inner_bytes)
        lo = rank * g // tp
        hi = max(lo + 1, (rank + 1) * g // tp)
        parts.append(block[:, lo:hi, :].reshape(s.outer, -1))
        start += g * u
    return np.concatenate(parts, axis=1).reshape(-1)


def _apply(seg, src: np.ndarray, dst: np.ndarray, count: np.ndarray) -> str:
    for k in range(seg.repeat):
        so = seg.src_offset + k * seg.src_stride
        do = seg.dst_offset + k * seg.dst_stride
        if so < 0 or do < 0 or so + seg.nbytes > src.size or do + seg.nbytes > dst.size:
            return (f"segment {seg} piece {k} is out of bounds (source item {src.size} B, "
                    f"destination item {dst.size} B)")
        dst[do:do + seg.nbytes] = src[so:so + seg.nbytes]
        count[do:do + seg.nbytes] += 1
    return ""


def prove(layout: FamilyLayout, plan: Plan, limit: int = 20) -> list[CoverageProblem]:
    """Return the coverage problems of `plan` (empty list = proven), at most `limit`."""
    topo = plan.topology
    P, D = topo.prefill, topo.decode
    problems: list[CoverageProblem] = []
    keys: dict[tuple[str, str, int], int] = {}

    def base_of(comp: str, tensor: str, layer_id: int) -> int:
        return keys.setdefault((comp, tensor, layer_id), len(keys)) << 36

    projections: dict[tuple[str, int, int], np.ndarray] = {}

    def held(comp: ComponentLayout, tp: int, rank: int, base: int) -> np.ndarray:
        """Labels of the projection of a full item with label base `base` (cached geometry)."""
        key = (comp.name, tp, rank if comp.shard is not None else 0)
        if key not in projections:
            projections[key] = project(comp, full_labels(0, comp.item_bytes), tp, rank)
        return projections[key] + base

    pre = {r.rank: r for r in plan.prefill}
    writes: dict[tuple[RankId, str, int], list] = {}
    for link in plan.links:
        for e in link.entries:
            writes.setdefault((link.decode, e.component, e.dst_pos), []).append((link.prefill, e))

    for c in layout.components:
        for reg in plan.decode:
            d_bytes = reg.item_bytes(c.name)
            if d_bytes != c.item_bytes_at(D.tp):
                problems.append(CoverageProblem(c.name, reg.rank, ("*", -1),
                                                f"registered item bytes {d_bytes} != layout "
                                                f"{c.item_bytes_at(D.tp)}"))
            for pos, (tensor, layer_id) in enumerate(reg.entries(c.name)):
                expected = held(c, D.tp, reg.rank.tp, base_of(c.name, tensor, layer_id))
                got = np.zeros(d_bytes, dtype=np.int64)
                count = np.zeros(d_bytes, dtype=np.int32)
                for src_rank, e in writes.get((reg.rank, c.name, pos), []):
                    src_entries = pre[src_rank].entries(c.name)
                    if not 0 <= e.src_pos < len(src_entries):
                        problems.append(CoverageProblem(c.name, reg.rank, (tensor, layer_id),
                                                        f"source position {e.src_pos} is not "
                                                        f"registered on prefill {src_rank}"))
                        continue
                    s_tensor, s_layer = src_entries[e.src_pos]
                    src = held(c, P.tp, src_rank.tp, base_of(c.name, s_tensor, s_layer))
                    for seg in e.segments:
                        why = _apply(seg, src, got, count)
                        if why:
                            problems.append(CoverageProblem(c.name, reg.rank, (tensor, layer_id),
                                                            why))
                if (count == 0).any():
                    n = int((count == 0).sum())
                    problems.append(CoverageProblem(c.name, reg.rank, (tensor, layer_id),
                                                    f"{n} of {d_bytes} bytes never written"))
                if (count > 1).any():
                    n = int((count > 1).sum())
                    problems.append(CoverageProblem(c.name, reg.rank, (tensor, layer_id),
                                                    f"{n} bytes written more than once"))
                wrong = (count == 1) & (got != expected)
                if wrong.any():
                    first = int(np.argmax(wrong))
                    problems.append(CoverageProblem(
                        c.name, reg.rank, (tensor, layer_id),
                        f"{int(wrong.sum())} bytes hold the wrong value (first at byte {first}: "
                        f"{_describe(int(got[first]), keys)} instead of "
                        f"{_describe(int(expected[first]), keys)})"))
                if len(problems) >= limit:
                    return problems
    return problems


def _describe(label: int, keys: dict) -> str:
    inv = {v: k for k, v in keys.items()}
    comp, tensor, layer = inv.get(label >> 36, ("?", "?", -1))
    return f"{comp}.{tensor}@{layer} byte {(label & ((1 << 36) - 1)) - 1}"
