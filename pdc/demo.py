"""`pdc demo`: prefill and decode ranks as local processes, real engine, every byte checked.

The parent lowers the plan (it may import the compiler); every rank process imports only
the runtime and the family's generated modules. Ranks fill their pools with the aggregate
labels of each request (runtime.labels), requests run in waves of `concurrency`, and every
decode rank verifies every byte of every item it owns after Success.

Page ids are allocated by the parent from per-(side, dp group) free lists in a shuffled
order (fragmented pools), except every fourth request, which gets contiguous pages
(pdc.verify.ranks.allocate). Process handling, endpoints and chunked sends are shared with
`pdc parity` in pdc.verify.ranks.
"""

from __future__ import annotations

import importlib
import queue
import sys
import time
from dataclasses import dataclass

import numpy as np

from pdc.runtime.family import Family, FamilyNotFound

from .console import Counter, error, print_table, wrap
from .verify.ranks import (
    ROLE_DECODE,
    ROLE_PREFILL,
    Processes,
    Req,
    allocate,
    bootstrap_server,
    chunk_plan,
    open_endpoint,
    request_labels,
    send_chunk,
)

__all__ = ["ROLE_DECODE", "ROLE_PREFILL", "DemoConfig", "Req", "default_decode", "run_demo"]


@dataclass
class DemoConfig:
    spec: str
    family_module: str  # python name under pdc.generated
    plan_json: str
    engine: str
    requests: int
    concurrency: int
    seed: int
    pages: int
    slots: int
    timeout_s: float
    stream: bool = False  # prefill sends with stream=True and plays a forward (layer_done)
    # Note [Namespace hosts]: "side/dp" -> (namespace, address) of the rank's host; empty:
    # every rank on this host's loopback
    hosts: dict | None = None
    secret_file: str = ""  # the control secret the ranks share (namespace hosts only)


# ~~~ rank process ~~~


