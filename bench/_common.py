"""Shared helpers of the bench/ scripts: arguments, machine facts, plans, timing, tables, JSON.

Every script prints a table and, with `--json PATH`, writes

    {"bench": name, "meta": {...}, "args": {...}, "rows": [...], "checks": {name: bool},
     "all_checks_passed": bool, "goals": {...}, "notes": [...]}

`checks` are the correctness checks the script ran (every byte it moved compared with a torch
reference); a script exits 1 when one fails. Timings never assert anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SPEC = ROOT / "specs" / "llama3-70b.yaml"


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--small", action="store_true",
                    help="tiny sizes on CPU (Triton interpreter); checks correctness, not speed")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    return ap


def machine() -> dict:
    import numpy as np

    meta = {
        "date": datetime.date.today().isoformat(),
        "host": platform.node(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    try:
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available():
            meta["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.device_count() > 1:
                meta["peer_access_0_1"] = bool(torch.cuda.can_device_access_peer(0, 1))
    except ImportError:
        pass
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    meta["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "")
    return meta


def finish(name: str, args: argparse.Namespace, rows: list[dict], checks: dict[str, bool],
           goals: dict | None = None, notes: list[str] | None = None,
           extra: dict | None = None) -> int:
    """Writes the JSON (if asked), prints the checks, returns the exit status."""
    ok = all(checks.values()) if checks else False
    out = {"bench": name, "meta": machine(), "args": vars(args), "rows": rows,
           "checks": checks, "all_checks_passed": ok, "goals": goals or {},
           "notes": notes or []}
    if extra:
        out.update(extra)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    bad = [k for k, v in checks.items() if not v]
    print(f"\nchecks: {len(checks) - len(bad)}/{len(checks)} passed" +
          (f"; FAILED: {', '.join(bad)}" if bad else ""))
    for line in notes or []:
        print(f"note: {line}")
    return 0 if ok else 1


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    """Prints rows; cols are (key, header, format) with format '' for str()."""
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        line = []
        for key, _, fmt in cols:
            v = r.get(key)
            line.append("" if v is None else (format(v, fmt) if fmt else str(v)))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    for n, c in enumerate(cells):
        print("  ".join(x.ljust(w) if i == 0 else x.rjust(w)
                        for i, (x, w) in enumerate(zip(c, widths, strict=True))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


# ~~~ plans ~~~


def llama_plan(prefill_tp: int, decode_tp: int, page_size: int = 16, backend: str = "local"):
    """(layout, plan) of Llama-3-70B for prefill TP -> decode TP over `backend` (an endpoint
    refuses a plan lowered for another engine, Note [Plan backend]).

    At the spec's own page size 16 the family comes from its generated module, as a serving
    process gets it (no compiler needed on a bare GPU image); another page size changes item
    shapes, so the spec is evaluated with it by the compiler's front end.
    """
    from pdc.runtime.family import Family

    if page_size == 16:
        family = Family.load("llama3_70b")
    else:
        from pdc.compiler.family import family_of
        from pdc.compiler.frontend import load_spec

        family = family_of(load_spec(str(LLAMA_SPEC), {"page_size": page_size}))
    side = f"page_size={page_size},tp="
    plan = family.plan_for(f"{side}{prefill_tp}", f"{side}{decode_tp}", backend)
    return family.layout, plan


def buffers(plan, side: str, rank, component: str, base: int, capacity: int):
    """The data path's buffer table of one rank whose `component` entries are laid out back to
    back from `base`, `capacity` items each: ([LocalBuffer], [RemoteBuffer], total bytes)."""
    from pdc.runtime.datapath import LocalBuffer, RemoteBuffer

    reg = plan.registration(side, rank)
    item = reg.item_bytes(component)
    local, remote = [], []
    for i, (_tensor, layer_id) in enumerate(reg.entries(component)):
        addr = base + i * capacity * item
        local.append(LocalBuffer(addr, item, capacity))
        remote.append(RemoteBuffer(layer_id, 0, addr, item, capacity))
    return local, remote, len(local) * capacity * item


# ~~~ pools on devices ~~~

POISON = 0xA5


class RankPool:
    """One rank's pool arena on one device, registered with its own engine."""

    def __init__(self, plan, side: str, rank, device, capacity: int, seed: int):
        import torch
        from page_engine import PageEngine

        self.engine = PageEngine(device)
        self.device = self.engine.device
        base_probe = plan.registration(side, rank)
        self.item = base_probe.item_bytes("kv")
        self.n_entries = len(base_probe.entries("kv"))
        self.capacity = capacity
        self.arena = torch.empty(self.n_entries * capacity * self.item, dtype=torch.uint8,
                                 device=self.device)
        if seed >= 0:
            g = torch.Generator(device=self.device).manual_seed(seed)
            self.arena.random_(0, 256, generator=g)
        base = self.engine.register_tensor(self.arena)
        self.local, self.remote, _ = buffers(plan, side, rank, "kv", base, capacity)

    def pages(self):
        """[entries, capacity, item] byte view."""
        return self.arena.view(self.n_entries, self.capacity, self.item)

    def close(self) -> None:
        self.engine.close()


def sync_all(devices):
    import torch

    def sync():
        for d in devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
    return sync



# ~~~ timing ~~~


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def wall(fn: Callable[[], object], sync: Callable[[], None], reps: int, warmup: int = 1
         ) -> list[float]:
    """Seconds per call, host clock, with `sync()` (all devices) before and after each call."""
    for _ in range(warmup):
        fn()
        sync()
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def cpu_time(fn: Callable[[], object], reps: int, warmup: int = 2, min_time: float = 0.0
             ) -> tuple[list[float], list[float]]:
    """(wall seconds, process CPU seconds) per call, for host-only work."""
    import gc

    for _ in range(warmup):
        fn()
    gc.collect()
    walls, cpus = [], []
    spent = 0.0
    while len(walls) < reps or spent < min_time:
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        c1 = time.process_time()
        walls.append(t1 - t0)
        cpus.append(c1 - c0)
        spent += t1 - t0
        if len(walls) >= 10 * max(1, reps) and spent >= min_time:
            break
    return walls, cpus


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def guarded(rows: list[dict], notes: list[str], checks: dict[str, bool], label: str,
            fn: Callable[[], dict | list | None]) -> None:
    """Runs one benchmark case; an exception becomes a row with its error and a failed check
    instead of ending the run (a GPU run is too dear to lose to one case)."""
    try:
        got = fn()
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        import traceback

        traceback.print_exc(file=sys.stderr)
        rows.append({"case": label, "error": f"{type(exc).__name__}: {exc}"})
        notes.append(f"{label}: {type(exc).__name__}: {exc}")
        checks[f"{label}: ran"] = False
        return
    if isinstance(got, list):
        rows.extend(got)
    elif got is not None:
        rows.append(got)
