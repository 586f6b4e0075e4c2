"""(d) CPU cost per request of the control plane: plan lookup, page pairs, descriptors, submit.

Llama-3-70B, prefill TP1 -> decode TP1, 1K/8K/64K-token requests, pages of 1 and 16 tokens,
page ids contiguous (one run) or fragmented (a random subset, in random order, of a 65,536-page
pool on each side), timed on this machine's CPU. For each request, pdc does, with the runtime's
own functions and a plan lowered from specs/llama3-70b.yaml:

- descriptors ("direct" path, what an RDMA engine is given): link lookup, `component_pairs`,
  `datapath.build_descriptors` over every plan entry, `submit_write` to an engine that only
  counts;
- staged: link lookup, `component_pairs`, `PageEngine.submit_pages(path="staged",
  chunks=1)`: one gather launch, one bulk copy, one scatter launch; here the launches and the
  copy are counted, not run (`RecordingDeviceEngine`), so the row is the host work around them;
- direct kernel: the same with `path="push"`, one launch.

In the same run, SGLang 0.5.23's own descriptor code for the same requests
(`MooncakeKVManager.send_kvcache` with a counting engine), through the peer harness in
../shared/peers/sglang-descriptors (relative to the repository root; --sglang-harness names
another copy), in its own scratch venv (--sglang-python). On a machine
with two GPUs, `--real` adds rows where the staged and direct submits launch for real (host time
to queue them, pools on cuda:0 and cuda:1).

Also a bench-only prototype of whole-item descriptor building vectorised across all plan entries
(`vectorised_descriptors` below), checked equal to build_descriptors: what the runtime's
contiguous-page case would cost with that change.

    python bench/control_cost.py --json out/control_cost.json --sglang-python /tmp/sg/bin/python
    python bench/control_cost.py --small --json /tmp/c.json
"""

from __future__ import annotations

import os
import sys

if "--small" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import subprocess
import tempfile
import time
from pathlib import Path

import _common as C
import numpy as np
import torch
from page_engine import PageEngine, _page_ids, page_copies
from pdc.runtime.datapath import LocalBuffer, RemoteBuffer, build_descriptors, component_pairs
from pdc.runtime.engines.base import Batch, BatchState, TransferEngine
from pdc.runtime.indices import DecodeTarget, PrefillChunk, check_capacity, contiguous_runs

# The peer harness lives beside the repository, in the shared folder (never an absolute path).
HARNESS = (Path(__file__).resolve().parents[1].parent / "shared" / "peers"
           / "sglang-descriptors" / "peer_sglang_descriptors.py")
SGLANG_POOL_PAGES = 65536  # the harness draws fragmented pages from a pool this size
CAPACITY = 1 << 17  # pdc's fake pools: room for 64K contiguous pages past an offset


class CountingEngine(TransferEngine):
    """Takes descriptors and only counts them, like the SGLang harness's fake engine."""

    name = "counting"

    def __init__(self) -> None:
        self.calls = 0
        self.descriptors = 0

    def register(self, addr, nbytes):
        pass

    def deregister(self, addr):
        pass

    def agent_info(self):
        return b""

    def connect(self, agent_info):
        return "peer"

    def submit_write(self, peer, src, dst, nbytes):
        self.calls += 1
        self.descriptors += len(src)
        return Batch(peer, [], 0, len(src), BatchState.DONE)

    def poll(self, batch):
        return batch.state

    def close(self):
        pass


