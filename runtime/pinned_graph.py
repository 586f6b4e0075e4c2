"""A CUDA graph of copy-kernel launches whose per-call values come from its own pinned buffer.

Note [Pinned graph input]: the launches that `descriptor_copy` and `staging_graphs` replay read
their per-call values (descriptor tables; item ids and staging offsets) from a buffer the
graph owns. Filling it through a fresh pinned block and a `copy_` per call cost the replay more
host time than the replay itself (an H100 call: pinned block 18 µs, copy 23 µs, replay 36 µs,
the device switch 16 µs; BENCHMARKS.md (u)). So each graph owns one pinned host buffer,
allocated when it is captured, and a call writes its values into it and replays, one CUDA call.
How the launches reach the buffer is the `graph_input` knob:
- "copy": the host-to-device copy of the buffer into a device buffer is the graph's first node,
  and the launches read the device buffer. The buffer may be rewritten once that copy has read
  it.
- "kernel" (the default): the graph's first node is a small kernel that reads the pinned
  buffer across the bus (a pinned block is addressable from the device) into the device
  buffer: kernel nodes only, which launch faster than a graph with a copy node, and the
  launches read device memory (an H100: a gather's host time 61 -> 46 µs against "copy",
  GPU time within 1 %; BENCHMARKS.md (aa)).
- "mapped": the launches read the pinned buffer themselves, no first node (an H100: replay
  and event 7.6 -> 5.7 µs); but every program reads its values across the bus, which slowed
  the kernels (scatter +5 %, a direct 8K request +0.1-0.2 ms; BENCHMARKS.md (aa)).
In "kernel" and "mapped" the graph is captured twice over two pinned buffers and calls
alternate between them, so a call waits only for the replay two calls back.
Each replay records an event on its slot, and the next call of that slot waits on it before
writing (a replay queued behind long work on its stream makes a later call of the same shape
wait; other shapes have their own buffers). Where capturing the copy fails (a torch that
refuses a host copy inside a capture), the graph holds the launches only and a call queues the
copy from the same buffer before the replay; where the pinned buffer cannot be seen as a device
tensor, "kernel" and "mapped" fall back to "copy".
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from . import knobs
from .cuda_streams import capture_stream

GRAPH_INPUTS = ("copy", "kernel", "mapped")


def capture_graph(run, stream, device: torch.device) -> torch.cuda.CUDAGraph:
    """A CUDA graph of the launches `run()` makes, captured on a side stream (a stream being
    captured may not be the legacy default) ordered after `stream`; the capture runs nothing.
    Raises what the capture raised."""
    graph = torch.cuda.CUDAGraph()
    side = capture_stream(device)  # Note [Own streams]: no other thread queues work on it
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


def mapped_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A tensor on `device` over the pinned `host` tensor's own memory (Note [Pinned graph
    input], "mapped"), or None where torch or the driver will not give one."""
    class _Interface:  # the CUDA array interface: torch wraps the address without a copy
        __cuda_array_interface__ = {"shape": tuple(host.shape), "data": (host.data_ptr(), False),
                                    "typestr": host.numpy().dtype.str, "version": 3}

    try:
        view = torch.as_tensor(_Interface(), device=device)
    except Exception:  # noqa: BLE001 - the copy mode serves instead
        return None
    if view.data_ptr() != host.data_ptr() or view.device != device:
        return None  # torch copied it (another device's block): not a view
    return view


def _bus_read_fn(src, dst, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n], where src is a pinned buffer read across the bus."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = i < n
    tl.store(dst + i, tl.load(src + i, mask=keep), mask=keep)


# A JITFunction built directly, as copy_kernels' is: triton.jit returns an interpreter object
# whenever TRITON_INTERPRET=1 was set before this import, and an interpreted launch copies its
# tensors to the host, which a capture refuses (the "kernel" captures failed so in a GPU test
# run whose collection had imported a test module that set the variable).
_bus_read = JITFunction(_bus_read_fn, do_not_specialize=["n"])


_BUS_BLOCK = 1024


