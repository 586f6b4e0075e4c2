"""Limits that keep loading, checking and lowering any spec bounded in time and memory.

Note [Spec limits]: a spec is untrusted input (a file from a colleague, a bug report, a fuzz
case), and every command that loads one is exposed to it. Each stage therefore refuses,
with a located error and a hint, input beyond a limit far above any real model, before it
does work that grows with that input:

- the file: at most MAX_SPEC_BYTES of UTF-8 text (read before YAML sees it);
- YAML (yaml_loader.scan, one linear pass over parser events before composing): at most
  MAX_DEPTH nested collections and MAX_NODES nodes *after* alias expansion, so an alias
  bomb is caught while it is still 500 bytes of text;
- expressions (expr.py): at most MAX_EXPR_CHARS characters, every value within
  +-MAX_MAGNITUDE;
- the model (model.py): at most MAX_LAYERS layer ids (real and draft), MAX_PARAMS params,
  MAX_COMPONENTS components, MAX_ENTRIES registered entries per rank set, MAX_SHARD_UNITS
  units per sharded axis, MAX_ITEM_BYTES per item, MAX_DEPLOYMENTS deployments;
- a topology (the schema's `side`, pdc.runtime.topology and .lowering, whose limits live in
  pdc.runtime.limits): at most MAX_TP / MAX_PP / MAX_DP /
  MAX_PAGE_SIZE per side and
  MAX_LOWERING_STEPS (entries x units-or-ranks) per plan, MAX_PROOF_BYTES of items checked
  by one coverage proof (it labels every byte).

Every check after these limits is linear (or n log n) in what the limits allow: params are
resolved in dependency order, lowering finds positions through dicts, never `tuple.index`.
The largest real spec (qwen38.yaml) is about 6 KB, 400 nodes, 48 layers and 3 components;
`tests/compiler/test_hostile_specs.py` runs every limit under a time and memory cap.
"""

from __future__ import annotations

# The limits the runtime's topology parsing and lowering enforce too (they live there: the
# runtime never imports the compiler).
from pdc.runtime.limits import (  # noqa: F401  (re-exported)
    MAX_DP,
    MAX_ITEM_BYTES,
    MAX_LAYERS,
    MAX_LOWERING_STEPS,
    MAX_MAGNITUDE,
    MAX_PAGE_SIZE,
    MAX_PP,
    MAX_SPEC_BYTES,
    MAX_TP,
)

MAX_DEPTH = 32
MAX_NODES = 5_000
MAX_EXPR_CHARS = 512
MAX_PARAMS = 2048
MAX_COMPONENTS = 64
MAX_ENTRIES = 65_536
MAX_SHARD_UNITS = 4096
MAX_DEPLOYMENTS = 64
MAX_PROOF_BYTES = 2**30
