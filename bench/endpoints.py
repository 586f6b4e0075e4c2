"""Endpoints over real engines: the staged path against the direct path, through `pdc demo`.

For each case (engine, spec, prefill -> decode) the same seeded requests run twice in one
invocation, through the real prefill and decode endpoints in separate processes over loopback:
once with the staging arena off (`PDC_STAGING_ARENA_BYTES=0`: the direct path, one descriptor
per head-slice piece) and once with it on (decode chooses the staged path per link). Every
byte of every request is verified against the aggregate labels in both runs; that is the
check. Rows report descriptors, batches, transfer GB/s (bytes / summed first-submit-to-done
time of the requests), wall time and latency; `ratio` compares the two runs of a case.

    python bench/endpoints.py --json bench/results/endpoints.json
    python bench/endpoints.py --small --json /tmp/e.json
"""

from __future__ import annotations

import io
import os
import sys

import _common as C

CASES = [  # (engine, spec file, prefill, decode)
    ("mooncake", "qwen38", "tp=2", "tp=1"),
    ("mooncake", "llama3-70b", "tp=2", "tp=1"),
    ("mooncake", "llama3-70b", "tp=1", "tp=2"),
    ("nixl", "llama3-70b", "tp=2", "tp=1"),
    ("nixl", "llama3-70b", "tp=1", "tp=2"),
]
ARENA_ON = 512 << 20


def run_case(args, engine: str, spec: str, prefill: str, decode: str, rows, checks) -> None:
    from pdc.demo import run_demo

    name = f"{engine} {spec} {prefill}->{decode}"
    got = {}
    for path, arena in (("direct", 0), ("staged", ARENA_ON)):
        os.environ["PDC_STAGING_ARENA_BYTES"] = str(arena)  # the rank processes inherit it
        out, summary = io.StringIO(), {}
        code = run_demo(str(C.ROOT / "specs" / f"{spec}.yaml"), prefill, decode, engine,
                        args.requests, concurrency=args.concurrency, seed=args.seed, out=out,
                        timeout_s=120, summary=summary)
        checks[f"{name} {path}: every request verified"] = code == 0 and \
            summary.get("ok") == args.requests
        if code != 0:
            print(out.getvalue(), file=sys.stderr)
        got[path] = summary
        rows.append({"case": f"{name} {path}", "path": path, "requests": summary.get("ok"),
                     "mib": summary.get("bytes", 0) / 2**20,
                     "descriptors": summary.get("descriptors"),
                     "batches": summary.get("batches"),
                     "staged_links": f"{summary.get('staged_links')}/{summary.get('links')}",
                     "gbps": summary.get("gbps"), "wall_s": summary.get("wall_s"),
                     "p50_ms": summary.get("p50_ms"), "p99_ms": summary.get("p99_ms")})
    os.environ.pop("PDC_STAGING_ARENA_BYTES", None)
    d, s = got["direct"], got["staged"]
    if d.get("descriptors") and s.get("descriptors") and d.get("gbps"):
        rows[-1]["desc_ratio"] = d["descriptors"] / s["descriptors"]
        rows[-1]["gbps_ratio"] = s["gbps"] / d["gbps"]


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cases = CASES
    if args.small:
        args.requests, args.concurrency = 3, 3
        cases = [CASES[0], CASES[3]]
    rows: list[dict] = []
    checks: dict[str, bool] = {}
    for case in cases:
        run_case(args, *case, rows, checks)
    C.table(rows, [("case", "case", ""), ("requests", "ok", "d"), ("mib", "MiB", ",.1f"),
                   ("descriptors", "descriptors", ",d"), ("batches", "batches", ",d"),
                   ("staged_links", "staged links", ""), ("gbps", "GB/s", ".3f"),
                   ("wall_s", "wall s", ".1f"), ("p50_ms", "p50 ms", ".0f"),
                   ("p99_ms", "p99 ms", ".0f"), ("desc_ratio", "desc direct/staged", ",.0f"),
                   ("gbps_ratio", "GB/s staged/direct", ".2f")])
    notes = ["GB/s is bytes over summed first-submit-to-done time of each request; over "
             "loopback TCP on a small CPU box it measures the engines' per-descriptor cost "
             "as much as bandwidth"]
    if args.small:
        notes.append("--small: 3 requests per run; figures are meaningless")
    staged = [r for r in rows if "gbps_ratio" in r]
    goals = {"staged_faster_in_every_case": bool(staged) and
             all(r["gbps_ratio"] > 1 for r in staged) and len(staged) == len(cases)}
    return C.finish("endpoints", args, rows, checks, goals, notes)


if __name__ == "__main__":
    sys.exit(main())
