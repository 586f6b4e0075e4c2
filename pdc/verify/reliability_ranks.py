"""The rank processes of the reliability harness (pdc/verify/reliability.py).

Each rank is one spawned process running `rank_main`: it opens its pools, engine and
endpoint from the harness's blob (its RelConfig, the family's layout module as text, the plan
as JSON, the decode groups that run) and then serves the parent's commands until told to stop,
driving every request it was given one step per loop:

- commands in: ("req", RelReq), ("stats",), ("stop",);
- results out: ("bootstrap", address) from the prefill leader, ("ready", key, control
  address), ("done", key, room, generation, state, reason, info) once per request,
  ("canary", key, room, generation, bytes) for writes into free pages, ("stats", key, the
  endpoint's counters), ("crash", key, traceback) and ("bye", key).

Prefill fills a request's items with its labels and sends its chunks on a clock (a slow
forward); decode checks the canaries, poisons what it expects, aborts on the request's own
clock or at its first byte, and on Success compares every byte (Note [What is checked] in
reliability.py). The sabotage runs break the protocol here on purpose: prefill through its
fault hook (Note [Fault hooks]), decode by reusing quarantined pages.

The spec need not be compiled into generated/: the parent renders the family's layout module
in memory (`family_sources`) and the ranks exec it (`load_family`).
"""

from __future__ import annotations

import os
import queue
import signal
import time
import types
from typing import TYPE_CHECKING

import numpy as np

from pdc.verify.ranks import ROLE_DECODE, ROLE_PREFILL, request_labels

if TYPE_CHECKING:
    from pdc.verify.reliability_types import RelConfig

POISON, CANARY = 0xA5, 0x5A


# ~~~ family modules without generated/ ~~~


def family_sources(spec) -> dict[str, str]:
    """The family's generated layout module as text, rendered in memory from the spec."""
    from pdc.compiler.emit import compile_specs

    out = compile_specs([spec])
    return {"layout": out.text(f"{spec.py_name}/layout.py")}


def load_family(sources: dict[str, str]):
    """(layout, Family) of the family whose generated layout module is `sources["layout"]`;
    the Family is the codec of its control messages."""
    from pdc.runtime.family import Family

    m = types.ModuleType("pdc_family_layout")
    exec(compile(sources["layout"], "<family layout>", "exec"), m.__dict__)
    return m.LAYOUT, Family.from_module(m)


# ~~~ rank processes ~~~


