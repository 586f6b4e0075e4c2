"""End to end: real engines, prefill and decode ranks in separate processes.

Each `pdc demo` run below starts one process per rank, runs requests with mixed lengths,
chunked prefill, decode prefix-cache hits and fragmented and contiguous pages, and checks
every decode byte against the aggregate labels (exit code 0 only when all are verified).
"""

from __future__ import annotations

import importlib
import io
import multiprocessing as mp
import time

import pytest
from pdc.runtime.family import Family

from pdc.demo import run_demo

from ..compiler.planning import ROOT, plan_for

pytestmark = pytest.mark.engines

QWEN = str(ROOT / "specs" / "qwen38.yaml")
GLM = str(ROOT / "specs" / "glm52.yaml")
LLAMA = str(ROOT / "specs" / "llama3-70b.yaml")

CASES = [
    ("mooncake", QWEN, "tp=1", "tp=1"),
    ("mooncake", QWEN, "tp=2", "tp=1"),
    ("mooncake", QWEN, "tp=1", "tp=2"),
    ("mooncake", QWEN, "tp=1,pp=2", "tp=1"),
    ("mooncake", GLM, "tp=2,pp=2", "tp=1"),
    ("mooncake", LLAMA, "tp=2", "tp=1"),
    ("nixl", QWEN, "tp=1", "tp=1"),
    ("nixl", QWEN, "tp=2", "tp=2"),
    ("nixl", QWEN, "tp=1,pp=2", "tp=1"),
    ("nixl", GLM, "tp=2", "tp=1,dp=2"),
    ("nixl", LLAMA, "tp=1", "tp=2"),
]


@pytest.mark.parametrize("engine,spec,prefill,decode", CASES,
                         ids=[f"{e}-{s.split('/')[-1][:-5]}-{p}-{d}" for e, s, p, d in CASES])
def test_demo_moves_every_byte(engine, spec, prefill, decode):
    out = io.StringIO()
    code = run_demo(spec, prefill, decode, engine, requests=5, concurrency=3, seed=3, out=out,
                    timeout_s=30)
    assert code == 0, out.getvalue()
    assert "requests ok      5" in out.getvalue()


STAGED = [
    ("mooncake", QWEN, "tp=2", "tp=1"),
    ("mooncake", LLAMA, "tp=1,pp=2", "tp=2"),
    ("nixl", LLAMA, "tp=2", "tp=1"),
]


@pytest.mark.parametrize("engine,spec,prefill,decode", STAGED,
                         ids=[f"{e}-{s.split('/')[-1][:-5]}-{p}-{d}" for e, s, p, d in STAGED])
def test_staged_path_moves_head_slices_in_few_descriptors(engine, spec, prefill, decode,
                                                          monkeypatch):
    """Heterogeneous TP: the same requests with the staging arena off (direct path, one
    descriptor per head-slice piece) and on (gather, bulk write, scatter); both verified."""
    runs = {}
    for arena in ("0", str(512 << 20)):
        monkeypatch.setenv("PDC_STAGING_ARENA_BYTES", arena)  # the rank processes inherit it
        out, got = io.StringIO(), {}
        code = run_demo(spec, prefill, decode, engine, requests=6, concurrency=3, seed=4,
                        out=out, timeout_s=30, summary=got)
        assert code == 0 and got["ok"] == 6, out.getvalue()
        runs[arena] = got
    direct, staged = runs.values()
    assert direct["bytes"] == staged["bytes"]
    assert direct["staged_links"] == 0 and staged["staged_links"] == staged["links"] > 0
    assert staged["descriptors"] * 20 < direct["descriptors"], (direct, staged)


