"""Transfer metrics: the duration guard, bytes and rates of a record, the log line, and a
Prometheus scrape over HTTP."""

from __future__ import annotations

import json
import urllib.request

from pdc.runtime.metrics import TransferMetrics, TransferRecord, duration_ms


def _rec(**kw) -> TransferRecord:
    base = dict(side="prefill", rank="dp0.pp0.tp1", room=7, ok=True, reason="", bytes=4_000_000,
                descriptors=12, batches=3, engine="mooncake", t_start=100.0,
                t_bootstrap_done=100.002, t_first_write=100.010, t_done=100.012)
    base.update(kw)
    return TransferRecord(**base)


def test_duration_from_an_unset_stamp_is_zero():
    assert duration_ms(0.0, 5.0) == 0.0
    assert duration_ms(5.0, 0.0) == 0.0
    assert duration_ms(5.0, 4.0) == 0.0
    assert abs(duration_ms(1.0, 1.5) - 500.0) < 1e-9


def test_record_durations_and_rate():
    r = _rec()
    assert round(r.bootstrap_ms, 6) == 2.0
    assert round(r.wait_ms, 6) == 8.0
    assert round(r.transfer_ms, 6) == 2.0
    assert round(r.latency_ms, 6) == 12.0
    assert round(r.gb_s, 6) == 2.0  # 4 MB in 2 ms


def test_failed_before_first_write_reports_no_transfer_and_no_rate():
    r = _rec(ok=False, reason="peer died", bytes=0, t_bootstrap_done=0.0, t_first_write=0.0)
    assert (r.bootstrap_ms, r.wait_ms, r.transfer_ms, r.gb_s) == (0.0, 0.0, 0.0, 0.0)
    assert round(r.latency_ms, 6) == 12.0


def test_log_line_is_one_json_object():
    line = _rec().log_line()
    assert "\n" not in line
    d = json.loads(line)
    assert d["event"] == "kv_transfer" and d["room"] == 7 and d["bytes"] == 4_000_000
    assert d["transfer_ms"] == 2.0 and d["gb_s"] == 2.0 and "t_start" not in d


def test_prometheus_scrape_has_sglang_style_names_with_rank_labels():
    m = TransferMetrics()
    m.observe(_rec())
    m.observe(_rec(room=8, ok=False, reason="bad index", bytes=0, t_first_write=0.0))
    m.observe(_rec(side="decode", rank="dp0.pp0.tp0", descriptors=0))
    port = m.serve(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        m.close()
    text = body.decode()
    lab = 'engine="mooncake",rank="dp0.pp0.tp1",side="prefill"'
    assert f"pdc:kv_transfer_latency_ms_count{{{lab}}} 2.0" in text
    assert f"pdc:kv_transfer_speed_gb_s_count{{{lab}}} 1.0" in text
    assert f"pdc:kv_transfer_total_mb_sum{{{lab}}} 4.0" in text
    assert f"pdc:kv_transfer_bootstrap_ms_count{{{lab}}} 2.0" in text
    assert f"pdc:kv_transfer_failed_total{{{lab}}} 1.0" in text
    assert f"pdc:kv_transfer_bytes_total{{{lab}}} 4e+06" in text
    assert f"pdc:kv_transfer_descriptors_total{{{lab}}} 24.0" in text
    assert 'pdc:kv_transfer_requests_total{engine="mooncake",outcome="failed",' \
           'rank="dp0.pp0.tp1",side="prefill"} 1.0' in text
    assert 'pdc:kv_transfer_latency_ms_count{engine="mooncake",rank="dp0.pp0.tp0",' \
           'side="decode"} 1.0' in text


def test_structured_log_is_opt_in(caplog):
    quiet, loud = TransferMetrics(), TransferMetrics(log=True)
    with caplog.at_level("INFO", logger="pdc.transfer"):
        quiet.observe(_rec())
        assert not caplog.records
        loud.observe(_rec())
    assert len(caplog.records) == 1 and json.loads(caplog.records[0].message)["room"] == 7


def test_ring_waits_are_counted_per_rank():
    """Note [Staging ring]: pieces that waited for a free slot of decode's ring."""
    m = TransferMetrics(log=False)
    m.observe(_rec(ring_waits=3))
    m.observe(_rec(room=8, ring_waits=2))
    m.observe(_rec(room=9))
    lab = 'engine="mooncake",rank="dp0.pp0.tp1",side="prefill"'
    assert f"pdc:kv_transfer_staging_ring_waits_total{{{lab}}} 5.0" in m.text()
    assert json.loads(_rec(ring_waits=3).log_line())["ring_waits"] == 3
