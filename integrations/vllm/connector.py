"""PdcConnector: the class vLLM loads; one instance per role (scheduler or worker)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .metadata import PdcConnectorMetadata
from .settings import check_parallel, parse_settings
from .stats import PdcConnectorStats, PdcPromMetrics


class PdcConnector(KVConnectorBase_V1, SupportsHMA):
    """SupportsHMA: vLLM keeps its hybrid KV cache manager on, so a hybrid model (attention
    and GDN/Mamba layers) gets one KV cache group per layer type; a model with attention
    layers only still has one group and takes the same path as before."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        self.settings = parse_settings(cfg.kv_role, cfg.kv_connector_extra_config)
        check_parallel(vllm_config)
        self.sched = self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import PdcScheduler

            self.sched = PdcScheduler(self.settings, vllm_config, cfg.engine_id,
                                      kv_cache_config)
        else:
            from .worker import PdcWorker

            self.worker = PdcWorker(self.settings, vllm_config, kv_cache_config)

    # ~~~ scheduler side ~~~

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.sched.bind(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> PdcConnectorMetadata:
        return self.sched.build_connector_meta(scheduler_output)

    def on_new_request(self, request) -> None:
        self.sched.on_new_request(request)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool,
                                                                        dict[str, Any] | None]:
        return self.sched.request_finished_all_groups(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self.sched.update_connector_output(connector_output)

    # ~~~ worker side ~~~

    def register_kv_caches(self, kv_caches) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a request runs only after get_finished reported its KV.
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        # the step's metadata is bound before the forward (Note [Sends at the first layer])
        self.worker.save_kv_layer(layer_name, self._get_connector_metadata())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]):
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=self.worker.take_failed_requests())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> PdcConnectorStats | None:
        return self.worker.take_stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return PdcConnectorStats(data=data) if data is not None else PdcConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues):
        return PdcPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.sched is not None:
            self.sched.shutdown()
