"""Peer liveness: heartbeats, silent peers, and this process's own stalls (the control thread's
timer, `Hub(on_tick=...)`). `Liveness` (runtime/endpoints/liveness_model.py) is the one model
of both sides (Note [Peer liveness]); the mixins below act on what it finds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from .. import knobs
from .. import wire as W
from .common import (
    KVPoll,
    PageState,
)
from .states import TERMINAL

if TYPE_CHECKING:
    from .host import DecodeHost, PrefillHost
else:  # Note [Typed mixins]: the hosts are for the type checker only
    PrefillHost = DecodeHost = object

LOG = logging.getLogger("pdc.liveness")


class PrefillLiveness(PrefillHost):
    """Heartbeats to decode peers; a silent peer fails the requests that wait on it. Part of
    PrefillEndpoint."""

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_hb >= knobs.get("heartbeat_interval_s"):
            self._last_hb = now
            self._hb_seq += 1
            hb = self.wire.encode(W.Heartbeat(side=W.PeerSide.PREFILL, rank=self.rank,
                                              sequence=self._hb_seq,
                                              monotonic_ns=time.monotonic_ns()))
            for p in list(self.peers.values()):
                self.hub.send(p.identity, hb)
        dead_after = knobs.get("peer_dead_after_s")
        with self.lock:
            _, died = self.liveness.tick(now, dead_after)
            for p in died:
                self.counters["peers_dead"] += 1
                LOG.warning("pdc prefill %s: decode peer %s silent for %.1f s of listening; "
                            "its requests fail (longest control stall here: %.0f ms)",
                            self.rank, p.name, dead_after, self.liveness.max_stall_s * 1e3)
                for r in self.rooms.values():
                    if p.rank in self.links and r.state not in TERMINAL and \
                            self._waits_on(r, p.instance, p.dp):
                        r.fail(f"decode peer {p.name} silent for {dead_after} s")
        self.on_change()  # Note [State-change signal]


class DecodeLiveness(DecodeHost):
    """Heartbeats to prefill peers, deadlines, silent peers and reconnects (Note [Frozen
    decode]). Part of DecodeEndpoint."""

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_hb >= knobs.get("heartbeat_interval_s"):
            self._last_hb = now
            self._hb_seq += 1
            hb = self.wire.encode(W.Heartbeat(side=W.PeerSide.DECODE, rank=self.rank,
                                              sequence=self._hb_seq,
                                              monotonic_ns=time.monotonic_ns()))
            for name in list(self.reg_state):
                self.hub.send(name, hb)
        dead_after = knobs.get("peer_dead_after_s")
        with self.lock:
            stalled, died = self.liveness.tick(now, dead_after)
            for name in died:
                LOG.warning("pdc decode %s: prefill peer %s silent for %.1f s of listening; "
                            "its requests fail (longest control stall here: %.0f ms)",
                            self.rank, name, dead_after, self.liveness.max_stall_s * 1e3)
            if stalled:
                LOG.warning("pdc decode %s: this process did not run for more than %.1f s; "
                            "pages of requests in flight are quarantined unless they succeed",
                            self.rank, dead_after)
                # Note [Frozen decode]: this process was stopped (or starved) for longer than
                # a peer may be silent. The transport may still hold writes that peers gave
                # up on meanwhile and that land as soon as it runs again, so pages of requests
                # in flight across the gap are quarantined unless they succeed.
                self.counters["self_freezes"] += 1
                for rv in self.recvs.values():
                    if rv.requested and rv.state != KVPoll.Success:
                        rv.suspect = True
                        if rv.state == KVPoll.Failed:
                            self._quarantine(rv)
            dead = set(self.liveness.dead)  # silent now (Note [Peer liveness])
            for rv in self.recvs.values():
                if rv.state == KVPoll.Failed:
                    if rv.requested and not rv.quarantined and now > rv.abort_deadline and \
                            not rv.quiet >= rv.expected:
                        self._quarantine(rv)
                    if rv.staged and self._page_state(rv) == PageState.REUSABLE:
                        self._free_staging(rv)  # no source may write into it any more
                    continue
                if rv.state == KVPoll.Success or not rv.requested:
                    continue
                if not self._settle(rv) or rv.succeeded.keys() >= rv.expected:
                    continue  # every source succeeded: a queued scatter ends it, no deadline
                missing = sorted(rv.expected - rv.succeeded.keys())
                if now > rv.deadline:
                    self._fail(rv, f"timed out after {knobs.get('transfer_timeout_s')} s "
                                   f"waiting for {', '.join(missing)}")
                    continue
                silent = [n for n in missing if n in dead]
                if silent:
                    self._fail(rv, f"prefill peer {silent[0]} silent for {dead_after} s")
        if dead and now - self._last_refresh >= knobs.get("reconnect_interval_s") and \
                not self._refreshing:
            self._last_refresh = now
            self._refreshing = True
            threading.Thread(target=self._refresh, args=(sorted(dead),), daemon=True,
                             name="pdc-decode-reconnect").start()
        self.on_change()  # Note [State-change signal]
