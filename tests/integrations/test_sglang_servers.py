"""pdc inside real SGLang 0.5.23 servers: a prefill and a decode server (separate processes,
`--disaggregation-transfer-backend pdc`) behind SGLang's router, against a plain server.

Needs the SGLang environment of scripts/install-sglang.sh (CI builds it); skipped with that
reason when it is absent. Lean on purpose (CI budget): one tiny random-weight Llama, one plain
server for the reference tokens (stopped before the pairs start), one PD pair per engine
shared by every test of that engine. The Mooncake pair's prefill sends per layer and sends
its cached prefix early (Note [SGLang per-layer sends]); the NIXL pair's does neither, the
negative control of the per-layer check.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.error

import pytest

from pdc.serving import sglang_harness as H

PYTHON = H.sglang_python()
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(PYTHON is None, reason="no SGLang environment: run "
                       "scripts/install-sglang.sh (CI does)"),
]

NEW_TOKENS = 16
PROMPTS = H.mixed_prompts(10, seed=1)  # 1 .. 300 tokens: up to 5 chunks of 64, 16-token pages
BAD_PAGE_ROOM = 7_000_001  # faults.py: the last chunk names a page beyond the KV capacity
EXTRA_PAGE_ROOM = 7_000_002  # faults.py: the last chunk carries one page too many
FAULTS = f"page_out_of_range@{BAD_PAGE_ROOM},extra_page@{EXTRA_PAGE_ROOM}"


@pytest.fixture(scope="module")
def workdir():
    d = tempfile.mkdtemp(prefix="pdc-sglang-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def model(workdir):
    return H.make_tiny_model(PYTHON, f"{workdir}/tiny-llama")


@pytest.fixture(scope="module")
def reference(model, workdir):
    """Greedy tokens of a plain (non-PD) SGLang server for every prompt."""
    plain = H.start_plain(PYTHON, model, workdir)
    try:
        results = H.run_prompts(plain.url, PROMPTS, NEW_TOKENS, in_flight=4)
    finally:
        plain.stop()
    assert [r.error for r in results] == [""] * len(PROMPTS)
    return [r.tokens for r in results]


LAST_CORE = str((os.cpu_count() or 1) - 1)
# Note [SGLang per-layer sends]: on for the Mooncake pair, off (the default) for NIXL's. The
# NIXL pair's prefill runs pdc's threads on decode's core (knob endpoint_cpus, Note [Endpoint
# CPUs]), the Mooncake pair's where the server computes (the default); it holds a chunked
# request's chunks until the last (knob sglang_hold_chunks, Note [SGLang held chunks]).
PAIR_ENV = {"mooncake": {"PDC_SGLANG_LAYER_SEND": "1", "PDC_SGLANG_CACHED_SEND": "1"},
            "nixl": {"PDC_ENDPOINT_CPUS": LAST_CORE, "PDC_SGLANG_HOLD_CHUNKS": "1"}}


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def pair(request, model, workdir, reference):
    p = H.PDPair.start(PYTHON, model, workdir, engine=request.param,
                       prefill_env={"PDC_SGLANG_FAULTS": FAULTS, "PDC_TRANSFER_LOG": "1",
                                    **PAIR_ENV[request.param]})
    yield p
    p.stop()


def _prefill_records(pair: H.PDPair) -> list[dict]:
    """The prefill server's transfer log (knob transfer_log): one record per request."""
    with open(pair.prefill.log) as f:
        lines = [line[line.index('{"'):] for line in f if '"event": "kv_transfer"' in line]
    return [json.loads(line) for line in lines]


