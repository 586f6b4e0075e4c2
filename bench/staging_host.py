"""Host time of the staged path's copy launches per request, graphs on and off, in one run.

One Llama-3-70B request of `--tokens` tokens, prefill TP2 -> decode TP1 (every KV page moves as
head slices: 160 staging blocks per link), on one GPU: prefill's gather of one link's chunk
(`staging.Launches.gather_chunk`) and decode's scatter of one link (`scatter_link`), each
request with fresh page ids and its region at another place of one arena. Host µs is the time
the call takes on the calling thread (its launches queued, not waited for); GPU µs is the same
call's launches timed by CUDA events; "of it graphs.run" is the host µs of the call's graph
part (`staging_graphs.LaunchGraphs.run`: the replay, or Triton's launches), the rest is the
Python that computes the launches' values. Modes (`--modes`) alternate per repetition:
"copy", "kernel" and "mapped" replay graphs (Note [Staging graphs]: the shape's first call
through Triton, its second captured, later ones replayed) with the `graph_input` knob at that
value (Note [Pinned graph input]); "off" sends every launch through Triton's launcher. Medians over `--reps` calls
after `--warmup`; the first and last timed request of each mode are checked against torch's
indexing copies (staging.gather / staging.scatter) byte for byte.

    python3 bench/staging_host.py --tokens 8192 --json out.json   # needs a CUDA device
    python bench/staging_host.py --small   # CPU (Triton interpreter): the checks only

`--profile N` then runs N more replayed calls of each kind under cProfile and prints where
their host time goes (cProfile's own cost inflates the Python rows; the torch calls' rows
are the CUDA side: pinned buffer, copy, replay).
"""

from __future__ import annotations

import statistics
import sys
import time

import _common as C
import numpy as np
import torch


def _setup(tokens: int, device: str):
    from pdc.runtime import staging
    from pdc.runtime.family import Family
    from pdc.runtime.pools import Capacity, TensorPools

    family = Family.load("llama3_70b")
    layout, plan = family.layout, family.plan_for("tp=2", "tp=1", "local")
    link = plan.links[0]
    page = 16
    pages = tokens // page
    cap = Capacity(pages=2 * pages, slots=1, aux_rows=1, window_pages=1)
    src = TensorPools(layout, plan.registration("prefill", link.prefill), cap, device)
    dst = TensorPools(layout, plan.registration("decode", link.decode), cap, device)
    src.arena.random_(0, 256, generator=torch.Generator(device=device).manual_seed(1))
    blocks, nbytes = staging.link_blocks(link, {"kv": pages, "aux_first_token": 1})
    return staging, layout, link, src, dst, blocks, nbytes, pages


def _timed(run, took: list):
    """`run` (LaunchGraphs.run) appending its host µs to `took`."""
    def timed(*args):
        t = time.perf_counter()
        try:
            return run(*args)
        finally:
            took.append((time.perf_counter() - t) * 1e6)
    return timed


def _time_call(fn, *args) -> tuple[float, float]:
    if not torch.cuda.is_available():  # --small: the interpreter on CPU, host time only
        t = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - t) * 1e6, 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t = time.perf_counter()
    fn(*args)
    host = time.perf_counter() - t
    end.record()
    end.synchronize()
    return host * 1e6, start.elapsed_time(end) * 1e3


