"""Rank processes on one host, shared by `pdc demo` and `pdc parity`.

The parent lowers the plan (it may import the compiler) and starts one process per rank
(`Processes`); a rank process imports only the runtime and the family's generated modules
(and, for parity, torch and transformers). Each process has its own command queue; all
report on one result queue. A rank that raises reports `("crash", name, traceback)` instead
of dying silently, and the parent's `get` turns that into `RankCrash`.

Also here: what every rank does the same way in both commands: the bootstrap server on the
prefill leader, pools and endpoints (`open_endpoint`), page / slot / window allocation of
requests (`allocate`), chunked prefill sends with absolute page positions (`chunk_plan`,
`send_chunk`), and the labels `pdc demo` and the reliability harness fill and check every
item with (`request_labels`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

ROLE_PREFILL, ROLE_DECODE = "prefill", "decode"


@dataclass
class Req:
    room: int
    tokens: int
    chunk_tokens: int
    prefix_tokens: int
    # per side: page ids (one per absolute page position), slot, ring slot, aux row, window ids
    ids: dict = field(default_factory=dict)
    # Injected fault, for tests: "bad_page" makes decode announce a page id beyond its pool.
    # The request must fail with a reason and leave every byte of its decode items untouched.
    fault: str = ""


# ~~~ inside a rank process ~~~


def rank_entry(target: Callable, name: str, log_path: str, cmd_q, res_q, *args) -> None:
    """Process entry: quiet native logs, run `target(cmd_q, res_q, *args)`, report a crash."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # Mooncake's glog writes to fd 2 and cannot be silenced otherwise: keep each rank's
    # native log in a file and show it only when the rank fails.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    try:
        target(cmd_q, res_q, *args)
    except Exception as e:  # noqa: BLE001 - report to the parent instead of dying silently
        import traceback

        res_q.put(("crash", name, f"{e!r}\n{traceback.format_exc()}"))


def bootstrap_server(plan):
    """The bootstrap service, run by prefill rank (dp 0, pp 0, tp 0)."""
    from pdc.runtime.control import BootstrapServer

    p = plan.topology.prefill
    return BootstrapServer(p.dp * p.pp * p.tp)


def open_endpoint(side: str, layout, wire_mod, plan, rank, dp: int, engine, pools,
                  bootstrap: str, metrics=None):
    """A PrefillEndpoint, or a DecodeEndpoint that every linked prefill rank accepted."""
    from pdc.runtime.endpoints import DecodeEndpoint, PrefillEndpoint

    if side == ROLE_PREFILL:
        return PrefillEndpoint(layout, wire_mod, plan, rank, dp, engine, pools, bootstrap,
                               metrics)
    ep = DecodeEndpoint(layout, wire_mod, plan, rank, dp, engine, pools, bootstrap, metrics)
    ep.wait_ready()
    return ep


