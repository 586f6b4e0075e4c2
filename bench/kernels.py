"""(a) Gather/scatter copy kernels against a contiguous copy of the same bytes, on one device.

One 8K-token Llama-3-70B request: 80 layers x K/V = 160 pools, 8 KV heads x 128, pages of
1/16/64 tokens, bf16 (2 B) and fp8 (1 B) values, page ids a random subset of a pool twice the
request's size, in random order. `gather` packs the request's pages into one staging buffer,
`scatter` unpacks it (runtime/copy_kernels.py, one launch for all 160 pools). The limit is a
torch contiguous device-to-device copy of the same number of bytes, timed in the same run,
interleaved with the kernels. Extra rows: gather of sequential page ids (same kernel, no random
access) and other tilings, to show where any gap comes from.

    python bench/kernels.py --json out/kernels.json          # GPU
    python bench/kernels.py --small --json /tmp/k.json       # CPU, Triton interpreter
"""

from __future__ import annotations

import os
import sys

if "--small" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import time

import _common as C
import numpy as np
import torch
from pdc.runtime import copy_kernels as ck

HEADS, HEAD_DIM = 8, 128
DTYPES = {"bf16": 2, "fp8": 1}


def alt_tilings(item: int) -> tuple:
    """Tilings tried beside copy_kernels.default_tiling (16 KiB tiles, 8 warps, <= 64 KiB per
    program): 32 KiB tiles with 16 warps and 64 KiB tiles with 16 warps, rows of whole items
    for small items."""
    out = []
    for tile, iters in ((32768, 4), (65536, 2)):
        block = min(item, tile)
        rows = max(1, tile // block)
        out.append(ck.Tiling(rows=rows, block_bytes=block,
                             iters=max(1, min(iters, item // block)), num_warps=16))
    return tuple(out)


def timer(dev: torch.device):
    """fn, reps -> seconds per call: CUDA events on the current stream, or the host clock."""
    def run(fn, reps: int) -> float:
        if dev.type == "cuda":
            fn()
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(reps)]
            for a, b in evs:
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize(dev)
            return C.median([a.elapsed_time(b) / 1e3 for a, b in evs])
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return C.median(out)
    return run


def host_launch_us(dev, fn, reps: int) -> float:
    """Host time of queueing one launch (no sync inside), median."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    return C.median(out) * 1e6


def geometry(args, dev, page: int, dname: str, rng, checks, notes, tilings: bool) -> list[dict]:
    b = DTYPES[dname]
    item = page * HEADS * HEAD_DIM * b
    n = -(-args.tokens // page)
    entries = 2 * args.layers
    cap = 2 * n
    arena = torch.empty(entries * cap * item, dtype=torch.uint8, device=dev)
    arena.random_(0, 256)
    pools = [arena[e * cap * item:(e + 1) * cap * item] for e in range(entries)]
    table = ck.EntryTable([ck.Entry(p, ck.SegmentSpec.whole(item)) for p in pools])
    idx = torch.from_numpy(rng.choice(cap, n, replace=False).astype(np.int64)).to(dev)
    seq = torch.arange(n, dtype=torch.int64, device=dev)
    nbytes = n * item * entries
    staging = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    other = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    tag = f"p{page}/{dname}"

    # Correctness first, on this very data: the kernels against torch indexing.
    ck.gather(table, idx, staging, check_indices=False)
    ck.gather_reference(table, idx, other)
    checks[f"{tag}: gather == torch reference"] = bool(torch.equal(staging, other))
    staging.random_(0, 256)
    ck.scatter(table, idx, staging, check_indices=False)
    ck.gather_reference(table, idx, other)
    checks[f"{tag}: scatter == torch reference"] = bool(torch.equal(staging, other))

    run = timer(dev)
    ops = {
        "copy": lambda: other.copy_(staging),
        "gather": lambda: ck.gather(table, idx, staging, check_indices=False),
        "scatter": lambda: ck.scatter(table, idx, staging, check_indices=False),
        "gather_sequential_ids": lambda: ck.gather(table, seq, staging, check_indices=False),
    }
    if (page, dname) == (16, "bf16"):
        # The family's own geometry: the runtime's staged path calls the generated module
        # (generated/llama3_70b/kernels.py), which fixes each component's alignment promise.
        from pdc.generated.llama3_70b import kernels as gen

        ops["gather_generated"] = lambda: gen.gather("kv", table, idx, staging,
                                                     check_indices=False)
        ops["scatter_generated"] = lambda: gen.scatter("kv", table, idx, staging,
                                                       check_indices=False)
    best: dict[str, float] = {}
    for _ in range(args.rounds):  # interleaved rounds, best round median per op
        for name, fn in ops.items():
            t = run(fn, args.reps)
            best[name] = min(best.get(name, t), t)
    copy_gbps = C.gbps(nbytes, best["copy"])
    tile = ck.default_tiling(item, n, dev)
    rows = []
    for name in [op for op in ops if op != "copy"]:
        gb = C.gbps(nbytes, best[name])
        rows.append({"case": f"{tag}/{name}", "page": page, "dtype": dname,
                     "op": name.removesuffix("_generated"),
                     "tiling": "default", "family": None if name.endswith("ids") else
                     "generated" if name.endswith("generated") else "default",
                     "unit_bytes": item, "units": n * entries,
                     "bytes": nbytes, "ms": best[name] * 1e3, "gbps": gb,
                     "copy_ms": best["copy"] * 1e3, "copy_gbps": copy_gbps,
                     "ratio_to_copy": best["copy"] / best[name],
                     "tile": f"{tile.rows}x{tile.block_bytes}Bx{tile.iters} w{tile.num_warps}"})
    if dev.type == "cuda" or args.small:
        rows[0]["host_us_per_launch"] = host_launch_us(
            dev, ops["gather"], max(3, args.reps))
    if tilings:
        for fam, t in zip(("32K tiles w16", "64K tiles w16"), alt_tilings(item), strict=True):
            for name in ("gather", "scatter"):
                fn = (lambda t=t: ck.gather(table, idx, staging, check_indices=False, tiling=t)) \
                    if name == "gather" else \
                    (lambda t=t: ck.scatter(table, idx, staging, check_indices=False, tiling=t))
                secs = run(fn, args.reps)
                rows.append({"case": f"{tag}/{name}", "page": page, "dtype": dname, "op": name,
                             "family": fam,
                             "tiling": f"{t.rows}x{t.block_bytes}Bx{t.iters} w{t.num_warps}",
                             "unit_bytes": item, "units": n * entries, "bytes": nbytes,
                             "ms": secs * 1e3, "gbps": C.gbps(nbytes, secs),
                             "copy_ms": best["copy"] * 1e3, "copy_gbps": copy_gbps,
                             "ratio_to_copy": best["copy"] / secs})
            ck.gather(table, idx, staging, check_indices=False, tiling=t)
            ck.gather_reference(table, idx, other)
            checks[f"{tag}: gather with tiling {t} == reference"] = bool(
                torch.equal(staging, other))
    return rows


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pages", default="1,16,64")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--tilings-for", default="1/bf16,1/fp8,16/bf16,16/fp8,64/bf16,64/fp8",
                    help="geometries (page/dtype) that also try alt_tilings()")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    if args.small:
        args.tokens, args.layers, args.reps, args.rounds = 64, 2, 1, 1
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.small
                                       else "cpu"))
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    checks: dict[str, bool] = {}
    notes: list[str] = []
    want_tilings = set(args.tilings_for.split(",")) if args.tilings_for else set()
    for page in (int(p) for p in args.pages.split(",")):
        for dname in args.dtypes.split(","):
            tag = f"{page}/{dname}"
            C.guarded(rows, notes, checks, f"p{tag}", lambda page=page, dname=dname, tag=tag:
                      geometry(args, dev, page, dname, rng, checks, notes, tag in want_tilings))
            if dev.type == "cuda":
                torch.cuda.empty_cache()  # the last geometry's buffers are gone with its frame
    C.table(rows, [("case", "case", ""), ("tiling", "tiling", ""), ("unit_bytes", "unit B", "d"),
                   ("bytes", "bytes", ",d"), ("ms", "ms", ".3f"), ("gbps", "GB/s", ",.0f"),
                   ("copy_gbps", "copy GB/s", ",.0f"), ("ratio_to_copy", "ratio", ".3f"),
                   ("host_us_per_launch", "host us", ".1f"), ("error", "error", "")])
    default = [r for r in rows if r.get("tiling") == "default" and r.get("op") != "gather_sequential_ids"]
    goals = {
        "a_ratio_target": 0.95,
        "a_min_ratio_default_tiling": min((r["ratio_to_copy"] for r in default), default=None),
        "a_met_all": bool(default) and all(r["ratio_to_copy"] >= 0.95 for r in default),
        "a_cases_below": [r["case"] for r in default if r["ratio_to_copy"] < 0.95],
        "a_min_ratio_by_tiling": {
            fam: min(r["ratio_to_copy"] for r in rows if r.get("family") == fam)
            for fam in sorted({r["family"] for r in rows if r.get("family")})},
    }
    if args.small:
        notes.append("--small: Triton interpreter on CPU; timings are meaningless, checks are not")
    return C.finish("kernels", args, rows, checks, goals, notes)


if __name__ == "__main__":
    sys.exit(main())
