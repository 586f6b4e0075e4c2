"""The liveness of peers, one pure model for both sides (Note [Peer liveness]): which peers
are silent, and whether this process itself stalled. The endpoints hold one each
(runtime/endpoints/host.py); the mixins of runtime/endpoints/liveness.py act on what it finds.
"""

from __future__ import annotations

# Note [Peer liveness]: of a gap between two control ticks, the part that counts as a peer's
# silence (the hub ticks every ~50 ms while it runs; 5x that is a thread held elsewhere).
LISTEN_SLACK_S = 0.25


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