class _Slot:
    """One pinned buffer, the graph that reads it, and the event of its last replay."""

    def __init__(self, like: torch.Tensor, build_run, stream, device, mode: str):
        self.host = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        self.host_np: np.ndarray = self.host.numpy()
        view = mapped_view(self.host, device) if mode != "copy" else None
        self.mode = mode if view is not None else "copy"
        self.copy_inside = False
        if view is not None and mode == "mapped":
            self.values = view
            self.graph = capture_graph(build_run(view), stream, device)
        elif view is not None:  # "kernel": one small kernel copies the buffer, then the launches
            self.values = like
            run = build_run(like)
            src, dst, n = view.view(-1), like.view(-1), like.numel()
            grid = (max(1, -(-n // _BUS_BLOCK)),)
            # Compiled here for the capture's own arguments (n = 0 reads nothing): a compile
            # inside the capture would load a module there.
            _bus_read[grid](src, dst, 0, BLOCK=_BUS_BLOCK)

            def with_read() -> None:
                _bus_read[grid](src, dst, n, BLOCK=_BUS_BLOCK)
                run()

            self.graph = capture_graph(with_read, stream, device)
        else:
            self.values = like
            run = build_run(like)

            def with_copy() -> None:
                like.copy_(self.host, non_blocking=True)
                run()

            try:
                self.graph = capture_graph(with_copy, stream, device)
                self.copy_inside = True
            except Exception:  # noqa: BLE001 - the launches alone, the copy queued per call
                self.graph = capture_graph(run, stream, device)
        self.read = torch.cuda.Event(blocking=True)  # Note [Sleeping waits]
        self.replayed = False


class PinnedGraph:
    """The launches `build_run(values)()` makes, where `values` is a device tensor shaped like
    `like`, as a graph whose input is its own pinned buffer (Note [Pinned graph input]).
    `like` is the device buffer the launches read ("mapped" reads the pinned buffer instead)."""

    def __init__(self, like: torch.Tensor, build_run: Callable[[torch.Tensor], Callable],
                 stream, device: torch.device, mode: str | None = None):
        mode = mode or knobs.get("graph_input")
        if mode not in GRAPH_INPUTS:
            raise ValueError(f"graph_input must be one of {', '.join(GRAPH_INPUTS)}, got {mode!r}")
        first = _Slot(like, build_run, stream, device, mode)
        self.mode = first.mode
        self.slots = [first]
        if first.mode != "copy":  # a slot's buffer is read while the next call fills the other
            self.slots.append(_Slot(like, build_run, stream, device, first.mode))
        # The stream it replays on: the callers key their graphs by the launching stream, so
        # it is this one, and recording on it needs no Stream object per call.
        self.stream = stream
        self._next = 0
        self._lock = threading.Lock()  # one call at a time writes a buffer and replays

    def put(self, parts: Sequence[np.ndarray]) -> None:
        """`call` with a fill that writes `parts` back to back (the buffer's length)."""
        self.call(None, parts)

    def call(self, fill: Callable[[np.ndarray], object] | None,
             parts: Sequence[np.ndarray] = ()) -> None:
        """`fill(a host buffer)` (or, without `fill`, `parts` written into it back to back),
        then queue the graph on the current stream (of the graph's device, which must be
        current)."""
        with self._lock:
            slot = self.slots[self._next]
            self._next = (self._next + 1) % len(self.slots)
            if slot.replayed:
                slot.read.synchronize()  # returns at once when that replay has read it (usual)
            if fill is None:
                buf, at = slot.host_np, 0
                for part in parts:
                    buf[at:at + len(part)] = part
                    at += len(part)
                if at != len(buf):  # a caller bug: the graph would read stale values
                    raise ValueError(f"{at} values for a graph input of {len(buf)}")
            else:
                fill(slot.host_np)
            if slot.mode == "copy" and not slot.copy_inside:
                slot.values.copy_(slot.host, non_blocking=True)
            slot.graph.replay()
            slot.read.record(self.stream)
            slot.replayed = True


def on_device(device: torch.device, fn, *args):
    """`fn(*args)` with `device` current; the device switch (16 µs of host time on an H100)
    only where another device is current."""
    if torch.cuda.current_device() == device.index:
        return fn(*args)
    with torch.cuda.device(device):
        return fn(*args)
