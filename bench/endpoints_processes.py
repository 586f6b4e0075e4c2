"""Prefill and decode as two processes through the real endpoints, per transfer engine.

One Llama-3-70B request at a time moves from a prefill process (its TP ranks' endpoints, pools
on `--prefill-device`) to a decode process (one TP1 endpoint, pools on `--decode-device`; on one
GPU both are cuda:0) through the real control plane (bootstrap server and ZeroMQ hubs), over
one engine: `cuda_ipc` (runtime/engines/cuda_ipc.py), `mooncake` with device memory (the CUDA
wheel; `--mooncake-protocol auto` picks nvlink_intra or tcp and the row says which) or `nixl`
with VRAM (UCX cuda_ipc). Cases: TP2->TP1 (head slices: decode stages both links; gather,
one bulk write per link, scatter) and TP1->TP1 (whole pages: the direct path, one descriptor
per page and layer).

Per case the same run also measures
- engine only: the engine writing the request's bytes between the same two processes with no
  endpoint, control message or gather/scatter (staged: one descriptor per link; direct: the
  request's page descriptors), and
- a device copy: one contiguous copy of the request's bytes on the prefill device.
Time is decode's init() to Success (decode's caller wakes on the endpoint's state-change
signal, or polls every `--decode-poll-us`, 0.2 ms), median of `--reps` requests with fresh page
ids (after one warm-up). `phases` splits it with the prefill senders' own stamps
(time.monotonic is one clock for both processes): init -> first submit (request message,
gather), first submit -> last write done, done -> Success (Success message, decode's scatter).
Every byte of the first and last timed requests is checked: the link digest
(runtime/integrity.py) over prefill's source items must equal the one over decode's destination
items on every link; the engine-only bytes are checked by CRC.

    python3 bench/endpoints_processes.py --engines cuda_ipc --json out.json
    python3 bench/endpoints_processes.py --small --json /tmp/p.json   # CPU, host engine "local"
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time
import zlib

import _common as C
import numpy as np

CASES = {"tp2-tp1-staged": (2, 1), "tp1-tp1-direct": (1, 1)}
STEP_S = 600.0


def _knobs(tokens: int) -> dict:
    return {"transfer_timeout_s": STEP_S, "prefill_room_timeout_s": STEP_S,
            "staged_min_descriptors": 0,
            "staging_arena_bytes": max(512 << 20, 2 * 1344 * 1024 * 1024 * tokens // 8192)}


def _engine(name: str, device: str, protocol: str):
    from pdc.runtime.engines import make_engine

    if name == "local":
        return make_engine("local")
    dev = None if device == "host" else device  # host pools: the engine's host class
    if name == "mooncake":
        return make_engine("mooncake", device=dev, protocol=protocol)
    return make_engine(name, device=dev)


def _pools(layout, plan, side, rank, cap, device):
    from pdc.runtime.pools import RankPools, TensorPools

    reg = plan.registration(side, rank)
    return RankPools(layout, reg, cap) if device == "host" else \
        TensorPools(layout, reg, cap, device)


def _fill(pools, seed: int) -> None:
    if isinstance(pools.arena, np.ndarray):
        pools.arena[:] = np.random.default_rng(seed).integers(0, 256, pools.nbytes, np.uint8)
        return
    import torch

    g = torch.Generator(device=pools.device).manual_seed(seed)
    pools.arena.random_(0, 256, generator=g)


def _kv_addrs(pools) -> tuple[list[int], int]:
    bufs = pools.buffers["kv"]
    return [pools.address("kv", i) for i in range(len(bufs))], bufs[0].item_bytes


def _crc(buf) -> int:
    return zlib.crc32(np.ascontiguousarray(buf if isinstance(buf, np.ndarray) else
                                           buf.cpu().numpy()))


def _pages(pools, ids) -> object:
    """The kv pages `ids` of every buffer, in buffer then id order (for CRCs)."""
    if isinstance(pools.arena, np.ndarray):
        return np.concatenate([pools.view("kv", i)[ids] for i in range(len(pools.buffers["kv"]))])
    import torch

    idx = torch.as_tensor(ids, device=pools.device)
    return torch.cat([pools.view("kv", i)[idx] for i in range(len(pools.buffers["kv"]))])


def _device_copy_gbps(pools, nbytes: int, reps: int) -> float:
    if isinstance(pools.arena, np.ndarray):
        return float("nan")
    import torch

    n = min(nbytes, pools.nbytes)
    out = torch.empty(n, dtype=torch.uint8, device=pools.device)
    times = []
    for i in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out.copy_(pools.arena[:n])
        b.record()
        b.synchronize()
        if i:
            times.append(a.elapsed_time(b) / 1e3)
    return n / C.median(times) / 1e9


# ~~~ prefill process ~~~


def prefill_main(conn, args_d: dict, case: str) -> None:
    try:
        _prefill(conn, args_d, case)
    except Exception as exc:  # noqa: BLE001 - report, the parent fails the case
        import traceback

        traceback.print_exc()
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _prefill(conn, a: dict, case: str) -> None:
    from pdc.runtime import integrity, knobs
    from pdc.runtime.datapath import component_pairs
    from pdc.runtime.endpoints import KVPoll, PrefillEndpoint
    from pdc.runtime.engines import plan_backend
    from pdc.runtime.family import Family
    from pdc.runtime.indices import DecodeTarget, PrefillChunk
    from pdc.runtime.plan_types import RankId
    from pdc.runtime.pools import Capacity

    knobs.override(**_knobs(a["tokens"]))
    ptp, dtp = CASES[case]
    layout, plan = C.llama_plan(ptp, dtp, backend=plan_backend(a["engine"]))
    wire = Family.load("llama3_70b")
    ps = plan.topology.prefill.page_size
    n = -(-a["tokens"] // ps)
    cap = Capacity(pages=2 * n, slots=2, aux_rows=2, window_pages=1)
    pools = [_pools(layout, plan, "prefill", RankId(0, tp), cap, a["prefill_device"])
             for tp in range(ptp)]
    for tp, p in enumerate(pools):
        _fill(p, 11 + tp)
    msg = conn.recv()  # ("engine_only", agent_info, [dst kv addrs], item, d_ids, dst base)
    _, info, d_addrs, d_item, d_ids, d_base = msg
    eng = _engine(a["engine"], a["prefill_device"], a["mooncake_protocol"])
    for p in pools:
        eng.register(p.base, p.nbytes)
    peer = eng.connect(info)
    rng = np.random.default_rng(7)
    s_ids = rng.permutation(2 * n)[:n].astype(np.int64)
    nbytes_req = sum(seg.total_bytes for lk in plan.links for e in lk.entries
                     if e.component == "kv" for seg in e.segments) * n
    if ptp == 1:  # the direct path's descriptors: one per page and buffer
        s_addrs, item = _kv_addrs(pools[0])
        src = (np.array(s_addrs, np.uint64)[:, None] + s_ids.astype(np.uint64) * item).ravel()
        dst = (np.array(d_addrs, np.uint64)[:, None] +
               np.asarray(d_ids, np.uint64) * d_item).ravel()
        lens = np.full(src.size, item, np.uint64)
    else:  # the staged path's bulk writes: one per link, the link's share of the request
        share = nbytes_req // ptp
        src = np.array([p.base for p in pools], np.uint64)
        dst = np.uint64(d_base) + np.arange(ptp, dtype=np.uint64) * np.uint64(share)
        lens = np.full(ptp, share, np.uint64)
    grids = None
    if ptp == 1 and getattr(eng, "takes_grids", False) and knobs.get("descriptor_grids"):
        from pdc.runtime.engines.base import DescriptorGrid  # Note [Descriptor grids]

        grids = [DescriptorGrid(np.array(s_addrs, np.uint64), np.array(d_addrs, np.uint64),
                                s_ids.astype(np.uint64) * np.uint64(item),
                                np.asarray(d_ids, np.uint64) * np.uint64(d_item),
                                np.full(n, item, np.uint64))]
    times, host = [], []
    for rep in range(a["reps"] + 1):
        t0 = time.perf_counter()
        if grids is not None:
            batch = eng.submit_grids(peer, grids)
        else:
            batch = eng.submit_write(peer, src, dst, lens)
        t1 = time.perf_counter()
        eng.wait(batch, STEP_S)
        if rep:
            times.append(time.perf_counter() - t0)
            host.append(t1 - t0)
    profile_n = int(a.get("profile_submits") or 0)
    if profile_n:  # where a submit's host time goes: cProfile over more submits, to stderr
        import cProfile
        import pstats

        prof = cProfile.Profile()
        for _ in range(profile_n):
            prof.enable()
            batch = eng.submit_grids(peer, grids) if grids is not None else \
                eng.submit_write(peer, src, dst, lens)
            prof.disable()
            eng.wait(batch, STEP_S)
        print(f"== cProfile of {profile_n} engine-only submits ({case}, {a['tokens']} tokens)",
              file=sys.stderr)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    if ptp == 1:
        crc = _crc(_pages(pools[0], s_ids))
    else:
        crc = _crc(np.concatenate([np.asarray(_crc_bytes(p, share)) for p in pools]))
    eo = {"ms": C.median(times) * 1e3, "bytes": int(lens.sum()), "descriptors": int(src.size),
          "form": "grids" if grids is not None else "flat",
          "crc": crc, "copy_gbps": _device_copy_gbps(pools[0], nbytes_req, a["reps"]),
          "transport": eng.transport().describe(),
          # host time of one submit_write with its real launches (the write is waited for
          # outside it): the engine's share of a request's host cost
          "submit_host_us": C.median(host) * 1e6, "graphs": _graph_stats()}
    eng.close()
    boot = conn.recv()[1]
    eps = [PrefillEndpoint(layout, wire, plan, RankId(0, tp), 0, _engine(
        a["engine"], a["prefill_device"], a["mooncake_protocol"]), pools[tp], boot)
        for tp in range(ptp)]
    conn.send(("ready", eo))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, room, seed, check = msg
        ids = np.random.default_rng(seed).permutation(2 * n)[:n].astype(np.int64)
        senders = [ep.sender(room) for ep in eps]
        for s in senders:
            s.send(ids, 0, True, a["tokens"], aux_row=1)
        deadline = time.monotonic() + STEP_S
        poll_s = a.get("prefill_poll_us", 200) * 1e-6
        while any(s.poll() not in (KVPoll.Success, KVPoll.Failed) for s in senders) and \
                time.monotonic() < deadline:
            time.sleep(poll_s)
        states = [s.poll() for s in senders]
        stats = [(s.stats.t_init, s.stats.t_done, s.stats.descriptors) for s in senders]
        digests = None
        if check:
            d_target = conn.recv()[1]
            chunk = PrefillChunk(0, ids, True, a["tokens"], aux_row=1)
            target = DecodeTarget(d_target, 0, aux_row=0)
            digests = [integrity.link_digest(room, 0, lk, pools[lk.prefill.tp].view,
                                             component_pairs(layout, chunk, target, ps), "src")
                       for lk in plan.links]
        conn.send(("sent", [str(x) for x in states], [s.reason for s in senders], stats,
                   digests))
    for ep in eps:
        ep.close()
        ep.engine.close()
    conn.send(("bye",))


def _graph_stats() -> dict:
    try:  # Note [Descriptor-copy graphs]; absent from trees older than it
        from pdc.runtime.descriptor_copy import graph_stats
    except ImportError:
        return {}
    return dict(graph_stats)


def _crc_bytes(pools, share: int):
    buf = pools.arena[:share]
    return buf if isinstance(buf, np.ndarray) else buf.cpu().numpy()


# ~~~ decode process (this one) ~~~


def run_case(args, case: str, rows, checks) -> None:
    from pdc.runtime import integrity, knobs
    from pdc.runtime.control import BootstrapServer
    from pdc.runtime.datapath import component_pairs
    from pdc.runtime.endpoints import DecodeEndpoint, KVPoll
    from pdc.runtime.engines import plan_backend
    from pdc.runtime.family import Family
    from pdc.runtime.indices import DecodeTarget, PrefillChunk
    from pdc.runtime.plan_types import RankId
    from pdc.runtime.pools import Capacity

    knobs.reset()
    knobs.override(**_knobs(args.tokens))
    ptp, dtp = CASES[case]
    layout, plan = C.llama_plan(ptp, dtp, backend=plan_backend(args.engine))
    wire = Family.load("llama3_70b")
    ps = plan.topology.prefill.page_size
    n = -(-args.tokens // ps)
    cap = Capacity(pages=2 * n, slots=2, aux_rows=2, window_pages=1)
    dpools = _pools(layout, plan, "decode", RankId(0, 0), cap, args.decode_device)
    if not isinstance(dpools.arena, np.ndarray):
        dpools.arena.fill_(C.POISON)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(child_conn, vars(args), case), daemon=True)
    proc.start()
    name = f"{args.engine} {case} {args.tokens}"
    boot = dec = None
    eo_eng = _engine(args.engine, args.decode_device, args.mooncake_protocol)
    try:
        eo_eng.register(dpools.base, dpools.nbytes)
        rng = np.random.default_rng(5)
        d_ids = rng.permutation(2 * n)[:n].astype(np.int64)
        d_addrs, d_item = _kv_addrs(dpools)
        conn.send(("engine_only", eo_eng.agent_info(), d_addrs, d_item, d_ids, dpools.base))
        boot = BootstrapServer(ptp)
        conn.send(("boot", boot.address))
        eo = _recv(conn, proc)[1]
        if ptp == 1:
            got = _crc(_pages(dpools, d_ids))
        else:
            got = _crc(dpools.arena[:eo["bytes"]])
        checks[f"{name}: engine-only bytes landed (CRC)"] = got == eo["crc"]
        eo_eng.close()
        eo_eng = None
        dec = DecodeEndpoint(layout, wire, plan, RankId(0, 0), 0,
                             _engine(args.engine, args.decode_device, args.mooncake_protocol),
                             dpools, boot.address)
        dec.wait_ready(120)
        # Note [State-change signal]: decode's control thread signals each turn that read a
        # message, so the wait below wakes at the Success; a scatter ended by a CUDA event
        # only a poll sees, at the wait's bound (--decode-poll-us, 0.2 ms by default); a
        # written event wakes it when the engine watches it (Note [Landed wake-up])
        changed = threading.Event()
        dec.on_change = changed.set
        times, phases, ok, staged, descs = [], [], True, [], 0
        for rep in range(args.reps + 1):
            room = 100 + rep
            ids = rng.permutation(2 * n)[:n].astype(np.int64)
            check = rep in (1, args.reps)
            t0 = time.perf_counter()
            m0 = time.monotonic()
            conn.send(("send", room, 1000 + rep, check))
            rv = dec.receiver(room)
            rv.init(ids, 0, aux_row=0)
            deadline = time.monotonic() + STEP_S
            while True:
                changed.clear()
                if rv.poll() in (KVPoll.Success, KVPoll.Failed) or \
                        time.monotonic() > deadline:
                    break
                changed.wait(args.decode_poll_us * 1e-6)
            dt, m1 = time.perf_counter() - t0, time.monotonic()
            if rv.poll() != KVPoll.Success:
                raise RuntimeError(f"request failed: {rv.reason or 'timed out'}")
            if check:
                conn.send(("target", ids))
            _, states, reasons, stats, digests = _recv(conn, proc)
            if any(s != str(KVPoll.Success) for s in states):
                raise RuntimeError(f"prefill senders: {states} {reasons}")
            staged.append(rv.links[0])
            descs = sum(s[2] for s in stats)
            if rep:
                times.append(dt)
                first = min(s[0] for s in stats)
                done = max(s[1] for s in stats)
                phases.append((first - m0, done - first, m1 - done))
            if check:
                chunk = PrefillChunk(0, np.zeros(n, np.int64), True, args.tokens, aux_row=1)
                target = DecodeTarget(ids, 0, aux_row=0)
                for lk, want in zip(plan.links, digests, strict=True):
                    pairs = component_pairs(layout, chunk, target, ps)
                    ok &= integrity.link_digest(room, 0, lk, dpools.view, pairs, "dst") == want
            rv.release()
        conn.send(("stop",))
        _recv(conn, proc)
    finally:
        if proc.is_alive():
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        if dec is not None:
            dec.close()
            dec.engine.close()
        if boot is not None:
            boot.close()
        if eo_eng is not None:
            eo_eng.close()
        knobs.reset()
    checks[f"{name}: every byte landed (link digests agree)"] = bool(ok)
    nbytes = sum(seg.total_bytes for lk in plan.links for e in lk.entries
                 if e.component == "kv" for seg in e.segments) * n
    ms = C.median(times) * 1e3
    ph = [C.median([p[i] for p in phases]) * 1e3 for i in range(3)]
    # Tails of the control path's two phases (the middle one is the engine's write)
    p99 = [_p99([p[i] for p in phases]) * 1e3 for i in (0, 2)]
    gbps = nbytes / ms / 1e6
    eo_gbps = eo["bytes"] / eo["ms"] / 1e6
    rows.append({"case": name, "engine": args.engine, "path": case.split("-")[-1],
                 "tokens": args.tokens, "bytes": nbytes, "descriptors": descs,
                 "staged_links": max(staged), "ms": ms, "gbps": gbps,
                 "engine_only_ms": eo["ms"], "engine_only_gbps": eo_gbps,
                 "ratio_to_engine": gbps / eo_gbps, "copy_gbps": eo["copy_gbps"],
                 "ratio_to_copy": gbps / eo["copy_gbps"],
                 "engine_submit_host_us": eo.get("submit_host_us"), "graphs": eo.get("graphs"),
                 "engine_form": eo.get("form", "flat"),
                 "fixed_ms": ms - nbytes / eo_gbps / 1e6,
                 "init_to_submit_ms": ph[0], "submit_to_done_ms": ph[1],
                 "done_to_success_ms": ph[2], "transport": eo["transport"],
                 "p99_ms": _p99(times) * 1e3, "init_to_submit_p99_ms": p99[0],
                 "done_to_success_p99_ms": p99[1],
                 "control_ms": C.median([p[0] + p[2] for p in phases]) * 1e3,
                 "control_p99_ms": _p99([p[0] + p[2] for p in phases]) * 1e3,
                 "ms_all": [round(t * 1e3, 3) for t in times],
                 "phases_all": [[round(x * 1e3, 3) for x in p] for p in phases]})


def _p99(xs: list[float]) -> float:
    """The 99th percentile (nearest rank); with under 100 samples, the largest."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-99 * len(s) // 100) - 1))] if s else float("nan")