def _direct(pair: H.PDPair, prompt: list[int], room: int, timeout_s: float = 120.0):
    """One request sent to prefill and decode directly (as the router does), with our room."""
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.bootstrap_port,
             "bootstrap_room": room}
    out = {}

    def post(name, url):
        out[name] = H.generate(url, prompt, NEW_TOKENS, timeout_s=timeout_s, extra=extra)

    threads = [threading.Thread(target=post, args=a)
               for a in (("prefill", pair.prefill.url), ("decode", pair.decode.url))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out["prefill"], out["decode"]


def test_pd_pair_is_token_identical_to_a_plain_server(pair, reference):
    results = H.run_prompts(pair.router.url, PROMPTS, NEW_TOKENS, in_flight=4)
    assert [r.error for r in results] == [""] * len(PROMPTS)
    mismatched = [i for i, (r, ref) in enumerate(zip(results, reference, strict=True))
                  if r.tokens != ref]
    assert mismatched == []
    assert all(len(r.tokens) == NEW_TOKENS for r in results)


def _places(pid: int) -> set[str]:
    """The CPU lists every thread of `pid` and of its child processes may run on."""
    pids, places = [pid], set()
    while pids:
        p = pids.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/status") as f:
                    places |= {ln.split()[1] for ln in f if ln.startswith("Cpus_allowed_list")}
                with open(f"/proc/{p}/task/{task}/children") as f:
                    pids += [int(c) for c in f.read().split()]
        except OSError:
            continue  # a thread or process that ended meanwhile
    return places


def test_prefill_and_decode_servers_compute_on_a_core_each(pair):
    # Note [Server cores]: every process and thread of prefill's server on core 0, of
    # decode's on the last core; with endpoint_cpus (the NIXL pair, Note [Endpoint CPUs])
    # prefill's pdc threads on the last core, SGLang's own on core 0
    engine = "mooncake" if "-mooncake-" in pair.prefill.name else "nixl"
    pdc_cores = {LAST_CORE} if "PDC_ENDPOINT_CPUS" in PAIR_ENV[engine] else set()
    assert _places(pair.prefill.proc.pid) == {"0"} | pdc_cores
    assert _places(pair.decode.proc.pid) == {LAST_CORE}


def test_first_tokens_from_prefill_through_pdcs_router_are_token_identical(pair, reference):
    """Note [SGLang first token from prefill]: every prompt's first token reaches the client
    from prefill, straight to the router's token socket (Note [First token straight to the
    router]), and decode's first token equals it (the router checks)."""
    router = pair.first_token_router()
    try:
        results = H.run_prompts(router.url, PROMPTS, NEW_TOKENS, in_flight=4)
    finally:
        router.stop()
    assert [r.error for r in results] == [""] * len(PROMPTS)
    assert [r.tokens for r in results] == reference
    stats = router.stats  # decode's token may win a race on a loaded box, never differ
    assert stats["first_direct"] + stats["first_from_prefill"] + stats["first_from_decode"] \
        == len(PROMPTS)
    assert stats["first_direct"] >= 1
    assert (stats["mismatches"], stats["errors"], stats["stray_datagrams"]) == (0, 0, 0)


def test_first_tokens_with_sglangs_optimistic_prefill(model, workdir, reference):
    """The first-token row of `sglang-demo --compare` runs its servers with SGLang's
    optimistic prefill (prefill's forward does not wait for decode's request; the backend's
    sender then gets its page count and decode's prefix after the forward): every prompt is
    token-identical, and prefill's log shows forwards that ran before decode asked."""
    from pdc.serving.sglang_demo import OPTIMISTIC

    logs = os.path.join(workdir, "optimistic")
    os.makedirs(logs, exist_ok=True)
    p = H.PDPair.start(PYTHON, model, logs, server_args=OPTIMISTIC)
    router = p.first_token_router()
    try:
        results = H.run_prompts(router.url, PROMPTS, NEW_TOKENS, in_flight=4)
    finally:
        router.stop()
        p.stop()
    assert [r.error for r in results] == [""] * len(PROMPTS)
    assert [r.tokens for r in results] == reference
    with open(p.prefill.log) as f:
        optimistic = [int(m) for m in re.findall(r"#optimistic-req: (\d+)", f.read())]
    assert max(optimistic, default=0) >= 1


def test_prefix_hits_keep_the_tokens_and_layers_leave_during_the_forward(pair, reference):
    """The prompts again: prefill's radix cache now holds them (whole pages, the last one
    recomputed: Note [SGLang swapped pages]), chunked over up to 5 forwards, 4 in flight."""
    results = H.run_prompts(pair.router.url, PROMPTS, NEW_TOKENS, in_flight=4)
    assert [(r.error, r.tokens) for r in results] == [("", t) for t in reference]
    records = [r for r in _prefill_records(pair) if r["ok"]]
    assert records
    early = sum(r["layer_batches"] for r in records)
    if "-mooncake-" in pair.prefill.name:
        assert early > 0  # a layer's pages were written before that forward ended
    else:
        assert early == 0
        # Note [SGLang held chunks]: one write per request, the prompts of 5 chunks too
        assert max(r["batches"] for r in records) == 1


@pytest.mark.parametrize("room, reason", [
    (BAD_PAGE_ROOM, "is outside the registered capacity"),
    (EXTRA_PAGE_ROOM, "exceed the"),
])
def test_wrong_page_list_fails_that_request_with_pdc_reason(pair, reference, room, reason):
    prefill, decode = _direct(pair, PROMPTS[1], room)
    assert decode.error and reason in decode.error, decode.error
    assert prefill.error, "prefill reported success for a request pdc refused"
    # the next request is untouched
    after = H.generate(pair.router.url, PROMPTS[2], NEW_TOKENS)
    assert (after.error, after.tokens) == ("", reference[2])


def _used_tokens(url: str) -> float:
    return H.metric_sum(H.metrics(url), "sglang:num_used_tokens")


def test_client_disconnect_mid_transfer_leaks_no_pages(pair, reference):
    # Fresh 300-token prompts (five chunked-prefill chunks, nothing cached), the client hanging
    # up at several points of the prefill forward and its transfer.
    fresh = H.mixed_prompts(2, seed=99)[1]
    errors = []
    for i, after_s in enumerate((0.0, 0.1, 0.3, 0.6)):
        prompt = [(t + i) % 509 + 3 for t in fresh]
        errors.append(H.generate(pair.router.url, prompt, 200, disconnect_after_s=after_s).error)
    # on an idle box the later cuts may come after the 200 tokens did: a whole answer, no cut
    assert errors[:2] == ["disconnected by the client"] * 2, errors
    assert set(errors[2:]) <= {"disconnected by the client", ""}, errors
    # Both sides free every page once the aborted requests drained (SGLang's own idle
    # self-check also fails the scheduler on a leak); prefill's radix cache is flushed first.
    deadline = time.monotonic() + 60
    while True:
        try:
            H._get(pair.prefill.url + "/flush_cache", 10.0)
        except urllib.error.HTTPError:  # 400 while aborted requests still drain: retry
            pass
        used = (_used_tokens(pair.prefill.url), _used_tokens(pair.decode.url))
        if used == (0.0, 0.0) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert used == (0.0, 0.0)
    after = H.run_prompts(pair.router.url, PROMPTS[:4], NEW_TOKENS, in_flight=4)
    assert [(r.error, r.tokens) for r in after] == [("", t) for t in reference[:4]]


def test_transfer_metrics_reach_sglang_metrics(pair, reference):
    before = H.metrics(pair.prefill.url)
    results = H.run_prompts(pair.router.url, PROMPTS[:4], NEW_TOKENS, in_flight=4)
    assert [r.error for r in results] == [""] * 4
    # prefill's scheduler observes a transfer's metric when it next polls the sender, which
    # may be after decode has replied: wait (bounded) until all four are counted
    count = "sglang:kv_transfer_latency_ms_count"
    deadline = time.monotonic() + 30
    while True:
        after = H.metrics(pair.prefill.url)
        if H.metric_sum(after, count) - H.metric_sum(before, count) >= 4 or \
                time.monotonic() > deadline:
            break
        time.sleep(0.2)

    def delta(name):
        return H.metric_sum(after, name) - H.metric_sum(before, name)

    assert delta("sglang:kv_transfer_latency_ms_count") == 4
    assert delta("sglang:kv_transfer_total_mb_count") == 4
    # bytes: every page of the four prompts (K and V of 2 layers, 1 KiB per page each) plus
    # the aux row, as pdc counted them
    pages = sum(-(-len(p) // H.PAGE_SIZE) for p in PROMPTS[:4])
    aux_row = 3 * 64 + 2 * 64 + 512 + 512 + 128 + 64 + 64
    assert delta("sglang:kv_transfer_total_mb_sum") == pytest.approx(
        (pages * 4 * 1024 + 4 * aux_row) / (1024 * 1024), rel=1e-6)
    assert delta("sglang:kv_transfer_latency_ms_sum") > 0


def test_prefill_death_fails_the_waiting_request_within_the_heartbeat_time(pair, reference):
    """Last test of each pair: it kills the prefill server."""
    import os
    import signal

    from pdc.runtime import knobs

    # A request decode holds (its transfer request sent) that prefill never started: only
    # prefill's death can end it early, through pdc's heartbeats.
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.bootstrap_port,
             "bootstrap_room": 7_000_003}
    box = {}
    waiter = threading.Thread(target=lambda: box.setdefault("r", H.generate(
        pair.decode.url, PROMPTS[4], NEW_TOKENS, extra=extra, timeout_s=300)))
    waiter.start()
    time.sleep(3.0)  # decode bootstraps the request and sends its transfer request
    os.killpg(pair.prefill.proc.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    waiter.join(timeout=120)
    assert not waiter.is_alive()
    failed_after_s = time.monotonic() - t_kill
    dead_after_s = knobs.get("peer_dead_after_s")
    assert "silent for" in box["r"].error, box["r"].error
    # pdc's heartbeat bound plus SGLang's polling, far below its 300 s bootstrap timeout and
    # pdc's 60 s transfer deadline
    assert failed_after_s < dead_after_s + 20
    assert pair.decode.alive()
