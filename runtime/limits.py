"""Limits of a topology and of one lowering, shared by the compiler and the runtime.

The runtime parses topologies and lowers plans itself (serving processes never import the
compiler), so the limits those steps enforce live here; the compiler's other limits, and the
reasoning behind all of them, are in compiler/limits.py (Note [Spec limits]). A spec file
holds at most MAX_SPEC_BYTES; that bound is here too because diagnostics echo spec lines.
"""

from __future__ import annotations

MAX_SPEC_BYTES = 256 * 1024
MAX_LAYERS = 4096  # layer ids, real and draft
MAX_TP = 256
MAX_PP = 256
MAX_DP = 1024
MAX_PAGE_SIZE = 65_536
MAX_LOWERING_STEPS = 1_000_000
# A bound family (runtime/binding.py) re-checks these for the served model's values.
MAX_MAGNITUDE = 2**64
MAX_ITEM_BYTES = 16 * 2**20
