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
    a = full.reshape(g.outer, g.axis_elems, g.inner_bytes)
    sizes = g.unit_sizes
    parts = []
    for grp, unit in g.local_units(tp, rank):
        e0 = g.unit_offset(grp, unit)
        parts.append(a[:, e0:e0 + sizes[grp], :])
    return np.concatenate(parts, axis=1).reshape(-1)


def merge(comp: ComponentLayout, parts: list[np.ndarray], tp: int) -> tuple[np.ndarray, list[int]]:
    """The inverse of `project`: full items from the bytes every rank of a TP group holds.

    `parts[r]` is rank r's `[n, item_bytes_at(tp)]` bytes of n items; returns the full
    `[n, item_bytes]` items and the ranks whose copy of a replicated unit (GQA replication,
    or a replicated component) differs from a lower rank's copy: a TP engine would compute
    with each rank's own copy, so a replica that disagrees is a transfer error too.
    """
    if len(parts) != tp:
        raise ValueError(f"merge of '{comp.name}' needs {tp} ranks' bytes, got {len(parts)}")
    n = parts[0].shape[0]
    full = np.zeros((n, comp.item_bytes), np.uint8)
    written = np.zeros(comp.item_bytes, bool)
    disagree = []
    for r, local in enumerate(parts):
        where = project(comp, np.arange(comp.item_bytes), tp, r)
        if local.shape != (n, len(where)):
            raise ValueError(f"rank {r} holds {local.shape} bytes of '{comp.name}', expected "
                             f"{(n, len(where))}")
        seen = written[where]
        if not np.array_equal(full[:, where[seen]], local[:, seen]):
            disagree.append(r)
        full[:, where[~seen]] = local[:, ~seen]
        written[where] = True
    if not written.all():
        raise ValueError(f"the ranks of '{comp.name}' hold {int(written.sum())} of its "
                         f"{comp.item_bytes} bytes")
    return full, disagree
