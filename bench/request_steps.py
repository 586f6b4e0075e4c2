"""The Python steps of one direct-path request, each alone, on the CPU (issue 29 item 4).

What the endpoints run for one Llama-3-70B request, prefill TP1 -> decode TP1, with the
runtime's own functions and no engine: decode's target, its staging items, the
TransferRequest's construction (its checks), its encoding and prefill's decoding, prefill's
target and page-coverage checks, the component pairs, the descriptor grids (Note [Descriptor
grids]) and the engine's grid checks. Page ids are a random half of a pool twice the
request's size on each side (one run per page). Each step is the minimum over `--repeat`
timings of `--number` calls, µs per call; the table's last row is their sum. Between two
trees, set PYTHONPATH to each and run this file of either; the steps' results are checked
against each other where they must agree (the decoded request equals the sent one, the grids
expand to `build_descriptors`' list).

    python bench/request_steps.py --tokens 8192 --json out.json
"""

from __future__ import annotations

import sys
import timeit

import _common as C
import numpy as np


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--number", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    if args.small:
        args.tokens, args.number, args.repeat = 256, 20, 3
    from pdc.runtime import staging
    from pdc.runtime import wire as W
    from pdc.runtime.datapath import DescriptorTemplate, build_descriptors, component_pairs
    from pdc.runtime.endpoints.handshake import _check_target
    from pdc.runtime.engines.base import check_grids, expand_grids
    from pdc.runtime.indices import DecodeTarget, PrefillChunk, check_page_coverage
    from pdc.runtime.plan_types import RankId
    from pdc.runtime.wire_codec import decode, encode

    layout, plan = C.llama_plan(1, 1)
    link, ps = plan.links[0], plan.topology.prefill.page_size
    pages = -(-args.tokens // ps)
    cap = 2 * pages
    rng = np.random.default_rng(0)
    dst, src = (rng.permutation(cap)[:pages].astype(np.int64) for _ in range(2))
    local, remote = {}, {}
    for side, base, out in (("prefill", 1 << 40, local), ("decode", 1 << 44, remote)):
        reg = plan.registration(side, link.prefill if side == "prefill" else link.decode)
        for name, _entries, _item in reg.components:
            at = base + len(out) * (1 << 36)
            loc, rem, _ = C.buffers(plan, side, reg.rank, name, at, cap)
            out[name] = loc if side == "prefill" else rem
    empty = np.zeros(0, np.int64)
    target = DecodeTarget(dst, 0, -1, -1, 0, empty, ())
    chunk = PrefillChunk(0, src, True, pages * ps, aux_row=0)
    tmpl = DescriptorTemplate.of(link, local, remote, False)
    caps = {c.name: cap for c in layout.components}

    def request():
        return W.TransferRequest(room=5, generation=1, decode_rank=RankId(0, 0),
                                 dst_page_ids=dst, aux_row=0, window_page_ids=empty,
                                 layer_slots=empty)

    msg = request()
    buf = encode(msg, 1, ())
    pairs = component_pairs(layout, chunk, target, ps)
    grids = tmpl.grids(pairs)
    assert grids is not None
    steps = {
        "decode: target": lambda: DecodeTarget(np.asarray(dst, np.int64), 0, -1, -1, 0,
                                               empty, ()),
        "decode: staging items": lambda: staging.request_items(layout, target, ps),
        "decode: TransferRequest()": request,
        "decode: encode": lambda: encode(msg, 1, ()),
        "prefill: decode": lambda: decode(buf, 1, ()),
        "prefill: target check": lambda: _check_target(layout, caps, target),
        "prefill: page coverage": lambda: check_page_coverage([chunk], target, ps, 0),
        "prefill: component pairs": lambda: component_pairs(layout, chunk, target, ps),
        "prefill: grids": lambda: tmpl.grids(pairs),
        "engine: grid checks": lambda: check_grids(grids),
    }
    rows = []
    for name, fn in steps.items():
        us = min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number * 1e6
        rows.append({"step": name, "us": round(us, 2)})
    rows.append({"step": "sum", "us": round(sum(r["us"] for r in rows), 2)})
    C.table(rows, [("step", "step", ""), ("us", "µs per call (min)", ".2f")])
    got = decode(buf, 1, ())
    flat = build_descriptors(link, local, remote, pairs)
    s, d, n = expand_grids(grids)
    checks = {
        "decoded request equals the sent one": bool(
            isinstance(got, W.TransferRequest) and got.room == msg.room
            and np.array_equal(got.dst_page_ids, msg.dst_page_ids)),
        "grids expand to build_descriptors": bool(
            np.array_equal(s, flat.src) and np.array_equal(d, flat.dst)
            and np.array_equal(n, flat.nbytes)),
    }
    print(f"{args.tokens} tokens, {pages} pages; grids: rows "
          f"{[len(g.src_rows) for g in grids]}, runs {[len(g.run_bytes) for g in grids]}")
    return C.finish("request_steps", args, rows, checks)


if __name__ == "__main__":
    sys.exit(main())
