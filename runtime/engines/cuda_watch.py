"""Decode's wake-up when a prefill's written event completes, without a thread that waits.

Note [Landed wake-up]: with Note [Success by event] decode ends a source's writes when the
done event of its last write completes, but learned it only at its caller's next poll: up
to a poll interval after the bytes landed (0.2 ms in bench/endpoints_processes.py, a
scheduler turn in a serving engine), and an idle SGLang scheduler waits for the endpoint's
state-change signal (Note [SGLang idle wait]). Here the event is waited for on a stream of
decode's own (cuStreamWaitEvent), and a host function queued behind that wait
(cuLaunchHostFunc) calls the endpoint's signal from the CUDA driver's callback thread. No
thread of pdc waits, spins or takes the GIL before the bytes have landed; the signal only
wakes the caller, whose poll then finds the event complete (the request's state changes
under the endpoint's lock, as before).

A prefill that dies before its event completes may leave that wait pending for good. Each
source has a stream of its own, so a stuck source holds back no other; once its oldest
pending watch is older than `peer_dead_after_s`, the stream is left to the driver (never
synchronised) and the source's next watch gets a new one. Decode's caller learns such a
request's outcome at its poll, from the source's Failed or its silence, as without the
wake-up.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Callable

from .. import knobs
from .base import TransferError

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit sync with the null stream
_pending: dict[int, tuple[_SourceStream, Callable[[], None]]] = {}  # token -> (stream, callback)
_tokens = itertools.count(1)
_lock = threading.Lock()
stats = {"fired": 0, "callback_errors": 0, "streams_given_up": 0}  # tests read it


def _fire(user_data) -> None:
    with _lock:
        got = _pending.pop(int(user_data or 0), None)
        if got is not None:
            got[0].pending.pop(int(user_data), None)
            stats["fired"] += 1
    if got is None:
        return  # its stream was given up, or its watch removed
    try:
        got[1]()
    except Exception:  # noqa: BLE001 - the driver's thread must not see a Python error
        stats["callback_errors"] += 1


_FIRE = _HOST_FN(_fire)  # kept for the life of the process: the driver may call it late


class _SourceStream:
    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.pending: dict[int, float] = {}  # token -> when its watch was queued


class LandedWatch:
    """Per engine: one stream per source, the driver calls of Note [Landed wake-up]."""

    def __init__(self, cu, ensure_context, device_index: int) -> None:
        self._cu = cu
        self._ensure_context = ensure_context
        self._device_index = device_index
        self._streams: dict[str, _SourceStream] = {}
        self._streams_lock = threading.Lock()  # endpoints sharing the engine watch at once
        cu.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        cu.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        cu.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
        cu.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]

    def watch(self, event, source: str, callback) -> bool:
        """Queues `callback()` behind `event` (a torch event opened from a peer's handle);
        False when the driver refuses, and the caller's poll is left to find it."""
        now = time.monotonic()
        try:
            self._ensure_context(self._device_index)
            with self._streams_lock:
                stream = self._stream(source, now)
            if self._cu.cuStreamWaitEvent(stream.handle, event.cuda_event, 0) != 0:
                return False
            token = next(_tokens)
            with _lock:
                _pending[token] = (stream, callback)
                stream.pending[token] = now
            if self._cu.cuLaunchHostFunc(stream.handle, _FIRE, token) != 0:
                with _lock:
                    _pending.pop(token, None)
                    stream.pending.pop(token, None)
                return False
        except (TransferError, AttributeError, ctypes.ArgumentError):
            return False
        return True

    def _stream(self, source: str, now: float) -> _SourceStream:
        stream = self._streams.get(source)
        if stream is not None:
            with _lock:
                if not stream.pending or \
                        min(stream.pending.values()) >= now - knobs.get("peer_dead_after_s"):
                    return stream
                for token in stream.pending:  # stuck: given up
                    _pending.pop(token, None)
                stream.pending.clear()
                stats["streams_given_up"] += 1
        handle = ctypes.c_void_p()
        if self._cu.cuStreamCreate(ctypes.byref(handle), _STREAM_NON_BLOCKING) != 0 or \
                not handle.value:
            raise TransferError("cuda_ipc: cuStreamCreate failed")
        stream = self._streams[source] = _SourceStream(int(handle.value))
        return stream

    def close(self) -> None:
        """Lets go of the streams: the driver frees each once its queued work has run, and a
        host function still queued finds no callback."""
        with self._streams_lock, _lock:
            for stream in self._streams.values():
                for token in stream.pending:
                    _pending.pop(token, None)
        for stream in self._streams.values():
            self._cu.cuStreamDestroy_v2(stream.handle)
        self._streams.clear()