def request_labels(layout, plan, side, rank, seed, req: Req, side_ids):
    """Yield (component, entry position, item id, position within the request, expected
    bytes) of every item of one request on a rank: the aggregate labels of runtime.labels,
    cut to the rank's TP share. Both `pdc demo` and the reliability harness fill and check
    pools with them."""
    from pdc.runtime.indices import window_first_page
    from pdc.runtime.labels import item_labels, project

    topo = plan.topology
    s = topo.prefill if side == ROLE_PREFILL else topo.decode
    reg = plan.registration(side, rank)
    page_size = s.page_size
    n_pages = -(-req.tokens // page_size)
    for comp in layout.components:
        positions: list[tuple[int, int]] = []  # (position within request, item id)
        if comp.index == "page":
            positions = [(p, int(side_ids["pages"][p])) for p in range(n_pages)]
        elif comp.index == "window":
            first = window_first_page(req.tokens, comp.window_tokens, page_size,
                                      comp.prefix_pages(req.prefix_tokens, page_size))
            positions = [(first + i, int(w)) for i, w in enumerate(side_ids["window"])]
        elif comp.index == "slot":
            positions = [(0, side_ids["slot"])]
        elif comp.index == "aux":
            positions = [(0, side_ids["aux"])]
        elif comp.index == "ring":
            r = comp.ring_rows
            positions = [(i, side_ids["ring"] * r + i) for i in range(r)]
        for pos, (tensor, layer_id) in enumerate(reg.entries(comp.name)):
            for where, item in positions:
                full = item_labels(seed, req.room, comp, tensor, layer_id, where)
                yield comp, pos, item, where, project(comp, full, s.tp, rank.tp)


@dataclass(frozen=True)
class Chunk:
    """One chunk of chunked prefill: whole pages first_page..end_page-1 (absolute positions,
    Note [Absolute page positions]), tokens start_token..end_token-1."""

    first_page: int
    end_page: int
    start_token: int
    end_token: int  # = the request's seq_len once this chunk is prefilled
    last: bool


def chunk_plan(tokens: int, chunk_tokens: int, page_size: int) -> list[Chunk]:
    """Chunks of `chunk_tokens` (a multiple of page_size) covering a `tokens` prompt."""
    n_pages = -(-tokens // page_size)
    per = chunk_tokens // page_size
    starts = list(range(0, n_pages, per)) or [0]
    return [Chunk(p0, min(p0 + per, n_pages), p0 * page_size,
                  min(tokens, (p0 + per) * page_size), i == len(starts) - 1)
            for i, p0 in enumerate(starts)]


def send_chunk(sender, ids: dict, c: Chunk, stream: bool = False) -> None:
    """Queue one chunk on a PrefillSender; slot, ring, aux and window ids go with the last."""
    sender.send(ids["pages"][c.first_page:c.end_page], c.first_page, c.last, c.end_token,
                slot=ids["slot"] if c.last else -1,
                ring_slot=ids["ring"] if c.last else -1,
                aux_row=ids["aux"] if c.last else -1,
                window_page_ids=ids["window"] if c.last else None, stream=stream)


# ~~~ the parent ~~~


def allocate(plan, layout, reqs: list[Req], rng, pages: int, slots: int) -> None:
    """Page, slot, ring, aux and window ids of each request on both sides (`req.ids`).

    Ids come from per-(side, dp group) pools of `pages` pages and `slots` slots: every fourth
    request (room % 4 == 0) gets consecutive pages from the bottom, the others a shuffled
    (fragmented) order of the rest.
    """
    from pdc.runtime.indices import window_first_page

    topo = plan.topology
    for side, s in ((ROLE_PREFILL, topo.prefill), (ROLE_DECODE, topo.decode)):
        groups: dict[int, list[Req]] = {}
        for r in reqs:
            groups.setdefault(r.room % s.dp, []).append(r)
        for _, rs in groups.items():
            sizes = [-(-r.tokens // s.page_size) for r in rs]
            contiguous = [r.room % 4 == 0 for r in rs]
            n_contig = sum(n for n, c in zip(sizes, contiguous, strict=True) if c)
            frag = rng.permutation(np.arange(n_contig, pages, dtype=np.int64))
            wins = rng.permutation(pages)
            slot_ids = rng.permutation(slots)
            c_next = f_next = w_next = 0
            for i, (r, n) in enumerate(zip(rs, sizes, strict=True)):
                if contiguous[i]:
                    page_ids = np.arange(c_next, c_next + n, dtype=np.int64)
                    c_next += n
                else:
                    page_ids = frag[f_next:f_next + n]
                    f_next += n
                nw = 0
                for c in layout.components:
                    if c.index == "window":
                        nw = n - window_first_page(r.tokens, c.window_tokens, s.page_size,
                                                   c.prefix_pages(r.prefix_tokens, s.page_size))
                r.ids[side] = {"pages": page_ids, "slot": int(slot_ids[i]),
                               "ring": int(slot_ids[i]), "aux": int(slot_ids[i]),
                               "window": wins[w_next:w_next + nw].astype(np.int64)}
                w_next += nw


class RankCrash(RuntimeError):
    """A rank process raised; the message holds its name and traceback."""


class Processes:
    """Spawned rank processes: one command queue each, one shared result queue, one native
    log file each under `log_dir` (kept when something fails, removed by `close`)."""

    def __init__(self, log_prefix: str = "pdc-ranks-"):
        self.ctx = mp.get_context("spawn")
        self.res_q = self.ctx.Queue()
        self.procs: list = []
        self.cmd_qs: list = []
        self.names: list[str] = []
        self.log_dir = tempfile.mkdtemp(prefix=log_prefix)

    def start(self, name: str, target: Callable, args: tuple = ()) -> int:
        """Start `target(cmd_q, res_q, *args)` in a new process; returns its index."""
        q = self.ctx.Queue()
        log = os.path.join(self.log_dir, f"{name}.log")
        p = self.ctx.Process(target=rank_entry, args=(target, name, log, q, self.res_q, *args),
                             daemon=True)
        p.start()
        self.procs.append(p)
        self.cmd_qs.append(q)
        self.names.append(name)
        return len(self.procs) - 1

    def __len__(self) -> int:
        return len(self.procs)

    def put(self, i: int, msg) -> None:
        self.cmd_qs[i].put(msg)

    def broadcast(self, msg) -> None:
        for q in self.cmd_qs:
            q.put(msg)

    def get(self, timeout: float = 60.0):
        """The next result; raises RankCrash when a rank crashed or exited (noticed within a
        second), queue.Empty on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.res_q.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                break
            except queue.Empty:
                dead = [n for n, p in zip(self.names, self.procs, strict=True)
                        if not p.is_alive()]
                if dead:
                    raise RankCrash(f"{', '.join(dead)} exited without a word") from None
                if time.monotonic() >= deadline:
                    raise
        if msg[0] == "crash":
            raise RankCrash(f"{msg[1]} crashed: {msg[2]}")
        return msg

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def join(self, timeout: float = 10.0) -> None:
        for p in self.procs:
            p.join(timeout=timeout)
            if p.is_alive():
                p.kill()

    def close(self, remove_logs: bool = True) -> None:
        self.join()
        if remove_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
