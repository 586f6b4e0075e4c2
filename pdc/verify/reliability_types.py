"""What the reliability harness (pdc/verify/reliability.py) is told and what it reports:
the run's configuration and faults, the report and its plain-data form, and the request
the harness sends. The rank processes (pdc/verify/reliability_ranks.py) read the same
configuration."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

from pdc.verify.ranks import Req


@dataclass
class Fault:
    at: int  # inject once this many requests have finished
    action: str  # "kill" (SIGKILL) or "stop" (SIGSTOP)
    side: str  # "prefill" or "decode"
    dp: int = 0  # the rank: its DP group (tp = pp = 1 on that side)
    restart_after_s: float | None = None  # kill: start a fresh process for it after this long
    resume_after_s: float | None = None  # stop: SIGCONT after this long; it rejoins


@dataclass
class RelConfig:
    spec: str
    prefill: str = "tp=1"
    decode: str = "tp=1"
    engine: str = "mooncake"
    requests: int = 1000  # (room, generation) pairs, retries included
    concurrency: int = 8  # requests in flight per decode DP group
    abort_rate: float = 0.3  # share of requests decode aborts at a random point
    retry_rate: float = 0.5  # share of aborted requests re-run as generation + 1
    bad_index_rate: float = 0.0  # share of requests whose decode sends a page id out of range
    prefix_rate: float = 0.2  # share of requests with a decode prefix-cache hit
    max_pages: int = 6  # pages per request, 1..max_pages
    pages: int = 96  # pool capacity (pages, per rank)
    slots: int = 32  # slots and aux rows per rank
    chunk_gap_s: float = 0.002  # prefill sends chunk k at k * gap (a slow forward)
    seed: int = 0
    checksum: bool = True
    knobs: dict = field(default_factory=dict)  # knob overrides in every rank
    engine_timeout_s: int = 5  # Mooncake's MC_TRANSFER_TIMEOUT (its minimum)
    faults: list = field(default_factory=list)
    decode_groups: tuple | None = None  # decode DP groups to run (None: all); others idle
    fuzz: bool = False
    deadline_s: float = 600.0  # the whole run; requests unfinished by then are lost
    # Nothing finished and no rank came (back) up for this long: the run stops there and
    # reports what it waits on, with every rank's stacks in its log (a hang, not a slow box:
    # a request takes well under a second even on a loaded 2-core box).
    stall_s: float = 120.0
    # Break the protocol on purpose, to show the checks catch it: "early_ack" makes prefill
    # ack an abort at once and go on writing; "reuse_quarantined" makes decode reuse pages
    # it was told to quarantine.
    sabotage: str = ""


@dataclass
class Report:
    requests: int = 0
    succeeded: int = 0
    failed: int = 0
    aborts: int = 0  # requests decode aborted
    retries: int = 0  # of which generation + 1 reruns
    faults_injected: int = 0
    lost: int = 0
    corrupted: int = 0  # requests whose verified bytes differ, plus canary violations
    corrupted_bytes: int = 0
    quarantined: int = 0  # requests whose decode pages were quarantined
    quarantined_pages: int = 0
    spent: list = field(default_factory=list)  # groups out of pages or slots (quarantined)
    unexpected: list = field(default_factory=list)  # failures nothing explains
    reasons: Counter = field(default_factory=Counter)  # failure reason (normalised) -> count
    fault_requests: int = 0  # requests a fault hit while in flight
    fault_resolution_s: float = 0.0  # longest fault-to-terminal time of those
    inconsistent: list = field(default_factory=list)  # decode Success but a prefill Failed
    fuzz: Counter = field(default_factory=Counter)
    rank_stats: dict = field(default_factory=dict)
    totals: Counter = field(default_factory=Counter)  # endpoint counters summed over ranks
    wall_s: float = 0.0
    log_dir: str = ""
    log_tails: dict = field(default_factory=dict)  # log file -> its last lines, on a failure

    @property
    def max_stall_ms(self) -> int:
        return max((st.get("max_stall_ms", 0) for st in self.rank_stats.values()), default=0)

    def summary(self) -> str:
        rows = [("requests", self.requests), ("succeeded", self.succeeded),
                ("failed", self.failed), ("aborts", self.aborts), ("retries", self.retries),
                ("faults injected", self.faults_injected), ("lost", self.lost),
                ("corrupted", self.corrupted), ("corrupted bytes", self.corrupted_bytes),
                ("quarantined", f"{self.quarantined} requests, {self.quarantined_pages} pages"),
                ("unexpected", len(self.unexpected)), ("wall", f"{self.wall_s:.1f} s")]
        t = self.totals
        rows.append(("aborts in flight", f"{t['aborts_mid_transfer']} after writes began, "
                                         f"{t['aborts_with_writes_in_flight']} with writes in "
                                         "flight (prefill counters)"))
        rows.append(("max stall", f"{self.max_stall_ms} ms (longest gap between two timer "
                                  "runs of a rank's control thread)"))
        if self.spent:
            rows.append(("spent groups", "; ".join(self.spent)))
        if self.fault_requests:
            rows.append(("fault-hit", f"{self.fault_requests} requests, all terminal within "
                                      f"{self.fault_resolution_s:.1f} s"))
        lines = [f"  {k:<16} {v}" for k, v in rows]
        lines += [f"  reason x{n}: {r}" for r, n in self.reasons.most_common(12)]
        lines += [f"  UNEXPECTED {u}" for u in self.unexpected[:10]]
        lines += [f"  INCONSISTENT {u}" for u in self.inconsistent[:10]]
        if self.fuzz:
            lines.append("  fuzz: " + ", ".join(f"{k} {v}" for k, v in sorted(self.fuzz.items())))
        return "\n".join(lines)


@dataclass
class RelReq(Req):
    generation: int = 0
    abort_after_s: float | None = None  # abort this long after init() ...
    abort_on_first_byte: bool = False  # ... or as soon as a byte of the request arrived
    chunk_gap_s: float = 0.0


def normalise(reason: str) -> str:
    """A failure reason without its numbers, for counting."""
    import re

    return re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?", "N", reason)[:160]


def report_dict(r: Report) -> dict:
    """The report as plain JSON-able data (dataclasses.asdict would garble the Counters)."""
    d = {f.name: dict(v) if isinstance(v := getattr(r, f.name), dict) else v
         for f in fields(r)}
    d["max_stall_ms"] = r.max_stall_ms
    return d
