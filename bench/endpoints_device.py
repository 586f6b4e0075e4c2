"""The endpoints' staged path on device pools: one Llama-3-70B request, prefill TP2 -> decode TP1.

Everything runs in one process on two GPUs: two prefill endpoints whose pools (pools.TensorPools)
sit on cuda:0, one decode endpoint whose pools sit on cuda:1, the real control plane over
ZeroMQ on loopback, and the local engine for device memory (runtime/engines/local_device.py)
as the transfer engine. Under heterogeneous TP every KV page moves as head slices, so decode stages
both links; rows compare how the staged copies run:

- staged, copy kernels (`staging_copies=kernels`, the default on CUDA): one gather launch per
  chunk and link, one scatter launch per link;
- staged, torch (`staging_copies=torch`): one torch indexing op per staging block;
- direct (`staging_arena_bytes=0`): one copy-engine copy per head-slice piece (only with
  `--direct`, it is slow: a million descriptors per link at 8K tokens).

Time is decode's `init()` to Success (all bytes in decode's pools, scatter included), median of
`--reps` requests with fresh page ids each (after one warm-up). The first and the last timed
request are checked outside the timing: the runtime's link digest (runtime/integrity.py) over
prefill's source bytes and over decode's destination bytes must agree on each link.

    python bench/endpoints_device.py --json out/endpoints_device.json
    python bench/endpoints_device.py --small --json /tmp/d.json     # CPU tensors, interpreter
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


def run_mode(args, name: str, knob_values: dict, layout, plan, devices, rows, checks) -> None:
    from pdc.runtime import integrity, knobs
    from pdc.runtime.control import BootstrapServer
    from pdc.runtime.datapath import component_pairs
    from pdc.runtime.endpoints import DecodeEndpoint, KVPoll, PrefillEndpoint
    from pdc.runtime.engines import make_engine
    from pdc.runtime.family import Family
    from pdc.runtime.indices import DecodeTarget, PrefillChunk
    from pdc.runtime.plan_types import RankId
    from pdc.runtime.pools import Capacity, TensorPools

    knobs.reset()
    knobs.override(transfer_timeout_s=600.0, prefill_room_timeout_s=600.0,
                   staged_min_descriptors=0, **knob_values)
    wire = Family.load("llama3_70b")
    ps = plan.topology.prefill.page_size
    n = -(-args.tokens // ps)
    cap = Capacity(pages=2 * n, slots=2, aux_rows=2, window_pages=1)
    boot = BootstrapServer(2)
    pre_pools, pre_eps, engines = [], [], []
    for tp in range(2):
        pools = TensorPools(layout, plan.registration("prefill", RankId(0, tp)), cap, devices[0])
        gen = torch.Generator(device=devices[0]).manual_seed(tp)
        pools.arena.copy_(torch.randint(0, 256, (pools.nbytes,), dtype=torch.uint8,
                                        generator=gen, device=devices[0]))
        eng = make_engine("local", device=devices[0])
        pre_pools.append(pools)
        engines.append(eng)
        pre_eps.append(PrefillEndpoint(layout, wire, plan, RankId(0, tp), 0, eng, pools,
                                       boot.address))
    dpools = TensorPools(layout, plan.registration("decode", RankId(0, 0)), cap, devices[1])
    deng = make_engine("local", device=devices[1])
    engines.append(deng)
    dec = DecodeEndpoint(layout, wire, plan, RankId(0, 0), 0, deng, dpools, boot.address)
    dec.wait_ready(30)
    rng = np.random.default_rng(5)
    times, ok, staged = [], True, []
    try:
        for rep in range(args.reps + 1):  # the first request warms up (kernel compile, tables)
            room = 100 + rep
            s_ids = rng.permutation(2 * n)[:n].astype(np.int64)
            d_ids = rng.permutation(2 * n)[:n].astype(np.int64)
            t0 = time.perf_counter()
            rv = dec.receiver(room)
            rv.init(d_ids, 0, aux_row=0)
            for ep in pre_eps:
                s = ep.sender(room)
                s.send(s_ids, 0, True, args.tokens, aux_row=1)
            while rv.poll() not in (KVPoll.Success, KVPoll.Failed):
                time.sleep(0.0002)
            dt = time.perf_counter() - t0
            if rv.poll() != KVPoll.Success:
                raise RuntimeError(f"{name}: request failed: {rv.reason}")
            staged.append(rv.links[0])
            if rep:
                times.append(dt)
            if rep in (1, args.reps) or args.small:
                ok &= _landed(layout, plan, pre_pools, dpools, s_ids, d_ids, args.tokens,
                              room, integrity, component_pairs, PrefillChunk, DecodeTarget)
            rv.release()
    finally:
        dec.close()
        for ep in pre_eps:
            ep.close()
        boot.close()
        for e in engines:
            e.close()
        knobs.reset()
    nbytes = sum(seg.total_bytes for lk in plan.links for e in lk.entries
                 if e.component == "kv" for seg in e.segments) * n  # bytes that move
    ms = C.median(times) * 1e3
    checks[f"{name}: every byte landed (link digests agree)"] = bool(ok)
    if "staging_arena_bytes" not in knob_values or knob_values["staging_arena_bytes"]:
        checks[f"{name}: every link staged"] = min(staged) == len(plan.links)
    rows.append({"case": name, "tokens": args.tokens, "staged_links": max(staged),
                 "bytes": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6,
                 "ms_all": [round(t * 1e3, 3) for t in times]})


def _landed(layout, plan, pre_pools, dpools, s_ids, d_ids, tokens, room, integrity,
            component_pairs, PrefillChunk, DecodeTarget) -> bool:
    """Link digests over source and destination bytes agree on every link. The digest hashes
    on the host, so on GPUs only the first and the last timed request are checked."""
    ps = plan.topology.prefill.page_size
    chunk = PrefillChunk(0, s_ids, True, tokens, aux_row=1)
    target = DecodeTarget(d_ids, 0, aux_row=0)
    ok = True
    for lk in plan.links:
        pairs = component_pairs(layout, chunk, target, ps)
        src = integrity.link_digest(room, 0, lk, pre_pools[lk.prefill.tp].view, pairs, "src")
        ok &= src == integrity.link_digest(room, 0, lk, dpools.view, pairs, "dst")
    return ok


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--direct", action="store_true", help="also the direct path (slow)")
    ap.add_argument("--modes", default="kernels,torch", help="staged copies to run")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    if args.small:
        args.tokens, args.reps = 32, 1
    if cuda and torch.cuda.device_count() < 2:
        print("needs two GPUs", file=sys.stderr)
        return 2
    devices = ("cuda:0", "cuda:1") if cuda else ("cpu", "cpu")
    layout, plan = C.llama_plan(2, 1)
    rows: list[dict] = []
    checks: dict[str, bool] = {}
    notes: list[str] = []
    # A link's region is half the request (1.3 GB at 8K tokens): size the arenas for it, or
    # decode falls back to the direct path.
    arena = {"staging_arena_bytes": max(512 << 20, 2 * 1344 * 1024 * 1024 * args.tokens // 8192)}
    names = {"kernels": "staged, copy kernels", "torch": "staged, torch ops"}
    modes = [(names[m], {"staging_copies": m, **arena}) for m in args.modes.split(",") if m]
    if args.direct or args.small:
        modes.append(("direct, one copy per piece", {"staging_arena_bytes": 0}))
    for name, knob_values in modes:
        C.guarded(rows, notes, checks, name, lambda name=name, kv=knob_values: run_mode(
            args, name, kv, layout, plan, devices, rows, checks))
    C.table(rows, [("case", "case", ""), ("tokens", "tokens", "d"),
                   ("staged_links", "staged links", "d"), ("bytes", "bytes", ",d"),
                   ("ms", "ms", ".3f"), ("gbps", "GB/s", ",.1f"), ("error", "error", "")])
    if args.small:
        notes.append("--small: CPU tensors, Triton interpreter; timings are meaningless")
    goals = {"best_case": min((r for r in rows if "ms" in r), key=lambda r: r["ms"],
                              default={}).get("case")}
    return C.finish("endpoints_device", args, rows, checks, goals, notes)


if __name__ == "__main__":
    sys.exit(main())
