"""A decode engine's links to prefill engines: one pdc DecodeEndpoint per prefill engine.

Note [Many engines]: in a deployment of many prefill and many decode engines (xPyD) each
request names the prefill engine that computed it (`pdc_bootstrap` in kv_transfer_params).
A decode worker opens an endpoint to a prefill engine at the first request from it, keeps it
while requests use it, and closes it once none has for `idle_s`, or at once when none does
and a prefill rank behind it went silent (the engine died; a restarted one is a new
bootstrap address, or the same one reopened by the next request). A prefill engine serves
many decode engines as the decode DP groups of its plan: decode engine i registers as group
i of `decode_engines` (settings `decode_engines`, `decode_index`), and prefill learns each
request's group from decode's first TransferRequest (Note [DP routing]). All endpoints of a
worker share its transfer engine, which registers the cache once (`SharedRegistrations`,
runtime/engines/base.py; pdc's SGLang decode servers use it too).

This module imports no vLLM: tests/vllm/test_decode_links.py runs it with stand-in endpoints.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdc.runtime.engines.base import SharedRegistrations

__all__ = ["DecodeLinks", "SharedRegistrations"]

LOG = logging.getLogger("pdc.vllm")
IDLE_S = 60.0  # an endpoint no request used for this long is closed


class DecodeLinks:
    """Endpoints by prefill bootstrap address, opened by `open_endpoint(bootstrap,
    prefill_tp)` at first use."""

    def __init__(self, open_endpoint: Callable, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic):
        self._open = open_endpoint
        self.idle_s = idle_s
        self._clock = clock
        self.endpoints: dict[str, object] = {}
        self._last_used: dict[str, float] = {}
        self._lock = threading.Lock()
        self.closed: list[tuple[str, str]] = []  # (bootstrap, why), for logs and tests

    def get(self, bootstrap: str, prefill_tp: int):
        with self._lock:
            ep = self.endpoints.get(bootstrap)
        if ep is None:
            ep = self._open(bootstrap, prefill_tp)  # raises: the request fails alone
            with self._lock:
                self.endpoints[bootstrap] = ep
        with self._lock:
            self._last_used[bootstrap] = self._clock()
        return ep

    def find(self, bootstrap: str):
        with self._lock:
            return self.endpoints.get(bootstrap)

    def sweep(self, busy: set[str]) -> None:
        """Close the endpoints no live request (`busy`: their bootstrap addresses) uses that
        are idle or whose prefill went silent (Note [Many engines])."""
        now = self._clock()
        with self._lock:
            items = list(self.endpoints.items())
        for bootstrap, ep in items:
            if bootstrap in busy:
                with self._lock:
                    self._last_used[bootstrap] = now
                continue
            if _silent(ep):
                why = "its prefill engine went silent"
            elif now - self._last_used.get(bootstrap, now) >= self.idle_s:
                why = f"no request for {self.idle_s:.0f} s"
            else:
                continue
            with self._lock:
                self.endpoints.pop(bootstrap, None)
                self._last_used.pop(bootstrap, None)
                self.closed.append((bootstrap, why))
            LOG.info("pdc: closing the link to the prefill engine at %s: %s", bootstrap, why)
            try:
                ep.close()
            except Exception as e:  # noqa: BLE001 - a broken link is gone either way
                LOG.warning("pdc: closing the link to %s: %s", bootstrap, e)

    def close(self) -> None:
        with self._lock:
            eps, self.endpoints = list(self.endpoints.values()), {}
        for ep in eps:
            ep.close()


def _silent(ep) -> bool:
    """Some prefill rank of the endpoint is silent (Note [Peer liveness])."""
    with ep.lock:
        return bool(ep.liveness.dead)
