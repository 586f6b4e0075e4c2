"""A long request through a small staging arena: the ring (Note [Staging ring]) against the
direct fallback and against an arena big enough for the whole region, in one run.

One Llama-3-70B request, prefill TP2 -> decode TP1 (every KV page moves as head slices, so
decode stages both links), through bench/endpoints_device.py's harness: real endpoints and
control plane in one process, pools.TensorPools and the local engine, on CPU tensors here or
on two GPUs. Modes:

- big arena: `staging_arena_bytes` holds each link's whole region (the path of requests that
  fit, unchanged by rings);
- ring: a small arena (`--arena`, default 16 MiB, against ~168 MiB per link at 1K tokens), so
  each link moves through a ring of `staging_ring_slots` slots of `staging_ring_slot_bytes`;
- direct fallback: the same small arena with rings off (`staging_ring_slots=0`): what such a
  request did before rings, one descriptor per head-slice piece.

Time is decode's init() to Success, median of `--reps` requests after one warm-up; the first
and last timed request of each mode are checked with the link digests.

    python bench/arena_ring.py --json bench/results/<date>-cpu-arena-ring/arena_ring.json
    python bench/arena_ring.py --small --json /tmp/a.json
"""

from __future__ import annotations

import sys

import _common as C
import torch
from endpoints_device import run_mode


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arena", type=int, default=16 << 20, help="small arena, bytes")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--slot-bytes", default=str(4 << 20),
                    help="most bytes of a ring slot; a comma list runs one ring mode each")
    ap.add_argument("--no-direct", action="store_true",
                    help="skip the direct fallback (at 8K tokens on one GPU it takes minutes)")
    ap.add_argument("--cuda", action="store_true",
                    help="pools on cuda:0 / cuda:1 (both on cuda:0 with one GPU)")
    args = ap.parse_args()
    if args.small:
        args.tokens, args.reps, args.arena, args.slot_bytes = 64, 1, 2 << 20, str(1 << 20)
    slot_sizes = [int(x) for x in args.slot_bytes.split(",")]
    devices = ("cpu", "cpu")
    if args.cuda:
        if not torch.cuda.is_available():
            print("--cuda needs a CUDA device", file=sys.stderr)
            return 2
        # one GPU: both sides on it (the local engine's copies stay inside its memory)
        devices = ("cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    layout, plan = C.llama_plan(2, 1)
    region = 1344 * 1024 * 1024 * args.tokens // 8192  # one link's whole region (BENCHMARKS (g))
    big = max(512 << 20, 2 * region)
    rings = [(f"small arena, ring of {b / 2**20:g} MiB slots" if len(slot_sizes) > 1
              else "small arena, ring",
              {"staging_arena_bytes": args.arena, "staging_ring_slots": args.slots,
               "staging_ring_slot_bytes": b}, "staged") for b in slot_sizes]
    modes = [("big arena (whole region)", {"staging_arena_bytes": big}, "staged"), *rings]
    if not args.no_direct:
        modes.append(("small arena, direct fallback", {**rings[0][1], "staging_ring_slots": 0},
                      "direct"))
    rows: list[dict] = []
    checks: dict[str, bool] = {}
    notes = [f"one link's whole staging region: ~{region / 2**20:.0f} MiB; small arena "
             f"{args.arena / 2**20:.0f} MiB; ring {args.slots} slots of at most "
             f"{', '.join(f'{b / 2**20:g}' for b in slot_sizes)} MiB"]
    for name, knob_values, path in modes:
        C.guarded(rows, notes, checks, name, lambda name=name, kv=knob_values: run_mode(
            args, name, kv, layout, plan, devices, rows, checks))
        if path == "direct":  # run_mode expects every link staged when the arena is on
            staged = checks.pop(f"{name}: every link staged", None)
            got = next((r for r in rows if r.get("case") == name and "staged_links" in r), {})
            checks[f"{name}: no link staged"] = staged is not None and \
                got.get("staged_links") == 0
        rows[-1]["arena_mib"] = knob_values["staging_arena_bytes"] / 2**20
    C.table(rows, [("case", "case", ""), ("tokens", "tokens", "d"),
                   ("arena_mib", "arena MiB", ",.0f"), ("staged_links", "staged links", "d"),
                   ("bytes", "bytes", ",d"), ("ms", "ms", ",.1f"), ("gbps", "GB/s", ",.2f"),
                   ("error", "error", "")])
    if args.small:
        notes.append("--small: 64 tokens; timings are meaningless")
    by = {r["case"]: r for r in rows if "ms" in r}
    goals = {}
    big_ms = by.get(modes[0][0], {}).get("ms")
    for name, kv, _ in rings:
        ring_ms = by.get(name, {}).get("ms")
        if big_ms and ring_ms:
            mib = kv["staging_ring_slot_bytes"] / 2**20
            suffix = "" if len(rings) == 1 else f"_{mib:g}mib"
            goals[f"ring_over_big_arena{suffix}"] = ring_ms / big_ms
            direct_ms = by.get("small arena, direct fallback", {}).get("ms")
            if direct_ms:
                goals[f"direct_over_ring{suffix}"] = direct_ms / ring_ms
    return C.finish("arena_ring", args, rows, checks, goals, notes)


if __name__ == "__main__":
    sys.exit(main())
