"""The staged path's copy-kernel launches of one request, replayed as one CUDA graph.

Note [Staging graphs]: Triton's Python launcher costs 150-220 µs of host time per launch on the
H200 box (BENCHMARKS.md (m)), and an 8K Llama-70B link's gather or scatter is one launch per
component and run of items, 0.8-1.3 ms of host time per link in the traces of (p). A launch's
arguments split into what a request shape fixes (entry tables, grid, word size, the staging
buffer) and what each request brings (the item ids and the staging offsets). The launches of
one call (`staging.Launches.gather_chunk` or `scatter_link`) therefore read the ids and the
offsets from one device buffer, filled by one host-to-device copy, and the staging buffer is
always the whole arena (a request's region is an offset into it, not a pointer of its own), so
that requests of one shape at any place in the arena share a graph. A shape's first call runs
through Triton (compiling the kernels if needed), its second is captured after it runs, later
ones write the values into the graph's pinned buffer and replay it (Note [Pinned graph input]
in pinned_graph.py). Graphs are kept per `Launches` (one per endpoint, whose arena and pools
they point into), the least recently used dropped beyond `GRAPH_CACHE`; the `staging_graphs`
knob (0) turns them off.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import knobs
from .pinned_graph import PinnedGraph, on_device

GRAPH_CACHE = 64


@dataclass
class _Graph:
    pinned: PinnedGraph
    launches: list  # copy_kernels.Prepared: keeps the tensors the graph points at alive
    anchor: object  # what the key names by id() (the link's blocks): alive as long as this


class LaunchGraphs:
    """Runs the launches of one call of `staging.Launches`, replaying them as a CUDA graph
    when the same call shape ran before on the same stream (Note [Staging graphs])."""

    def __init__(self, limit: int = GRAPH_CACHE):
        self.limit = limit
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # launched once, not captured
        self._lock = threading.Lock()
        self.stats = {"launched": 0, "captured": 0, "replayed": 0, "capture_errors": 0}
        self.last_capture_error = ""

    def run(self, key: tuple, anchor: object, parts: list[np.ndarray], device: torch.device,
            build: Callable[[torch.Tensor], list]) -> None:
        """Queue the launches that `build(values on the device)` prepares (copy_kernels.Prepared),
        on `device`'s current stream, where the values are `parts` back to back (written
        straight into a replayed graph's buffer). `key` fixes everything but the values;
        `anchor` is the object the key names by id()."""
        if device.type != "cuda":
            for launch in build(torch.from_numpy(np.concatenate(parts))):
                launch.run()
            self.stats["launched"] += 1
            return
        on_device(device, self._run_cuda, key, anchor, parts, device, build)

    def _run_cuda(self, key, anchor, parts, device, build) -> None:
        # The raw stream handle (what Triton's launcher reads too): no Stream object per call.
        key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), *key)
        got, capture = None, False
        if knobs.get("staging_graphs"):
            with self._lock:
                got = self._graphs.get(key)
                if got is not None and got.anchor is anchor:
                    self._graphs.move_to_end(key)
                    self.stats["replayed"] += 1
                elif key in self._seen:
                    got = None
                    del self._seen[key]
                    capture = True
                else:
                    got = None
                    self._seen[key] = None
                    while len(self._seen) > self.limit:
                        self._seen.popitem(last=False)
        if got is not None:  # Note [Pinned graph input]
            got.pinned.put(parts)
            return
        # torch's pinned-memory cache keeps the block until the copy below has read it
        values = np.concatenate(parts)
        host = torch.empty(len(values), dtype=torch.int64, pin_memory=True)
        host.numpy()[:] = values
        dev = host.to(device, non_blocking=True)
        launches = build(dev)
        for launch in launches:
            launch.run()
        self.stats["launched"] += 1
        if capture:
            self._capture(key, anchor, dev, build, device)

    def _capture(self, key, anchor, dev, build, device) -> None:
        held: list = []  # every slot's launches: they keep the tensors the graphs point at

        def build_run(values):
            launches = build(values)
            held.extend(launches)

            def run() -> None:
                for launch in launches:
                    launch.run()
            return run

        try:  # after the launches above compiled the kernels
            pinned = PinnedGraph(dev, build_run, torch.cuda.current_stream(device), device)
        except Exception as exc:  # noqa: BLE001 - a capture that fails costs only the graph
            self.stats["capture_errors"] += 1
            self.last_capture_error = repr(exc)
            return
        with self._lock:
            self._graphs[key] = _Graph(pinned, held, anchor)
            self.stats["captured"] += 1
            while len(self._graphs) > self.limit:
                self._graphs.popitem(last=False)
