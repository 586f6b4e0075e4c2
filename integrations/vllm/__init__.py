"""pdc as a vLLM v1 KV connector.

    KVTransferConfig(kv_connector="PdcConnector",
                     kv_connector_module_path="pdc.integrations.vllm",
                     kv_role="kv_producer" | "kv_consumer",
                     kv_connector_extra_config={"family": "vllm-llama", "engine": "mooncake"})

See docs/vllm.md for the settings, the request flow and what differs from vLLM's own
NixlConnector and MooncakeConnector.
"""

from __future__ import annotations

import importlib

__all__ = ["PdcConnector", "PdcConnectorStats", "PdcPromMetrics"]
_HOME = {"PdcConnector": ".connector", "PdcConnectorStats": ".stats", "PdcPromMetrics": ".stats"}


def __getattr__(name: str):
    # Imported on first use (vLLM's getattr(module, "PdcConnector")): the modules that need
    # no vLLM (events.py, settings.py) import on a machine without it, as the GPU test of
    # Note [Forward events] does.
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