def _rank_loop(cmd_q, res_q, cfg: DemoConfig, side: str, dp: int, pp: int, tp: int) -> None:
    from pdc.runtime import knobs

    if cfg.hosts:
        from .netns import enter

        namespace, address = cfg.hosts[f"{side}/{dp}"]
        enter(namespace)  # first: before any socket or thread (Note [Namespace hosts])
        knobs.override(bind_host=address, control_secret_file=cfg.secret_file,
                       control_auth="on")
    from pdc.runtime.endpoints import KVPoll
    from pdc.runtime.engines import make_engine
    from pdc.runtime.metrics import RecordBuffer
    from pdc.runtime.plan_types import Plan, RankId, dp_group_of_room
    from pdc.runtime.pools import Capacity, RankPools

    knobs.override(transfer_timeout_s=cfg.timeout_s)
    layout_mod = importlib.import_module(f"pdc.generated.{cfg.family_module}.layout")
    # The family is the codec of its control messages (Family.encode/decode).
    wire_mod = Family.load(cfg.family_module)
    layout = layout_mod.LAYOUT
    plan = Plan.from_json(cfg.plan_json)
    rank = RankId(pp, tp)
    topo = plan.topology
    boot = None
    if side == ROLE_PREFILL and (dp, pp, tp) == (0, 0, 0):
        boot = bootstrap_server(plan)
        res_q.put(("bootstrap", boot.address))
    bootstrap = cmd_q.get()
    cap = Capacity(pages=cfg.pages, slots=cfg.slots, aux_rows=cfg.slots, window_pages=cfg.pages)
    pools = RankPools(layout, plan.registration(side, rank), cap)
    engine = make_engine(cfg.engine)
    records = RecordBuffer()
    ep = open_endpoint(side, layout, wire_mod, plan, rank, dp, engine, pools, bootstrap, records)
    res_q.put(("ready", side, dp, pp, tp, ep.transport.describe()))
    my_dp = topo.prefill.dp if side == ROLE_PREFILL else topo.decode.dp
    while True:
        cmd = cmd_q.get()
        if cmd is None:
            break
        wave: list[Req] = [r for r in cmd if dp_group_of_room(r.room, my_dp) == dp]
        results = []
        if side == ROLE_PREFILL:
            senders = {}
            for r in wave:
                ids = r.ids[side]
                for comp, pos, item, _, data in request_labels(layout, plan, side, rank,
                                                               cfg.seed, r, ids):
                    pools.view(comp.name, pos)[item] = data
                s = ep.sender(r.room)
                for c in chunk_plan(r.tokens, r.chunk_tokens, topo.prefill.page_size):
                    send_chunk(s, ids, c, stream=cfg.stream)
                senders[r.room] = s
            deadline = time.monotonic() + cfg.timeout_s + 5
            early = _play_forward(ep, plan, layout, rank, senders, deadline) if cfg.stream \
                else {}
            while senders and time.monotonic() < deadline:
                for room, s in list(senders.items()):
                    st = s.poll()
                    if st in (KVPoll.Success, KVPoll.Failed):
                        t = s.stats
                        why = early.get(room, s.reason)
                        results.append((room, int(KVPoll.Failed) if room in early else int(st),
                                        why, t.bytes, t.descriptors,
                                        # a rank with nothing to write has no interval
                                        t.t_done - t.t_init if t.batches else 0.0,
                                        t.batches))
                        del senders[room]
                time.sleep(0.002)
            results += [(room, int(KVPoll.Failed), "prefill deadline", 0, 0, 0.0, 0)
                        for room in senders]
        else:
            recvs = {}
            for r in wave:
                ids = r.ids[side]
                page_size = topo.decode.page_size
                for comp, pos, item, where, data in request_labels(layout, plan, side, rank,
                                                                   cfg.seed, r, ids):
                    view = pools.view(comp.name, pos)
                    if comp.index == "page" and \
                            where < comp.prefix_pages(r.prefix_tokens, page_size):
                        view[item] = data  # decode prefix cache already holds these pages
                    else:
                        view[item] = 0xA5  # poison: every byte must be overwritten
                rv = ep.receiver(r.room)
                pages = np.array(ids["pages"])
                if r.fault == "bad_page":
                    pages[-1] = cfg.pages + 5
                rv.init(pages, r.prefix_tokens, slot=ids["slot"], ring_slot=ids["ring"],
                        aux_row=ids["aux"], window_page_ids=ids["window"])
                recvs[r.room] = (rv, r, time.monotonic())
            pending = dict(recvs)
            while pending:
                for room, (rv, r, t0) in list(pending.items()):
                    st = rv.poll()
                    if st == KVPoll.Success:
                        dt = time.monotonic() - t0
                        bad = _verify(layout, plan, rank, cfg.seed, r, pools)
                        results.append((room, int(KVPoll.Success) if not bad else
                                        int(KVPoll.Failed), bad, rv.bytes, dt, *rv.links))
                        del pending[room]
                    elif st == KVPoll.Failed:
                        why = rv.reason
                        if r.fault:
                            touched = _touched(layout, plan, rank, cfg.seed, r, pools)
                            why = f"{why}; {touched}" if touched else why
                        results.append((room, int(st), why, 0, 0.0, *rv.links))
                        del pending[room]
                time.sleep(0.001)
            for rv, _, _ in recvs.values():
                rv.release()
        res_q.put(("wave", side, dp, pp, tp, results, records.drain()))
    ep.close()
    if boot is not None:
        boot.close()
    engine.close()
    res_q.put(("bye", side, dp, pp, tp))


def _play_forward(ep, plan, layout, rank, senders: dict, deadline: float) -> dict[int, str]:
    """What a streaming forward does: layer_done per layer in order, then forward_done.

    After each layer it waits until every request issued a write for it (a layer of a real
    forward takes long enough for that), so each layer leaves in its own batch. Returns the
    requests that broke the streaming contract: finished before forward_done (request-wide
    state must wait for it) or issued nothing for a layer that they move."""
    from pdc.runtime.endpoints import KVPoll

    terminal = (KVPoll.Success, KVPoll.Failed)
    real = set(layout.all_layer_ids)
    layers = sorted({e.layer_id for lk in plan.links_from(rank) for e in lk.entries} & real)
    broken: dict[int, str] = {}
    for layer in layers:
        before = {room: s.stats.batches for room, s in senders.items()}
        ep.layer_done(layer)
        while True:
            idle = [room for room, s in senders.items()
                    if s.stats.batches == before[room] and s.poll() not in terminal]
            if not idle or time.monotonic() > deadline:
                break
            time.sleep(0.0005)
        for room in idle:
            broken.setdefault(room, f"streaming: nothing issued after layer_done({layer})")
        for room, s in senders.items():
            if s.poll() == KVPoll.Success:
                broken.setdefault(room, f"streaming: Success after layer_done({layer}), "
                                        "before forward_done")
    ep.forward_done()
    return broken


