"""Reliability harness: many requests through real engines while things go wrong.

One process per rank (like `pdc demo`; what a rank does is in reliability_ranks.py); this
module is the parent, which plays router and scheduler. It allocates
page ids per (side, DP group) from LIFO free lists, so pages a request gave back go to the
very next request (the most hostile order for a stale write), and streams requests to the
ranks with at most `concurrency` in flight per decode group. Along the way it

- aborts requests at random points of their transfer (decode calls abort() on its own
  clock) and re-runs some aborted rooms as generation + 1 at once, while the old generation
  may still drain on prefill;
- injects faults: `kill -9` or SIGSTOP of a rank mid-transfer (optionally restarting or
  resuming it later), bad page ids from decode;
- optionally fuzzes the prefill ranks' control sockets (garbage, mutated and truncated valid
  messages, wrong fingerprints, unknown rooms, impersonation, registration floods,
  oversized messages) while the well-formed traffic goes on.

Every byte is checked (Note [What is checked]). Reasons are kept for every failure, and a
request is *lost* when it never reaches a terminal state on a surviving rank.

Note [What is checked]:
- labels: prefill fills each request's items with per-byte labels of (seed, generation,
  room, component, tensor, layer, position); decode poisons the items it expects and, on
  Success, compares every byte (a generation's stale bytes never match the next one);
- canaries: decode fills the items of a request whose pages it gives back with a canary and
  checks the canary when the pages are handed out again; any write that landed in between
  (a late write of an aborted request) counts as corruption;
- quarantine: pages a decode rank reports quarantined are never handed out again;
- the link checksum (knob `checksum`) on every Success.

The spec need not be compiled into generated/: the parent renders the family's layout
module in memory and the ranks exec it (reliability_ranks.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from pdc.runtime.indices import window_first_page
from pdc.verify.ranks import ROLE_DECODE, ROLE_PREFILL
from pdc.verify.reliability_fuzz import Fuzzer
from pdc.verify.reliability_ranks import family_sources, rank_main
from pdc.verify.reliability_types import Fault, RelConfig, RelReq, Report, normalise

# ~~~ parent ~~~

LOG_TAIL_LINES = 60  # per rank log, kept in a failed run's report
START_S = 60  # for every rank to start and register, or the bootstrap rank to answer


@dataclass
class _Flight:
    req: RelReq
    groups: dict  # side -> dp group
    waiting: set  # rank keys yet to report
    reports: dict = field(default_factory=dict)
    hit: float | None = None  # when a fault hit one of its ranks
    side_done: set = field(default_factory=set)
    t_issue: float = field(default_factory=time.monotonic)


class _Pool:
    """LIFO free lists of one (side, DP group): ids given back go out first."""

    def __init__(self, pages: int, slots: int, rng):
        self.pages = list(rng.permutation(pages)[::-1])
        self.slots = list(rng.permutation(slots)[::-1])
        self.windows = list(rng.permutation(pages)[::-1])
        self.quarantined_pages = 0

    def take(self, n: int, nw: int):
        if len(self.pages) < n or not self.slots or len(self.windows) < nw:
            return None
        pages = [self.pages.pop() for _ in range(n)]
        windows = [self.windows.pop() for _ in range(nw)]
        s = self.slots.pop()
        return {"pages": np.array(pages, np.int64), "slot": int(s), "ring": int(s),
                "aux": int(s), "window": np.array(windows, np.int64)}

    def give(self, ids: dict) -> None:
        self.pages.extend(int(p) for p in ids["pages"][::-1])
        self.windows.extend(int(w) for w in ids["window"][::-1])
        self.slots.append(ids["slot"])


class Harness:
    def __init__(self, cfg: RelConfig, out=None):
        from pdc.compiler.family import plan_spec
        from pdc.compiler.frontend import load_spec

        self.cfg = cfg
        self.out = out or sys.stderr
        spec = load_spec(cfg.spec)
        family, self.plan = plan_spec(spec, cfg.prefill, cfg.decode, cfg.engine)
        self.layout = family.layout
        self.topo = topo = self.plan.topology
        self.sources = family_sources(spec)
        dgroups = cfg.decode_groups if cfg.decode_groups is not None else range(topo.decode.dp)
        self.blob = {"cfg": cfg, "sources": self.sources, "plan": self.plan.to_json(),
                     "decode_groups": list(dgroups)}
        self.rng = np.random.default_rng(cfg.seed)
        self.report = Report()
        for f in cfg.faults:
            s = topo.prefill if f.side == ROLE_PREFILL else topo.decode
            if s.tp * s.pp != 1:
                raise ValueError("faults need tp = pp = 1 on the faulted side")
            if f.side == ROLE_PREFILL and f.dp == 0:
                raise ValueError("the prefill leader (dp 0) hosts the bootstrap table; fault "
                                 "another prefill rank")

    # ~~~ ranks ~~~

    def _group_keys(self, side: str, g: int) -> list[tuple]:
        s = self.topo.prefill if side == ROLE_PREFILL else self.topo.decode
        return [(side, g, p, t) for p in range(s.pp) for t in range(s.tp)]

    def _spawn(self, key: tuple, bootstrap: str | None) -> None:
        q = self.ctx.Queue()
        log = os.path.join(self.log_dir, "{}-dp{}-pp{}-tp{}.log".format(*key))
        p = self.ctx.Process(target=rank_main, args=(self.blob, key, bootstrap, q, self.res_q,
                                                      log), daemon=True)
        p.start()
        self.procs[key], self.cmd_qs[key] = p, q
        self.ready.discard(key)

    def run(self) -> Report:
        cfg, topo = self.cfg, self.topo
        self.ctx = mp.get_context("spawn")
        self.res_q = self.ctx.Queue()
        self.procs, self.cmd_qs = {}, {}
        self.ready: set = set()
        self.down: set = set()  # killed or stopped
        self.returning: set = set()  # killed or stopped ranks that will be back
        self.log_dir = tempfile.mkdtemp(prefix="pdc-reliability-")
        self.report.log_dir = self.log_dir
        dgroups = cfg.decode_groups if cfg.decode_groups is not None else range(topo.decode.dp)
        self.keys = [k for g in range(topo.prefill.dp) for k in self._group_keys(ROLE_PREFILL, g)]
        self.keys += [k for g in dgroups for k in self._group_keys(ROLE_DECODE, g)]
        self.hub_addr: dict = {}
        t_start = time.monotonic()
        try:
            self._spawn(self.keys[0], None)
            self.bootstrap = self._expect("bootstrap")[1]
            for k in self.keys[1:]:
                self._spawn(k, self.bootstrap)
            while len(self.ready) < len(self.keys):
                self._handle(self._get(START_S))
            self._loop(t_start)
        except queue.Empty:  # a rank did not start; _shutdown names it and keeps its stacks
            self.report.unexpected.append(f"the ranks were not all up within {START_S} s")
        finally:
            self._shutdown()
            self.report.wall_s = time.monotonic() - t_start
        return self.report

    def _get(self, timeout: float):
        msg = self.res_q.get(timeout=timeout)
        if msg[0] == "crash":
            raise RuntimeError(f"rank {msg[1]} crashed: {msg[2]}\n  logs: {self.log_dir}")
        return msg

    def _expect(self, kind: str):
        while True:
            msg = self._get(START_S)
            if msg[0] == kind:
                return msg
            self._handle(msg)

    # ~~~ the scheduling loop ~~~

    def _loop(self, t_start: float) -> None:
        cfg, topo = self.cfg, self.topo
        self.pools = {}
        for side, s in ((ROLE_PREFILL, topo.prefill), (ROLE_DECODE, topo.decode)):
            for g in range(s.dp):
                self.pools[(side, g)] = _Pool(cfg.pages, cfg.slots, self.rng)
        self.flights: dict = {}  # (room, gen) -> _Flight
        self.spent: set = set()  # (side, dp group): Note [Spent groups]
        self.orphans: dict = {}  # (room, gen, key) -> (pool key, ids) of ranks that were down
        self.finished = 0
        self.issued = 0
        self.next_room = 1
        self.retry_q: list = []
        self.timers: list = []  # (time, action, fault)
        faults = sorted(cfg.faults, key=lambda f: f.at)
        dgroups = cfg.decode_groups if cfg.decode_groups is not None else range(topo.decode.dp)
        self.dgroups = list(dgroups)
        fuzzer = None
        if cfg.fuzz:
            fuzzer = Fuzzer(self)
            fuzzer.start()
        deadline = t_start + cfg.deadline_s
        self.progress_t = time.monotonic()
        while self.finished < cfg.requests:
            now = time.monotonic()
            if now > deadline:
                break
            if not self.flights and (
                    all((ROLE_PREFILL, g) in self.spent for g in range(topo.prefill.dp)) or
                    all((ROLE_DECODE, g) in self.spent for g in self.dgroups)):
                break  # Note [Spent groups]
            if now - self.progress_t > cfg.stall_s:
                self._stalled()
                break
            while faults and self.finished >= faults[0].at and self._inflight_on(faults[0]):
                self._inject(faults.pop(0))
            for t, action, f in list(self.timers):
                if now >= t:
                    self.timers.remove((t, action, f))
                    action(f)
            self._issue()
            try:
                msg = self._get(0.005)
            except queue.Empty:
                continue
            self._handle(msg)
            while True:
                try:
                    msg = self.res_q.get_nowait()
                except queue.Empty:
                    break
                if msg[0] == "crash":
                    raise RuntimeError(f"rank {msg[1]} crashed: {msg[2]}\n  logs: {self.log_dir}")
                self._handle(msg)
        if fuzzer is not None:
            fuzzer.stop()
            self.report.fuzz.update(fuzzer.counts)
        self.report.lost = len(self.flights)
        for fl in self.flights.values():
            self.report.unexpected.append(f"room {fl.req.room} gen {fl.req.generation}: LOST, "
                                          f"waiting for {sorted(fl.waiting)}")

    def _stalled(self) -> None:
        """Name what the run waits on and have every rank that is up write its stacks into
        its log (_shutdown has the others write theirs)."""
        waits = Counter(k for fl in self.flights.values() for k in fl.waiting)
        not_up = sorted("{}.dp{}.pp{}.tp{}".format(*k) for k in self.keys if k not in self.ready)
        self.report.unexpected.append(
            f"stalled: nothing finished for {self.cfg.stall_s:.0f} s with "
            f"{self.finished}/{self.cfg.requests} finished; ranks not (back) up: "
            f"{not_up or 'none'}; "
            f"down: {sorted('{}.dp{}'.format(*k) for k in self.down) or 'none'}; "
            "requests waiting on: " + (", ".join(
                "{}.dp{}.pp{}.tp{} x{}".format(*k, n) for k, n in waits.most_common()) or
                "none (none issued: no pages or no healthy group)"))
        for key, p in self.procs.items():
            if key in self.ready and p.is_alive():
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)

    def _inflight_on(self, f: Fault) -> bool:
        """Faults hit mid-transfer: wait until the rank has a request whose prefill is still
        sending chunks (so neither side can have finished it), and is up again after an
        earlier fault."""
        if (f.side, f.dp, 0, 0) in self.down or (f.side, f.dp, 0, 0) in self.returning:
            return False
        now = time.monotonic()
        return any(fl.groups[f.side] == f.dp and fl.req.chunk_gap_s > 0 and
                   now < fl.t_issue + (fl.req.n_chunks - 1) * fl.req.chunk_gap_s
                   for fl in self.flights.values())

    def _healthy(self, side: str, g: int) -> bool:
        return (side, g) not in self.spent and \
            all(k in self.ready and k not in self.down for k in self._group_keys(side, g))

    def _issue(self) -> None:
        cfg, topo = self.cfg, self.topo
        if self.returning and self.issued >= cfg.requests - max(20, cfg.requests // 5):
            return  # keep the last requests for the ranks that come back (restart, resume)
        per_group = Counter(fl.groups[ROLE_DECODE] for fl in self.flights.values())
        budget = cfg.requests - self.finished - len(self.flights)
        while budget > 0 and self.issued < cfg.requests:
            if self.retry_q:
                req = self.retry_q[0]
                room = req.room
            else:
                req = None
                room = self._pick_room(per_group)
                if room is None:
                    return
            pg = room % topo.prefill.dp
            dg = room % topo.decode.dp
            if not (self._healthy(ROLE_PREFILL, pg) and self._healthy(ROLE_DECODE, dg)) or \
                    per_group[dg] >= cfg.concurrency:
                if req is not None:
                    self.retry_q.pop(0)  # its groups are down: run a fresh request instead
                    continue
                return
            if req is None:
                req = self._new_req(room, 0)
            ids = {}
            for side, g in ((ROLE_PREFILL, pg), (ROLE_DECODE, dg)):
                s = topo.prefill if side == ROLE_PREFILL else topo.decode
                n = -(-req.tokens // s.page_size)
                nw = sum(n - window_first_page(req.tokens, c.window_tokens, s.page_size,
                                               c.prefix_pages(req.prefix_tokens, s.page_size))
                         for c in self.layout.components if c.index == "window")
                got = self.pools[(side, g)].take(n, nw)
                if got is None:
                    for side2, g2 in ids:
                        self.pools[(side2, g2)].give(ids[(side2, g2)])
                    if not any(fl.groups[side] == g for fl in self.flights.values()) and \
                            not any(o[0] == (side, g) for o in self.orphans.values()):
                        self._spend(side, g)
                    return  # wait for pages
                ids[(side, g)] = got
            if self.retry_q and req is self.retry_q[0]:
                self.retry_q.pop(0)
            else:
                self.next_room = room + 1
            req.ids = {ROLE_PREFILL: ids[(ROLE_PREFILL, pg)], ROLE_DECODE: ids[(ROLE_DECODE, dg)]}
            keys = self._group_keys(ROLE_PREFILL, pg) + self._group_keys(ROLE_DECODE, dg)
            self.flights[(room, req.generation)] = _Flight(
                req, {ROLE_PREFILL: pg, ROLE_DECODE: dg}, set(keys))
            for k in keys:
                self.cmd_qs[k].put(("req", req))
            self.issued += 1
            self.report.requests += 1
            self.report.aborts += req.abort_after_s is not None
            self.report.retries += req.generation > 0
            per_group[dg] += 1
            budget -= 1

    def _spend(self, side: str, g: int) -> None:
        """Note [Spent groups]: quarantined pages and slots never come back (Note [What is
        checked]), so a group whose rank quarantined enough of them (a decode rank that froze,
        or whose prefill peers died mid-transfer, several times) cannot take this request even
        with nothing in flight: it takes no more requests, and the run ends once no group of a
        side is left, instead of waiting for pages that cannot come."""
        pool = self.pools[(side, g)]
        self.spent.add((side, g))
        self.report.spent.append(f"{side}.dp{g}: {len(pool.pages)} pages, {len(pool.slots)} "
                                 f"slots free, {pool.quarantined_pages} pages quarantined")

    def _pick_room(self, per_group) -> int | None:
        topo = self.topo
        room = self.next_room
        for _ in range(topo.prefill.dp * topo.decode.dp * 4):
            dg = room % topo.decode.dp
            if dg in self.dgroups and self._healthy(ROLE_PREFILL, room % topo.prefill.dp) and \
                    self._healthy(ROLE_DECODE, dg) and per_group[dg] < self.cfg.concurrency:
                self.next_room = room
                return room
            room += 1
        return None

    def _new_req(self, room: int, generation: int) -> RelReq:
        cfg, rng = self.cfg, self.rng
        page_size = self.topo.prefill.page_size
        n_pages = int(rng.integers(1, cfg.max_pages + 1))
        tokens = (n_pages - 1) * page_size + int(rng.integers(1, page_size + 1))
        chunk_pages = int(rng.integers(1, n_pages + 1))
        prefix = int(rng.integers(0, n_pages)) * page_size if rng.random() < cfg.prefix_rate \
            else 0
        n_chunks = -(-n_pages // chunk_pages)
        abort, on_byte = None, False
        gap = cfg.chunk_gap_s if rng.random() < 0.5 else 0.0
        if rng.random() < cfg.abort_rate:
            abort = float(rng.uniform(0, n_chunks * gap + 0.004))
            on_byte = bool(rng.random() < 0.5)  # half of them right after the first write
        fault = "bad_page" if rng.random() < cfg.bad_index_rate else ""
        req = RelReq(room=room, tokens=tokens, chunk_tokens=chunk_pages * page_size,
                     prefix_tokens=prefix, fault=fault, generation=generation,
                     abort_after_s=abort, abort_on_first_byte=on_byte, chunk_gap_s=gap)
        req.seed_labels = cfg.seed * 65599 + generation
        req.n_chunks = n_chunks
        return req

    # ~~~ results ~~~

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "ready":
            self.progress_t = time.monotonic()
            self.ready.add(msg[1])
            self.returning.discard(msg[1])
            if msg[1][0] == ROLE_PREFILL:
                self.hub_addr[msg[1]] = msg[2]
        elif kind == "canary":
            _, key, room, gen, nbad = msg
            self.report.corrupted += 1
            self.report.corrupted_bytes += nbad
            self.report.unexpected.append(f"{key}: room {room} gen {gen}: {nbad} bytes written "
                                          "into pages while they were free")
        elif kind == "stats":
            name = "{}.dp{}.pp{}.tp{}".format(*msg[1])
            if name in self.report.rank_stats:  # a restarted rank: keep both incarnations
                name += f"#{sum(1 for k in self.report.rank_stats if k.startswith(name))}"
            self.report.rank_stats[name] = msg[2]
            self.report.totals.update({k: v for k, v in msg[2].items()
                                       if k not in ("rooms", "finished", "peers", "requests",
                                                    "engine_peers", "max_stall_ms")})
        elif kind == "done":
            self._on_done(*msg[1:])

    def _on_done(self, key, room, gen, state, reason, info) -> None:
        fl = self.flights.get((room, gen))
        if fl is None or key not in fl.waiting:
            orphan = self.orphans.pop((room, gen, key), None)
            if orphan is not None:  # a rank that was down came back and reported late
                self._release(orphan[0], orphan[1], info)
            return
        fl.waiting.discard(key)
        fl.reports[key] = (state, reason, info)
        for side in (ROLE_PREFILL, ROLE_DECODE):
            self._maybe_side_done(fl, side)
        if not fl.waiting:
            self._finish(fl)

    def _maybe_side_done(self, fl: _Flight, side: str) -> None:
        if side in fl.side_done:
            return
        keys = self._group_keys(side, fl.groups[side])
        if any(k in fl.waiting for k in keys):
            return
        fl.side_done.add(side)
        reported = [fl.reports[k][2] for k in keys if k in fl.reports]
        pool = (side, fl.groups[side])
        if len(reported) == len(keys):
            quarantined = any(i.get("pages") == "quarantined" for i in reported)
            self._release(pool, fl.req.ids[side], {"pages": "quarantined" if quarantined
                                                   else "reusable"})
        if side == ROLE_DECODE:
            dec = [fl.reports[k] for k in keys if k in fl.reports]
            if fl.req.abort_after_s is not None and dec and all(
                    s == 4 and r == "aborted by decode" for s, r, _ in dec) and \
                    self.rng.random() < self.cfg.retry_rate and \
                    self.issued + len(self.retry_q) < self.cfg.requests:
                self.retry_q.append(self._new_req(fl.req.room, fl.req.generation + 1))

    def _release(self, pool_key, ids, info) -> None:
        pool = self.pools[pool_key]
        if pool_key[0] == ROLE_DECODE and info.get("pages") == "quarantined":
            pool.quarantined_pages += len(ids["pages"])
            self.report.quarantined += 1
            self.report.quarantined_pages += len(ids["pages"])
            return
        pool.give(ids)

    def _finish(self, fl: _Flight) -> None:
        del self.flights[(fl.req.room, fl.req.generation)]
        self.finished += 1
        self.progress_t = time.monotonic()
        r, req = self.report, fl.req
        if fl.hit is not None:
            r.fault_requests += 1
            r.fault_resolution_s = max(r.fault_resolution_s, time.monotonic() - fl.hit)
        dec = [(k, v) for k, v in fl.reports.items() if k[0] == ROLE_DECODE]
        pre = [(k, v) for k, v in fl.reports.items() if k[0] == ROLE_PREFILL]
        tag = f"room {req.room} gen {req.generation}"
        if dec and all(v[0] == 3 for _, v in dec):
            bad = [v[1] for _, v in dec if v[1]]
            if bad:
                r.corrupted += 1
                r.corrupted_bytes += sum(v[2].get("corrupt_bytes", 0) for _, v in dec)
                r.unexpected.append(f"{tag}: CORRUPTED: {bad[0]}")
                r.failed += 1
                return
            failed_pre = [v[1] for _, v in pre if v[0] == 4]
            if failed_pre:
                r.inconsistent.append(f"{tag}: decode Success, prefill Failed: {failed_pre[0]}")
            r.succeeded += 1
            return
        r.failed += 1
        gone = sorted("{}.dp{}".format(*k) for k in set(self._group_keys(
            ROLE_PREFILL, fl.groups[ROLE_PREFILL]) + self._group_keys(
            ROLE_DECODE, fl.groups[ROLE_DECODE])) - fl.reports.keys())
        why = next((v[1] for _, v in dec if v[0] == 4), "") or \
            next((v[1] for _, v in pre if v[0] == 4), "") or \
            f"no terminal report: {', '.join(gone)} went down first"
        r.reasons[normalise(why)] += 1
        if "BYTES WRITTEN" in why:
            r.corrupted += 1
            r.unexpected.append(f"{tag}: {why}")
        elif not (req.abort_after_s is not None or req.fault or fl.hit is not None):
            r.unexpected.append(f"{tag}: {why}")

    # ~~~ faults ~~~

    def _inject(self, f: Fault) -> None:
        key = (f.side, f.dp, 0, 0)
        proc = self.procs[key]
        sig = signal.SIGKILL if f.action == "kill" else signal.SIGSTOP
        os.kill(proc.pid, sig)
        now = time.monotonic()
        self.down.add(key)
        self.report.faults_injected += 1
        print(f"  fault: {f.action} {f.side} dp{f.dp} (pid {proc.pid}) with "
              f"{sum(1 for fl in self.flights.values() if key in fl.waiting)} requests in "
              "flight on it", file=self.out)
        for fl in self.flights.values():
            if fl.groups[f.side] == f.dp:
                fl.hit = fl.hit if fl.hit is not None else now
            if key in fl.waiting:
                fl.waiting.discard(key)
                if f.action == "stop":
                    self.orphans[(fl.req.room, fl.req.generation, key)] = (
                        (f.side, f.dp), fl.req.ids[f.side])
                fl.side_done.add(f.side)  # its pages went (or will go back) with the rank
        for fl in list(self.flights.values()):
            if not fl.waiting:
                self._finish(fl)
        if f.action == "kill" and f.restart_after_s is not None:
            self.timers.append((now + f.restart_after_s, self._restart, f))
            self.returning.add(key)
        if f.action == "stop" and f.resume_after_s is not None:
            self.timers.append((now + f.resume_after_s, self._resume, f))
            self.returning.add(key)

    def _restart(self, f: Fault) -> None:
        key = (f.side, f.dp, 0, 0)
        self.procs[key].join(timeout=5)
        self.pools[(f.side, f.dp)] = _Pool(self.cfg.pages, self.cfg.slots, self.rng)
        self.spent.discard((f.side, f.dp))  # a new process: all of its pages
        self.orphans = {k: v for k, v in self.orphans.items() if k[2] != key}
        self.down.discard(key)
        self._spawn(key, self.bootstrap)
        print(f"  fault: restarted {f.side} dp{f.dp}", file=self.out)

    def _resume(self, f: Fault) -> None:
        key = (f.side, f.dp, 0, 0)
        os.kill(self.procs[key].pid, signal.SIGCONT)
        # Route to it again once its peers heard from it (a request to a peer that is still
        # "silent" on the other side fails at once, by design).
        grace = max(0.5, 3 * self.cfg.knobs.get("heartbeat_interval_s", 1.0))
        self.timers.append((time.monotonic() + grace, self._readmit, f))
        print(f"  fault: resumed {f.side} dp{f.dp}", file=self.out)

    def _readmit(self, f: Fault) -> None:
        self.down.discard((f.side, f.dp, 0, 0))
        self.returning.discard((f.side, f.dp, 0, 0))

    def _shutdown(self) -> None:
        for key, p in self.procs.items():
            if key in self.down and p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
        for key, p in self.procs.items():
            if key not in self.ready and key not in self.down and p.is_alive():
                # Started (or restarted) but never ready: keep its stacks, then end it.
                os.kill(p.pid, signal.SIGUSR1)
                time.sleep(0.5)
                p.kill()
                self.report.unexpected.append(
                    "{}.dp{}.pp{}.tp{} never became ready".format(*key))
        alive = [k for k, p in self.procs.items() if p.is_alive()]
        for k in alive:
            try:
                self.cmd_qs[k].put(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 30
        byes = set()
        while len(byes) < len(alive) and time.monotonic() < deadline:
            try:
                msg = self.res_q.get(timeout=0.5)
            except queue.Empty:
                if all(not self.procs[k].is_alive() for k in alive if k not in byes):
                    break
                continue
            if msg[0] == "bye":
                byes.add(msg[1])
            elif msg[0] == "done":
                self._on_done(*msg[1:])
            elif msg[0] in ("stats", "canary"):
                self._handle(msg)
        for p in self.procs.values():
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        errors = any(st.get("handler_errors") or st.get("worker_errors")
                     for st in self.report.rank_stats.values())
        if not self.report.unexpected and not self.report.lost and not errors:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.report.log_dir = ""
            return
        # The logs may not outlive the machine (a CI runner): their ends go into the report.
        for name in sorted(os.listdir(self.log_dir)):
            with open(os.path.join(self.log_dir, name), errors="replace") as f:
                tail = f.readlines()[-LOG_TAIL_LINES:]
            if tail:
                self.report.log_tails[name] = "".join(tail)


def run(cfg: RelConfig, out=None) -> Report:
    return Harness(cfg, out).run()
