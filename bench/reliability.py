"""Reliability under faults and load: the long versions of tests/runtime/test_reliability.py.

    python bench/reliability.py [--storm 10000] [--faults 3000] [--soak 5000] [--fuzz 2000]
                                [--engine mooncake] [--seed 0] [--json out.json]

Scenarios (each one run of pdc.verify.reliability; a count of 0 skips it):
- storm:  1 prefill -> 1 decode rank; 40 % of requests aborted at a random point (half of
          them the moment decode sees their first byte), half of those re-run at once as
          generation + 1 of the same room; decode pages go back to a LIFO free list, so the
          very next request reuses them.
- faults: prefill tp=1 x dp=2 -> decode tp=1 x dp=3; kill -9 of a decode and of a prefill
          rank (each restarted), SIGSTOP of a decode and of a prefill rank (each resumed after
          it was declared dead), all mid-transfer, while the others go on.
- soak:   prefill tp=2 x dp=2 -> decode tp=1 x dp=4 (4 rank pairs, heterogeneous TP; over
          NIXL, which the spec allows equal TP only, decode tp=2 x dp=2),
          every link through the staged path (staged_min_descriptors=0), chunked prefill,
          prefix hits, 10 % aborts with re-runs, 2 % bad page ids from decode, link
          checksums on.
- fuzz:   garbage, mutated, truncated and foreign-fingerprint messages, impersonation,
          unknown rooms, registration floods and oversized messages against the prefill rank
          while verified requests go on.

Every successful request is checked byte by byte against labels of its generation, every
page given back carries a canary that is checked when it is handed out again, and quarantined
pages are never reused. Exits 1 unless every scenario lost nothing, corrupted nothing and
explained every failure.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

from pdc.verify.reliability import run
from pdc.verify.reliability_types import Fault, RelConfig, report_dict

TINY = str(Path(__file__).resolve().parents[1] / "tests" / "runtime" / "specs" / "tiny.yaml")
KNOBS = dict(heartbeat_interval_s=0.1, peer_dead_after_s=2.5, abort_ack_timeout_s=1.5,
             transfer_timeout_s=20.0, prefill_room_timeout_s=30.0, reconnect_interval_s=0.3)
# Eight rank processes: on a 2-core box a control thread can go ~1 s without running
# (endpoint stats: max_stall_ms), so the soak, which is about load, detects failures slower.
SOAK = dict(KNOBS, peer_dead_after_s=10.0, abort_ack_timeout_s=10.0, transfer_timeout_s=30.0,
            prefill_room_timeout_s=60.0, staged_min_descriptors=0)


def scenarios(args) -> list[tuple[str, RelConfig]]:
    out = []
    base = dict(spec=TINY, engine=args.engine, seed=args.seed, knobs=KNOBS, deadline_s=3600)
    if args.storm:
        out.append(("storm", RelConfig(**base, requests=args.storm, abort_rate=0.4,
                                       retry_rate=0.5, concurrency=8)))
    if args.faults:
        n = args.faults
        faults = [Fault(at=n // 10, action="kill", side="decode", dp=2, restart_after_s=0.5),
                  Fault(at=3 * n // 10, action="kill", side="prefill", dp=1,
                        restart_after_s=0.5),
                  Fault(at=5 * n // 10, action="stop", side="decode", dp=1, resume_after_s=4.0),
                  Fault(at=7 * n // 10, action="stop", side="prefill", dp=1,
                        resume_after_s=5.0)]
        out.append(("faults", RelConfig(**base, prefill="tp=1,dp=2", decode="tp=1,dp=3",
                                        requests=n, abort_rate=0.1, concurrency=4,
                                        faults=faults)))
    if args.soak:
        # The spec forbids heterogeneous attention TP over NIXL (its backend matrix): there the
        # soak pairs equal TP, four rank pairs as well.
        decode = "tp=2,dp=2" if args.engine == "nixl" else "tp=1,dp=4"
        out.append(("soak", RelConfig(**{**base, "knobs": SOAK}, prefill="tp=2,dp=2",
                                      decode=decode, requests=args.soak, abort_rate=0.1,
                                      bad_index_rate=0.02, concurrency=6)))
    if args.fuzz:
        knobs = dict(KNOBS, prefill_room_timeout_s=2.0, max_message_bytes=1 << 20,
                     max_registrations=16, max_pending_rooms_per_peer=64,
                     max_finished_rooms=2000)
        out.append(("fuzz", RelConfig(**{**base, "knobs": knobs}, decode="tp=1,dp=2",
                                      decode_groups=(0,), requests=args.fuzz, abort_rate=0.1,
                                      fuzz=True)))
    return out


def machine(engine: str = "mooncake") -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    packages = {"mooncake": ("Mooncake", ("mooncake-transfer-engine-non-cuda",
                                          "mooncake-transfer-engine")),
                "nixl": ("NIXL", ("nixl-cu12", "nixl-cu13", "nixl"))}
    label, names = packages.get(engine, (engine, ()))
    got = "?"
    for name in names:
        try:
            got = version(name)
            break
        except PackageNotFoundError:
            continue
    return (f"{os.cpu_count()} CPU ({model or platform.processor()}), "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"{label} {got}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--storm", type=int, default=10000)
    ap.add_argument("--faults", type=int, default=3000)
    ap.add_argument("--soak", type=int, default=5000)
    ap.add_argument("--fuzz", type=int, default=2000)
    ap.add_argument("--engine", default="mooncake", choices=["mooncake", "nixl"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every report here")
    args = ap.parse_args(argv)
    results, ok = {}, True
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    for name, cfg in scenarios(args):
        print(f"== {name}: {cfg.requests} requests, prefill {cfg.prefill}, decode {cfg.decode}, "
              f"{cfg.engine}", flush=True)
        t0 = time.monotonic()
        log = io.StringIO()
        r = run(cfg, out=log)
        print(log.getvalue() + r.summary(), flush=True)
        clean = (r.lost == 0 and r.corrupted == 0 and not r.unexpected and not r.inconsistent
                 and r.succeeded + r.failed == r.requests)
        ok &= clean
        results[name] = report_dict(r) | {"clean": clean, "seconds": time.monotonic() - t0}
    print("\n| scenario | requests | succeeded | aborts | faults | lost | corrupted | "
          "quarantined | wall |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, d in results.items():
        print(f"| {name} | {d['requests']} | {d['succeeded']} | {d['aborts']} "
              f"({d['retries']} re-runs) | {d['faults_injected']} | {d['lost']} | "
              f"{d['corrupted']} | {d['quarantined']} | {d['wall_s']:.1f} s |")
    cmd = "python bench/reliability.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\ncommand: {cmd.strip()}\nmachine: {machine(args.engine)}\ndate: {started}")
    if args.json:
        where = machine(args.engine)
        Path(args.json).write_text(json.dumps({"command": cmd.strip(), "machine": where,
                                               "date": started, "results": results},
                                              indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