class RecordingDeviceEngine(PageEngine):
    """The device engine with its device operations counted instead of run: everything the
    host does per request stays (id checks, index tensors, chunking, slot lookup)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.ops = {"gather": 0, "scatter": 0, "bulk_copy": 0, "direct": 0}
        self._dummy = torch.empty(1, dtype=torch.uint8)

    def register(self, addr, nbytes):  # fake addresses: no view, nothing is ever touched
        with self._lock:
            self._regions.add(addr, nbytes)

    def _slot(self, key, nbytes, device):
        return self._dummy

    def _gather(self, plan, idx, staging):
        self.ops["gather"] += 1

    def _scatter(self, plan, idx, staging):
        self.ops["scatter"] += 1

    def _bulk_copy(self, dst, src):
        self.ops["bulk_copy"] += 1

    def _launch_direct(self, plan, s_idx, d_idx, n, device, programs=None):
        self.ops["direct"] += 1


def fake_buffers(plan, side, rank, base):
    """Buffer tables of every component at fake addresses (nothing is allocated)."""
    reg = plan.registration(side, rank)
    local, remote, spans = {}, {}, []
    addr = base
    for name, entries, item in reg.components:
        local[name], remote[name] = [], []
        for _tensor, layer_id in entries:
            local[name].append(LocalBuffer(addr, item, CAPACITY))
            remote[name].append(RemoteBuffer(layer_id, 0, addr, item, CAPACITY))
            spans.append((addr, item * CAPACITY))
            addr += -(-(item * CAPACITY) // 4096) * 4096
    return local, remote, spans


def page_ids(tokens: int, page: int, layout: str, seed: int):
    n = -(-tokens // page)
    if layout == "contiguous":
        return np.arange(1024, 1024 + n, dtype=np.int64), np.arange(4096, 4096 + n,
                                                                     dtype=np.int64)
    rng = np.random.default_rng(seed + page)
    return (rng.permutation(SGLANG_POOL_PAGES)[:n].astype(np.int64),
            rng.permutation(SGLANG_POOL_PAGES)[:n].astype(np.int64))


class Link:
    """What a prefill endpoint keeps per linked decode rank: the plan link, both sides' buffer
    tables, and the page plans of the device engine (built once, at registration)."""

    def __init__(self, layout, plan, link):
        self.layout, self.link = layout, link
        self.page_size = plan.topology.prefill.page_size
        self.local, _, src_spans = fake_buffers(plan, "prefill", link.prefill, 0x7F00_0000_0000)
        _, self.remote, dst_spans = fake_buffers(plan, "decode", link.decode, 0x5500_0000_0000)
        self.engine = CountingEngine()
        self.dev = RecordingDeviceEngine()
        self.dev_peer_engine = RecordingDeviceEngine()
        for a, n in src_spans:
            self.dev.register(a, n)
        for a, n in dst_spans:
            self.dev_peer_engine.register(a, n)
        self.dev_peer = self.dev.connect(self.dev_peer_engine.agent_info())
        self.kv_plan = self.dev.plan_pages(
            self.dev_peer, page_copies(link, self.local, self.remote, "kv"))


def vectorised_descriptors(ctx: Link, pairs):
    """Bench-only prototype (not runtime code): whole-item descriptors for all entries of a
    component in a few numpy operations instead of a Python loop over the plan's entries."""
    pre = ctx.__dict__.setdefault("_vec", {})
    srcs, dsts, lens = [], [], []
    for comp, (s_ids, d_ids) in pairs.items():
        if comp not in pre:  # once per link: per-entry bases as arrays
            es = [e for e in ctx.link.entries if e.component == comp]
            assert all(e.whole_item for e in es), "prototype covers whole items only"
            lbs = [ctx.local[comp][e.src_pos] for e in es]
            rbs = [ctx.remote[comp][e.dst_pos] for e in es]
            pre[comp] = (np.array([b.base for b in lbs], np.int64),
                         np.array([b.base for b in rbs], np.int64), lbs[0].item_bytes,
                         lbs[0].capacity, rbs[0].capacity)
        lb, rb, item, lcap, rcap = pre[comp]
        check_capacity(s_ids, lcap, f"prefill '{comp}'")
        check_capacity(d_ids, rcap, f"decode '{comp}'")
        ss, ds, n = contiguous_runs(s_ids, d_ids)
        srcs.append((lb[:, None] + ss[None, :] * item).ravel())
        dsts.append((rb[:, None] + ds[None, :] * item).ravel())
        lens.append(np.broadcast_to(n * item, (len(lb), len(n))).ravel())
    return (np.concatenate(srcs).astype(np.uint64), np.concatenate(dsts).astype(np.uint64),
            np.concatenate(lens).astype(np.uint64))