def _recv(conn, proc):
    if not conn.poll(STEP_S):
        raise RuntimeError("prefill process did not answer")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"prefill process: {msg[1]}")
    return msg


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--engines", default="cuda_ipc", help="comma list: cuda_ipc,mooncake,nixl")
    ap.add_argument("--tokens-list", default="8192,1024")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--pairs", default="", metavar="CASE:TOKENS,...",
                    help="only these (case, tokens) pairs, e.g. tp2-tp1-staged:8192 "
                         "(default: every case at every --tokens-list length)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-poll-us", type=int, default=200,
                    help="the longest decode's caller sleeps between polls when no state "
                         "change wakes it (a serving engine's idle scheduler: 2000 for "
                         "SGLang's idle wait)")
    ap.add_argument("--prefill-poll-us", type=int, default=200,
                    help="how often prefill's caller polls its senders, as a serving engine's "
                         "scheduler would (its Python shares the GIL with pdc's threads)")
    ap.add_argument("--profile-submits", type=int, default=0, metavar="N",
                    help="also run N engine-only submits under cProfile (table on stderr)")
    ap.add_argument("--prefill-device", default="cuda:0")
    ap.add_argument("--decode-device", default="cuda:0")
    ap.add_argument("--mooncake-protocol", default="auto")
    args = ap.parse_args()
    if args.small:
        args.engines, args.tokens_list, args.reps = "local", "64", 1
        args.prefill_device = args.decode_device = "host"
    rows, checks, notes = [], {}, []
    pairs = [(c, int(t)) for t in args.tokens_list.split(",") for c in args.cases.split(",")]
    if args.pairs:
        pairs = [(p.split(":")[0], int(p.split(":")[1])) for p in args.pairs.split(",")]
    for engine in args.engines.split(","):
        for case, tokens in pairs:
            args.engine, args.tokens = engine, tokens
            C.guarded(rows, notes, checks, f"{engine} {case} {tokens}",
                      lambda case=case: run_case(args, case, rows, checks))
            print(rows[-1], flush=True)  # a run cut short still shows the cases it did
    C.table(rows, [("case", "case", ""), ("transport", "transport", ""),
                   ("ms", "ms", ".2f"), ("gbps", "GB/s", ",.1f"),
                   ("engine_only_gbps", "engine GB/s", ",.1f"),
                   ("ratio_to_engine", "/engine", ".3f"), ("copy_gbps", "copy GB/s", ",.0f"),
                   ("ratio_to_copy", "/copy", ".3f"), ("fixed_ms", "fixed ms", ".2f"),
                   ("init_to_submit_ms", "init->submit", ".2f"),
                   ("submit_to_done_ms", "submit->done", ".2f"),
                   ("done_to_success_ms", "done->Success", ".2f"),
                   ("control_ms", "control p50", ".2f"), ("control_p99_ms", "control p99", ".2f"),
                   ("engine_submit_host_us", "submit host us", ",.0f"), ("error", "error", "")])
    if args.small:
        notes.append("--small: host pools and the host engine 'local'; timings are meaningless")
    big = [r for r in rows if "ms" in r and r["tokens"] >= 8192]
    goals = {"endpoints_vs_engine_target": 0.8, "fixed_ms_target": 1.0,
             "ratio_to_engine_8k": {r["case"]: round(r["ratio_to_engine"], 3) for r in big},
             "fixed_ms": {r["case"]: round(r["fixed_ms"], 3) for r in rows if "ms" in r}}
    return C.finish("endpoints_processes", args, rows, checks, goals, notes)


if __name__ == "__main__":
    sys.exit(main())
