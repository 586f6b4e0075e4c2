"""Host µs of the same small steps run back to back and after the thread slept, on a GPU host.

A scratch measurement for the device call beside it (issue 29 item 4: the control path's
steps take 2-10x longer inside a request than in a tight loop): per mode, the median over N
rounds of (a) a CUDA graph replay of one tiny kernel plus an event record, (b) an event record
alone, (c) 200 iterations of pure Python arithmetic. Modes: back to back; after sleeping 0.2,
1 and 10 ms; after spinning 1 ms (the core busy, no sleep). Not a bench of the project's code.
"""

import statistics
import time

import torch

N = 300


def main() -> None:
    x = torch.zeros(1024, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x.add_(1)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            x.add_(1)
    ev = torch.cuda.Event()
    torch.cuda.synchronize()

    def py() -> int:
        t = 0
        for i in range(200):
            t += i * i
        return t

    def spin(s: float) -> None:
        end = time.perf_counter() + s
        while time.perf_counter() < end:
            pass

    modes = {"back to back": None, "slept 0.2 ms": 2e-4, "slept 1 ms": 1e-3,
             "slept 10 ms": 1e-2, "spun 1 ms": "spin"}
    for name, pause in modes.items():
        rows = {"replay+record": [], "record": [], "python 200 iters": []}
        for _ in range(N):
            for step in rows:
                if pause == "spin":
                    spin(1e-3)
                elif pause is not None:
                    time.sleep(pause)
                t = time.perf_counter()
                if step == "replay+record":
                    g.replay()
                    ev.record()
                elif step == "record":
                    ev.record()
                else:
                    py()
                rows[step].append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        print(f"{name:14s} " + "  ".join(f"{k} {statistics.median(v):6.1f} us (p90 "
                                         f"{sorted(v)[int(0.9 * len(v))]:6.1f})"
                                         for k, v in rows.items()), flush=True)


if __name__ == "__main__":
    main()