def rank_main(blob: dict, key: tuple, bootstrap: str | None, cmd_q, res_q, log: str) -> None:
    """Process entry of rank `key` = (side, dp, pp, tp): native logs and faulthandler stacks
    into `log`, then the rank loop; a rank that raises reports `("crash", key, traceback)`."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks into the log on demand
    try:
        _rank_loop(blob, key, bootstrap, cmd_q, res_q)
    except Exception as e:  # noqa: BLE001 - report to the parent instead of dying silently
        import traceback

        res_q.put(("crash", key, f"{e!r}\n{traceback.format_exc()}"))


def _items(layout, plan, side, rank, req, ids):
    """(component, entry position, item id, position, labels) of one request on a rank."""
    seed = req.seed_labels
    return request_labels(layout, plan, side, rank, seed, req, ids)


def _rank_loop(blob, key, bootstrap, cmd_q, res_q):
    from pdc.runtime import knobs
    from pdc.runtime.control import BootstrapServer
    from pdc.runtime.endpoints import (
        NO_FAULTS,
        DecodeEndpoint,
        Faults,
        KVPoll,
        PageState,
        PrefillEndpoint,
    )
    from pdc.runtime.engines import make_engine
    from pdc.runtime.plan_types import Plan, RankId
    from pdc.runtime.pools import Capacity, RankPools

    side, dp, pp, tp = key
    cfg: RelConfig = blob["cfg"]
    knobs.override(**{**cfg.knobs, "checksum": int(cfg.checksum)})
    layout, wire = load_family(blob["sources"])
    plan = Plan.from_json(blob["plan"])
    rank = RankId(pp, tp)
    topo = plan.topology
    boot = None
    if bootstrap is None:
        boot = BootstrapServer(topo.prefill.dp * topo.prefill.pp * topo.prefill.tp)
        bootstrap = boot.address
        res_q.put(("bootstrap", boot.address))
    cap = Capacity(pages=cfg.pages, slots=cfg.slots, aux_rows=cfg.slots, window_pages=cfg.pages)
    pools = RankPools(layout, plan.registration(side, rank), cap)
    kw = {"transfer_timeout_s": cfg.engine_timeout_s} if cfg.engine == "mooncake" else {}
    engine = make_engine(cfg.engine, **kw)
    if side == ROLE_PREFILL:
        # The early_ack sabotage: prefill acks aborts before its writes drained (Note [Fault
        # hooks]); the decode canaries must catch the late writes.
        faults = Faults(ack_abort_before_drain=True) if cfg.sabotage == "early_ack" else \
            NO_FAULTS
        ep = PrefillEndpoint(layout, wire, plan, rank, dp, engine, pools, bootstrap,
                             faults=faults)
    else:
        pools.arena[:] = CANARY
        ep = DecodeEndpoint(layout, wire, plan, rank, dp, engine, pools, bootstrap)
        ep.wait_ready()
    if side == ROLE_PREFILL:
        # Serving once every decode rank that runs has registered (again, after a restart).
        want = len(blob["decode_groups"]) * len(plan.links_from(rank))
        while len(ep.peers) < want:
            time.sleep(0.01)
    res_q.put(("ready", key, ep.hub.address if side == ROLE_PREFILL else ""))
    active: dict = {}  # (room, gen) -> state
    running = True
    while running or active:
        idle = True
        while True:
            try:
                cmd = cmd_q.get_nowait()
            except queue.Empty:
                break
            idle = False
            if cmd[0] == "req":
                req = cmd[1]
                if side == ROLE_PREFILL:
                    active[(req.room, req.generation)] = _prefill_start(
                        layout, plan, rank, ep, pools, req)
                else:
                    st = _decode_start(layout, plan, rank, ep, pools, req, cfg, res_q, key)
                    active[(req.room, req.generation)] = st
            elif cmd[0] == "stats":
                res_q.put(("stats", key, ep.stats()))
            elif cmd[0] == "stop":
                running = False
        now = time.monotonic()
        for k, st in list(active.items()):
            if side == ROLE_PREFILL:
                done = _prefill_step(st, now, KVPoll)
            else:
                done = _decode_step(layout, plan, rank, pools, st, now, KVPoll, PageState,
                                    cfg.sabotage == "reuse_quarantined")
            if done is not None:
                idle = False
                res_q.put(("done", key, k[0], k[1], *done))
                del active[k]
        if not running and active and side == ROLE_DECODE:
            for st in active.values():
                st["rv"].abort(wait=False)
        if idle:
            time.sleep(0.001)
    res_q.put(("stats", key, ep.stats()))
    ep.close()
    if boot is not None:
        time.sleep(0.2)
        boot.close()
    engine.close()
    res_q.put(("bye", key))


def _prefill_start(layout, plan, rank, ep, pools, req):
    ids = req.ids[ROLE_PREFILL]
    for comp, pos, item, _, data in _items(layout, plan, ROLE_PREFILL, rank, req, ids):
        pools.view(comp.name, pos)[item] = data
    page_size = plan.topology.prefill.page_size
    n_pages = len(ids["pages"])
    per_chunk = max(1, req.chunk_tokens // page_size)
    starts = list(range(0, n_pages, per_chunk)) or [0]
    chunks = []
    for i, p0 in enumerate(starts):
        last = i == len(starts) - 1
        chunks.append(dict(page_ids=ids["pages"][p0:p0 + per_chunk], page_start=p0,
                           last_chunk=last,
                           seq_len=min(req.tokens, (p0 + per_chunk) * page_size),
                           slot=ids["slot"] if last else -1, ring_slot=ids["ring"] if last else -1,
                           aux_row=ids["aux"] if last else -1,
                           window_page_ids=ids["window"] if last else None))
    try:
        s = ep.sender(req.room, req.generation)
    except ValueError as e:
        return {"error": f"sender: {e}"}
    t0 = time.monotonic()
    return {"s": s, "chunks": chunks, "next": 0, "t0": t0, "gap": req.chunk_gap_s}


def _prefill_step(st, now, KVPoll):
    if "error" in st:
        return (int(KVPoll.Failed), st["error"], {})
    s = st["s"]
    while st["next"] < len(st["chunks"]) and now >= st["t0"] + st["next"] * st["gap"]:
        s.send(**st["chunks"][st["next"]])
        st["next"] += 1
    state = s.poll()
    if state in (KVPoll.Success, KVPoll.Failed) and st["next"] == len(st["chunks"]):
        return (int(state), s.reason, {"bytes": s.stats.bytes})
    if state == KVPoll.Failed:
        return (int(state), s.reason, {"bytes": s.stats.bytes})
    return None


def _decode_items(layout, plan, rank, req):
    return list(_items(layout, plan, ROLE_DECODE, rank, req, req.ids[ROLE_DECODE]))


def _decode_start(layout, plan, rank, ep, pools, req, cfg, res_q, key):
    items = _decode_items(layout, plan, rank, req)
    # Canary: nothing may have written into these items since they were given back.
    bad = 0
    for comp, pos, item, _, _ in items:
        got = pools.view(comp.name, pos)[item]
        bad += int((got != CANARY).sum())
    if bad:
        res_q.put(("canary", key, req.room, req.generation, bad))
    prefix_pages = req.prefix_tokens // plan.topology.decode.page_size
    for comp, pos, item, where, data in items:
        view = pools.view(comp.name, pos)
        if comp.index == "page" and where < prefix_pages:
            view[item] = data  # the prefix cache already holds these pages
        else:
            view[item] = POISON
    ids = req.ids[ROLE_DECODE]
    rv = ep.receiver(req.room, req.generation)
    pages = np.array(ids["pages"])
    if req.fault == "bad_page":
        pages[-1] = cfg.pages + 5
    rv.init(pages, req.prefix_tokens, slot=ids["slot"], ring_slot=ids["ring"],
            aux_row=ids["aux"], window_page_ids=ids["window"])
    t0 = time.monotonic()
    abort_at = t0 + req.abort_after_s if req.abort_after_s is not None else None
    watch = []
    if req.abort_on_first_byte:
        abort_at = None
        watch = [(pools.view(c.name, pos), item) for c, pos, item, where, _ in items
                 if not (c.index == "page" and where < prefix_pages)][:8]
    return {"rv": rv, "req": req, "items": items, "abort_at": abort_at, "aborted": False,
            "t0": t0, "watch": watch}


def _decode_step(layout, plan, rank, pools, st, now, KVPoll, PageState, reuse_all=False):
    rv = st["rv"]
    if not st["aborted"] and (st["abort_at"] is not None and now >= st["abort_at"] or any(
            (view[item] != POISON).any() for view, item in st["watch"])):
        rv.abort(wait=False)
        st["aborted"] = True
    state = rv.poll()
    if state == KVPoll.Success:
        bad, nbad = "", 0
        for comp, pos, item, where, data in st["items"]:
            got = pools.view(comp.name, pos)[item]
            if not np.array_equal(got, data):
                n = int((got != data).sum())
                nbad += n
                bad = bad or (f"{comp.name} entry {pos} position {where}: {n} of {len(data)} "
                              "bytes differ from the labels")
        _give_back(pools, st["items"])
        rv.release()
        return (int(state), bad, {"pages": "reusable", "corrupt_bytes": nbad,
                                  "aborted": st["aborted"], "bytes": rv.bytes})
    if state == KVPoll.Failed:
        ps = rv.page_state
        if ps == PageState.PENDING:
            return None
        reason = rv.reason
        if reuse_all:
            ps = PageState.REUSABLE
        if ps == PageState.REUSABLE:
            if st["req"].fault:
                # Refused before any write: every byte outside the prefix is still poison.
                prefix = st["req"].prefix_tokens // plan.topology.decode.page_size
                for comp, pos, item, where, _ in st["items"]:
                    if comp.index == "page" and where < prefix:
                        continue
                    if (pools.view(comp.name, pos)[item] != POISON).any():
                        reason += f"; BYTES WRITTEN into {comp.name} entry {pos} at {where}"
                        break
            _give_back(pools, st["items"])
        rv.release()
        return (int(state), reason, {"pages": ps.value, "aborted": st["aborted"]})
    return None


def _give_back(pools, items) -> None:
    for comp, pos, item, _, _ in items:
        pools.view(comp.name, pos)[item] = CANARY