@pytest.mark.parametrize("stream", [False, True], ids=["chunked", "streamed"])
def test_staging_rings_move_requests_larger_than_the_arena(stream, monkeypatch):
    """Note [Staging ring]: a 1 MiB arena holds no request's whole region (1.25 MiB a page on
    each link), so every staged link moves through a ring of 64 KiB slots over Mooncake;
    every byte is verified, and no link falls back to the direct path."""
    monkeypatch.setenv("PDC_STAGING_ARENA_BYTES", str(1 << 20))
    monkeypatch.setenv("PDC_STAGING_RING_SLOT_BYTES", str(64 << 10))
    out, got = io.StringIO(), {}
    code = run_demo(LLAMA, "tp=1,pp=2", "tp=2", "mooncake", requests=4, concurrency=2,
                    seed=4, out=out, timeout_s=60, stream=stream, summary=got)
    assert code == 0 and got["ok"] == 4, out.getvalue()
    assert got["staged_links"] == got["links"] > 0, got


@pytest.mark.parametrize("engine,spec,prefill,decode", [
    ("mooncake", QWEN, "tp=2", "tp=1"),
    ("nixl", GLM, "tp=1,pp=2", "tp=1"),
])
def test_per_layer_streaming_sends_each_layer_as_the_forward_finishes_it(engine, spec, prefill,
                                                                          decode):
    """Prefill sends with stream=True and calls layer_done per layer, then forward_done: a
    request that issues nothing for a finished layer, or succeeds before forward_done, fails
    the demo (pdc.demo._play_forward); every byte is verified as always."""
    out, got = io.StringIO(), {}
    code = run_demo(spec, prefill, decode, engine, requests=4, concurrency=2, seed=6, out=out,
                    timeout_s=30, stream=True, summary=got)
    assert code == 0 and got["ok"] == 4, out.getvalue()
    assert "streamed per layer" in out.getvalue()
    layout, plan = plan_for(spec, {k: int(v) for k, v in (x.split("=") for x in
                                                          prefill.split(","))}, {"tp": 1})
    moved = {e.layer_id for lk in plan.links for e in lk.entries} & set(layout.all_layer_ids)
    assert got["batches"] >= 4 * len(moved)  # at least one batch per request and layer


@pytest.mark.parametrize("engine,transport", [
    ("mooncake", "mooncake: tcp on 127.0.0.1"), ("nixl", "nixl: ucx(tls=tcp) on lo")])
def test_demo_metrics_scraped_with_rank_labels_and_transport_named(engine, transport):
    import urllib.request

    from pdc.runtime.metrics import TransferMetrics

    metrics = TransferMetrics()
    port = metrics.serve(0)
    out, got = io.StringIO(), {}
    try:
        code = run_demo(LLAMA, "tp=2", "tp=2", engine, requests=5, concurrency=3, seed=2,
                        out=out, timeout_s=30, summary=got, metrics=metrics)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        metrics.close()
    assert code == 0, out.getvalue()
    text = text.decode()
    for side in ("prefill", "decode"):
        for tp in (0, 1):
            lab = f'engine="{engine}",outcome="ok",rank="dp0.pp0.tp{tp}",side="{side}"'
            assert f"pdc:kv_transfer_requests_total{{{lab}}} 5.0" in text, text
    lab = f'engine="{engine}",rank="dp0.pp0.tp0",side="decode"'
    assert f"pdc:kv_transfer_speed_gb_s_count{{{lab}}} 5.0" in text
    # TP 2 -> TP 2: decode rank r hears from prefill rank r only, whose Success statuses say
    # how many descriptors it submitted for decode.
    for tp in (0, 1):
        sent, recv = (_sample(text, "pdc:kv_transfer_descriptors_total",
                             f'engine="{engine}",rank="dp0.pp0.tp{tp}",side="{side}"')
                     for side in ("prefill", "decode"))
        assert sent > 0 and recv == sent, (tp, sent, recv)
    assert got["transports"] and all(t.startswith(transport) for t in got["transports"])
    assert f"transport        {transport}" in out.getvalue()


def _sample(text: str, name: str, labels: str) -> float:
    prefix = f"{name}{{{labels}}} "
    return next(float(ln[len(prefix):]) for ln in text.splitlines() if ln.startswith(prefix))