def time_case(args, fn, expect_heavy: bool):
    if expect_heavy:
        w, c = C.cpu_time(fn, reps=args.heavy_reps, warmup=1)
    else:
        w, c = C.cpu_time(fn, reps=7, warmup=2, min_time=args.min_time)
    return C.median(w) * 1e6, C.median(c) * 1e6, len(w)


def pdc_rows(args, ctxs, tokens, page, layout, checks):
    ctx_key = ("pp0.tp0", "pp0.tp0")
    s_ids, d_ids = page_ids(tokens, page, layout, seed=20240917)
    contexts = ctxs[page]
    out = []

    def request_pairs(ctx):
        chunk = PrefillChunk(0, s_ids, True, tokens, aux_row=0)
        target = DecodeTarget(d_ids, 0, aux_row=1)
        return component_pairs(ctx.layout, chunk, target, ctx.page_size)

    def descriptors():
        ctx = contexts[ctx_key]  # plan lookup: the endpoint's link table
        d = build_descriptors(ctx.link, ctx.local, ctx.remote, request_pairs(ctx))
        ctx.engine.submit_write("peer", d.src, d.dst, d.nbytes)
        return d

    def staged(path: str):
        def run():
            ctx = contexts[ctx_key]
            kv_s, kv_d = request_pairs(ctx)["kv"]
            return ctx.dev.submit_pages(ctx.kv_plan, kv_s, kv_d, path=path, chunks=1)
        return run

    def prototype():
        ctx = contexts[ctx_key]
        src, dst, n = vectorised_descriptors(ctx, request_pairs(ctx))
        ctx.engine.submit_write("peer", src, dst, n)
        return src, dst, n

    ctx = contexts[ctx_key]
    d = descriptors()
    n_desc = d.count
    checks[f"{tokens}/p{page}/{layout}: descriptors cover the request"] = (
        d.total_bytes == (len(s_ids) * ctx.kv_plan.unit_bytes + 64))
    p = prototype()
    checks[f"{tokens}/p{page}/{layout}: prototype == build_descriptors"] = bool(
        np.array_equal(p[0], d.src) and np.array_equal(p[1], d.dst)
        and np.array_equal(p[2], d.nbytes))
    del d, p
    heavy = n_desc > 2_000_000
    us, cpu, reps = time_case(args, descriptors, heavy)
    base = {"tokens": tokens, "page": page, "layout": layout, "pages": len(s_ids)}
    out.append(base | {"system": "pdc", "path": "descriptors (build_descriptors)",
                       "descriptors": n_desc, "us": us, "cpu_us": cpu, "reps": reps,
                       "ns_per_desc": us * 1e3 / n_desc})
    us, cpu, reps = time_case(args, prototype, heavy)
    out.append(base | {"system": "pdc-prototype", "path": "descriptors, vectorised (bench only)",
                       "descriptors": n_desc, "us": us, "cpu_us": cpu, "reps": reps,
                       "ns_per_desc": us * 1e3 / n_desc})
    for path, label in (("staged", "staged: 1 gather + 1 bulk copy + 1 scatter"),
                        ("push", "direct kernel: 1 launch")):
        before = dict(ctx.dev.ops)
        b = staged(path)()
        ops = {k: v - before[k] for k, v in ctx.dev.ops.items() if v != before[k]}
        checks[f"{tokens}/p{page}/{layout}: {path} queues {ops}"] = (
            b.nbytes == len(s_ids) * ctx.kv_plan.unit_bytes and
            ops == ({"gather": 1, "scatter": 1, "bulk_copy": 1} if path == "staged"
                    else {"direct": 1}))
        us, cpu, reps = time_case(args, staged(path), False)
        out.append(base | {"system": "pdc", "path": label + " (counted, not run)",
                           "descriptors": 1, "us": us, "cpu_us": cpu, "reps": reps})
    return out


