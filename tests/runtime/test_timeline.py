"""A request's timeline (Note [Timeline stamps]): the stamps both endpoints log, decode's
descriptor count from prefill's Success, the engine's `seen` mark, and pdc/timeline.py joining
the two sides into phases."""

from __future__ import annotations

import json

from pdc.runtime import knobs
from pdc.runtime.endpoints import KVPoll
from pdc.runtime.metrics import RecordBuffer, mark

from pdc.serving.timeline import PHASES, collect, parse_line, summarize

from .failure_tools import fill, send_all, wait_for

PAGES = [1, 2, 3]


def _one_request(pair, arrived: float):
    pair.pre.metrics, pair.dec.metrics = RecordBuffer(), RecordBuffer()
    fill(pair.ppools, PAGES, 1, 7)
    rv = pair.dec.receiver(5, arrived=arrived)
    rv.init(PAGES, slot=1, aux_row=1)
    sender = pair.pre.sender(5)
    send_all(sender, PAGES, 1)
    wait_for(lambda: rv.poll() == KVPoll.Success, what="decode's Success")
    wait_for(lambda: sender.poll() == KVPoll.Success, what="prefill's Success")
    (p,), (d,) = pair.pre.metrics.drain(), pair.dec.metrics.drain()
    return rv, sender, p, d


def test_decode_reports_the_descriptors_prefill_submitted_for_it(pair):
    import time

    rv, sender, p, d = _one_request(pair, time.monotonic())
    assert p.descriptors > 0
    assert rv.descriptors == d.descriptors == sender.stats.descriptors == p.descriptors
    assert d.bytes == p.bytes > 0


def test_both_sides_stamp_the_request_in_order(pair):
    import time

    arrived = time.monotonic()
    _, _, p, d = _one_request(pair, arrived)
    ps, ds = p.stamps(), d.stamps()
    assert set(ps) == {"start", "requested", "forward_done", "first_write", "done"}
    assert set(ds) == {"start", "arrived", "requested", "done"}
    assert ds["arrived"] == round(arrived, 6) <= ds["start"] <= ds["requested"]
    assert ds["requested"] <= ps["requested"] <= ps["first_write"] <= ps["done"] <= ds["done"]
    assert ps["forward_done"] <= ps["first_write"]
    line = json.loads(d.log_line())
    assert line["t"] == ds and line["descriptors"] == d.descriptors and "t_done" not in line


def test_the_engine_seeing_success_is_marked_once(pair, caplog):
    import time

    knobs.override(transfer_log=1)
    with caplog.at_level("INFO", logger="pdc.transfer"):
        rv, _, p, d = _one_request(pair, time.monotonic())
        rv.poll()
        rv.poll()
    marks = [json.loads(r.message) for r in caplog.records if '"kv_mark"' in r.message]
    assert [(m["mark"], m["room"], m["side"], m["ok"]) for m in marks] == \
        [("seen", 5, "decode", True)]
    assert marks[0]["t"] >= d.stamps()["done"]


def test_timeline_joins_the_sides_into_phases(pair):
    import time

    _, _, p, d = _one_request(pair, time.monotonic())
    lines = [f"INFO pdc.transfer: {p.log_line()}", "unrelated text {\"a\": 1}",
             d.log_line()]
    t_seen = d.stamps()["done"] + 0.004
    lines.append(json.dumps({"event": "kv_mark", "mark": "seen", "side": "decode", "room": 5,
                             "generation": 0, "t": t_seen}))
    lines.append(json.dumps({"event": "kv_mark", "mark": "first_token", "side": "decode",
                             "room": 5, "generation": 0, "t": t_seen + 0.010}))
    assert parse_line(lines[1]) is None
    reqs = collect(lines, "run1")
    assert list(reqs) == [("run1", 5, 0)]
    rows = {r.phase: r for r in summarize(reqs.values())}
    first_token_way = {"to prefill", "prefill token", "token out"}  # no router marks here
    assert set(rows) == {name for name, *_ in PHASES} - first_token_way | {"arrive to token"}
    assert all(r.n == 1 for r in rows.values())
    assert round(rows["first token"].p50_ms, 3) == 10.0
    assert round(rows["engine sees"].p50_ms, 3) == 4.0
    total = rows["arrive to token"].p50_ms
    parts = sum(rows[n].p50_ms for n in ("decode queue", "ask", "wait forward", "submit",
                                          "transfer", "tell decode", "engine sees",
                                          "first token"))
    assert abs(total - parts) < 1e-6


