"""What an interprocess event costs per request on the cuda_ipc path (Note [Success by event]):
prefill creates one per batch and exports its handle, decode opens that handle. Host µs per
step, median of N, between two processes on one GPU. A scratch measurement for the device
call beside it; not a bench of the project's code."""

import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

N = 200


def _since(t: float) -> float:
    return (time.perf_counter() - t) * 1e6


def child(conn):
    torch.cuda.init()
    s = torch.cuda.Stream()
    create, record, handle, kept = [], [], [], []
    for _ in range(N):
        t = time.perf_counter()
        ev = torch.cuda.Event(blocking=True, interprocess=True)
        create.append(_since(t))
        t = time.perf_counter()
        ev.record(s)
        record.append(_since(t))
        t = time.perf_counter()
        h = bytes(ev.ipc_handle())
        handle.append(_since(t))
        kept.append(ev)
        conn.send(h)
    conn.send(("stats", statistics.median(create), statistics.median(record),
               statistics.median(handle),
               bytes(kept[0].ipc_handle()) == bytes(kept[0].ipc_handle())))
    conn.recv()  # keep the events alive until the parent opened them


def main():
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=child, args=(b,))
    p.start()
    dev = torch.device("cuda:0")
    torch.cuda.init()
    opened, query = [], []
    handles = [a.recv() for _ in range(N)]
    stats = a.recv()
    evs = []
    for h in handles:
        t = time.perf_counter()
        ev = torch.cuda.Event.from_ipc_handle(dev, h)
        opened.append(_since(t))
        t = time.perf_counter()
        ev.query()
        query.append(_since(t))
        evs.append(ev)
    cached = {}
    hit = []
    for h in handles:
        t = time.perf_counter()
        cached.get(h)
        hit.append(_since(t))
    a.send("done")
    p.join()
    print(f"prefill: Event(interprocess) {stats[1]:.1f} us, record {stats[2]:.1f} us, "
          f"ipc_handle {stats[3]:.1f} us; the same event's handle twice equal: {stats[4]}")
    print(f"decode: from_ipc_handle {statistics.median(opened):.1f} us (p90 "
          f"{sorted(opened)[int(0.9 * N)]:.1f}), query {statistics.median(query):.1f} us, "
          f"a dict lookup of the handle {statistics.median(hit):.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