def _touched(layout, plan, rank, seed, req: Req, pools) -> str:
    """For a request that failed: name an item outside the prefix that was written at all."""
    page_size = plan.topology.decode.page_size
    for comp, pos, item, where, _ in request_labels(layout, plan, ROLE_DECODE, rank, seed,
                                                    req, req.ids[ROLE_DECODE]):
        if comp.index == "page" and where < comp.prefix_pages(req.prefix_tokens, page_size):
            continue
        if (pools.view(comp.name, pos)[item] != 0xA5).any():
            return f"BYTES WRITTEN into {comp.name} entry {pos} position {where}"
    return ""


def _verify(layout, plan, rank, seed, req: Req, pools) -> str:
    for comp, pos, item, where, data in request_labels(layout, plan, ROLE_DECODE, rank, seed,
                                                       req, req.ids[ROLE_DECODE]):
        got = pools.view(comp.name, pos)[item]
        if not np.array_equal(got, data):
            n = int((got != data).sum())
            return (f"{comp.name} entry {pos} position {where}: {n} of {len(data)} bytes differ "
                    "from the aggregate reference")
    return ""


# ~~~ parent ~~~


def default_decode(spec_path: str, prefill: str, engine: str) -> tuple[str, str]:
    """decode tp=1 unless the spec's backend matrix forbids heterogeneous attention TP for
    this engine; then decode uses the prefill tp (and says so)."""
    from pdc.compiler.diagnostics import SpecErrors
    from pdc.compiler.frontend import load_spec
    from pdc.compiler.topology import parse_side_arg

    try:
        spec = load_spec(spec_path)
    except SpecErrors:
        return "tp=1", ""  # run_demo reports the spec's errors
    rule = spec.backend(engine)
    side, errs = parse_side_arg(prefill, "--prefill")
    tp = side.get("tp", 1)
    if rule is not None and not rule.hetero_attention_tp and tp != 1 and not errs:
        return (f"tp={tp}", f"{spec.family} over {engine} forbids heterogeneous attention TP "
                f"(spec {rule.loc}); using decode tp={tp}")
    return "tp=1", ""


def run_demo(spec_path: str, prefill: str, decode: str, engine: str, requests: int,
             concurrency: int = 4, seed: int = 0, timeout_s: float = 60.0,
             out=None, faults: dict[int, str] | None = None, stream: bool = False,
             summary: dict | None = None, metrics=None, hosts: str = "local") -> int:
    """Run the demo; `faults` maps request indices to an injected fault (see Req.fault);
    `stream` sends per layer as a forward reports them (_play_forward); `summary`, when
    given, receives the printed figures as numbers (for bench/, tests and `pdc demo --json`),
    and on a failure `errors`: Diagnostics or error dicts (pdc.console.error); `metrics`, a
    runtime.metrics.TransferMetrics, receives every rank's per-request records after each
    wave (serve it to scrape them while the demo runs).
    Exit code 0 when every request ended as expected (verified, or failed cleanly as its
    fault demands)."""
    out = out or sys.stdout  # looked up per call: a default bound at import misses capture
    from pdc.compiler.diagnostics import SpecErrors
    from pdc.compiler.family import plan_spec
    from pdc.compiler.frontend import load_spec

    summary = summary if summary is not None else {}
    try:
        spec = load_spec(spec_path)
        family, plan = plan_spec(spec, prefill, decode, engine)
    except SpecErrors as e:
        print(str(e), file=sys.stderr)
        summary["errors"] = list(e.diagnostics)
        return 1
    layout, topo = family.layout, plan.topology
    try:
        Family.load(spec.py_name)
    except FamilyNotFound:
        layout_py, hint = f"generated/{spec.py_name}/layout.py", f"run `pdc compile {spec_path}`"
        print(f"pdc demo: error: {layout_py} is missing\n  hint: {hint}", file=sys.stderr)
        summary["errors"] = [error(layout_py, f"{layout_py} is missing", hint)]
        return 1
    if hosts in ("netns", "netns6"):
        from .netns import unavailable

        why = unavailable()
        if why:
            print(f"pdc demo: error: --hosts netns: {why}", file=sys.stderr)
            summary["errors"] = [error("<demo>", f"--hosts netns: {why}",
                                       "run as root with iproute2, or without --hosts")]
            return 1
        with _NamespaceHosts(topo, ipv6=hosts == "netns6") as (placed, secret_file, counters):
            code = _run(spec, spec_path, plan, layout, engine, requests, concurrency, seed,
                        timeout_s, stream, faults, out, summary, metrics, placed, secret_file)
            counters(out, summary)
            return code
    return _run(spec, spec_path, plan, layout, engine, requests, concurrency, seed, timeout_s,
                stream, faults, out, summary, metrics, None, "")