def test_timeline_lays_out_the_first_tokens_way_from_prefill(pair):
    # Note [SGLang first token from prefill]: pdc's router and prefill's scheduler mark it.
    import time

    _, _, p, d = _one_request(pair, time.monotonic())
    start = p.stamps()["start"]

    def marked(what, side, t):
        return json.dumps({"event": "kv_mark", "mark": what, "side": side, "room": 5,
                           "generation": 0, "t": t})

    lines = [p.log_line(), d.log_line(), marked("router_in", "router", start - 0.003),
             marked("token_out", "prefill", start + 0.020),
             marked("router_token", "router", start + 0.027)]
    rows = {r.phase: r for r in summarize(collect(lines, "run1").values())}
    got = {n: round(rows[n].p50_ms, 3) for n in ("to prefill", "prefill token", "token out",
                                                 "router to token")}
    assert got == {"to prefill": 3.0, "prefill token": 20.0, "token out": 7.0,
                   "router to token": 30.0}


def test_bench_timeline_reads_log_folders(tmp_path, pair, capsys):
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import timeline as bench_timeline

    _, _, p, d = _one_request(pair, time.monotonic())
    run = tmp_path / "run"
    run.mkdir()
    (run / "prefill.log").write_text(f"some engine text\npdc.transfer: {p.log_line()}\n")
    (run / "decode.log").write_text(f"pdc.transfer: {d.log_line()}\n")
    assert bench_timeline.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "pdc timeline: 1 requests of 1 runs" in out and "transfer" in out
    (tmp_path / "empty").mkdir()
    assert bench_timeline.main([str(tmp_path / "empty")]) == 1
    assert capsys.readouterr().err == (
        f"timeline: error: no finished request with both sides' kv_transfer lines in "
        f"{tmp_path / 'empty'}\n  hint: run the engines with PDC_TRANSFER_LOG=1\n")
    mark("first_token", "decode", 5)  # the knob is off: nothing logged, nothing raised


class _WakingEngine:
    """Wraps the tests' ManualEngine: batches end on `release()` (another thread), which
    calls the completion callback (Note [Completion wake-up]); counts polls."""

    def __init__(self, inner):
        self.inner, self.polls, self.callbacks = inner, 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def on_completion(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def poll(self, batch):
        self.polls += 1
        return self.inner.poll(batch)

    def release(self):
        n = self.inner.release()
        for cb in self.callbacks:
            cb()
        return n


def _polls_while_in_flight(fam, worker_poll: int) -> int:
    import time

    from pdc.runtime.control import BootstrapServer
    from pdc.runtime.endpoints import DecodeEndpoint, PrefillEndpoint

    from .failure_tools import R0, ManualEngine

    knobs.override(worker_poll=worker_poll)
    boot, peng = BootstrapServer(1), _WakingEngine(ManualEngine())
    ppools, dpools = fam.pools("prefill"), fam.pools("decode")
    pre = PrefillEndpoint(fam.layout, fam.wire, fam.plan, R0, 0, peng, ppools, boot.address)
    dec = DecodeEndpoint(fam.layout, fam.wire, fam.plan, R0, 0, ManualEngine(), dpools,
                         boot.address)
    try:
        dec.wait_ready(5)
        peng.inner.hold = True
        rv = dec.receiver(9)
        rv.init(PAGES, slot=1, aux_row=1)
        send_all(pre.sender(9), PAGES, 1)
        wait_for(lambda: peng.inner.held, what="writes in flight")
        before = peng.polls
        time.sleep(0.3)
        during = peng.polls - before
        peng.release()
        wait_for(lambda: rv.poll() == KVPoll.Success, what="decode's Success")
        return during
    finally:
        dec.close()
        pre.close()
        boot.close()
        knobs.reset()


def test_the_worker_sleeps_until_the_engine_says_a_batch_ended(fam):
    """An engine that reports finished batches wakes the transfer worker; it does not poll
    them every poll_sleep_s (a few looks at its deadlines only), and worker_poll=1 brings
    the polling back. Counts, not times: the writes stay in flight until released."""
    woken = _polls_while_in_flight(fam, 0)
    polled = _polls_while_in_flight(fam, 1)
    assert woken < 20 < 60 < polled, (woken, polled)
