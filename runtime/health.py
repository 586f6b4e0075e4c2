"""Health an orchestrator can probe: an endpoint is unhealthy when its transfers stall, its
quarantine grows past a bound, a peer it depends on is dead, or its control thread stopped.

Note [Health]: `HealthCheck(endpoint).check()` reads the endpoint's own state (liveness,
counters, in-flight writes) under its lock and says why it is unhealthy, each reason one line
that names the peer, the count or the seconds. `serve_health()` answers HTTP GET /healthz
with 200 {"ok": true} or 503 {"ok": false, "reasons": [...]} for every check given (a
Kubernetes liveness or readiness probe, a load balancer's health check) and /metrics with
the process's TransferMetrics in the Prometheus or OpenMetrics text format (the latter
carries exemplars: the room and generation of a request per latency bucket, the id that
joins its records on both sides). Thresholds are the knobs `health_stall_s` and
`health_max_quarantined`. A check keeps the last progress it saw, so it is meant to be
polled (every probe is a poll); the first poll only starts the stall clock.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import knobs


@dataclass(frozen=True)
class Health:
    ok: bool
    reasons: tuple[str, ...]


class HealthCheck:
    """Note [Health] of one PrefillEndpoint or DecodeEndpoint."""

    def __init__(self, endpoint: Any, name: str = ""):
        self.ep = endpoint
        self.side = "prefill" if hasattr(endpoint, "rooms") else "decode"
        self.name = name or f"{self.side}.{endpoint.rank_label}"
        self._done = -1  # batches completed at the last poll
        self._since = time.monotonic()  # when that count last changed

    def check(self, now: float | None = None) -> Health:
        now = time.monotonic() if now is None else now
        ep = self.ep
        stall_s = float(knobs.get("health_stall_s"))
        bound = int(knobs.get("health_max_quarantined"))
        with ep.lock:
            dead = sorted(getattr(p, "name", str(p)) for p in ep.liveness.dead)
            quarantined = int(ep.counters.get("quarantined", 0))
            done = int(ep.counters.get("batches_done", 0))
            in_flight = sum(len(r.inflight) for r in getattr(ep, "rooms", {}).values())
            last_tick = ep.liveness.last_tick
        reasons = [f"{self.name}: peer {p} is dead (silent for more than "
                   f"{knobs.get('peer_dead_after_s'):.3g} s)" for p in dead]
        if self.side == "decode" and quarantined > bound:  # only decode quarantines pages
            reasons.append(f"{self.name}: {quarantined} requests quarantined, more than the "
                           f"bound {bound} (health_max_quarantined): their pages are never "
                           "reused")
        if done != self._done or not in_flight:
            self._done, self._since = done, now
        elif now - self._since > stall_s:
            reasons.append(f"{self.name}: transfers stalled: {in_flight} writes in flight and "
                           f"none completed for {now - self._since:.3g} s (health_stall_s "
                           f"{stall_s:.3g})")
        if last_tick and now - last_tick > stall_s:
            reasons.append(f"{self.name}: the control thread has not run for "
                           f"{now - last_tick:.3g} s")
        return Health(not reasons, tuple(reasons))


def check_all(checks: list[HealthCheck]) -> Health:
    results = [c.check() for c in checks]
    reasons = tuple(r for h in results for r in h.reasons)
    return Health(not reasons, reasons)


class HealthServer:
    """/healthz and /metrics over HTTP in a daemon thread (Note [Health])."""

    def __init__(self, checks: list[HealthCheck], metrics: Any = None, port: int = 0,
                 host: str = "127.0.0.1"):
        self.checks = checks
        self.metrics = metrics
        self._lock = threading.Lock()  # checks keep state: one probe at a time
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server name
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    with outer._lock:
                        h = check_all(outer.checks)
                    body = json.dumps({"ok": h.ok, "reasons": list(h.reasons)}).encode()
                    self._answer(200 if h.ok else 503, "application/json", body)
                elif path == "/metrics" and outer.metrics is not None:
                    om = "application/openmetrics-text" in self.headers.get("Accept", "")
                    text, kind = outer.metrics.exposition(om)
                    self._answer(200, kind, text)
                else:
                    self._answer(404, "text/plain", b"not found: /healthz, /metrics\n")

            def _answer(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass  # probes every few seconds would flood the serving engine's log

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="pdc-health",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
