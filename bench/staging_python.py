"""Host time of the Python around a replayed staged call, on the CPU, no GPU needed.

What `bench/staging_host.py` times on a GPU is this Python plus the replay's CUDA calls (the
pinned buffer, its copy, the replay; its `--profile` times those one by one). Here the graph
step is left out: each `staging.Launches` gets a `LaunchGraphs` that keeps the call's key and
values and launches nothing, so the time is the call's own work before the CUDA calls (runs
of items, checks, staging offsets, launch alignment, the ids/offsets buffer, the key). Same
workload as staging_host.py: one Llama-3-70B link of an 8K request, prefill TP2 -> decode TP1,
160 staging blocks, fresh page ids each call and the region at one of two places in the arena;
the pools' bytes are never read (allocated, not written). Median of `--reps` calls each.

    python bench/staging_python.py --json out.json
"""

from __future__ import annotations

import statistics
import sys
import time

import _common as C
import numpy as np
import torch


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if args.small:
        args.tokens, args.reps = 256, 20
    from pdc.runtime import staging
    from pdc.runtime.family import Family
    from pdc.runtime.pools import Capacity, TensorPools
    from pdc.runtime.staging_graphs import LaunchGraphs

    class UnwrittenPools(TensorPools):
        def new_bytes(self, nbytes: int, zeroed: bool = True):
            return super().new_bytes(nbytes, zeroed=False)  # pages committed only if touched

    class NoLaunch(LaunchGraphs):
        def run(self, key, anchor, parts, device, build) -> None:
            self.last = (key, sum(len(p) for p in parts))
            self.stats["launched"] += 1

    family = Family.load("llama3_70b")
    layout, plan = family.layout, family.plan_for("tp=2", "tp=1", "local")
    link, pages = plan.links[0], args.tokens // 16
    cap = Capacity(pages=2 * pages, slots=1, aux_rows=1, window_pages=1)
    src = UnwrittenPools(layout, plan.registration("prefill", link.prefill), cap, "cpu")
    dst = UnwrittenPools(layout, plan.registration("decode", link.decode), cap, "cpu")
    blocks, nbytes = staging.link_blocks(link, {"kv": pages, "aux_first_token": 1})
    arena = torch.empty(2 * nbytes, dtype=torch.uint8)
    lx = staging.Launches(staging.family_kernels(layout))
    lx.graphs = NoLaunch()
    rng = np.random.default_rng(0)
    took: dict[str, list[float]] = {"gather": [], "scatter": []}
    for i in range(args.reps + 3):
        ids = rng.permutation(2 * pages)[:pages].astype(np.int64)
        at = int(rng.integers(0, 2)) * nbytes
        out = arena[at:at + nbytes]
        positions = {"kv": (ids, np.arange(pages, dtype=np.int64))}
        dst_ids = {"kv": rng.permutation(2 * pages)[:pages].astype(np.int64),
                   "aux_first_token": np.zeros(1, np.int64)}
        t0 = time.perf_counter()
        lx.gather_chunk(link, blocks, src.view, positions, None, out)
        t1 = time.perf_counter()
        lx.scatter_link(link, blocks, dst.view, dst_ids, out)
        t2 = time.perf_counter()
        if i >= 3:  # the first calls build the link's programs
            took["gather"].append((t1 - t0) * 1e6)
            took["scatter"].append((t2 - t1) * 1e6)
    rows = [{"call": k, "host us": round(statistics.median(v), 1), "calls": len(v)}
            for k, v in took.items()]
    C.table(rows, [("call", "call", ""), ("host us", "host us (median)", ".1f"),
                   ("calls", "calls", "d")])
    print(f"{args.tokens} tokens, {len(blocks)} blocks; last key and values: {lx.graphs.last}")
    # a check, so that the exit status says the run timed what it was asked to
    return C.finish("staging_python", args, rows,
                    {f"{args.reps} calls of each timed": all(len(v) == args.reps
                                                             for v in took.values())})


if __name__ == "__main__":
    sys.exit(main())
