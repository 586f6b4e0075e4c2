"""Transfer statistics for vLLM's logger and Prometheus, named like the NIXL connector's.

| name | kind | what |
|---|---|---|
| `vllm:pdc_xfer_time_seconds` | histogram | one request's transfer, request known to pdc -> done |
| `vllm:pdc_post_time_seconds` | histogram | request known -> first write posted (prefill) |
| `vllm:pdc_bytes_transferred` | histogram | bytes of one request |
| `vllm:pdc_num_descriptors` | histogram | descriptors of one request (prefill: submitted; decode: submitted for it by prefill, from prefill's Success) |
| `vllm:pdc_num_failed_transfers` | counter | failed transfers (load errors on decode) |

Labels are vLLM's own (`model_name`, `engine`). Prefill records what it sent, decode what it
received.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

_LISTS = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors")


@dataclass
class PdcConnectorStats(KVConnectorStats):
    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {k: [] for k in _LISTS}
        self.data["num_failed_transfers"] = 0

    def record(self, nbytes: int, descriptors: int, batches: int, t_start: float,
               t_done: float, t_first_post: float = 0.0) -> None:
        self.data["transfer_duration"].append(max(t_done - t_start, 0.0) if t_start else 0.0)
        self.data["post_duration"].append(max(t_first_post - t_start, 0.0)
                                          if t_first_post and t_start else 0.0)
        self.data["bytes_transferred"].append(int(nbytes))
        self.data["num_descriptors"].append(int(descriptors))

    def failed(self) -> None:
        self.data["num_failed_transfers"] += 1

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for k in _LISTS:
                self.data[k].extend(other.data[k])
            self.data["num_failed_transfers"] += other.data["num_failed_transfers"]
        return self

    def reduce(self) -> dict[str, int | float]:
        n = len(self.data["transfer_duration"])
        total_bytes = sum(self.data["bytes_transferred"])
        total_s = sum(self.data["transfer_duration"])
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(total_s / n * 1e3, 3) if n else 0.0,
            "Total MB transferred": round(total_bytes / 1e6, 3),
            "Avg descriptors": round(sum(self.data["num_descriptors"]) / n, 1) if n else 0,
            "Num failed transfers": self.data["num_failed_transfers"],
        }

    def is_empty(self) -> bool:
        return not self.data["transfer_duration"] and not self.data["num_failed_transfers"]

    def clone_and_reset(self) -> PdcConnectorStats:
        old = copy.copy(self)
        self.reset()
        return old


class PdcPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        time_buckets = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]

        def hist(name, doc, buckets):
            m = self._histogram_cls(name=name, documentation=doc, buckets=buckets,
                                    labelnames=labelnames)
            return create_metric_per_engine(m, per_engine_labelvalues)

        self.xfer_time = hist("vllm:pdc_xfer_time_seconds",
                              "Histogram of pdc KV transfer time per request.", time_buckets)
        self.post_time = hist("vllm:pdc_post_time_seconds",
                              "Histogram of time until pdc posted a request's first write.",
                              time_buckets)
        self.bytes = hist("vllm:pdc_bytes_transferred",
                          "Histogram of bytes moved per pdc KV transfer.",
                          [2 ** (10 + i) for i in range(1, 25, 2)])
        self.descriptors = hist("vllm:pdc_num_descriptors",
                                "Histogram of descriptors per pdc KV transfer.",
                                [1, 4, 16, 64, 256, 1000, 4000, 16000, 64000])
        failed = self._counter_cls(name="vllm:pdc_num_failed_transfers",
                                   documentation="Number of failed pdc KV transfers.",
                                   labelnames=labelnames)
        self.failed = create_metric_per_engine(failed, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for metric, key in ((self.xfer_time, "transfer_duration"),
                            (self.post_time, "post_duration"),
                            (self.bytes, "bytes_transferred"),
                            (self.descriptors, "num_descriptors")):
            for v in transfer_stats_data[key]:
                metric[engine_idx].observe(v)
        if transfer_stats_data["num_failed_transfers"]:
            self.failed[engine_idx].inc(transfer_stats_data["num_failed_transfers"])
