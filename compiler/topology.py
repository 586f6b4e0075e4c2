"""Topology of a spec deployment; the rest of the topology stage lives in the runtime.

Parsing and resolving sides (pdc.runtime.topology) is needed by serving processes, which
never import the compiler; this module only turns a deployment's `SideSpec` into a `Side`.
"""

from __future__ import annotations

from pdc.runtime.topology import (
    SIDE_KEYS,
    SIDE_MAX,
    parse_side_arg,
    resolve_side,
    split_stages,
    topology_from_args,
)

from .layout import FamilyLayout
from .model import SideSpec

__all__ = ["SIDE_KEYS", "SIDE_MAX", "parse_side_arg", "resolve_side", "side_from_spec", "split_stages",
           "topology_from_args"]


def side_from_spec(layout: FamilyLayout, side: SideSpec, what: str):
    return resolve_side(layout, side.tp, side.pp, side.dp, side.page_size, side.stages,
                        what=what, loc=side.loc)
