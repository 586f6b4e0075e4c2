"""(c) Heterogeneous TP over NVLink: prefill TP2 -> decode TP1 (head merge) and TP1 -> TP2 (head
split), one 8K-token Llama-3-70B request, through the local engine's device mode.

Plans are lowered from specs/llama3-70b.yaml. Every prefill rank's pools sit on GPU0 and every
decode rank's on GPU1, one engine per rank, so all 2.68 GB cross NVLink once:

- merge (TP2 -> TP1): each prefill rank holds 4 of the 8 KV heads ([16, 4, 128] bf16 pages,
  16 KiB); the decode rank's [16, 8, 128] pages take rank r's heads at 4r..4r+3, i.e. 16 pieces
  of 1 KiB per page. Two engines (two ranks) submit at once.
- split (TP1 -> TP2): the reverse; one prefill engine submits to its two decode peers.

Paths: direct peer kernel (push: GPU0 runs it; pull: GPU1 runs it) and staged (gather -> one
bulk copy per chunk -> scatter; the head interleave happens in the gather or the scatter). The
limit is a contiguous GPU0 -> GPU1 copy of the same bytes, timed in the same run.

    python bench/hetero_tp.py --json out/hetero_tp.json
    python bench/hetero_tp.py --small --json /tmp/h.json
"""

from __future__ import annotations

import os
import sys

if "--small" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import _common as C
import numpy as np
import torch
from page_engine import page_copies

HEAD_BYTES = 128 * 2  # one head of one token, bf16


def heads_view(pool: C.RankPool, page: int):
    """[entries, capacity, page tokens, heads, 256 B] view of a pool."""
    heads = pool.item // (page * HEAD_BYTES)
    return pool.arena.view(pool.n_entries, pool.capacity, page, heads, HEAD_BYTES)