def _run(spec, spec_path, plan, layout, engine, requests, concurrency, seed, timeout_s,
         stream, faults, out, summary, metrics, hosts, secret_file) -> int:
    topo = plan.topology
    page_size = topo.prefill.page_size
    slots = max(concurrency, 1)
    max_pages_per_req = 8
    cfg = DemoConfig(spec_path, spec.py_name, plan.to_json(), engine, requests, concurrency,
                     seed, pages=max_pages_per_req * concurrency, slots=slots,
                     timeout_s=timeout_s, stream=stream, hosts=hosts, secret_file=secret_file)
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(requests):
        n_pages = int(rng.integers(1, max_pages_per_req + 1))
        tokens = (n_pages - 1) * page_size + int(rng.integers(1, page_size + 1))
        chunk_pages = int(rng.integers(1, n_pages + 1))
        prefix = int(rng.integers(0, n_pages)) * page_size if i % 3 == 1 else 0
        reqs.append(Req(room=1000 + i, tokens=tokens, chunk_tokens=chunk_pages * page_size,
                        prefix_tokens=prefix, fault=(faults or {}).get(i, "")))

    ranks = [(ROLE_PREFILL, g, s, t) for g in range(topo.prefill.dp)
             for s in range(topo.prefill.pp) for t in range(topo.prefill.tp)]
    ranks += [(ROLE_DECODE, g, s, t) for g in range(topo.decode.dp)
              for s in range(topo.decode.pp) for t in range(topo.decode.tp)]
    print(wrap(f"pdc demo: {spec.family} {topo.describe()}; {len(ranks)} rank processes, "
               f"{requests} requests" + (", streamed per layer" if stream else "")), file=out)
    summary.update(family=spec.family, topology=topo.describe(), rank_processes=len(ranks))
    t_start = time.monotonic()
    procs = Processes("pdc-demo-")
    for side, g, s, t in ranks:
        procs.start(f"{side}-dp{g}-pp{s}-tp{t}", _rank_loop, (cfg, side, g, s, t))
    get = procs.get
    progress = None
    try:
        msg = get()
        boot = msg[1]
        procs.broadcast(boot)
        transports = sorted({get()[5] for _ in ranks})
        outcome: dict[int, list] = {}
        progress = Counter("requests", requests)
        for w in range(0, requests, concurrency):
            wave = reqs[w:w + concurrency]
            allocate(plan, layout, wave, rng, cfg.pages, cfg.slots)
            procs.broadcast(wave)
            for _ in ranks:
                m = get(timeout=timeout_s + 30)
                for res in m[5]:
                    outcome.setdefault(res[0], []).append((m[1], res))
                if metrics is not None:
                    for rec in m[6]:
                        metrics.observe(rec)
            progress.tick(len(wave))
        progress.close()
        procs.broadcast(None)
        for _ in ranks:
            get()
    except (RuntimeError, queue.Empty) as e:
        if progress is not None:
            progress.close()
        why = str(e) or "no answer from a rank process in time"
        print(f"pdc demo: error: {why}\n  rank logs: {procs.log_dir}", file=sys.stderr)
        summary["errors"] = [error("<demo>", why, f"see the rank logs in {procs.log_dir}")]
        procs.kill()
        return 1
    procs.join()
    wall = time.monotonic() - t_start
    procs.close()
    return _report(outcome, reqs, wall, out, summary, transports)


