"""Peer liveness: heartbeats, silent peers, and this process's own stalls (the control thread's
timer, `Hub(on_tick=...)`). `Liveness` is the one model of both sides (Note [Peer liveness]);
the mixins below act on what it finds.
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

# Note [Peer liveness]: of a gap between two control ticks, the part that counts as a peer's
# silence (the hub ticks every ~50 ms while it runs; 5x that is a thread held elsewhere).
LISTEN_SLACK_S = 0.25

LOG = logging.getLogger("pdc.liveness")


class Liveness:
    """Note [Peer liveness]: one model for both sides, pure (the caller passes the time and
    holds its lock). A peer is heard whenever any message of it arrives; one silent for more
    than `dead_after` seconds of *listening* is dead until it is heard again.

    Silence counts only while this process listens. The control thread ticks every ~50 ms
    when it runs; a longer gap between two ticks means it was held (a slow handler, the
    endpoint's lock, a starved core) and read no socket meanwhile, so the peers' messages of
    that time are still queued, not missing. Of each gap only `LISTEN_SLACK_S` counts as
    silence: a peer needs `dead_after` seconds of listening without a word, and on a process
    that stalls every tick a dead peer is still found, later. A gap longer than `dead_after`
    means this process itself did not run (stopped or starved): every peer gets a fresh
    window, and the caller learns that it stalled (decode quarantines, Note [Frozen decode]).
    Keys are whatever names a peer on that side: prefill's are the registered incarnations of
    decode ranks (a restarted rank is another key), decode's the prefill ranks' names."""

    def __init__(self) -> None:
        self.last_heard: dict = {}  # peer -> monotonic time it was last heard
        self.dead: set = set()  # peers silent for longer than dead_after at the last tick
        self.last_tick = 0.0
        self.max_stall_s = 0.0  # longest gap between two ticks

    def add(self, peer, now: float) -> None:
        """A new peer (or a new address of one): heard now, a fresh window."""
        self.last_heard[peer] = now
        self.dead.discard(peer)

    def forget(self, peer) -> None:
        self.last_heard.pop(peer, None)
        self.dead.discard(peer)

    def heard(self, peer, now: float) -> bool:
        """A message of `peer` arrived; returns whether it had been dead (it revived)."""
        if peer not in self.last_heard:
            return False
        self.last_heard[peer] = now
        if peer in self.dead:
            self.dead.discard(peer)
            return True
        return False

    def tick(self, now: float, dead_after: float) -> tuple[bool, list]:
        """(whether this process stalled since the last tick, the peers that died now)."""
        gap = now - self.last_tick if self.last_tick else 0.0
        self.max_stall_s = max(self.max_stall_s, gap)
        stalled = gap > dead_after
        self.last_tick = now
        unheard = gap - LISTEN_SLACK_S  # of the gap, the time nobody could be heard
        for peer, heard_at in self.last_heard.items():
            if stalled:
                self.last_heard[peer] = now
            elif unheard > 0:
                self.last_heard[peer] = min(now, heard_at + unheard)
        died = [p for p, t in self.last_heard.items()
                if p not in self.dead and now - t > dead_after]
        self.dead.update(died)
        return stalled, died


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
                            self._decode_group(r) == p.dp:
                        r.fail(f"decode peer {p.name} silent for {dead_after} s")


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