def main() -> int:
    ap = C.parser(__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--modes", default="copy,kernel,mapped,off",
                    help="comma-separated: copy, kernel, mapped (graphs replayed, graph_input "
                         "knob), off")
    args = ap.parse_args()
    device = "cpu" if args.small else "cuda:0"
    if args.small:
        args.tokens, args.reps, args.warmup = 32, 2, 1
    elif not torch.cuda.is_available():
        print("needs a CUDA device (or --small)", file=sys.stderr)
        return 2
    from pdc.runtime import knobs

    staging, layout, link, src, dst, blocks, nbytes, pages = _setup(args.tokens, device)
    arena = torch.empty(3 * nbytes, dtype=torch.uint8, device=device)
    rng = np.random.default_rng(0)
    modes = args.modes.split(",")
    for m in modes:
        if m not in ("copy", "kernel", "mapped", "off"):
            print(f"--modes: unknown mode {m!r}; use copy, kernel, mapped or off",
                  file=sys.stderr)
            return 2
    launches = {m: staging.Launches(staging.family_kernels(layout)) for m in modes}
    times: dict[str, dict[str, list]] = {m: {"gather host": [], "gather gpu": [],
                                             "gather run": [], "scatter host": [],
                                             "scatter gpu": [], "scatter run": []}
                                         for m in launches}
    run_us: list[float] = []  # host µs of each LaunchGraphs.run: the call's graph part
    for lx in launches.values():
        lx.graphs.run = _timed(lx.graphs.run, run_us)
    checks = []
    total = args.warmup + args.reps
    for i in range(total):
        for mode, lx in launches.items():
            knobs.override(staging_graphs=0 if mode == "off" else 1,
                           graph_input="copy" if mode == "off" else mode)
            try:
                ids = rng.permutation(2 * pages)[:pages].astype(np.int64)
                at = int(rng.integers(0, 2)) * nbytes  # the region moves within the arena
                out = arena[at:at + nbytes]
                positions = {"kv": (ids, np.arange(pages, dtype=np.int64))}
                hg, gg = _time_call(lx.gather_chunk, link, blocks, src.view, positions, None,
                                    out)
                rg = run_us[-1]
                dst_ids = {"kv": rng.permutation(2 * pages)[:pages].astype(np.int64),
                           "aux_first_token": np.zeros(1, np.int64)}
                hs, gs = _time_call(lx.scatter_link, link, blocks, dst.view, dst_ids, out)
                rs = run_us[-1]
            finally:
                knobs.reset()
            if i >= args.warmup:
                for k, v in (("gather host", hg), ("gather gpu", gg), ("gather run", rg),
                             ("scatter host", hs), ("scatter gpu", gs), ("scatter run", rs)):
                    times[mode][k].append(v)
            if i in (args.warmup, total - 1):
                checks.append(_check(staging, link, blocks, src, dst, ids, dst_ids, out))
    if args.profile:
        try:
            for mode, lx in launches.items():
                if mode != "off":
                    print(f"--- graph_input {mode}")
                    _profile(args.profile, lx, link, blocks, src, dst, arena, nbytes, pages,
                             rng)
        except Exception as exc:  # noqa: BLE001 - the table below still prints
            print(f"--profile failed: {exc!r}")
    rows = []
    for mode, lx in launches.items():
        row = {"graphs": mode, **{k: round(statistics.median(v), 1) for k, v in times[mode].items()},
               **{k: lx.graphs.stats[k] for k in ("launched", "captured", "replayed")},
               "input": ",".join(sorted({g.pinned.mode for g in lx.graphs._graphs.values()}))}
        rows.append(row)
    C.table(rows, [("graphs", "graphs", ""), ("gather host", "gather host us", ".1f"),
                   ("gather run", "of it graphs.run", ".1f"), ("gather gpu", "gather GPU us", ".1f"),
                   ("scatter host", "scatter host us", ".1f"),
                   ("scatter run", "of it graphs.run", ".1f"),
                   ("scatter gpu", "scatter GPU us", ".1f"), ("launched", "launched", "d"),
                   ("captured", "captured", "d"), ("replayed", "replayed", "d"),
                   ("input", "graph input", "")])
    print(f"{args.tokens} tokens, {len(blocks)} blocks, {nbytes} B per link region")
    names = [f"{m} request {k}" for k in ("first", "last") for m in launches]
    return C.finish("staging_host", args, rows, dict(zip(names, checks, strict=True)))


