"""The prefill transfer worker sleeping until woken vs polling (Note [Completion wake-up]).

One process holds a prefill and a decode endpoint of the vllm-llama family (2 layers, pages of
32 tokens, the tiny model of `pdc vllm-demo`) over two real engines, and a Python thread that
stands for a serving engine's scheduler: it counts loop turns while it holds the GIL. Both
ways run in this one invocation, in turns, on the same endpoints' code: `worker_poll=1` (the
worker polls in-flight writes every `poll_sleep_s` and wakes every 10 x that while idle, what
pdc did before 2026-12-03) and `worker_poll=0` (it sleeps until a message, a sender call or a
finished batch wakes it). Per way:

- idle: process CPU ms per wall second with both endpoints open and no request (no scheduler
  thread running);
- requests: `--requests` one-at-a-time requests of `--tokens` tokens (decode init -> decode
  Success, the decode side polling every 0.5 ms as an engine step would), p50 / p99 ms, and
  the scheduler thread's turns per second during them relative to its rate alone (1.0 = pdc
  took nothing from it).

Every request's bytes are compared with prefill's (the check). No timing is asserted.

    python bench/worker_wake.py --engine mooncake --json out.json
"""

from __future__ import annotations

import os
import sys
import threading
import time

import _common as C

FAMILY = "vllm_llama"
PAGES = 256


def _endpoints(engine_name: str, poll: int):
    import numpy as np
    from pdc.runtime import knobs
    from pdc.runtime.control import BootstrapServer
    from pdc.runtime.endpoints import DecodeEndpoint, PrefillEndpoint
    from pdc.runtime.engines import make_engine
    from pdc.runtime.family import Family
    from pdc.runtime.plan_types import RankId
    from pdc.runtime.pools import Capacity, RankPools

    knobs.override(worker_poll=poll)
    fam = Family.load(FAMILY)
    plan = fam.plan_for("tp=1", "tp=1", engine_name)
    layout = __import__(f"pdc.generated.{FAMILY}.layout", fromlist=["LAYOUT"]).LAYOUT
    cap = Capacity(pages=PAGES, slots=4, aux_rows=4, window_pages=PAGES)
    r0 = RankId(0, 0)
    ppools = RankPools(layout, plan.registration("prefill", r0), cap)
    dpools = RankPools(layout, plan.registration("decode", r0), cap)
    for pos in range(len(ppools.buffers["kv"])):
        view = ppools.view("kv", pos)
        view[:] = np.random.default_rng(pos).integers(0, 255, view.shape, dtype=np.uint8)
    boot = BootstrapServer(1)
    pre = PrefillEndpoint(layout, fam, plan, r0, 0, make_engine(engine_name), ppools,
                          boot.address)
    dec = DecodeEndpoint(layout, fam, plan, r0, 0, make_engine(engine_name), dpools,
                         boot.address)
    dec.wait_ready(30)
    return boot, pre, dec, ppools, dpools, plan.topology.prefill.page_size


def _spinner():
    state = {"turns": 0, "stop": False}

    def spin():
        while not state["stop"]:
            state["turns"] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    return state, t


def _spin_rate(seconds: float) -> float:
    state, t = _spinner()
    t0 = time.perf_counter()
    time.sleep(seconds)
    n = state["turns"] / (time.perf_counter() - t0)
    state["stop"] = True
    t.join()
    return n


def run_way(engine_name: str, poll: int, requests: int, tokens: int, alone: float,
            checks: dict) -> dict:
    import numpy as np
    from pdc.runtime.endpoints import KVPoll

    boot, pre, dec, ppools, dpools, page = _endpoints(engine_name, poll)
    try:
        time.sleep(0.3)  # handshakes settle
        c0, w0 = time.process_time(), time.perf_counter()
        time.sleep(2.0)
        idle_cpu = (time.process_time() - c0) / (time.perf_counter() - w0) * 1e3
        n_pages = -(-tokens // page)
        rng = np.random.default_rng(poll)
        lat = []
        state, t = _spinner()
        t0 = time.perf_counter()
        ok = True
        for i in range(requests):
            src = rng.choice(PAGES, n_pages, replace=False)
            dst = rng.choice(PAGES, n_pages, replace=False)
            room = 1000 * (poll + 1) + i
            s = pre.sender(room)
            s.send(list(src), 0, True, tokens)
            rv = dec.receiver(room)
            start = time.perf_counter()
            rv.init(list(dst))
            while rv.poll() not in (KVPoll.Success, KVPoll.Failed):
                time.sleep(0.0005)
            lat.append((time.perf_counter() - start) * 1e3)
            ok &= rv.poll() == KVPoll.Success
            for pos in range(len(ppools.buffers["kv"])):
                ok &= bool(np.array_equal(ppools.view("kv", pos)[src],
                                          dpools.view("kv", pos)[dst]))
            rv.release()
            while s.poll() not in (KVPoll.Success, KVPoll.Failed):
                time.sleep(0.0005)
        rate = state["turns"] / (time.perf_counter() - t0)
        state["stop"] = True
        t.join()
        checks[f"{engine_name} worker_poll={poll}: every byte"] = ok
        lat.sort()
        return {"engine": engine_name, "worker": "polls" if poll else "woken",
                "idle_cpu_ms_per_s": round(idle_cpu, 2),
                "p50_ms": round(lat[len(lat) // 2], 3),
                "p99_ms": round(lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], 3),
                "scheduler_rate": round(rate / alone, 3)}
    finally:
        dec.close()
        pre.close()
        boot.close()


def main() -> int:
    ap = C.parser(__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("mooncake", "nixl"), default="mooncake")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--turns", type=int, default=2, help="alternations of the two ways")
    args = ap.parse_args()
    if args.small:
        args.requests, args.turns = 20, 1
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    rows, checks = [], {}
    alone = _spin_rate(2.0)
    for _ in range(args.turns):
        for poll in (1, 0):
            rows.append(run_way(args.engine, poll, args.requests, args.tokens, alone, checks))
    C.table(rows, [("engine", "engine", ""), ("worker", "worker", ""),
                   ("idle_cpu_ms_per_s", "idle CPU ms/s", ".2f"), ("p50_ms", "p50 ms", ".3f"),
                   ("p99_ms", "p99 ms", ".3f"), ("scheduler_rate", "scheduler rate", ".3f")])
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return C.finish("worker_wake", args, rows, checks,
                    notes=[f"load average {os.getloadavg()}"])


if __name__ == "__main__":
    sys.exit(main())
