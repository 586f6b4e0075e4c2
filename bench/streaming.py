"""(e) Per-layer streaming: a simulated prefill forward on GPU0 (a bf16 matmul chain per layer,
sized to --layer-ms) with each layer's KV pages sent to GPU1 as soon as the layer is done, on the
engine's own streams, triggered by a CUDA event recorded after the layer (`submit_pages(...,
after=event)`), against sending after the forward. One 8K-token Llama-3-70B request (page 16,
random pages), local engine's device mode, one page plan per layer (its K and V buffers).

Reported per path (push: GPU0's SMs run the copy kernel, sharing them with the forward; pull:
GPU1's SMs run it; staged: gather on GPU0, copy engine, scatter on GPU1):
- forward alone; one layer's transfer alone (median over layers); the whole request alone;
- overlapped: forward + per-layer transfers, until both devices are idle; exposed = that minus
  the forward alone; goal: exposed <= one layer's transfer. Also, within the same run, the tail
  from the forward's last event to the last transfer's end, and the forward's own time with the
  transfers beside it (exposed compares two separate ~80 ms runs, whose spread is milliseconds);
- not overlapped: forward, then the request: exposed = the whole transfer.

    python bench/streaming.py --json out/streaming.json
    python bench/streaming.py --small --json /tmp/s.json
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
from page_engine import page_copies


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--layer-ms", default="1.0,0.25",
                    help="simulated forward time per layer, ms (one run each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--paths", default="push,push:8,pull,staged",
                    help="push:N caps the direct kernel at N programs per buffer")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    if args.small:
        args.tokens, args.reps, args.layer_ms = 32, 1, "1.0"
    if cuda and torch.cuda.device_count() < 2:
        print("needs two GPUs", file=sys.stderr)
        return 2
    src_dev, dst_dev = ("cuda:0", "cuda:1") if cuda else ("cpu", "cpu")
    layout, plan = C.llama_plan(1, 1, args.page)
    link = plan.links[0]
    n = -(-args.tokens // args.page)
    cap = 2 * n
    src = C.RankPool(plan, "prefill", link.prefill, src_dev, cap, seed=3)
    dst = C.RankPool(plan, "decode", link.decode, dst_dev, cap, seed=-1)
    eng = src.engine
    peer = eng.connect(dst.engine.agent_info())
    layer_ids = sorted({e.layer_id for e in link.entries if e.component == "kv"})
    if args.small:
        layer_ids = layer_ids[:3]
    per_layer = [eng.plan_pages(peer, page_copies(link, {"kv": src.local}, {"kv": dst.remote},
                                                  "kv", {lid})) for lid in layer_ids]
    whole = eng.plan_pages(peer, page_copies(link, {"kv": src.local}, {"kv": dst.remote}, "kv",
                                             set(layer_ids)))
    rng = np.random.default_rng(2)
    s_ids = rng.choice(cap, n, replace=False).astype(np.int64)
    d_ids = rng.choice(cap, n, replace=False).astype(np.int64)
    devices = [src.device, dst.device]
    sync = C.sync_all(devices)
    rows: list[dict] = []
    checks: dict[str, bool] = {}
    notes: list[str] = []

    # the simulated layer: a bf16 matmul chain on GPU0 (float32 on the CPU)
    dt = torch.bfloat16 if cuda else torch.float32
    m = 4096 if cuda else 64
    a = torch.randn(m, m, dtype=dt, device=src.device)
    b = torch.randn(m, m, dtype=dt, device=src.device)
    c = torch.empty(m, m, dtype=dt, device=src.device)

    def mm():
        torch.mm(a, b, out=c)

    one_mm = C.median(C.wall(mm, sync, 5, warmup=2))

    def verify(label: str):
        s = torch.from_numpy(s_ids)
        d = torch.from_numpy(d_ids)
        kv = [e for e in link.entries if e.component == "kv" and e.layer_id in set(layer_ids)]
        sp = torch.tensor([e.src_pos for e in kv])
        dp = torch.tensor([e.dst_pos for e in kv])
        want = src.pages().index_select(1, s.to(src.device)).index_select(0, sp.to(src.device))
        got = dst.pages().index_select(1, d.to(dst.device)).index_select(0, dp.to(dst.device))
        checks[f"{label}: every layer's pages landed"] = bool(torch.equal(want.to(dst.device),
                                                                          got))

    def transfer(pp, path, after=None):
        # "push:8": the direct kernel on GPU0 with at most 8 programs per buffer (few SMs)
        name, _, cap = path.partition(":")
        return eng.submit_pages(pp, s_ids, d_ids, path=name, after=after,
                                programs=int(cap) if cap else None)

    for layer_ms in (float(x) for x in args.layer_ms.split(",")):
        k = max(1, round(layer_ms * 1e-3 / one_mm))

        def forward(on_layer=None, k=k):
            for i in range(len(layer_ids)):
                for _ in range(k):
                    mm()
                if on_layer is not None:
                    on_layer(i)

        f_alone = C.median(C.wall(forward, sync, args.reps))
        rows.append({"case": f"forward alone, {len(layer_ids)} layers x {k} matmuls",
                     "layer_ms": layer_ms, "path": "-", "ms": f_alone * 1e3,
                     "per_layer_ms": f_alone * 1e3 / len(layer_ids)})
        for path in args.paths.split(","):
            def one_path(path=path, layer_ms=layer_ms, f_alone=f_alone, forward=forward):
                def layer_alone():
                    times = []
                    for pp in per_layer[:: max(1, len(per_layer) // 8)]:
                        times += C.wall(lambda pp=pp: eng.wait(transfer(pp, path), 60.0), sync,
                                        1, warmup=1)
                    return C.median(times)

                l1 = layer_alone()
                whole_t = C.median(C.wall(lambda: eng.wait(transfer(whole, path), 60.0), sync,
                                          args.reps))
                batches: list = []
                host: list = []
                tails: list = []  # forward's end -> last transfer done, same run
                fwd: list = []  # start -> forward's end, with the transfers beside it

                def overlapped():
                    batches.clear()
                    t_start = time.perf_counter()

                    def send(i):
                        t0 = time.perf_counter()
                        if cuda:
                            ev = torch.cuda.Event()
                            ev.record(torch.cuda.current_stream(src.device))
                        else:
                            ev = None
                        batches.append(transfer(per_layer[i], path, after=ev))
                        host.append(time.perf_counter() - t0)

                    forward(send)
                    if cuda:
                        f_end = torch.cuda.Event()
                        f_end.record(torch.cuda.current_stream(src.device))
                        while not f_end.query():
                            time.sleep(0)
                    t_f = time.perf_counter()
                    for bt in batches:
                        eng.wait(bt, 60.0)
                    tails.append(time.perf_counter() - t_f)
                    fwd.append(t_f - t_start)

                def serial():
                    forward()
                    eng.wait(transfer(whole, path), 60.0)

                dst.arena.fill_(C.POISON)
                t_over = C.median(C.wall(overlapped, sync, args.reps))
                tail = C.median(tails[1:] or tails)  # the first call is the warm-up
                verify(f"{layer_ms} ms/layer, {path}, overlapped")
                t_serial = C.median(C.wall(serial, sync, args.reps))
                exposed = t_over - f_alone
                return [{"case": f"{path}: one layer's transfer alone", "layer_ms": layer_ms,
                         "path": path, "ms": l1 * 1e3},
                        {"case": f"{path}: whole request alone", "layer_ms": layer_ms,
                         "path": path, "ms": whole_t * 1e3,
                         "gbps": C.gbps(n * whole.unit_bytes, whole_t)},
                        {"case": f"{path}: not overlapped (forward, then request)",
                         "layer_ms": layer_ms, "path": path, "ms": t_serial * 1e3,
                         "exposed_ms": (t_serial - f_alone) * 1e3},
                        {"case": f"{path}: overlapped per layer", "layer_ms": layer_ms,
                         "path": path, "ms": t_over * 1e3, "exposed_ms": exposed * 1e3,
                         "one_layer_ms": l1 * 1e3, "exposed_over_one_layer": exposed / l1,
                         "submit_host_us_per_layer": C.median(host) * 1e6,
                         "tail_ms": tail * 1e3, "tail_over_one_layer": tail / l1,
                         "forward_with_transfers_ms": C.median(fwd[1:] or fwd) * 1e3}]

            C.guarded(rows, notes, checks, f"{layer_ms} ms {path}", one_path)
    C.table(rows, [("layer_ms", "ms/layer", ".2f"), ("case", "case", ""), ("ms", "ms", ".3f"),
                   ("exposed_ms", "exposed ms", ".3f"), ("one_layer_ms", "1 layer ms", ".3f"),
                   ("exposed_over_one_layer", "exposed/1 layer", ".2f"), ("tail_ms", "tail ms", ".3f"),
                   ("forward_with_transfers_ms", "fwd ms", ".3f"), ("gbps", "GB/s", ",.1f"),
                   ("error", "error", "")])
    over = [r for r in rows if "exposed_over_one_layer" in r]
    goals = {"e_target": "exposed <= one layer's transfer",
             "e_by_case": {f"{r['layer_ms']} ms/layer {r['path']}": r["exposed_over_one_layer"]
                           for r in over},
             "e_tail_by_case": {f"{r['layer_ms']} ms/layer {r['path']}": r["tail_over_one_layer"]
                                for r in over},
             "e_met_by_best_path": {
                 str(lm): min((r["exposed_over_one_layer"] for r in over if r["layer_ms"] == lm),
                              default=None) <= 1.0
                 for lm in {r["layer_ms"] for r in over}}}
    if args.small:
        notes.append("--small: CPU; nothing overlaps there (no streams), checks only")
    src.close()
    dst.close()
    return C.finish("streaming", args, rows, checks, goals, notes)


if __name__ == "__main__":
    sys.exit(main())
