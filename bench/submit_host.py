"""Host time of one cuda_ipc submit, whole and step by step (issue 29 item 4).

A direct-path request of `--pages` pages over 160 rows (Llama-3-70B's K and V buffers of 80
layers) from this process into a peer process's buffer through CUDA IPC, as descriptor grids
(Note [Descriptor grids]) and as the flat list: the host µs of `submit_grids` /
`submit_write` (the write waited for outside the timing), then each step of a grid submit
alone (the peer's liveness, the grid checks, the rows' spans and translation, the device
check, the stream switch, the reused ready event, the launch's graph replay, the done event;
and the device and stream context objects and fresh ready event of the submit before), medians of
`--reps` after a warm-up, and cProfile over `--profile N` submits. Every byte of the first
and last grid write is read back from the peer. Needs a CUDA device.

    python3 bench/submit_host.py --json out.json
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time

import _common as C
import numpy as np
import torch

ROWS, PAGE = 160, 4096


def _peer(conn, size: int) -> None:
    from pdc.runtime.engines.cuda_ipc import CudaIpcEngine

    eng = CudaIpcEngine("cuda:0")
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
    eng.register_tensor(dst)
    conn.send((eng.agent_info(), dst.data_ptr()))
    while conn.recv() == "read":
        conn.send(dst.cpu().numpy().tobytes())
    eng.close()


def _us(fn, reps: int) -> float:
    took = []
    for _ in range(reps):
        torch.cuda.synchronize()  # a step never waits for the GPU work of the one before
        t = time.perf_counter()
        fn()
        took.append((time.perf_counter() - t) * 1e6)
    return statistics.median(took)


def main() -> int:
    ap = C.parser(__doc__)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--profile", type=int, default=300)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("submit_host.py needs a CUDA device", file=sys.stderr)
        return 2
    from pdc.runtime import descriptor_copy
    from pdc.runtime.engines.base import DescriptorGrid, check_grids
    from pdc.runtime.engines.cuda_ipc import CudaIpcEngine

    n = args.pages
    size = ROWS * 2 * n * PAGE
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(b, size), daemon=True)
    proc.start()
    rows, checks = [], {}
    try:
        info, base = a.recv()
        eng = CudaIpcEngine("cuda:0")
        src = torch.randint(0, 256, (size // 2,), dtype=torch.uint8, device="cuda:0")
        eng.register_tensor(src)
        peer = eng.connect(info)
        target = eng._peers[peer]
        rng = np.random.default_rng(0)
        s_rows = src.data_ptr() + np.arange(ROWS, dtype=np.uint64) * np.uint64(n * PAGE)
        d_rows = base + np.arange(ROWS, dtype=np.uint64) * np.uint64(2 * n * PAGE)

        def grids():
            s_ids = rng.permutation(n).astype(np.uint64)
            d_ids = rng.permutation(2 * n)[:n].astype(np.uint64)
            return s_ids, d_ids, [DescriptorGrid(s_rows, d_rows, s_ids * PAGE, d_ids * PAGE,
                                                 np.full(n, PAGE, np.uint64))]

        def check(s_ids, d_ids, label):
            a.send("read")
            got = torch.frombuffer(bytearray(a.recv()), dtype=torch.uint8)
            got = got.view(ROWS, 2 * n, PAGE)[:, torch.from_numpy(d_ids.astype(np.int64))]
            want = src.cpu().view(ROWS, n, PAGE)[:, torch.from_numpy(s_ids.astype(np.int64))]
            checks[label] = bool(torch.equal(got, want))

        for form in ("grids", "flat"):
            took = []
            for rep in range(args.reps + 3):
                s_ids, d_ids, g = grids()
                flat = g[0].expand()
                t = time.perf_counter()
                batch = eng.submit_grids(peer, g) if form == "grids" else \
                    eng.submit_write(peer, *flat)
                dt = (time.perf_counter() - t) * 1e6
                eng.wait(batch, 60)
                if rep >= 3:
                    took.append(dt)
                if form == "grids" and rep in (3, args.reps + 2):
                    check(s_ids, d_ids, f"grid write {rep - 2} lands every byte")
            rows.append({"what": f"submit_{form} (whole call)", "host_us": statistics.median(took)})
        # each step of a grid submit alone
        _, _, g = grids()
        g = check_grids(g)
        stream = eng._stream(eng.device, "write")
        mapped = [eng._mapped_grid(peer, target, 0, g[0])]
        ready = eng._ready_event(None)
        steps = {
            "_alive (reads /proc/<pid>/stat)": lambda: eng._alive(peer, target),
            "check_grids": lambda: check_grids(g),
            "_mapped_grid (spans, 2x outside, translate)": lambda: eng._mapped_grid(
                peer, target, 0, g[0]),
            # what _queue does now, then the context objects and fresh event it did before
            "current_device() check": lambda: torch.cuda.current_device(),
            "set_stream(s) there and back": lambda: _set_back(stream),
            "reused Event.record(current_stream)": lambda: ready.record(
                torch.cuda.current_stream()),
            "(before) torch.cuda.device(...) enter+exit": lambda: _ctx(
                torch.cuda.device(eng.device)),
            "(before) torch.cuda.stream(s) enter+exit": lambda: _ctx(torch.cuda.stream(stream)),
            "(before) Event() + record(current_stream)": lambda: eng._ready_event(None),
            "stream.wait_event(ev)": lambda: stream.wait_event(ready),
            "launch_grids (replay) on the stream": lambda: _on(stream, lambda: descriptor_copy
                                                               .launch_grids(mapped, eng.device)),
            "Event(blocking) + record(stream)": lambda: torch.cuda.Event(blocking=True).record(
                stream),
        }
        for label, fn in steps.items():
            fn()
            rows.append({"what": label, "host_us": _us(fn, args.reps)})
            torch.cuda.synchronize()
        rows.append({"what": "graphs", **descriptor_copy.graph_stats})
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            for _ in range(args.profile):
                _, _, g2 = grids()
                prof.enable()
                batch = eng.submit_grids(peer, g2)
                prof.disable()
                eng.wait(batch, 60)
            print(f"== cProfile of {args.profile} submit_grids", file=sys.stderr)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(22)
        eng.close()
    finally:
        a.send("stop")
        proc.join(30)
    for r in rows:
        print(r)
    return C.finish("submit_host", args, rows, checks)


def _set_back(stream) -> None:
    caller = torch.cuda.current_stream()
    torch.cuda.set_stream(stream)
    torch.cuda.set_stream(caller)


def _ctx(cm) -> None:
    cm.__enter__()
    cm.__exit__(None, None, None)


def _on(stream, fn) -> None:
    with torch.cuda.stream(stream):
        fn()


if __name__ == "__main__":
    sys.exit(main())
