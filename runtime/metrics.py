"""Per-request transfer metrics: one record per finished request and side, a structured log line,
and a Prometheus exporter whose names follow SGLang's `sglang:kv_transfer_*` family.

Note [Transfer durations]: every duration is taken between two monotonic stamps, and a stamp
that was never set (0.0) makes the duration 0, never "now minus zero": a request that failed
before its first write, or a side that has no bootstrap phase, must not report a bogus hour-long
latency or an infinite rate. Bytes are the bytes actually written or received for the request
(pages sent beyond a prefix hit, slot items, aux rows), not the prompt's full length.

Note [Timeline stamps]: the log line of a record carries the request's stamps (`t`, seconds of
time.monotonic(), which every process of one host reads from the same clock) so that
bench/timeline.py can join the two sides of a request by room and lay out where its time to
first token went. Prefill: `start` (its room opened), `requested` (decode's TransferRequest
arrived), `forward_done` (the forward wrote the last chunk), `first_write` (first batch
submitted), `done` (last write completed, Success). Decode: `arrived` (the serving engine
first saw the request, when the integration says), `start` (receiver made), `requested`
(TransferRequests sent), `done` (every prefill rank reported Success). `mark()` adds the
points no record holds: decode's engine saw the Success (`seen`), the first token left
(`first_token`, from the driver that sees it); on the first token's way from prefill (Note
[SGLang first token from prefill]), prefill's scheduler streamed it (`token_out`) and pdc's
router had the request (`router_in`) and sent the token on (`router_token`). Across hosts the clocks differ: compare
stamps of one side only.

Prometheus metrics (labels: `side` prefill/decode, `rank` e.g. `dp0.pp0.tp1`, `engine`):

| name | kind | meaning |
|---|---|---|
| `pdc:kv_transfer_latency_ms` | histogram | request known -> terminal state |
| `pdc:kv_transfer_bootstrap_ms` | histogram | request known -> peers linked and registered |
| `pdc:kv_transfer_wait_ms` | histogram | bootstrap done -> first write submitted (prefill's forward) |
| `pdc:kv_transfer_transfer_ms` | histogram | first write submitted -> last write done |
| `pdc:kv_transfer_speed_gb_s` | histogram | bytes / transfer time (requests that wrote bytes) |
| `pdc:kv_transfer_total_mb` | histogram | bytes of one request, MB (10^6) |
| `pdc:kv_transfer_bytes_total` | counter | bytes of succeeded requests |
| `pdc:kv_transfer_descriptors_total` | counter | descriptors submitted (prefill), or submitted for it by the prefill ranks (decode) |
| `pdc:kv_transfer_requests_total` | counter | finished requests, by `outcome` ok/failed |
| `pdc:kv_transfer_failed_total` | counter | failed requests |
| `pdc:kv_transfer_staging_ring_waits_total` | counter | times a staged piece waited for a free slot of decode's ring (prefill; Note [Staging ring] in runtime/staging_ring.py) |
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from . import knobs

LOG = logging.getLogger("pdc.transfer")

_MS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000,
               10000, 30000, 60000)
_GBS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 200, 400, 800)
_MB_BUCKETS = (0.01, 0.1, 1, 4, 16, 64, 256, 1024, 4096, 16384)


def duration_ms(start: float, end: float) -> float:
    """end - start in ms; 0 when either stamp is unset or they are out of order."""
    if start <= 0.0 or end <= 0.0 or end < start:
        return 0.0
    return (end - start) * 1e3


@dataclass(frozen=True)
class TransferRecord:
    """What one side saw of one request, taken when the request reached a terminal state."""

    side: str  # "prefill" | "decode"
    rank: str  # "dp0.pp0.tp1"
    room: int
    ok: bool
    reason: str  # "" when ok
    bytes: int  # written (prefill) or reported written to this rank (decode)
    descriptors: int  # submitted by this rank (prefill); 0 on decode
    batches: int
    engine: str
    t_start: float  # monotonic s: decode init() / prefill's first sender() or request
    t_bootstrap_done: float  # peers linked and registered for this request (0 = unset)
    t_first_write: float  # first batch submitted (prefill) or first progress seen (decode)
    t_done: float  # terminal state reached
    generation: int = 0  # prefill: the use's generation (0 until decode asked); decode: its own
    t_arrived: float = 0.0  # decode: the serving engine first saw the request (0 = not told)
    t_forward_done: float = 0.0  # prefill: the forward wrote the last chunk (0 = unset)
    # prefill: batches of a streamed chunk's ready layers, issued before its forward was done
    layer_batches: int = 0
    ring_waits: int = 0  # prefill: times a staged piece waited for a free ring slot

    @property
    def bootstrap_ms(self) -> float:
        return duration_ms(self.t_start, self.t_bootstrap_done)

    @property
    def wait_ms(self) -> float:
        return duration_ms(self.t_bootstrap_done or self.t_start, self.t_first_write)

    @property
    def transfer_ms(self) -> float:
        return duration_ms(self.t_first_write, self.t_done)

    @property
    def latency_ms(self) -> float:
        return duration_ms(self.t_start, self.t_done)

    @property
    def gb_s(self) -> float:
        ms = self.transfer_ms
        return self.bytes / (ms * 1e6) if ms > 0 and self.bytes else 0.0

    def stamps(self) -> dict[str, float]:
        """The monotonic stamps that were set (Note [Timeline stamps]), by phase name."""
        named = (("start", self.t_start), ("arrived", self.t_arrived),
                 ("requested", self.t_bootstrap_done), ("forward_done", self.t_forward_done),
                 ("first_write", self.t_first_write), ("done", self.t_done))
        # Decode's "first write" is its request (it writes nothing): not a stamp of its own.
        return {k: round(v, 6) for k, v in named
                if v > 0.0 and not (k == "first_write" and self.side == "decode")}

    def as_dict(self) -> dict:
        d = asdict(self)
        for k in ("t_start", "t_bootstrap_done", "t_first_write", "t_done", "t_arrived",
                  "t_forward_done"):
            d.pop(k)
        d.update(bootstrap_ms=round(self.bootstrap_ms, 3), wait_ms=round(self.wait_ms, 3),
                 transfer_ms=round(self.transfer_ms, 3), latency_ms=round(self.latency_ms, 3),
                 gb_s=round(self.gb_s, 4), t=self.stamps())
        return d

    def log_line(self) -> str:
        """One JSON object on one line (`event: kv_transfer`), for log pipelines."""
        return json.dumps({"event": "kv_transfer", **self.as_dict()}, sort_keys=True)


def _log(line: str) -> None:
    """One line on the `pdc.transfer` logger. A serving engine configures only its own
    loggers, which would leave INFO lines of this one unseen: when nothing would show them,
    they go to stderr (the engine's log) on a handler of their own."""
    if LOG.level == logging.NOTSET:
        LOG.setLevel(logging.INFO)
        if not LOG.hasHandlers():
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            LOG.addHandler(handler)
    LOG.info(line)


def emit(metrics: TransferMetrics | RecordBuffer | None, rec: TransferRecord) -> None:
    """Hand a finished request's record to the process's metrics; without metrics, the
    structured log line alone when the `transfer_log` knob asks for it."""
    if metrics is not None:
        metrics.observe(rec)
    elif knobs.get("transfer_log"):
        _log(rec.log_line())


def mark(what: str, side: str, room: int, generation: int = 0, t: float = 0.0,
         **fields: Any) -> None:
    """A point of a request's timeline that no record holds (Note [Timeline stamps]), e.g.
    the serving engine saw decode's Success, or its first token left: one JSON line
    (`event: kv_mark`) on the transfer log when the `transfer_log` knob is on."""
    if knobs.get("transfer_log"):
        _log(json.dumps({"event": "kv_mark", "mark": what, "side": side, "room": room,
                         "generation": generation,
                         "t": round(t or time.monotonic(), 6), **fields}, sort_keys=True))


class RecordBuffer:
    """Keeps records for a caller that ships them elsewhere (e.g. a rank process reporting to
    its parent); `emit()` accepts it wherever it accepts TransferMetrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[TransferRecord] = []

    def observe(self, rec: TransferRecord) -> None:
        with self._lock:
            self._records.append(rec)

    def drain(self) -> list[TransferRecord]:
        with self._lock:
            out, self._records = self._records, []
        return out


class TransferMetrics:
    """Prometheus metrics of the transfers of one process (any number of endpoints).

    Each instance has its own registry, so several endpoints or tests in one process never
    collide on metric names; `serve()` exposes it over HTTP (the /metrics text format).
    """

    def __init__(self, log: bool | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.log = bool(knobs.get("transfer_log")) if log is None else log
        self._lock = threading.Lock()
        self.records_seen = 0
        labels = ("side", "rank", "engine")

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"pdc:kv_transfer_{name}", doc, labels, buckets=buckets,
                             registry=self.registry)

        self._latency = hist("latency_ms", "request known to terminal state, ms", _MS_BUCKETS)
        self._bootstrap = hist("bootstrap_ms", "request known to peers registered, ms",
                               _MS_BUCKETS)
        self._wait = hist("wait_ms", "bootstrap done to first write submitted, ms",
                          _MS_BUCKETS)
        self._transfer = hist("transfer_ms", "first write submitted to last write done, ms",
                              _MS_BUCKETS)
        self._speed = hist("speed_gb_s", "bytes of a request over its transfer time, GB/s",
                           _GBS_BUCKETS)
        self._total_mb = hist("total_mb", "bytes of one request, MB", _MB_BUCKETS)
        self._bytes = Counter("pdc:kv_transfer_bytes", "bytes of succeeded requests", labels,
                              registry=self.registry)
        self._descriptors = Counter("pdc:kv_transfer_descriptors", "descriptors submitted",
                                    labels, registry=self.registry)
        self._requests = Counter("pdc:kv_transfer_requests", "finished requests",
                                 (*labels, "outcome"), registry=self.registry)
        self._failed = Counter("pdc:kv_transfer_failed", "failed requests", labels,
                               registry=self.registry)
        self._ring_waits = Counter("pdc:kv_transfer_staging_ring_waits",
                                   "staged pieces that waited for a free ring slot", labels,
                                   registry=self.registry)
        self._server: Any = None  # prometheus_client's WSGIServer once serve() ran

    def observe(self, rec: TransferRecord) -> None:
        lv = (rec.side, rec.rank, rec.engine)
        with self._lock:
            self.records_seen += 1
            self._requests.labels(*lv, "ok" if rec.ok else "failed").inc()
            # Note [Health]: the exemplar names the request (room, generation) whose latency
            # fell in a bucket, so a slow one is found in both sides' records and logs.
            ids = {"room": str(rec.room), "generation": str(rec.generation)}
            self._latency.labels(*lv).observe(rec.latency_ms, exemplar=ids)
            if rec.t_bootstrap_done:
                self._bootstrap.labels(*lv).observe(rec.bootstrap_ms)
            self._descriptors.labels(*lv).inc(rec.descriptors)
            if rec.ring_waits:
                self._ring_waits.labels(*lv).inc(rec.ring_waits)
            if rec.ok:
                self._bytes.labels(*lv).inc(rec.bytes)
                self._total_mb.labels(*lv).observe(rec.bytes / 1e6)
                if rec.t_first_write:
                    self._wait.labels(*lv).observe(rec.wait_ms)
                    self._transfer.labels(*lv).observe(rec.transfer_ms, exemplar=ids)
                if rec.gb_s > 0:
                    self._speed.labels(*lv).observe(rec.gb_s)
            else:
                self._failed.labels(*lv).inc()
        if self.log:
            _log(rec.log_line())

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def exposition(self, openmetrics: bool = False) -> tuple[bytes, str]:
        """(body, content type): Prometheus text, or OpenMetrics with exemplars."""
        if openmetrics:
            from prometheus_client.openmetrics import exposition as om

            return om.generate_latest(self.registry), om.CONTENT_TYPE_LATEST
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serves /metrics on host:port (0 = a free port) in a daemon thread; returns the port."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
