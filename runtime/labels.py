"""Deterministic per-byte labels of aggregate state, for verifying transfers end to end.

The aggregate (non-PD) content of one item is a pure function of (seed, room, component,
tensor, layer id, position of the item within the request); a rank holds its attention-TP
projection of it (Note [Shard ownership] in layout_types). Prefill fills its pools with
these labels, decode checks every byte it received against the same function.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .layout_types import ComponentLayout


def item_labels(seed: int, room: int, comp: ComponentLayout, tensor: str, layer_id: int,
                position: int) -> np.ndarray:
    key = f"{seed}/{room}/{comp.name}/{tensor}/{layer_id}/{position}".encode()
    s = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.frombuffer(np.random.default_rng(s).bytes(comp.item_bytes), np.uint8)


def project(comp: ComponentLayout, full: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """The bytes of a full item that attention-TP rank `rank` of `tp` holds."""
    g = comp.shard
    if g is None:
        return full
    axis = sum(g.group_units) * g.unit_elems
    a = full.reshape(g.outer, axis, g.inner_bytes)
    starts = np.cumsum((0,) + g.group_units[:-1])
    parts = []
    for grp, unit in g.local_units(tp, rank):
        e0 = (starts[grp] + unit) * g.unit_elems
        parts.append(a[:, e0:e0 + g.unit_elems, :])
    return np.concatenate(parts, axis=1).reshape(-1)
