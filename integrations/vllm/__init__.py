"""pdc as a vLLM v1 KV connector.

    KVTransferConfig(kv_connector="PdcConnector",
                     kv_connector_module_path="pdc.integrations.vllm",
                     kv_role="kv_producer" | "kv_consumer",
                     kv_connector_extra_config={"family": "vllm-llama", "engine": "mooncake"})

See docs/vllm.md for the settings, the request flow and what differs from vLLM's own
NixlConnector and MooncakeConnector.
"""

from .connector import PdcConnector
from .stats import PdcConnectorStats, PdcPromMetrics

__all__ = ["PdcConnector", "PdcConnectorStats", "PdcPromMetrics"]
