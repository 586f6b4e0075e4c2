"""Cached-prefix early send ("lever B"): time to last byte at 0, 50 and 90 % prefill prefix hit.

Pages that prefill already holds from its prefix cache are final before the forward runs, so
prefill can send them at once as a non-streamed chunk (`PrefillSender.send_cached`) and stream
only the pages the forward computes, layer by layer. Without lever B the cached pages travel
with the streamed chunk, each layer's share after that layer of the forward.

One Llama-3-70B request (page 16, TP1 -> TP1) between a prefill and a decode endpoint in this
process over a real engine (local: process_vm_writev, or nixl / UCX TCP), both endpoints and the
control plane real. The forward is simulated: per layer it sleeps `--layer-ms` times the
uncached fraction (a forward computes only the tokens it did not find cached), then calls
layer_done. Time to last byte = decode Success - the request's start; medians of `--reps`.

    python bench/lever_b.py --json bench/results/<date>-cpu-lever-b/lever_b.json
"""

from __future__ import annotations

import time

import _common as C
import numpy as np
from pdc.runtime import knobs
from pdc.runtime.control import BootstrapServer
from pdc.runtime.endpoints import DecodeEndpoint, KVPoll, PrefillEndpoint
from pdc.runtime.engines import make_engine
from pdc.runtime.plan_types import RankId, Topology
from pdc.runtime.pools import Capacity, RankPools

PAGE = 16


def endpoints(engine: str, pages: int):
    from pdc.compiler.lower import lower
    from pdc.runtime.family import Family

    layout, plan = C.llama_plan(1, 1)
    if engine != "local":
        t = plan.topology
        plan = lower(layout, Topology(t.prefill, t.decode, engine), ())
    wire = Family.load("llama3_70b")
    cap = Capacity(pages=pages, slots=2, aux_rows=2, window_pages=1)
    r0 = RankId(0, 0)
    boot = BootstrapServer(1)
    pe, de = make_engine(engine), make_engine(engine)
    pp = RankPools(layout, plan.registration("prefill", r0), cap)
    dp = RankPools(layout, plan.registration("decode", r0), cap)
    pre = PrefillEndpoint(layout, wire, plan, r0, 0, pe, pp, boot.address)
    dec = DecodeEndpoint(layout, wire, plan, r0, 0, de, dp, boot.address)
    dec.wait_ready(10)
    layers = sorted(layout.all_layer_ids)
    return pre, dec, (boot, pe, de), layers


def one_request(pre, dec, layers, room: int, tokens: int, hit: float, lever_b: bool,
                layer_ms: float, rng) -> float:
    n_pages = -(-tokens // PAGE)
    cached = int(n_pages * hit)
    src = rng.permutation(2 * n_pages)[:n_pages]
    dst = rng.permutation(2 * n_pages)[:n_pages]
    rv = dec.receiver(room, 0)
    rv.init(dst, 0, aux_row=0)
    t0 = time.perf_counter()
    s = pre.sender(room)
    if lever_b and cached:
        s.send_cached(src[:cached], cached * PAGE)
        s.send(src[cached:], cached, True, tokens, aux_row=0, stream=True)
    else:
        s.send(src, 0, True, tokens, aux_row=0, stream=True)
    per_layer = layer_ms * 1e-3 * (1.0 - cached / n_pages)
    for layer in layers:
        time.sleep(per_layer)
        pre.layer_done(layer)
    pre.forward_done()
    while rv.poll() not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(0.0002)
    ttlb = time.perf_counter() - t0
    if rv.poll() != KVPoll.Success:
        raise RuntimeError(f"room {room} failed: {rv.reason}")
    while s.poll() != KVPoll.Success:
        time.sleep(0.0002)
    rv.release()
    return ttlb


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--engine", default="local", choices=["local", "nixl"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layer-ms", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.small:
        args.tokens, args.reps = 64, 2
    knobs.override(staging_arena_bytes=0)
    pre, dec, keep, layers = endpoints(args.engine, 2 * -(-args.tokens // PAGE))
    rng = np.random.default_rng(0)
    rows, room = [], 1
    try:
        for hit in (0.0, 0.5, 0.9):
            got = {}
            for lever_b in (False, True):
                t = []
                for _ in range(args.reps):
                    t.append(one_request(pre, dec, layers, room, args.tokens, hit, lever_b,
                                         args.layer_ms, rng))
                    room += 1
                got[lever_b] = float(np.median(t)) * 1e3
            fwd = len(layers) * args.layer_ms * (1 - int(hit * -(-args.tokens // PAGE)) /
                                                 -(-args.tokens // PAGE))
            rows.append({"prefix_hit": hit, "forward_ms": round(fwd, 1),
                         "ttlb_ms_without": round(got[False], 2),
                         "ttlb_ms_lever_b": round(got[True], 2),
                         "after_forward_ms_without": round(got[False] - fwd, 2),
                         "after_forward_ms_lever_b": round(got[True] - fwd, 2),
                         "ratio": round(got[True] / got[False], 3)})
    finally:
        dec.close()
        pre.close()
        boot, pe, de = keep
        boot.close()
        pe.close()
        de.close()
    C.table(rows, [("prefix_hit", "prefix hit", ".0%"), ("forward_ms", "forward ms", ".1f"),
                   ("ttlb_ms_without", "TTLB ms without", ".2f"),
                   ("ttlb_ms_lever_b", "TTLB ms lever B", ".2f"),
                   ("after_forward_ms_without", "after fwd without", ".2f"),
                   ("after_forward_ms_lever_b", "after fwd lever B", ".2f"),
                   ("ratio", "B / without", ".3f")])
    return C.finish("lever_b", args, rows, {"every request succeeded": True})


if __name__ == "__main__":
    raise SystemExit(main())
