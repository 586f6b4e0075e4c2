"""Many of each behind SGLang's router, across hosts: 2 prefill + 2 decode SGLang servers with
pdc's backend in network namespaces (prefill host, decode host, router and client host; Note
[Namespace hosts]), the control plane authenticated, requests flowing the whole time while

1. a third prefill server joins: the router is told (POST /workers), the decode servers open
   its endpoint at their first request for it;
2. one prefill server leaves gracefully: the router forgets it (DELETE /workers/ID), its
   in-flight requests finish, then it stops;
3. one prefill server is killed (SIGKILL): only requests it held fail, each with a reason,
   within pdc's liveness window; the router is told at once, as an orchestrator watching the
   process would.

At the end the survivors hold zero pages (SGLang's `num_used_tokens` after a cache flush) and
serve token-identical results. Slow (5 SGLang servers, ~9 min on the loaded 2-core box), so outside
CI: `PDC_SLOW=1 pytest tests/integrations/test_sglang_scaleout.py -s` prints the figures
(docs/deploy.md, "SGLang across hosts").
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
from pdc.runtime import knobs

from pdc.netns import Hosts, inside, unavailable
from pdc.serving import sglang_harness as H

PYTHON = H.sglang_python()
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(PYTHON is None, reason="no SGLang environment: run "
                       "scripts/install-sglang.sh (CI does)"),
    pytest.mark.skipif(bool(unavailable()), reason=f"namespace hosts: {unavailable()}"),
    pytest.mark.skipif(os.environ.get("PDC_SLOW") != "1", reason="slow (5 SGLang servers, "
                       "~9 min): PDC_SLOW=1 pytest tests/integrations/test_sglang_scaleout.py"),
]

NEW_TOKENS = 16
PROMPTS = H.mixed_prompts(12, seed=4)
IN_FLIGHT = 4
# The Rust router's own health checks (5 s timeouts) and circuit breaker took both decode
# servers out at a load of 12 on the 2-core box ("No available decode workers (all circuits
# open or unhealthy)"): here the test is the orchestrator that tells the router of every
# change, and retries are off so that each failure reaches the client.
ROUTER_ARGS = ("--disable-retries", "--disable-health-check", "--disable-circuit-breaker")


def _call(method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"content-type": "application/json"},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@dataclass
class Sent:
    prompt: int
    t_start: float
    t_end: float
    result: H.Result


class Load:
    """IN_FLIGHT clients sending PROMPTS round and round through the router until stopped."""

    def __init__(self, url: str):
        self.url = url
        self.sent: list[Sent] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.next = 0
        self.running: dict[int, float] = {}  # worker -> start of its request in flight
        self.threads = [threading.Thread(target=self._worker, args=(w,), daemon=True)
                        for w in range(IN_FLIGHT)]

    def _worker(self, w: int) -> None:
        while not self.stopping.is_set():
            with self.lock:
                i = self.next % len(PROMPTS)
                self.next += 1
                t0 = self.running[w] = time.monotonic()
            r = H.generate(self.url, PROMPTS[i], NEW_TOKENS, index=i, timeout_s=180)
            with self.lock:
                self.sent.append(Sent(i, t0, time.monotonic(), r))
                del self.running[w]
            if r.error:
                time.sleep(0.5)  # a failing router answers at once: do not spin

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=240)

    def wait_started_before(self, t: float, timeout_s: float = 240) -> None:
        """Until every request sent before `t` has finished."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if all(t0 >= t for t0 in self.running.values()):
                    return
            assert time.monotonic() < deadline, "requests still in flight"
            time.sleep(0.1)

    def done_after(self, t: float) -> int:
        with self.lock:
            return sum(1 for s in self.sent if s.t_start >= t)


@pytest.fixture(scope="module")
def workdir(request):
    d = tempfile.mkdtemp(prefix="pdc-sglang-scaleout-")
    with open(os.open(os.path.join(d, "control-secret"), os.O_WRONLY | os.O_CREAT, 0o600),
              "w") as f:
        f.write(os.urandom(24).hex())
    yield d
    if request.session.testsfailed:
        print(f"servers' logs kept in {d}")
    else:
        shutil.rmtree(d, ignore_errors=True)


