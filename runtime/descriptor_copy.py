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

import numpy as np
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from .copy_specs import pow2_alignment

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
    vecs = (nbytes // np.uint64(align)).astype(np.int64)
    host = torch.from_numpy(np.concatenate((src.astype(np.int64), dst.astype(np.int64), vecs)))
    gpu = device.type == "cuda"
    if gpu:
        table = host.pin_memory().to(device, non_blocking=True)
        block_bytes, iters, warps = 1 << 14, 2, 8
    else:
        table, block_bytes, iters, warps = host, 1 << 16, 64, 1
    block = max(1, block_bytes // word)
    max_words = int(nbytes.max()) // word
    chunks = -(-max_words // (block * iters))
    anchor = table.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[word])
    grid = (chunks, min(n, _MAX_GRID_Y))
    if gpu:
        with torch.cuda.device(device):
            _kernel(device)[grid](table, anchor, n, ALIGN=align, VEC=vec, BLOCK=block,
                                  ITERS=iters, num_warps=warps)
        return
    with _INTERPRETER_LOCK:
        _kernel(device)[grid](table, anchor, n, ALIGN=align, VEC=vec, BLOCK=block, ITERS=iters)
