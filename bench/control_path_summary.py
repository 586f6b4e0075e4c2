"""Pools the rounds of bench/control_path_ab.sh: per tree, engine and case, p50 and p99 of
decode init() -> Success and of the control path's own phases (init -> prefill's first
submit, prefill's last write done -> decode's Success), over every request of every round.

    python3 bench/control_path_summary.py OUT
"""

from __future__ import annotations

import glob
import json
import os
import sys


def _pct(xs: list[float], q: int) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-q * len(s) // 100) - 1))] if s else float("nan")


def main(out: str) -> int:
    pooled: dict[tuple[str, str], dict[str, list[float]]] = {}
    checks = {}
    rounds: dict[tuple[str, str], list[str]] = {}
    for path in sorted(glob.glob(os.path.join(out, "*-*.json"))):
        tree = os.path.basename(path).split("-")[0]
        d = json.load(open(path))
        checks[os.path.basename(path)] = d.get("all_checks_passed")
        for row in d["rows"]:
            if "ms_all" not in row:
                continue
            p = pooled.setdefault((row["case"], tree), {"total": [], "in": [], "out": [],
                                                         "control": []})
            p["total"] += row["ms_all"]
            p["in"] += [x[0] for x in row["phases_all"]]
            p["out"] += [x[2] for x in row["phases_all"]]
            p["control"] += [x[0] + x[2] for x in row["phases_all"]]
            rounds.setdefault((row["case"], tree), []).append(
                f"{_pct([x[0] + x[2] for x in row['phases_all']], 50):.2f}")
    print("| case | tree | requests | init->Success p50 / p99 ms | control path p50 / p99 ms "
          "| init->first submit p50 / p99 ms | last write done->Success p50 / p99 ms |")
    print("|---|---|---:|---|---|---|---|")
    for (case, tree), p in sorted(pooled.items(), key=lambda kv: (kv[0][0], kv[0][1] != "before")):
        cells = [f"{_pct(p[k], 50):.2f} / {_pct(p[k], 99):.2f}"
                 for k in ("total", "control", "in", "out")]
        print(f"| {case} | {tree} | {len(p['total'])} | " + " | ".join(cells) + " |")
    print()
    print("control path p50 ms of each round (the rounds alternate before, after):")
    for (case, tree), r in sorted(rounds.items()):
        print(f"- {case}, {tree}: {', '.join(r)}")
    print()
    print("checks passed per file:", json.dumps(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
