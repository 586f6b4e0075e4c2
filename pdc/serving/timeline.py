"""Per-request timelines from pdc's transfer log: where a request's time to first token goes.

With the `transfer_log` knob on (PDC_TRANSFER_LOG=1), every process that runs a pdc endpoint
writes one JSON line per finished request and side (`event: kv_transfer`, with the request's
monotonic stamps, Note [Timeline stamps] in runtime/metrics.py) and a line per extra point
(`event: kv_mark`: decode's engine saw the Success, the first token left). This module reads
those lines out of any log (an engine's stderr with other text around them is fine), joins
the two sides of each request by (room, generation) within one run, and splits the request
into the phases of PHASES. `bench/timeline.py` prints them for log folders; the demos print
them under their tables.

All stamps of one request must come from one host's clock (one machine runs both engines).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# (name, start stamp, end stamp, what it is). Stamps: d.* decode's record, p.* prefill's,
# m.* marks; `ready` = max(p.requested, p.forward_done): prefill holds both the request and
# the KV; `sent` = max(ready, p.first_write): with chunked prefill the first chunk's writes
# leave while later chunks compute, and that part of the writes costs the request nothing. A
# phase is left out of a request that lacks either stamp.
PHASES = (
    ("hand-over", "p.forward_done", "d.arrived",
     "prefill's forward done -> the request reaches decode (proxy or router; negative when "
     "the router sends to both at once)"),
    ("decode queue", "d.arrived", "d.requested",
     "the request reaches decode -> decode asks prefill (decode's scheduler allocates)"),
    ("ask", "d.requested", "p.requested", "decode asks -> prefill has the request"),
    ("wait forward", "p.requested", "ready",
     "prefill has the request -> its forward is done too (0 when it was done before)"),
    ("submit", "ready", "sent",
     "both there -> first write submitted (0 when earlier chunks' writes left before the "
     "last chunk was computed: chunked prefill)"),
    ("transfer", "sent", "p.done",
     "the later of both there and first write -> last write done: the writes' time that "
     "the forward did not hide"),
    ("tell decode", "p.done", "d.done", "last write done -> decode's endpoint has Success"),
    ("engine sees", "d.done", "m.seen", "decode's endpoint -> its engine polls the Success"),
    ("first token", "m.seen", "m.first_token", "the engine saw it -> first token out"),
    # The first token from prefill (Note [SGLang first token from prefill]): its own way out.
    ("to prefill", "m.router_in", "p.start",
     "pdc's router has the request -> prefill's scheduler has it (HTTP, tokenizer)"),
    ("prefill token", "p.start", "m.token_out",
     "prefill's scheduler has it -> streams its first token (decode's ask, the forward)"),
    ("token out", "m.token_out", "m.router_token",
     "prefill streams the first token -> pdc's router sends it to the client (detokenizer, "
     "prefill's HTTP, the router's threads)"),
)
TOTALS = (("arrive to token", "d.arrived", "m.first_token",
           "the request reaches decode -> first token out"),
          ("router to token", "m.router_in", "m.router_token",
           "pdc's router has the request -> sends its first token"))


@dataclass
class Request:
    """The stamps of one request (seconds, one host's monotonic clock), both sides merged."""

    run: str
    room: int
    generation: int
    stamps: dict = field(default_factory=dict)  # "d.arrived" -> s
    ok: bool = True

    def at(self, name: str) -> float | None:
        if name == "ready":
            req, fwd = self.stamps.get("p.requested"), self.stamps.get("p.forward_done")
            return None if req is None else max(req, fwd or req)
        if name == "sent":
            ready, first = self.at("ready"), self.stamps.get("p.first_write")
            return None if ready is None or first is None else max(ready, first)
        return self.stamps.get(name)

    def phase_ms(self, start: str, end: str) -> float | None:
        a, b = self.at(start), self.at(end)
        return None if a is None or b is None else (b - a) * 1e3


# Several ranks of one side report the same request: their starts merge by the earliest,
# their ends by the latest (the request waits for the last rank).
_EARLIEST = {"start", "arrived", "first_write"}


def parse_line(line: str) -> dict | None:
    """The kv_transfer or kv_mark object on a log line, or None."""
    i = line.find('{"')
    if i < 0 or '"kv_' not in line:
        return None
    try:
        obj = json.loads(line[i:])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and obj.get("event") in ("kv_transfer",
                                                                  "kv_mark") else None


def collect(lines: Iterable[str], run: str = "") -> dict[tuple, Request]:
    """Requests of one run by (run, room, generation)."""
    out: dict[tuple, Request] = {}
    for line in lines:
        obj = parse_line(line)
        if obj is None:
            continue
        key = (run, int(obj["room"]), int(obj.get("generation", 0)))
        req = out.setdefault(key, Request(run, key[1], key[2]))
        if obj["event"] == "kv_mark":
            _merge(req.stamps, f"m.{obj['mark']}", float(obj["t"]), earliest=True)
            continue
        req.ok = req.ok and bool(obj.get("ok"))
        side = "d" if obj["side"] == "decode" else "p"
        for name, t in (obj.get("t") or {}).items():
            _merge(req.stamps, f"{side}.{name}", float(t), earliest=name in _EARLIEST)
    return out


def _merge(stamps: dict, key: str, t: float, earliest: bool) -> None:
    old = stamps.get(key)
    stamps[key] = t if old is None else (min(old, t) if earliest else max(old, t))


def read_runs(paths: Iterable[str | Path]) -> list[Request]:
    """Every request in the logs under `paths`: a file is one run, a folder one run of all
    the *.log and *.jsonl files in it (not below)."""
    requests: list[Request] = []
    for p in map(Path, paths):
        files = sorted([*p.glob("*.log"), *p.glob("*.jsonl")]) if p.is_dir() else [p]
        lines: list[str] = []
        for f in files:
            lines += f.read_text(errors="replace").splitlines()
        requests += collect(lines, str(p)).values()
    return requests


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass(frozen=True)
class PhaseRow:
    phase: str
    what: str
    n: int
    p50_ms: float
    p99_ms: float
    mean_ms: float


def summarize(requests: Iterable[Request]) -> list[PhaseRow]:
    """One row per phase (and the total) over the succeeded requests that have both its
    stamps; phases no request has are left out."""
    done = [r for r in requests if r.ok and "d.done" in r.stamps and "p.done" in r.stamps]
    rows = []
    for name, start, end, what in (*PHASES, *TOTALS):
        xs = [x for r in done if (x := r.phase_ms(start, end)) is not None]
        if xs:
            rows.append(PhaseRow(name, what, len(xs), _pct(xs, 0.5), _pct(xs, 0.99),
                                 statistics.fmean(xs)))
    return rows


def print_summary(rows: list[PhaseRow], out, title: str) -> None:
    from ..console import print_table

    print_table(("phase", "n", "p50 ms", "p99 ms", "mean ms", "from -> to"),
                [(r.phase, str(r.n), f"{r.p50_ms:.1f}", f"{r.p99_ms:.1f}", f"{r.mean_ms:.1f}",
                  r.what) for r in rows], out, right=(1, 2, 3, 4), title=title)
