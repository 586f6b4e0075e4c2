"""Health an orchestrator can probe (Note [Health], runtime/health.py): a rank turns unhealthy
when its writes stall, a peer it depends on dies, or its quarantine passes the bound, each
with a reason; /healthz answers 200 or 503, /metrics carries the request ids as exemplars."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest
from pdc.runtime import knobs
from pdc.runtime.health import HealthCheck, HealthServer
from pdc.runtime.metrics import TransferMetrics

from .failure_tools import send_all, tight_knobs, wait_for
from .test_failures import start


@pytest.fixture(autouse=True)
def _clean_knobs():
    yield
    knobs.reset()


def test_stalled_writes_make_prefill_unhealthy_until_they_complete(pair):
    check = HealthCheck(pair.pre)
    assert check.check().ok
    knobs.override(health_stall_s=0.2)
    pair.peng.hold = True
    s, rv = start(pair, 3, [1, 2], 1, 7)
    send_all(s, [1, 2], 1)
    wait_for(lambda: pair.peng.held, what="writes in flight")
    assert check.check().ok  # the stall clock starts
    time.sleep(0.3)
    h = check.check()
    assert not h.ok and len(h.reasons) == 1
    assert re.fullmatch(r"prefill\.dp0\.pp0\.tp0: transfers stalled: \d+ writes in flight and "
                        r"none completed for 0\.\d+ s \(health_stall_s 0\.2\)", h.reasons[0]), h
    pair.peng.release()
    wait_for(lambda: check.check().ok, what="healthy once the writes complete")
    wait_for(lambda: rv.poll().name == "Success", what="the request")


def test_a_dead_decode_peer_makes_prefill_unhealthy(fam):
    from .failure_tools import Pair

    tight_knobs()
    p = Pair(fam)
    try:
        check = HealthCheck(p.pre)
        wait_for(lambda: check.check().ok, what="healthy while both run")
        p.dec.close()
        h = wait_for(lambda: (lambda x: x if not x.ok else None)(check.check()), timeout=5,
                     what="the dead decode rank")
        assert h.reasons == ("prefill.dp0.pp0.tp0: peer decode.dp0.pp0.tp0 is dead (silent for "
                             "more than 0.6 s)",)
    finally:
        p.pre.close()
        p.boot.close()


def test_quarantine_past_the_bound_makes_decode_unhealthy(pair):
    knobs.override(health_max_quarantined=0)
    check = HealthCheck(pair.dec)
    assert check.check().ok
    pair.peng.hold = True
    s, rv = start(pair, 4, [3], 2, 9)
    send_all(s, [3], 2)
    wait_for(lambda: pair.peng.held, what="a write in flight")
    rv.release()  # given up while a write may land: quarantined
    assert check.check().reasons == (
        "decode.dp0.pp0.tp0: 1 requests quarantined, more than the bound 0 "
        "(health_max_quarantined): their pages are never reused",)
    pair.peng.release()


def _get(url: str, accept: str = "") -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_healthz_and_metrics_over_http(pair):
    metrics = TransferMetrics(log=False)
    pair.dec.metrics = pair.pre.metrics = metrics
    s, rv = start(pair, 11, [1], 1, 5)
    send_all(s, [1], 1)
    wait_for(lambda: rv.poll().name == "Success", what="the request")
    server = HealthServer([HealthCheck(pair.pre), HealthCheck(pair.dec)], metrics)
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert _get(base + "/healthz") == (200, json.dumps({"ok": True, "reasons": []}))
        knobs.override(health_max_quarantined=-1)  # any count is past it: unhealthy
        code, body = _get(base + "/healthz")
        assert code == 503 and json.loads(body) == {"ok": False, "reasons": [
            "decode.dp0.pp0.tp0: 0 requests quarantined, more than the bound -1 "
            "(health_max_quarantined): their pages are never reused"]}
        code, text = _get(base + "/metrics", "application/openmetrics-text")
        assert code == 200
        # the request id on both sides' latency histograms, as exemplars
        for side in ("prefill", "decode"):
            assert re.search(r'pdc_kv_transfer_latency_ms_bucket\{engine="local",le="[^"]+",'
                             rf'rank="dp0\.pp0\.tp0",side="{side}"\}} 1\.0 # '
                             r'\{generation="0",room="11"\}', text), text
        assert _get(base + "/nothing")[0] == 404
    finally:
        server.close()
