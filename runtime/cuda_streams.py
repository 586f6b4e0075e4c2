"""CUDA streams of pdc's own, outside torch's stream pool, and waits for GPU work that sleep.

Note [Own streams]: `torch.cuda.Stream()` hands out the streams of a per-device pool (32 per
priority), round robin, to every caller in the process: the serving engine's own streams,
pdc's engines' copies, a graph capture's side stream. Two callers can get the same stream.
For copies that only orders them needlessly; for a capture it is an error: work that
another thread queues on a stream this thread is capturing breaks the capture and fails
that thread's call (an H100, 2026-12-07: a staging ring captures a graph per piece shape, so
its captures went round the pool, and the local engine's write stream, waiting for a
gather's event, was the stream a capture had, cudaErrorStreamCaptureIsolation; the request
failed). So captures run on a stream of their own per thread and device, and the local
engine copies on streams of its own: streams made by the driver (cuStreamCreate,
non-blocking: no implicit order with the legacy default stream), which no caller of the pool
gets, wrapped for torch by `torch.cuda.ExternalStream`. They live as long as the process.
Where the driver cannot be reached, a pool stream serves (and a collision stays possible).

Note [Sleeping waits]: under the driver's default scheduling (fewer contexts than cores) a
host thread that synchronises a stream, a default event or an interprocess event spins until
the work is done, blocking flag or not: an H100, 2026-12-07 (BENCHMARKS.md (ab)), a 50 ms
wait took 50 ms of CPU on an interprocess or default event and 0.1 ms on a blocking-sync
one. So pdc's events that a host may wait on are made blocking-sync, and a wait for work it
does not own an event of that kind for (a stream's queue: `sleep_until_idle`; an
interprocess event: `sleep_until`) waits on a blocking-sync event recorded behind it.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING
_per_thread = threading.local()


@functools.cache
def _cu():
    """The CUDA driver, or None where it cannot be loaded."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    except (OSError, AttributeError):
        return None
    return cu


def own_stream(device: torch.device):
    """A new stream on `device` that torch's pool gives no one else (Note [Own streams])."""
    cu = _cu()
    if cu is not None:
        with torch.cuda.device(device):
            # A runtime call on the device makes its primary context current on this thread,
            # which cuStreamCreate creates the stream in.
            torch.cuda.current_stream(device).query()
            ctx, handle = ctypes.c_void_p(), ctypes.c_void_p()
            if cu.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value and \
                    cu.cuStreamCreate(ctypes.byref(handle), _NON_BLOCKING) == 0 and handle.value:
                return torch.cuda.ExternalStream(handle.value, device=device)
    return torch.cuda.Stream(device)


def _this_thread(kind: str, device: torch.device, make):
    """This thread's `kind` of thing for `device`, made by `make(device)` on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    things = _per_thread.__dict__.setdefault(kind, {})
    thing = things.get(index)
    if thing is None:
        thing = things[index] = make(torch.device("cuda", index))
    return thing


def capture_stream(device: torch.device):
    """This thread's stream for capturing graphs on `device` (Note [Own streams])."""
    return _this_thread("streams", device, own_stream)


def sleep_until_idle(device: torch.device) -> None:
    """Return once the work queued so far on `device`'s current stream has run, asleep
    meanwhile (Note [Sleeping waits])."""
    done = torch.cuda.Event(blocking=True)
    done.record(torch.cuda.current_stream(device))
    done.synchronize()


def sleep_until(event, device: torch.device) -> None:
    """Return once `event` (of `device`) has completed, asleep meanwhile (Note [Sleeping
    waits]): this thread's stream waits for it and a blocking-sync event behind that is
    waited for."""
    if event.query():
        return
    stream, wake = _this_thread("waits", device,
                                lambda d: (own_stream(d), torch.cuda.Event(blocking=True)))
    with torch.cuda.device(stream.device):
        stream.wait_event(event)
        wake.record(stream)
    wake.synchronize()
