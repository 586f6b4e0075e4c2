"""Host cost of one per-layer submit: indices recomputed per layer vs once per chunk.

A streamed chunk is submitted once per layer (layer_done). Before Note [Indices once per chunk]
every layer recomputed the chunk's (source, destination) index pairs; now they are computed on
the first submit and reused. This measures, for one Llama-3-70B request (page 16, fragmented
pages, TP1 -> TP1 and TP2 -> TP1, one chunk), the host time of the descriptor work of every
layer both ways in one run: `recompute` = component_pairs + build_descriptors per layer,
`reuse` = component_pairs once + build_descriptors per layer. The descriptors are identical.

    python bench/layer_submit.py --json bench/results/<date>-cpu-layer-submit/layer_submit.json
"""

from __future__ import annotations

import time

import _common as C
import numpy as np
from pdc.runtime.datapath import build_descriptors, component_pairs
from pdc.runtime.indices import DecodeTarget, PrefillChunk


def one_case(prefill_tp: int, tokens: int, reps: int) -> dict:
    layout, plan = C.llama_plan(prefill_tp, 1)
    page = 16
    n_pages = -(-tokens // page)
    rng = np.random.default_rng(0)
    capacity = 2 * n_pages
    src_ids = rng.permutation(capacity)[:n_pages].astype(np.int64)
    dst_ids = rng.permutation(capacity)[:n_pages].astype(np.int64)
    # Not the last chunk: the page components only (what a streamed middle chunk sends).
    chunk = PrefillChunk(0, src_ids, False, tokens)
    target = DecodeTarget(dst_ids, 0)
    link = plan.links[0]
    local, _, nbytes = C.buffers(plan, "prefill", link.prefill, "kv", 1 << 32, capacity)
    _, remote, _ = C.buffers(plan, "decode", link.decode, "kv", 1 << 40, capacity)
    layers = sorted({e.layer_id for e in link.entries})
    best = {}
    for mode in ("recompute", "reuse"):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            pairs = component_pairs(layout, chunk, target, page)
            n = 0
            for layer in layers:
                if mode == "recompute":
                    pairs = component_pairs(layout, chunk, target, page)
                n += len(build_descriptors(link, {"kv": local}, {"kv": remote}, pairs,
                                           {layer}).src)
            times.append((time.perf_counter() - t0) / len(layers))
        best[mode] = (float(np.median(times)) * 1e6, n)
    return {"prefill_tp": prefill_tp, "tokens": tokens, "layers": len(layers),
            "recompute_us_per_layer": round(best["recompute"][0], 1),
            "reuse_us_per_layer": round(best["reuse"][0], 1),
            "descriptors": best["reuse"][1],
            "same_descriptors": best["recompute"][1] == best["reuse"][1],
            "speedup": round(best["recompute"][0] / best["reuse"][0], 2)}


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    cases = [(1, 1024), (1, 8192), (2, 8192)] if not args.small else [(1, 256)]
    rows = [one_case(tp, tokens, args.reps) for tp, tokens in cases]
    C.table(rows, [("prefill_tp", "prefill tp", ""), ("tokens", "tokens", ""),
                   ("layers", "layers", ""), ("descriptors", "descriptors", ""),
                   ("recompute_us_per_layer", "recompute us/layer", ".1f"),
                   ("reuse_us_per_layer", "reuse us/layer", ".1f"), ("speedup", "x", ".2f")])
    return C.finish("layer_submit", args, rows,
                    {"same descriptors both ways": all(r["same_descriptors"] for r in rows)})


if __name__ == "__main__":
    raise SystemExit(main())
