"""Where the time to first token goes, per phase, from pdc's transfer log (pdc/serving/timeline.py).

Run engines with PDC_TRANSFER_LOG=1 (the demos' `--timeline` does), then point this at their
log folders (one folder = one run) or log files:

    python bench/timeline.py LOGDIR [LOGDIR ...] [--json out.json]

Prints one row per phase (n, p50, p99, mean ms) over the succeeded requests, every run
together, then per run with --per-run. Requests are joined across the prefill and decode
logs by (room, generation) within a run; all stamps must come from one host.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdc.serving.timeline import print_summary, read_runs, summarize  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="log folders (one per run) or log files")
    ap.add_argument("--per-run", action="store_true", help="a table per run as well")
    ap.add_argument("--json", metavar="PATH", help="write the rows here")
    args = ap.parse_args(argv)
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        print(f"timeline: error: {missing[0]}: no such file or folder", file=sys.stderr)
        return 1
    requests = read_runs(args.paths)
    rows = summarize(requests)
    if not rows:
        print("timeline: error: no finished request with both sides' kv_transfer lines in "
              f"{', '.join(args.paths)}\n  hint: run the engines with PDC_TRANSFER_LOG=1",
              file=sys.stderr)
        return 1
    ok = [r for r in requests if r.ok]
    print_summary(rows, sys.stdout, f"pdc timeline: {len(ok)} requests of "
                                    f"{len({r.run for r in requests})} runs")
    out = {"all": [asdict(r) for r in rows]}
    if args.per_run:
        for run in sorted({r.run for r in requests}):
            mine = summarize([r for r in requests if r.run == run])
            print_summary(mine, sys.stdout, f"run {run}")
            out[run] = [asdict(r) for r in mine]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
