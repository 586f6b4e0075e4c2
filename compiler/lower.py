"""Lowering is a pure function of the layout and the topology, and lives in the runtime
(pdc.runtime.lowering): serving processes make their plans without the compiler. The compiler
proves that same lowering (coverage.py, deployments.py); these names stay importable here.
"""

from __future__ import annotations

from pdc.runtime.lowering import (
    check_topology,
    local_units,
    lower,
    lowering_steps,
    owning_stages,
    replicated_writers,
    request_writer_stages,
    source_position,
    source_stages,
    tp_sources,
)

__all__ = ["check_topology", "local_units", "lower", "lowering_steps", "owning_stages", "replicated_writers",
           "request_writer_stages", "source_position", "source_stages", "tp_sources"]
