"""A CUDA graph of copy-kernel launches whose per-call values come from its own pinned buffer.

Note [Pinned graph input]: the launches that `descriptor_copy` and `staging_graphs` replay read
their per-call values (descriptor tables; item ids and staging offsets) from a device buffer.
Filling it through a fresh pinned block and a `copy_` per call cost the replay more host time
than the replay itself (an H100 call: pinned block 18 µs, copy 23 µs, replay 36 µs, the device
switch 16 µs; BENCHMARKS.md (u)). So each graph owns one pinned host buffer, allocated when it
is captured, and the host-to-device copy of that buffer is the graph's first node: a call
writes its values into the buffer and replays, one CUDA call. The buffer may be rewritten only
after the previous replay's copy has read it: each replay records an event, and the next call
waits on it before writing (a replay queued behind long work on its stream makes the next call
of the same shape wait; other shapes have their own buffers). Where capturing the copy fails
(a torch that refuses a host copy inside a capture), the graph holds the launches only and a
call queues the copy from the same buffer before the replay, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch


def capture_graph(run, stream, device: torch.device) -> torch.cuda.CUDAGraph:
    """A CUDA graph of the launches `run()` makes, captured on a side stream (a stream being
    captured may not be the legacy default) ordered after `stream`; the capture runs nothing.
    Raises what the capture raised."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                run()
            finally:
                graph.capture_end()
    finally:
        stream.wait_stream(side)
    return graph


class PinnedGraph:
    """The launches of `run()`, reading `values` (a device buffer), as a graph whose input
    is its own pinned buffer (Note [Pinned graph input])."""

    def __init__(self, values: torch.Tensor, run, stream, device: torch.device):
        self.values = values
        self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self.host_np: np.ndarray = self.host.numpy()
        self.copy_inside = True

        def with_copy() -> None:
            values.copy_(self.host, non_blocking=True)
            run()

        try:
            self.graph = capture_graph(with_copy, stream, device)
        except Exception:  # noqa: BLE001 - the launches alone, the copy queued per call
            self.copy_inside = False
            self.graph = capture_graph(run, stream, device)
        self.read = torch.cuda.Event()
        # The stream it replays on: the callers key their graphs by the launching stream, so
        # it is this one, and recording on it needs no Stream object per call.
        self.stream = stream
        self._replayed = False
        self._lock = threading.Lock()  # one call at a time writes the buffer and replays

    def call(self, fill: Callable[[np.ndarray], object]) -> None:
        """`fill(the host buffer)`, then queue the graph on the current stream (of the
        graph's device, which must be current)."""
        with self._lock:
            if self._replayed:
                self.read.synchronize()  # returns at once when the last copy ran (usual)
            fill(self.host_np)
            if not self.copy_inside:
                self.values.copy_(self.host, non_blocking=True)
            self.graph.replay()
            self.read.record(self.stream)
            self._replayed = True


def on_device(device: torch.device, fn, *args):
    """`fn(*args)` with `device` current; the device switch (16 µs of host time on an H100)
    only where another device is current."""
    if torch.cuda.current_device() == device.index:
        return fn(*args)
    with torch.cuda.device(device):
        return fn(*args)