def real_rows(args, tokens_list, checks, notes):
    """Staged and direct submits with real launches on cuda:0 -> cuda:1: host time to queue."""
    rows = []
    for page in (16, 1):
        layout, plan = C.llama_plan(1, 1, page)
        link = plan.links[0]
        for tokens in tokens_list:
            n = -(-tokens // page)
            cap = max(2 * n, 64)
            src = C.RankPool(plan, "prefill", link.prefill, "cuda:0", cap, seed=-1)
            dst = C.RankPool(plan, "decode", link.decode, "cuda:1", cap, seed=-1)
            peer = src.engine.connect(dst.engine.agent_info())
            pp = src.engine.plan_pages(peer, page_copies(link, {"kv": src.local},
                                                         {"kv": dst.remote}, "kv"))
            table = {("pp0.tp0", "pp0.tp0"): (link, pp)}
            for lay in ("contiguous", "fragmented"):
                if lay == "contiguous":
                    s_ids, d_ids = np.arange(n), np.arange(n, 2 * n)
                else:
                    rng = np.random.default_rng(page)
                    s_ids, d_ids = rng.permutation(cap)[:n], rng.permutation(cap)[:n]
                for path in ("staged", "push"):
                    host = []
                    for i in range(args.real_reps + 3):
                        torch.cuda.synchronize(0)
                        torch.cuda.synchronize(1)
                        c0 = time.perf_counter()
                        lk, p = table[("pp0.tp0", "pp0.tp0")]
                        chunk = PrefillChunk(0, s_ids, True, tokens, aux_row=0)
                        target = DecodeTarget(d_ids, 0, aux_row=1)
                        kv_s, kv_d = component_pairs(layout, chunk, target, page)["kv"]
                        b = src.engine.submit_pages(p, kv_s, kv_d, path=path, chunks=1)
                        c1 = time.perf_counter()
                        src.engine.wait(b, 60.0)
                        if i >= 3:
                            host.append(c1 - c0)
                    rows.append({"tokens": tokens, "page": page, "layout": lay, "pages": n,
                                 "system": "pdc", "descriptors": 1,
                                 "path": ("staged: 1 gather + 1 bulk copy + 1 scatter"
                                          if path == "staged" else "direct kernel: 1 launch")
                                 + " (real launches, cuda:0 -> cuda:1)",
                                 "us": C.median(host) * 1e6, "reps": len(host)})
            checks[f"real {tokens}/p{page}: ran"] = True
            src.close()
            dst.close()
            del src, dst
            torch.cuda.empty_cache()
    return rows


def graph_rows(args, checks, notes):
    """Bench-only prototype (not runtime code): the direct kernel's launch and its index upload
    captured once in a CUDA graph with static buffers; per request the engine's id check, the ids
    copied into pinned memory, one replay. Shows what a launch without Python's Triton launcher
    costs (8K tokens, page 16 and 1, cuda:0 -> cuda:1)."""
    rows = []
    for page in (16, 1):
        layout, plan = C.llama_plan(1, 1, page)
        link = plan.links[0]
        n = -(-8192 // page)
        cap = 2 * n
        src = C.RankPool(plan, "prefill", link.prefill, "cuda:0", cap, seed=5)
        dst = C.RankPool(plan, "decode", link.decode, "cuda:1", cap, seed=-1)
        peer = src.engine.connect(dst.engine.agent_info())
        pp = src.engine.plan_pages(peer, page_copies(link, {"kv": src.local},
                                                     {"kv": dst.remote}, "kv"))
        table = {("pp0.tp0", "pp0.tp0"): (link, pp)}
        dev0 = src.device
        pinned = torch.empty(2 * n, dtype=torch.int64, pin_memory=True)
        pn = pinned.numpy()
        static = torch.empty(2 * n, dtype=torch.int64, device=dev0)
        stream = torch.cuda.Stream(dev0)
        pn[:] = np.arange(2 * n) % cap
        with torch.cuda.device(dev0), torch.cuda.stream(stream):  # compile outside capture
            static.copy_(pinned, non_blocking=True)
            src.engine._launch_direct(pp, static[:n], static[n:], n, dev0)
        torch.cuda.synchronize(dev0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(dev0), torch.cuda.graph(graph, stream=stream):
            static.copy_(pinned, non_blocking=True)
            src.engine._launch_direct(pp, static[:n], static[n:], n, dev0)
        for lay in ("contiguous", "fragmented"):
            rng = np.random.default_rng(page + 11)
            s_ids, d_ids = ((np.arange(n), np.arange(n, 2 * n)) if lay == "contiguous" else
                            (rng.permutation(cap)[:n], rng.permutation(cap)[:n]))

            host = []
            for i in range(args.real_reps + 3):
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                t0 = time.perf_counter()
                lk, p = table[("pp0.tp0", "pp0.tp0")]
                chunk = PrefillChunk(0, s_ids, True, 8192, aux_row=0)
                target = DecodeTarget(d_ids, 0, aux_row=1)
                kv_s, kv_d = component_pairs(layout, chunk, target, page)["kv"]
                s_ok, d_ok = _page_ids(p, kv_s, kv_d)  # the engine's id check
                pn[:n] = s_ok
                pn[n:] = d_ok
                graph.replay()
                t1 = time.perf_counter()
                if i >= 3:
                    host.append(t1 - t0)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            sp = torch.from_numpy(s_ids)
            dp = torch.from_numpy(d_ids)
            want = src.pages().index_select(1, sp.to(dev0))
            got = dst.pages().index_select(1, dp.to(dst.device))
            checks[f"graph replay p{page}/{lay}: every page landed"] = bool(
                torch.equal(want.to(dst.device), got))
            rows.append({"tokens": 8192, "page": page, "layout": lay, "pages": n,
                         "system": "pdc-prototype", "descriptors": 1,
                         "path": "direct kernel, CUDA graph replay (bench only, cuda:0 -> cuda:1)",
                         "us": C.median(host) * 1e6, "reps": len(host)})
        src.close()
        dst.close()
        del src, dst
        torch.cuda.empty_cache()
    return rows


def sglang_rows(args, notes):
    py = args.sglang_python or os.environ.get("PDC_SGLANG_PYTHON", "")
    if not py:
        notes.append("SGLang baseline skipped: no --sglang-python (set it up with "
                     "../shared/peers/sglang-descriptors/peer_sglang_setup.sh VENV)")
        return None, None
    harness = Path(args.sglang_harness)
    if not Path(py).exists() or not harness.exists():
        notes.append(f"SGLang baseline skipped: {py} or {harness} is missing")
        return None, None
    cfg = {"tokens": args.tokens, "pages": [16, 1], "min_time": args.min_time,
           "heavy_s": 1.0, "slice": 8192 in args.tokens and not args.small}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sg.json"
        proc = subprocess.run([py, str(Path(__file__).with_name("_sglang_peer.py")),
                               str(harness), str(out), json.dumps(cfg)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            notes.append(f"SGLang baseline failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip()[-800:]}")
            return None, None
        got = json.loads(out.read_text())
    rows = []
    for r in got["rows"]:
        rows.append({"tokens": r["tokens"], "page": r["page_size"], "layout": r["layout"],
                     "pages": r["pages"], "system": "sglang",
                     "path": r["function"] + (f" rank{r['prefill_tp_rank']}"
                                              if "prefill_tp_rank" in r else ""),
                     "case_sglang": r["case"], "descriptors": r["descriptors"],
                     "us": r["median_us"], "cpu_us": r["cpu_median_us"], "reps": r["reps"],
                     "ns_per_desc": r.get("ns_per_descriptor")})
    return rows, {"version": got["sglang_version"], "numpy": got["numpy"],
                  "real_modules": got["real_modules"]}


def slice_rows(args, checks):
    """TP2 -> TP1 head slices at 8K, page 16, fragmented: pdc rank 0's link."""
    layout, plan = C.llama_plan(2, 1, 16)
    link = next(lk for lk in plan.links if lk.prefill.tp == 0)
    ctx = Link(layout, plan, link)
    contexts = {("pp0.tp0", "pp0.tp0"): ctx}
    s_ids, d_ids = page_ids(8192, 16, "fragmented", seed=20240917)

    def pairs():
        chunk = PrefillChunk(0, s_ids, True, 8192, aux_row=0)
        return component_pairs(layout, chunk, DecodeTarget(d_ids, 0, aux_row=1), 16)

    def descriptors():
        c = contexts[("pp0.tp0", "pp0.tp0")]
        d = build_descriptors(c.link, c.local, c.remote, pairs())
        c.engine.submit_write("peer", d.src, d.dst, d.nbytes)
        return d

    def staged():
        c = contexts[("pp0.tp0", "pp0.tp0")]
        kv_s, kv_d = pairs()["kv"]
        return c.dev.submit_pages(c.kv_plan, kv_s, kv_d, path="staged", chunks=1)

    d = descriptors()
    checks["slice tp2->1 rank0: descriptors are 1 KiB head slices"] = bool(
        d.count == 512 * 16 * 160 + 1 and int(d.nbytes[0]) == 1024)
    n_desc = d.count
    del d
    base = {"tokens": 8192, "page": 16, "layout": "fragmented", "pages": 512,
            "tp": "2->1 rank0"}
    us, cpu, reps = time_case(args, descriptors, True)
    rows = [base | {"system": "pdc", "path": "descriptors (build_descriptors), head slices",
                    "descriptors": n_desc, "us": us, "cpu_us": cpu, "reps": reps,
                    "ns_per_desc": us * 1e3 / n_desc}]
    us, cpu, reps = time_case(args, staged, False)
    rows.append(base | {"system": "pdc", "path": "staged (counted, not run), head slices",
                        "descriptors": 1, "us": us, "cpu_us": cpu, "reps": reps})
    return rows


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,8192,65536")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds of timing per case")
    ap.add_argument("--heavy-reps", type=int, default=3)
    ap.add_argument("--sglang-python", default=None,
                    help="python of SGLang's scratch venv (peer_sglang_setup.sh); else skipped")
    ap.add_argument("--sglang-harness", default=str(HARNESS),
                    help="peer_sglang_descriptors.py (default: ../shared/peers/"
                    "sglang-descriptors/ beside the repository)")
    ap.add_argument("--real", action="store_true",
                    help="also time real staged/direct submits on cuda:0 -> cuda:1")
    ap.add_argument("--real-reps", type=int, default=20)
    args = ap.parse_args()
    if args.small:
        args.tokens, args.min_time, args.heavy_reps = "1024", 0.0, 1
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    rows: list[dict] = []
    checks: dict[str, bool] = {}
    notes: list[str] = []
    ctxs = {}
    for page in (16, 1):
        layout, plan = C.llama_plan(1, 1, page)
        ctxs[page] = {("pp0.tp0", "pp0.tp0"): Link(layout, plan, plan.links[0])}
    for tokens in args.tokens:
        for page in (16, 1):
            for lay in ("contiguous", "fragmented"):
                C.guarded(rows, notes, checks, f"pdc {tokens}/p{page}/{lay}",
                          lambda t=tokens, p=page, lay=lay: pdc_rows(args, ctxs, t, p, lay,
                                                                     checks))
    if 8192 in args.tokens:
        C.guarded(rows, notes, checks, "pdc slice", lambda: slice_rows(args, checks))
    if args.real:
        if torch.cuda.device_count() >= 2:
            C.guarded(rows, notes, checks, "real launches",
                      lambda: real_rows(args, [t for t in args.tokens if t <= 8192], checks,
                                        notes))
            C.guarded(rows, notes, checks, "graph replay", lambda: graph_rows(args, checks,
                                                                              notes))
        else:
            notes.append("--real skipped: needs two CUDA devices")
    sg, sg_meta = sglang_rows(args, notes)
    if sg:
        rows.extend(sg)
    # ratios against SGLang, case by case
    by_case = {(r["tokens"], r["page"], r["layout"]): r for r in rows
               if r.get("system") == "sglang" and "send_kvcache" in r["path"]
               and "slice" not in r["path"]}
    for r in rows:
        s = by_case.get((r.get("tokens"), r.get("page"), r.get("layout")))
        if s and r.get("system") in ("pdc", "pdc-prototype") and "tp" not in r:
            r["sglang_us"] = s["us"]
            r["speedup_vs_sglang"] = s["us"] / r["us"]
            if r.get("cpu_us"):
                # process CPU time: steadier than wall time on a shared machine
                r["sglang_cpu_us"] = s["cpu_us"]
                r["cpu_speedup_vs_sglang"] = s["cpu_us"] / r["cpu_us"]
            if r.get("ns_per_desc") and s.get("ns_per_desc"):
                r["per_desc_speedup_vs_sglang"] = s["ns_per_desc"] / r["ns_per_desc"]
                if r.get("cpu_us"):
                    r["per_desc_cpu_speedup_vs_sglang"] = (
                        s["cpu_us"] / s["descriptors"]) / (r["cpu_us"] / r["descriptors"])
    rows_sorted = sorted((r for r in rows if "tokens" in r),
                         key=lambda r: (r["tokens"], -r["page"], r["layout"],
                                        r["system"], r["path"]))
    C.table(rows_sorted + [r for r in rows if "tokens" not in r], [
        ("tokens", "tokens", "d"), ("page", "page", "d"), ("layout", "layout", ""),
        ("system", "system", ""), ("path", "path", ""), ("descriptors", "desc", ",d"),
        ("us", "us/request", ",.1f"), ("cpu_us", "cpu us", ",.1f"),
        ("ns_per_desc", "ns/desc", ",.1f"), ("speedup_vs_sglang", "x SGLang", ",.1f"),
        ("cpu_speedup_vs_sglang", "x SGLang cpu", ",.1f"),
        ("per_desc_speedup_vs_sglang", "x SGLang/desc", ",.1f"), ("error", "error", "")])
    staged8k = [r for r in rows if r.get("tokens") == 8192 and r.get("path", "").startswith(
        "staged") and r.get("system") == "pdc" and "tp" not in r]
    desc8k = [r for r in rows if r.get("tokens") == 8192 and r.get("path", "").startswith(
        "descriptors (build") and "per_desc_speedup_vs_sglang" in r]
    goals = {
        "d_staged_target_us": 50.0,
        "d_staged_8k_max_us": max((r["us"] for r in staged8k), default=None),
        "d_staged_met": bool(staged8k) and all(r["us"] <= 50.0 for r in staged8k),
        "d_per_desc_target_speedup": 20.0,
        "d_per_desc_speedup_8k": {f"p{r['page']}/{r['layout']}": r["per_desc_speedup_vs_sglang"]
                                  for r in desc8k},
        "d_per_desc_met": bool(desc8k) and all(r["per_desc_speedup_vs_sglang"] >= 20.0
                                               for r in desc8k),
        "d_per_desc_cpu_speedup_8k": {
            f"p{r['page']}/{r['layout']}": r.get("per_desc_cpu_speedup_vs_sglang")
            for r in desc8k},
    }
    if not sg:
        goals["d_per_desc_met"] = None
    return C.finish("control_cost", args, rows, checks, goals, notes,
                    extra={"sglang": sg_meta})


if __name__ == "__main__":
    sys.exit(main())