class _NamespaceHosts:
    """One namespace host per DP group of each side (Note [Namespace hosts]), a control secret
    in a private file, and afterwards the bytes each host's interface carried."""

    def __init__(self, topo, ipv6: bool = False):
        self.ipv6 = ipv6
        self.groups = [f"prefill/{g}" for g in range(topo.prefill.dp)] + \
            [f"decode/{g}" for g in range(topo.decode.dp)]

    def __enter__(self):
        import base64
        import os
        import tempfile

        from .netns import Hosts

        self.hosts = Hosts(len(self.groups), ipv6=self.ipv6)
        self.dir = tempfile.mkdtemp(prefix="pdc-demo-secret-")
        secret_file = os.path.join(self.dir, "secret")
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, base64.b64encode(os.urandom(32)))
        os.close(fd)
        placed = {g: (h.namespace, h.address)
                  for g, h in zip(self.groups, self.hosts.hosts, strict=True)}
        return placed, secret_file, self._counters

    def _counters(self, out, summary: dict) -> None:
        rows = []
        got = self.hosts.counters()
        for g, h in zip(self.groups, self.hosts.hosts, strict=True):
            tx, rx = got[h.namespace]
            rows.append({"host": h.namespace, "address": h.address,
                         "ranks": g.replace("/", " dp"), "sent_bytes": tx, "received_bytes": rx})
            print(f"  host {h.namespace} {h.address} ({g.replace('/', ' dp')}): sent "
                  f"{tx / 2**20:.1f} MiB, received {rx / 2**20:.1f} MiB on {h.device}", file=out)
        print("  control plane: authenticated (a secret made for this run)", file=out)
        summary.update(hosts=rows, control_auth=True)

    def __exit__(self, *exc) -> None:
        import shutil

        self.hosts.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _report(outcome, reqs, wall, out, summary: dict, transports: list[str]) -> int:
    ok, failed, reasons, nbytes, lat, desc, xfer = 0, 0, [], 0, [], 0, []
    staged, links, batches = 0, 0, 0
    faulted = []
    for r in reqs:  # reasons: (room, why) of each failed request
        res = outcome.get(r.room, [])
        if r.fault:
            dec = [x for side, x in res if side == ROLE_DECODE]
            clean = dec and all(x[1] == 4 and x[2] and "BYTES WRITTEN" not in x[2] for x in dec)
            faulted.append((r.room, r.fault, bool(clean), dec[0][2] if dec else "no result"))
            continue
        dec = [x for side, x in res if side == ROLE_DECODE]
        pre = [x for side, x in res if side == ROLE_PREFILL]
        good = dec and all(x[1] == 3 for side, x in res)
        if good:
            ok += 1
            nbytes += sum(x[3] for x in dec)
            lat.append(max(x[4] for x in dec))
            desc += sum(x[4] for x in pre)
            batches += sum(x[6] for x in pre)
            staged += sum(x[5] for x in dec)
            links += sum(x[6] for x in dec)
            xfer.append(max(x[5] for x in pre) if pre else 0.0)
        else:
            failed += 1
            why = next((x[2] for _, x in res if x[1] != 3 and x[2]), "no result")
            reasons.append((r.room, why))
    p50 = np.percentile(lat, 50) * 1e3 if lat else 0.0
    p99 = np.percentile(lat, 99) * 1e3 if lat else 0.0
    busy = sum(xfer)
    summary.update(ok=ok, failed=failed, bytes=nbytes, descriptors=desc, batches=batches,
                   staged_links=staged, links=links, transfer_s=busy,
                   gbps=nbytes / busy / 1e9 if busy else 0.0, wall_s=wall,
                   p50_ms=float(p50), p99_ms=float(p99), transports=transports)
    rows = [("requests ok", f"{ok}"), ("requests failed", f"{failed}"),
            ("bytes moved", f"{nbytes / 2**20:.1f} MiB " + (
                "(every byte verified)" if ok and not failed else
                f"(every byte of the {ok} verified request{'s' if ok > 1 else ''})" if ok else
                "(nothing verified: no request succeeded)")),
            ("descriptors", f"{desc} in {batches} batches (staged path on {staged} of {links} "
                            "links)"),
            ("transfer GB/s", f"{nbytes / busy / 1e9:.3f} (bytes / summed first-submit-to-done "
                              "time)" if busy else "n/a"),
            ("wall", f"{wall:.1f} s (labels, verification and process start included)"),
            ("latency p50", f"{p50:.1f} ms (decode init to verified Success)"),
            ("latency p99", f"{p99:.1f} ms")]
    rows += [("transport", t) for t in transports]
    print_table(("", ""), rows, out, header=False, min_widths=(15,))
    for room, why in reasons[:10]:
        print(wrap(f"  FAILED room {room}: {why}", indent="    "), file=out)
    for room, fault, clean, why in faulted:
        verdict = "failed cleanly" if clean else "DID NOT FAIL CLEANLY"
        print(wrap(f"  fault {fault} room {room}: {verdict}: {why}", indent="    "), file=out)
    summary["failures"] = [{"room": room, "reason": why} for room, why in reasons]
    summary["faults"] = [{"room": room, "fault": fault, "failed_cleanly": clean, "reason": why}
                         for room, fault, clean, why in faulted]
    errors = [error("<demo>", f"request room {room} failed: {why}", "") for room, why in reasons]
    errors += [error("<demo>", f"fault {fault} in room {room} did not fail cleanly: {why}", "")
               for room, fault, clean, why in faulted if not clean]
    summary["errors"] = errors
    return 0 if not errors else 1
