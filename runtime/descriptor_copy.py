"""One kernel launch for a list of (src, dst, nbytes) descriptors, or for descriptor grids
(Note [Descriptor grids] in engines/base.py), on one device.

An engine that writes device memory it can address (its own, or a peer's opened through CUDA
IPC) gets a request as descriptors. One cudaMemcpyAsync per descriptor costs ~2-10 µs of host
time each, and a direct-path 8K Llama-70B request is 81,920 descriptors of 32 KiB (about a
second); this launch moves any number of them in one go. Descriptors of `COPY_ENGINE_BYTES`
or more go to the copy engine instead (a few large copies: there the copy engine is as fast and
leaves the SMs alone), which `split` decides.

Addresses are absolute device addresses (UVA), read from an int64 table inside the kernel and
turned into pointers (the `addr.to(pointer type)` idiom of copy_kernels.py). CPU tensors run
through the Triton interpreter, which is how the tests run it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from .copy_specs import pow2_alignment
from .pinned_graph import PinnedGraph, on_device

# Descriptors at least this long go to the copy engine (cudaMemcpyAsync), not the kernel.
COPY_ENGINE_BYTES = 4 << 20
_MAX_GRID_Y = 65535  # CUDA's gridDim.y; programs loop over the descriptors beyond it


def _copy_grid(
    table_ptr,  # int64: rows [3, n_rows] (source base, destination base, grid), then runs
    word_ptr,  # [3, n_grids, n_runs] (source offset, destination offset, length in vectors)
    n_rows,
    n_runs,
    n_grids,
    ALIGN: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    # Note [Descriptor grids]: descriptor d is row d // n_runs and run d % n_runs of its row's
    # grid; padded runs have length 0 and copy nothing. A flat list is one row of base 0 whose
    # runs are the descriptors. Addresses are int64 turned into pointers of the word type.
    chunk = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1).to(tl.int64)
    step = tl.num_programs(1).to(tl.int64)
    runs_ptr = table_ptr + 3 * n_rows
    n_slots = n_grids * n_runs
    for d in range(first, n_rows * n_runs, step):
        row = d // n_runs
        at = tl.load(table_ptr + 2 * n_rows + row) * n_runs + d - row * n_runs
        src = tl.multiple_of((tl.load(table_ptr + row) + tl.load(runs_ptr + at))
                             .to(word_ptr.dtype), ALIGN)
        dst = tl.multiple_of((tl.load(table_ptr + n_rows + row) +
                              tl.load(runs_ptr + n_slots + at)).to(word_ptr.dtype), ALIGN)
        n_words = tl.load(runs_ptr + 2 * n_slots + at) * VEC
        lo = chunk * (ITERS * BLOCK)
        left = tl.maximum(n_words - lo, 0)
        n_iter = tl.minimum((left + BLOCK - 1) // BLOCK, ITERS)
        for it in range(0, n_iter):
            cols = lo + it * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_words
            tl.store(dst + cols, tl.load(src + cols, mask=mask), mask=mask)


_compiled = JITFunction(_copy_grid, do_not_specialize=["n_rows", "n_runs", "n_grids"])
_interpreted = None
_INTERPRETER_LOCK = threading.Lock()  # the interpreter patches module state while it runs


def _kernel(device: torch.device):
    global _interpreted
    if device.type == "cuda":
        return _compiled
    if _interpreted is None:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreted = InterpretedFunction(_copy_grid)
    return _interpreted


def split(nbytes: np.ndarray, copy_engine_bytes: int = COPY_ENGINE_BYTES):
    """(indices for the kernel, indices for the copy engine) of a descriptor list."""
    big = nbytes >= copy_engine_bytes
    return np.flatnonzero(~big), np.flatnonzero(big)


# Note [Descriptor-copy graphs]: Triton's Python launcher costs 150-220 µs of host time per
# launch on the H200 box (BENCHMARKS.md (m)), more than the rest of a direct-path submit. A
# launch of the same shape (descriptor count, alignment, grid) on the same stream as an earlier
# one therefore replays a CUDA graph captured from it: the new table is written into that
# graph's own pinned buffer, which the graph's first node copies to the device (Note [Pinned
# graph input] in pinned_graph.py). A shape's first launch runs
# through Triton (compiling the kernel if needed); its second is captured after it runs, so a
# shape seen once (a one-off request length) costs no capture. Graphs are kept per (device,
# stream, shape), the least recently used dropped beyond GRAPH_CACHE; the
# `descriptor_copy_graphs` knob (0) turns them off.
GRAPH_CACHE = 32
_graphs: OrderedDict[tuple, PinnedGraph] = OrderedDict()
_seen: OrderedDict[tuple, None] = OrderedDict()  # shapes launched once, not captured yet
_GRAPH_LOCK = threading.Lock()
graph_stats: dict = {"captured": 0, "replayed": 0}  # tests and the benches read it


def _shape(align: int, max_bytes: int, descriptors: int, gpu: bool, pad: bool):
    """(word bytes, grid, meta, warps) of one launch over `descriptors` descriptors whose
    longest is `max_bytes`; `pad` rounds the chunk count up to a power of two so that
    launches of nearby lengths share a graph."""
    word = min(align, 4)
    block_bytes, iters, warps = (1 << 14, 2, 8) if gpu else (1 << 16, 64, 1)
    block = max(1, block_bytes // word)
    chunks = -(-(max_bytes // word) // (block * iters))
    grid = (_pow2_at_least(chunks) if pad else chunks, min(descriptors, _MAX_GRID_Y))
    return word, grid, {"ALIGN": align, "VEC": align // word, "BLOCK": block, "ITERS": iters}, \
        warps


def _pow2_at_least(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def launch(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, device: torch.device) -> None:
    """Copies every descriptor on `device`'s current stream (queued, not waited for).

    `src`/`dst` are uint64 device addresses this process may read and write, `nbytes` their
    lengths; the caller has checked them against its registrations.
    """
    n = int(src.size)
    if n == 0:
        return
    align = pow2_alignment(src, dst, nbytes)
    word, grid, meta, warps = _shape(align, int(nbytes.max()), n, device.type == "cuda", False)
    table = (src, dst, nbytes, align)
    _run(3 + 3 * n, lambda buf: _table(buf, table), (1, n, 1), word, grid, meta, warps, device)


def launch_grids(grids: list, device: torch.device) -> None:
    """`launch` of the descriptors of checked `DescriptorGrid`s (Note [Descriptor grids]),
    their destination rows already addresses this process may write: the kernel computes each
    address, so the host writes rows + runs, not rows x runs. The run count is padded to a
    power of two (runs of length 0) so that requests of nearby lengths replay one graph."""
    grids = [g for g in grids if g.count]
    if not grids:
        return
    n_rows = sum(len(g.src_rows) for g in grids)
    n_runs = _pow2_at_least(max(len(g.run_bytes) for g in grids), 8)
    # one reduction over every array of the grids (checked: all uint64), not one per array
    align = pow2_alignment(np.concatenate([a for g in grids for a in (
        g.src_rows, g.dst_rows, g.src_runs, g.dst_runs, g.run_bytes)]))
    gpu = device.type == "cuda"
    word, grid, meta, warps = _shape(align, max(int(g.run_bytes.max()) for g in grids),
                                     n_rows * n_runs, gpu, gpu)
    size = 3 * n_rows + 3 * len(grids) * n_runs

    def fill(buf: np.ndarray) -> None:
        rows = buf[:3 * n_rows].view(np.uint64).reshape(3, n_rows)
        runs = buf[3 * n_rows:].view(np.uint64).reshape(3, len(grids), n_runs)
        at = 0
        for k, g in enumerate(grids):
            r, m = len(g.src_rows), len(g.run_bytes)
            rows[0, at:at + r] = g.src_rows
            rows[1, at:at + r] = g.dst_rows
            rows[2, at:at + r] = k
            at += r
            runs[0, k, :m] = g.src_runs
            runs[1, k, :m] = g.dst_runs
            np.floor_divide(g.run_bytes, np.uint64(align), out=runs[2, k, :m], casting="unsafe")
            runs[:, k, m:] = 0

    _run(size, fill, (n_rows, n_runs, len(grids)), word, grid, meta, warps, device)


def _run(size: int, fill, counts: tuple, word: int, grid, meta: dict, warps: int,
         device: torch.device) -> None:
    """One launch over a table of `size` int64 that `fill` writes; `counts`: (rows, runs,
    grids)."""
    if device.type != "cuda":
        host = torch.empty(size, dtype=torch.int64)
        fill(host.numpy())
        anchor = host.view(_WORD_DTYPES[word])
        with _INTERPRETER_LOCK:
            _kernel(device)[grid](host, anchor, *counts, **meta)
        return
    on_device(device, _launch_cuda, size, fill, counts, word, grid, meta, warps, device)


_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _table(host: np.ndarray, table) -> None:
    """Write a flat descriptor list into `host` as one grid row of base 0 (int64 [3 + 3 * n]):
    one pass per row, no intermediate arrays (81,920 descriptors for a direct-path 8K
    Llama-70B request)."""
    src, dst, nbytes, align = table
    host[:3] = 0
    runs = host[3:].view(np.uint64).reshape(3, len(src))
    runs[0] = src
    runs[1] = dst
    np.floor_divide(nbytes, np.uint64(align), out=runs[2], casting="unsafe")


def _launch_cuda(size: int, fill, counts: tuple, word: int, grid, meta: dict, warps: int,
                 device: torch.device) -> None:
    from . import knobs

    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), counts, word,
           grid, tuple(meta.values()))
    use_graphs = bool(knobs.get("descriptor_copy_graphs"))
    got, capture = None, False
    if use_graphs:
        with _GRAPH_LOCK:
            got = _graphs.get(key)
            if got is not None:
                _graphs.move_to_end(key)
            elif key in _seen:
                del _seen[key]
                capture = True
            else:
                _seen[key] = None
                while len(_seen) > GRAPH_CACHE:
                    _seen.popitem(last=False)
    if got is not None:  # Note [Pinned graph input]
        got.call(fill)
        graph_stats["replayed"] += 1
        return
    # torch's pinned-memory cache keeps the block until the copy below has read it.
    host = torch.empty(size, dtype=torch.int64, pin_memory=True)
    fill(host.numpy())
    dev = host.to(device, non_blocking=True)
    anchor = dev.view(_WORD_DTYPES[word])
    _compiled[grid](dev, anchor, *counts, **meta, num_warps=warps)
    if not capture:
        return
    try:  # after the launch above compiled the kernel
        def build_run(table):
            words = table.view(_WORD_DTYPES[word])
            return lambda: _compiled[grid](table, words, *counts, **meta, num_warps=warps)

        graph = PinnedGraph(dev, build_run, torch.cuda.current_stream(device), device)
    except Exception as exc:  # noqa: BLE001 - a capture that fails costs only the graph
        # The launch above is queued either way; this shape keeps Triton's launcher.
        graph_stats["capture_errors"] = graph_stats.get("capture_errors", 0) + 1
        graph_stats["last_capture_error"] = repr(exc)
        return
    with _GRAPH_LOCK:
        _graphs[key] = graph  # the device table is the graph's from now on
        graph_stats["captured"] += 1
        while len(_graphs) > GRAPH_CACHE:
            _graphs.popitem(last=False)