def test_nixl_rejects_heterogeneous_qwen38_attention_tp(capsys):
    assert run_demo(QWEN, "tp=2", "tp=1", "nixl", requests=1) == 1
    assert "rule `hetero_attention_tp: false`" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_out_of_range_index_fails_only_that_request(engine):
    out = io.StringIO()
    code = run_demo(LLAMA, "tp=2", "tp=1", engine, requests=4, concurrency=4, seed=5, out=out,
                    faults={2: "bad_page"}, timeout_s=30)
    text = out.getvalue()
    assert code == 0, text
    assert "requests ok      3" in text
    assert "fault bad_page room 1002: failed cleanly" in text
    assert "is outside the registered capacity" in text


# ~~~ handshake validation: fail fast, no hang ~~~


def _prefill_rank(plan_json: str, family: str, engine: str, ready, stop) -> None:
    from pdc.runtime.control import BootstrapServer
    from pdc.runtime.endpoints import PrefillEndpoint
    from pdc.runtime.engines import make_engine
    from pdc.runtime.plan_types import Plan, RankId
    from pdc.runtime.pools import Capacity, RankPools

    layout = importlib.import_module(f"pdc.generated.{family}.layout").LAYOUT
    wire = Family.load(family)
    plan = Plan.from_json(plan_json)
    boot = BootstrapServer(1)
    eng = make_engine(engine)
    pools = RankPools(layout, plan.registration("prefill", RankId(0, 0)), Capacity(4, 1, 1, 4))
    ep = PrefillEndpoint(layout, wire, plan, RankId(0, 0), 0, eng, pools, boot.address)
    ready.put(boot.address)
    stop.wait(60)
    ep.close()
    boot.close()


def _decode_against(prefill_plan, decode_plan, family, wire_override=None):
    from pdc.runtime.control import ControlError
    from pdc.runtime.endpoints import DecodeEndpoint
    from pdc.runtime.engines import make_engine
    from pdc.runtime.plan_types import RankId
    from pdc.runtime.pools import Capacity, RankPools

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_prefill_rank,
                       args=(prefill_plan.to_json(), family, "mooncake", ready, stop))
    proc.start()
    try:
        boot = ready.get(timeout=60)
        layout = importlib.import_module(f"pdc.generated.{family}.layout").LAYOUT
        wire = wire_override or Family.load(family)
        eng = make_engine("mooncake")
        pools = RankPools(layout, decode_plan.registration("decode", RankId(0, 0)),
                          Capacity(4, 1, 1, 4))
        ep = DecodeEndpoint(layout, wire, decode_plan, RankId(0, 0), 0, eng, pools, boot)
        t0 = time.monotonic()
        with pytest.raises(ControlError) as info:
            ep.wait_ready(timeout_s=20)
        elapsed = time.monotonic() - t0
        ep.close()
        eng.close()
        return str(info.value), elapsed
    finally:
        stop.set()
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()


def test_page_size_mismatch_fails_fast_at_handshake():
    _, prefill_plan = plan_for(LLAMA, {"tp": 1}, {"tp": 1})
    _, decode_plan = plan_for(LLAMA, {"tp": 1, "page_size": 32}, {"tp": 1, "page_size": 32},
                              page_size=32)
    why, elapsed = _decode_against(prefill_plan, decode_plan, "llama3_70b")
    assert why.startswith("registration rejected by prefill.dp0.pp0.tp0: page size differs: "
                          "prefill 16, decode 32")
    assert elapsed < 10  # a verdict, not the deadline


def test_fingerprint_mismatch_fails_fast_at_handshake():
    import types

    from pdc.runtime import wire as W

    real = Family.load("llama3_70b")
    other = types.SimpleNamespace(
        encode=lambda m: W.encode(m, real.fingerprint ^ 1, real.wire_components),
        decode=lambda b: W.decode(b, real.fingerprint ^ 1, real.wire_components),
        registration_sections=real.registration_sections)
    _, plan = plan_for(LLAMA, {"tp": 1}, {"tp": 1})
    why, elapsed = _decode_against(plan, plan, "llama3_70b", wire_override=other)
    assert "registration rejected by prefill.dp0.pp0.tp0: cannot read its reply" in why
    assert "fingerprint" in why
    assert elapsed < 10
