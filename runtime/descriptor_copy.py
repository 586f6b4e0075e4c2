"""One kernel launch for a list of (src, dst, nbytes) descriptors on one device.

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


def _copy_descriptors(
    table_ptr,  # int64 [3, n]: source addresses, destination addresses, lengths in vectors
    word_ptr,  # any tensor of the word type: fixes the pointer type of the addresses
    n_desc,
    ALIGN: tl.constexpr,  # bytes every address is a multiple of (hint only)
    VEC: tl.constexpr,  # words per vector; every length is a multiple of it
    BLOCK: tl.constexpr,  # words per iteration
    ITERS: tl.constexpr,  # iterations per program
):
    chunk = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1).to(tl.int64)
    step = tl.num_programs(1).to(tl.int64)
    for d in range(first, n_desc, step):
        src = tl.multiple_of(tl.load(table_ptr + d).to(word_ptr.dtype), ALIGN)
        dst = tl.multiple_of(tl.load(table_ptr + n_desc + d).to(word_ptr.dtype), ALIGN)
        n_words = tl.load(table_ptr + 2 * n_desc + d) * VEC
        lo = chunk * (ITERS * BLOCK)
        left = tl.maximum(n_words - lo, 0)
        n_iter = tl.minimum((left + BLOCK - 1) // BLOCK, ITERS)
        for it in range(0, n_iter):
            cols = lo + it * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_words
            tl.store(dst + cols, tl.load(src + cols, mask=mask), mask=mask)


_compiled = JITFunction(_copy_descriptors, do_not_specialize=["n_desc"])
_interpreted = None
_INTERPRETER_LOCK = threading.Lock()  # the interpreter patches module state while it runs


def _kernel(device: torch.device):
    global _interpreted
    if device.type == "cuda":
        return _compiled
    if _interpreted is None:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreted = InterpretedFunction(_copy_descriptors)
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


def launch(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, device: torch.device) -> None:
    """Copies every descriptor on `device`'s current stream (queued, not waited for).

    `src`/`dst` are uint64 device addresses this process may read and write, `nbytes` their
    lengths; the caller has checked them against its registrations.
    """
    n = int(src.size)
    if n == 0:
        return
    align = pow2_alignment(src, dst, nbytes)
    word = min(align, 4)
    vec = align // word
    gpu = device.type == "cuda"
    if gpu:
        block_bytes, iters, warps = 1 << 14, 2, 8
    else:
        block_bytes, iters, warps = 1 << 16, 64, 1
    block = max(1, block_bytes // word)
    max_words = int(nbytes.max()) // word
    chunks = -(-max_words // (block * iters))
    grid = (chunks, min(n, _MAX_GRID_Y))
    meta = {"ALIGN": align, "VEC": vec, "BLOCK": block, "ITERS": iters}
    table = (src, dst, nbytes, align)
    if not gpu:
        host = torch.empty(3 * n, dtype=torch.int64)
        _table(host.numpy(), table)
        anchor = host.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[word])
        with _INTERPRETER_LOCK:
            _kernel(device)[grid](host, anchor, n, **meta)
        return
    on_device(device, _launch_cuda, table, n, word, grid, meta, warps, device)


def _table(host: np.ndarray, table) -> None:
    """Write a descriptor table into `host` (int64 [3 * n]): one pass per row, no
    intermediate arrays (81,920 descriptors for a direct-path 8K Llama-70B request)."""
    src, dst, nbytes, align = table
    rows = host.view(np.uint64).reshape(3, len(src))
    rows[0] = src
    rows[1] = dst
    np.floor_divide(nbytes, np.uint64(align), out=rows[2], casting="unsafe")


def _launch_cuda(table, n: int, word: int, grid, meta: dict, warps: int,
                 device: torch.device) -> None:
    from . import knobs

    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), n, word, grid,
           tuple(meta.values()))
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
        got.call(lambda buf: _table(buf, table))
        graph_stats["replayed"] += 1
        return
    # torch's pinned-memory cache keeps the block until the copy below has read it.
    host = torch.empty(3 * n, dtype=torch.int64, pin_memory=True)
    _table(host.numpy(), table)
    dev = host.to(device, non_blocking=True)
    anchor = dev.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[word])
    _compiled[grid](dev, anchor, n, **meta, num_warps=warps)
    if not capture:
        return
    try:  # after the launch above compiled the kernel
        graph = PinnedGraph(
            dev, lambda: _compiled[grid](dev, anchor, n, **meta, num_warps=warps),
            torch.cuda.current_stream(device), device)
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