def _workers(router: H.Server) -> dict:
    return json.loads(_call("GET", router.url + "/workers")[1])


def _wait_workers(router: H.Server, prefill: int, decode: int, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        w = _workers(router)
        healthy = [x for x in w["workers"] if x.get("is_healthy", True)]
        counts = (sum(x["worker_type"] == "prefill" for x in healthy),
                  sum(x["worker_type"] == "decode" for x in healthy))
        if counts == (prefill, decode):
            return w
        assert time.monotonic() < deadline, f"router workers {counts}, want {prefill, decode}"
        time.sleep(0.5)


def _routed(server: H.Server, router_host: str) -> int:
    """Requests the router handed `server`, from its HTTP access log (a decode server's
    `sglang:num_requests_total` stays 0 in PD mode; its own warm-up request comes from its
    own address)."""
    with open(server.log, errors="replace") as f:
        return sum(f'{router_host}:' in line and '"POST /generate' in line for line in f)


def _worker_id(router: H.Server, url: str) -> str:
    return next(x["id"] for x in _workers(router)["workers"] if x["url"] == url)


def _phases(sent: list[Sent], starts: dict[str, float]) -> dict:
    """Requests by the phase they started in (`starts`: phase -> its start, in order): sent,
    ok, failed and the failures' reasons."""
    names = list(starts)
    out = {n: {"sent": 0, "ok": 0, "failed": 0, "reasons": []} for n in names}
    for s in sent:
        phase = next(n for n in reversed(names) if s.t_start >= starts[n])
        row = out[phase]
        row["sent"] += 1
        if s.result.error:
            row["failed"] += 1
            if s.result.error not in row["reasons"]:
                row["reasons"].append(s.result.error)
        else:
            row["ok"] += 1
    return out


@pytest.mark.timeout(2700)
def test_2p2d_join_graceful_leave_and_kill_across_namespaces(workdir):
    t_run = time.monotonic()
    model = H.make_tiny_model(PYTHON, f"{workdir}/tiny-llama")
    plain = H.start_plain(PYTHON, model, workdir)
    try:
        ref = H.run_prompts(plain.url, PROMPTS, NEW_TOKENS, in_flight=IN_FLIGHT)
    finally:
        plain.stop()
    assert [r.error for r in ref] == [""] * len(PROMPTS)
    reference = [r.tokens for r in ref]
    env = {"PDC_CONTROL_SECRET_FILE": f"{workdir}/control-secret"}
    servers: list[H.Server] = []
    report: dict = {}
    with Hosts(3, tag=f"pdcso{os.getpid() % 10000}") as hosts, \
            inside(hosts.hosts[2].namespace):
        ph, dh, rh = hosts.hosts

        def prefill(name: str) -> tuple[H.Server, int]:
            port = H.free_port()
            s = H.start_server(PYTHON, model, name, workdir, mode="prefill", bootstrap_port=port,
                               extra_env=env, host=ph.address, netns=ph.namespace)
            servers.append(s)
            return s, port

        def decode(name: str, port: int) -> H.Server:
            s = H.start_server(PYTHON, model, name, workdir, mode="decode", bootstrap_port=port,
                               extra_env=env, host=dh.address, netns=dh.namespace)
            servers.append(s)
            return s

        try:
            (p0, b0), (p1, b1) = prefill("p0"), prefill("p1")
            d0, d1 = decode("d0", b0), decode("d1", b1)
            H.wait_ready([p0, p1, d0, d1], 900, progress=print)
            router = H.start_router(PYTHON, p0, b0, d0, workdir, more=((p1, b1), d1),
                                    host=rh.address, netns=rh.namespace, mini_lb=False,
                                    extra_args=ROUTER_ARGS)
            servers.append(router)
            H.wait_ready([router], 120, path="/health", progress=print)
            _wait_workers(router, 2, 2)
            totals = {s.name: H.transfer_totals(s.url) for s in (p0, p1)}
            load = Load(router.url).start()
            try:
                # Steady state: every server takes requests.
                while load.done_after(0) < 24:
                    time.sleep(0.5)
                spread = {s.name: H.transfer_totals(s.url)[0] - totals[s.name][0]
                          for s in (p0, p1)}
                spread.update({s.name: _routed(s, rh.address) for s in (d0, d1)})
                report["spread"] = spread
                errors = sorted({s.result.error for s in load.sent if s.result.error})
                assert all(v > 0 for v in spread.values()), (spread, errors)

                # Join: a third prefill server; the router is told while requests flow.
                p2, b2 = prefill("p2")
                H.wait_ready([p2], 600, progress=print)
                t_join = time.monotonic()
                status, text = _call("POST", router.url + "/workers",
                                     {"url": p2.url, "worker_type": "prefill",
                                      "bootstrap_port": b2})
                assert status in (200, 202), text
                _wait_workers(router, 3, 2)
                while H.transfer_totals(p2.url)[0] < 4:
                    time.sleep(0.5)
                report["join_s"] = round(time.monotonic() - t_join, 1)

                # Graceful leave: the router forgets p0, its in-flight requests finish.
                t_leave = time.monotonic()
                status, text = _call("DELETE", router.url + "/workers/" +
                                     _worker_id(router, p0.url))
                assert status in (200, 202), text
                _wait_workers(router, 2, 2)
                t_removed = time.monotonic()
                load.wait_started_before(t_removed)  # p0's last requests finished
                t_drained = time.monotonic()
                report["leave_drained_s"] = round(t_drained - t_leave, 1)
                p0.stop()

                # Kill: p1 dies with requests in flight; the router is told at once.
                time.sleep(3.0)
                os.killpg(p1.proc.pid, signal.SIGKILL)
                t_kill = time.monotonic()
                p1.proc.wait(timeout=30)
                _call("DELETE", router.url + "/workers/" + _worker_id(router, p1.url))
                t_told = time.monotonic()
                _wait_workers(router, 1, 2)
                while load.done_after(t_told + 5) < 12:
                    time.sleep(0.5)
            finally:
                load.stop()
            sent = load.sent
            failed = [s for s in sent if s.result.error]
            wrong = [s for s in sent if not s.result.error
                     and s.result.tokens != reference[s.prompt]]
            # The kill phase starts once p0 is gone: requests in flight at the kill began in it.
            report["phases"] = _phases(sent, {"steady": 0.0, "join": t_join,
                                              "graceful_leave": t_leave, "kill": t_drained})
            report.update(
                sent=len(sent), ok=len(sent) - len(failed), failed=len(failed),
                reasons=sorted({s.result.error for s in failed}),
                failed_after_kill_s=[round(s.t_end - t_kill, 1) for s in failed],
                wrong_tokens=len(wrong))
            # The survivors hold no pages once their caches are flushed.
            deadline = time.monotonic() + 60
            while True:
                for s in (p2, d0, d1):
                    _call("POST", s.url + "/flush_cache")
                used = {s.name: H.metric_sum(H.metrics(s.url), "sglang:num_used_tokens")
                        for s in (p2, d0, d1)}
                if not any(used.values()) or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            report["used_tokens_after"] = used
            after = H.run_prompts(router.url, PROMPTS[:4], NEW_TOKENS, in_flight=4)
            report["after_ok"] = sum(not r.error and r.tokens == reference[i]
                                     for i, r in enumerate(after))
            report["run_s"] = round(time.monotonic() - t_run)
            print("2P2D scale-out report:", json.dumps(report, indent=1))
        finally:
            for s in reversed(servers):
                s.stop()
    dead_after_s = knobs.get("peer_dead_after_s")
    assert wrong == []
    # Only requests in flight at the kill (started before the router was told) failed, each
    # with a reason, within pdc's liveness window plus SGLang's polling.
    assert all(t_drained <= s.t_start <= t_told for s in failed), report
    assert len(failed) <= IN_FLIGHT, report
    assert all(s.t_end - t_kill < dead_after_s + 20 for s in failed), report
    assert used == {"p2": 0.0, "d0": 0.0, "d1": 0.0}, report
    assert report["after_ok"] == 4, report