def _profile(n, lx, link, blocks, src, dst, arena, nbytes, pages, rng) -> None:
    """cProfile over `n` replayed gathers and scatters (graphs on), the top rows by own time."""
    import cProfile
    import pstats

    calls = []
    for _ in range(n):
        ids = rng.permutation(2 * pages)[:pages].astype(np.int64)
        at = int(rng.integers(0, 2)) * nbytes
        out = arena[at:at + nbytes]
        calls.append((ids, out, {"kv": rng.permutation(2 * pages)[:pages].astype(np.int64),
                                 "aux_first_token": np.zeros(1, np.int64)}))
    prof = cProfile.Profile()
    for ids, out, dst_ids in calls:
        positions = {"kv": (ids, np.arange(pages, dtype=np.int64))}
        prof.enable()
        lx.gather_chunk(link, blocks, src.view, positions, None, out)
        lx.scatter_link(link, blocks, dst.view, dst_ids, out)
        prof.disable()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    print(f"cProfile: {n} replayed gathers and scatters (graphs on)")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(18)
    if torch.cuda.is_available() and lx.graphs._graphs:
        _replay_steps(n, next(iter(lx.graphs._graphs.values())))


def _replay_steps(n: int, got) -> None:
    """Host µs of each step of a replay (staging_graphs.LaunchGraphs._run_cuda), alone, median
    of `n`: the device check, the stream handle, the wait for the last copy, the fill of the
    graph's pinned buffer, the replay with its event, and the whole call (with the graph's
    last values, so it rewrites the last request's bytes)."""
    import time

    from pdc.runtime.pinned_graph import on_device

    pinned = got.pinned
    slot = pinned.slots[0]
    device = slot.values.device
    values = slot.host_np.copy()

    def fill(buf):
        buf[:] = values

    def replay():
        slot.graph.replay()
        slot.read.record(pinned.stream)

    def context():
        with torch.cuda.device(device):
            pass

    steps = {"on_device (device current)": lambda: on_device(device, int, 0),
             "torch.cuda.device enter+exit": context,
             "raw stream handle": lambda: torch._C._cuda_getCurrentRawStream(device.index),
             "wait for the last replay": lambda: slot.read.synchronize(),
             "fill the pinned buffer": lambda: fill(slot.host_np),
             "graph.replay() + event": replay,
             "PinnedGraph.call (all)": lambda: pinned.call(fill)}
    print(f"  graph input: {slot.mode}, copy inside the graph: {slot.copy_inside}")
    for name, step in steps.items():
        took = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            took.append((time.perf_counter() - t) * 1e6)
        print(f"  {name:32} {statistics.median(took):8.1f} us")
    torch.cuda.synchronize()


def _check(staging, link, blocks, src, dst, ids, dst_ids, out) -> bool:
    """The gathered region and the scattered pages equal torch's indexing copies."""
    want = torch.empty_like(out)
    for b in blocks:
        e = link.entries[b.entry]
        if e.component != "kv":
            continue
        tb = b.segment.total_bytes
        staging.gather(src.view("kv", e.src_pos), ids, b.segment,
                       want[b.offset:b.offset + len(ids) * tb])
    kv = [b for b in blocks if link.entries[b.entry].component == "kv"]
    ok = all(torch.equal(out[b.offset:b.offset + len(ids) * b.segment.total_bytes],
                         want[b.offset:b.offset + len(ids) * b.segment.total_bytes]) for b in kv)
    for b in kv:
        e = link.entries[b.entry]
        pool = dst.view("kv", e.dst_pos)
        tb = b.segment.total_bytes
        got = torch.empty(len(ids) * tb, dtype=torch.uint8, device=out.device)
        staging.gather(pool, dst_ids["kv"], _dst_as_src(b.segment), got)
        ok = ok and torch.equal(got, out[b.offset:b.offset + len(ids) * tb])
    return ok


def _dst_as_src(seg):
    """The segment read back from decode's side (its destination placement as the source)."""
    from dataclasses import replace

    return replace(seg, src_offset=seg.dst_offset, src_stride=seg.dst_stride)


if __name__ == "__main__":
    sys.exit(main())