def run_direction(args, name: str, prefill_tp: int, decode_tp: int, src_dev, dst_dev,
                  rows, checks, notes):
    layout, plan = C.llama_plan(prefill_tp, decode_tp, args.page)
    n = -(-args.tokens // args.page)
    cap = 2 * n
    layers = {0, 1} if args.small else None
    pre = {r.rank: C.RankPool(plan, "prefill", r.rank, src_dev, cap, seed=7 + r.rank.tp)
           for r in plan.prefill}
    dec = {r.rank: C.RankPool(plan, "decode", r.rank, dst_dev, cap, seed=-1)
           for r in plan.decode}
    devices = [next(iter(pre.values())).device, next(iter(dec.values())).device]
    sync = C.sync_all(devices)
    jobs = []  # (engine, page plan, link)
    for link in plan.links:
        src, dst = pre[link.prefill], dec[link.decode]
        peer = src.engine.connect(dst.engine.agent_info())
        copies = page_copies(link, {"kv": src.local}, {"kv": dst.remote}, "kv", layers)
        jobs.append((src.engine, src.engine.plan_pages(peer, copies), link))
    nbytes = n * sum(pp.unit_bytes for _, pp, _ in jobs)
    rng = np.random.default_rng(1)
    s_ids = rng.choice(cap, n, replace=False).astype(np.int64)
    d_ids = rng.choice(cap, n, replace=False).astype(np.int64)
    csrc = torch.empty(nbytes, dtype=torch.uint8, device=devices[0])
    cdst = torch.empty(nbytes, dtype=torch.uint8, device=devices[1])
    csrc.random_(0, 256)
    limit = C.median(C.wall(lambda: cdst.copy_(csrc), sync, args.reps))
    rows.append({"case": f"{name}: contiguous P2P copy (limit)", "direction": name,
                 "path": "torch copy_", "bytes": nbytes, "ms": limit * 1e3,
                 "gbps": C.gbps(nbytes, limit)})
    heads_total = 8

    def verify(label: str):
        s = torch.from_numpy(s_ids)
        d = torch.from_numpy(d_ids)
        same = True
        for link in plan.links:
            src, dst = pre[link.prefill], dec[link.decode]
            kv = [e for e in link.entries if e.component == "kv"
                  and (layers is None or e.layer_id in layers)]
            sp = torch.tensor([e.src_pos for e in kv])
            dp = torch.tensor([e.dst_pos for e in kv])
            sv = heads_view(src, args.page)
            dv = heads_view(dst, args.page)
            if prefill_tp > decode_tp:  # merge: this rank's heads land at its slot
                k = heads_total // prefill_tp
                h0 = link.prefill.tp % (prefill_tp // decode_tp) * k
                want = sv.index_select(1, s.to(src.device)).index_select(0, sp.to(src.device))
                got = dv.index_select(1, d.to(dst.device)).index_select(0, dp.to(dst.device))
                got = got[:, :, :, h0:h0 + k]
            else:  # split: this decode rank takes its heads of the source pages
                k = heads_total // decode_tp
                h0 = link.decode.tp % (decode_tp // prefill_tp) * k
                want = sv.index_select(1, s.to(src.device)).index_select(0, sp.to(src.device))
                want = want[:, :, :, h0:h0 + k]
                got = dv.index_select(1, d.to(dst.device)).index_select(0, dp.to(dst.device))
            same &= bool(torch.equal(want.to(dst.device), got))
        untouched = True
        for dst in dec.values():
            keep = torch.ones(dst.capacity, dtype=torch.bool, device=dst.device)
            keep[d.to(dst.device)] = False
            untouched &= bool((dst.pages()[:, keep, :] == C.POISON).all())
        checks[f"{label}: every head slice landed"] = same
        checks[f"{label}: no other page written"] = untouched

    def measure(path: str, chunks=None):
        label = f"{name}: " + ("direct peer kernel (" + path + ")" if path != "staged"
                               else f"staged, {chunks or 'default'} chunks")
        for dst in dec.values():
            dst.arena.fill_(C.POISON)
        sync()

        def once():
            batches = [(eng, eng.submit_pages(pp, s_ids, d_ids, path=path, chunks=chunks))
                       for eng, pp, _ in jobs]
            for eng, b in batches:
                eng.wait(b, 120.0)

        t = C.median(C.wall(once, sync, args.reps))
        verify(label)
        return {"case": label, "direction": name, "path": path, "bytes": nbytes,
                "ms": t * 1e3, "gbps": C.gbps(nbytes, t), "ratio_to_p2p": limit / t,
                "submits": len(jobs), "copies_per_submit": len(jobs[0][1].copies),
                "piece_bytes": min(c.segment.nbytes for _, pp, _ in jobs for c in pp.copies)}

    for path in ("push", "pull"):
        C.guarded(rows, notes, checks, f"{name} {path}", lambda path=path: measure(path))
    C.guarded(rows, notes, checks, f"{name} staged", lambda: measure("staged"))
    for p in list(pre.values()) + list(dec.values()):
        p.close()


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if args.small:
        args.tokens, args.reps = 32, 1
    cuda = torch.cuda.is_available() and not args.small
    if cuda and torch.cuda.device_count() < 2:
        print("needs two GPUs", file=sys.stderr)
        return 2
    src_dev, dst_dev = ("cuda:0", "cuda:1") if cuda else ("cpu", "cpu")
    rows: list[dict] = []
    checks: dict[str, bool] = {}
    notes: list[str] = []
    for name, p, d in (("TP2->TP1 merge", 2, 1), ("TP1->TP2 split", 1, 2)):
        C.guarded(rows, notes, checks, name, lambda name=name, p=p, d=d: run_direction(
            args, name, p, d, src_dev, dst_dev, rows, checks, notes))
        if cuda:
            torch.cuda.empty_cache()
    C.table(rows, [("case", "case", ""), ("piece_bytes", "piece B", "d"),
                   ("bytes", "bytes", ",d"), ("ms", "ms", ".3f"), ("gbps", "GB/s", ",.1f"),
                   ("ratio_to_p2p", "ratio to P2P", ".3f"), ("error", "error", "")])
    goals: dict = {"c_ratio_target": 0.85}
    for name in ("TP2->TP1 merge", "TP1->TP2 split"):
        cand = [r for r in rows if r.get("direction") == name and "ratio_to_p2p" in r]
        best = max(cand, key=lambda r: r["ratio_to_p2p"], default=None)
        goals[name] = {"best_path": best["case"] if best else None,
                       "best_ratio": best["ratio_to_p2p"] if best else None,
                       "met": bool(best and best["ratio_to_p2p"] >= 0.85)}
    if args.small:
        notes.append("--small: CPU, Triton interpreter, two layers; timings are meaningless")
    return C.finish("hetero_tp", args, rows, checks, goals, notes)


if __name__ == "__main__":
    sys.exit(main())
