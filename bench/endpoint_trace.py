"""Where one request's time goes between the two processes of `bench/endpoints_processes.py`.

Runs that bench with the endpoints' main steps wrapped in stamps (time.monotonic, one clock for
both processes): decode's init() and message handler, prefill's message handler, coverage
check, component pairs, descriptor build, gather, submit and Success reply, decode's scatter,
and the engine's submit_write. With `TRACE_FINE=1` the cuda_ipc submit's own steps too (the
peer's liveness, the grid checks, the rows' translation, the queueing, the launch, the written
event); `TRACE_EXTRA=module:Owner.name,...` stamps more functions or methods by name. Each
stamp keeps the thread's CPU time beside the wall time, so a step that waits (for
the GIL, in a system call) shows as wall time above its CPU time. Each process writes its
stamps to `TRACE_OUT.<pid>.json` at exit (with `TRACE_PROFILE=1` also
`TRACE_OUT.<pid>.prof.txt`: cProfile inside each thread's outermost wrapped step, the wall
times then inflated by the profiler); `--show TRACE_OUT` prints, per case, the median
start, end, duration and CPU time of every step relative to decode's init(). The wrappers cost
about a microsecond per call, so the bench's own table stays comparable. Timings only; nothing
is asserted.

    TRACE_OUT=/tmp/tr/t TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine \\
        BENCH_WRAP="python3 $PWD/bench/endpoint_trace.py" bash bench/run_gpu_engines.sh OUT
    python bench/endpoint_trace.py --show /tmp/tr/t --reps 5 --cases staged-8K,direct-8K
"""

from __future__ import annotations

import atexit
import collections
import cProfile
import functools
import glob
import importlib
import json
import os
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

STAMPS: list[tuple[str, float, float, float]] = []  # label, start, end, thread CPU s
# TRACE_PROFILE=1: cProfile inside the outermost wrapped step of each thread, one profiler
# per thread (a profiler follows only the thread that enabled it), merged at exit
PROFILE = bool(os.environ.get("TRACE_PROFILE"))
_LOCAL = threading.local()
_PROFILERS: list = []


def _wrap(owner, name: str, label: str) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def stamped(*a, **k):
        prof = _outermost() if PROFILE else None
        t, c = time.monotonic(), time.thread_time()
        try:
            return f(*a, **k)
        finally:
            STAMPS.append((label, t, time.monotonic(), time.thread_time() - c))
            if prof is not None:
                prof.disable()
                _LOCAL.depth = 0

    setattr(owner, name, stamped)


def _outermost():
    """This thread's profiler, enabled, when no wrapped step of the thread runs already."""
    if getattr(_LOCAL, "depth", 0):
        return None
    prof = getattr(_LOCAL, "prof", None)
    if prof is None:
        prof = _LOCAL.prof = cProfile.Profile()
        _PROFILERS.append(prof)
    _LOCAL.depth = 1
    prof.enable()
    return prof


def install() -> None:
    from pdc.runtime import staging
    from pdc.runtime.endpoints import decode as dc
    from pdc.runtime.endpoints import prefill_control as pc
    from pdc.runtime.endpoints import prefill_worker as pw
    from pdc.runtime.endpoints import staged as sg

    _wrap(pw.DescriptorTemplate, "build", "prefill.build")
    if hasattr(pw.DescriptorTemplate, "grids"):  # Note [Descriptor grids]
        _wrap(pw.DescriptorTemplate, "grids", "prefill.grids")
    _wrap(pw, "check_page_coverage", "prefill.coverage")
    _wrap(pw, "component_pairs", "prefill.pairs")
    for owner, names in [(pw.PrefillWorker, ["_submit", "_finish_success"]),
                         (pc.PrefillControl, ["_on_decoded", "_reply"]),
                         (dc.DecodeEndpoint, ["_on_message", "_complete"]),
                         (dc.DecodeReceiver, ["init"]),
                         (staging.Launches, ["gather_chunk", "scatter_link"])]:
        for n in names:
            _wrap(owner, n, f"{owner.__name__}.{n}")
    _wrap(sg.PrefillStaging, "_gather", "prefill.gather")
    _wrap(sg.DecodeStaging, "_unstage", "decode.unstage")
    graphs: list = []  # every LaunchGraphs of the process (Note [Staging graphs]), if any
    try:
        from pdc.runtime import staging_graphs as gr

        _wrap(gr.LaunchGraphs, "run", "LaunchGraphs.run")
        init = gr.LaunchGraphs.__init__

        def kept(self, *a, **k):
            init(self, *a, **k)
            graphs.append(self)

        gr.LaunchGraphs.__init__ = kept
    except ImportError:  # a tree from before the graphs
        pass
    # TRACE_EXTRA="module:Owner.name,module:name,...": more steps, each stamped as its name
    for spec in filter(None, os.environ.get("TRACE_EXTRA", "").split(",")):
        mod, _, path = spec.partition(":")
        owner = importlib.import_module(mod)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        _wrap(owner, name, path)
    eng = os.environ.get("TRACE_ENGINE_CLS")
    if eng:
        mod, cls = eng.rsplit(".", 1)
        owner = getattr(importlib.import_module(mod), cls)
        _wrap(owner, "submit_write", "engine.submit_write")
        if "submit_grids" in vars(owner):
            _wrap(owner, "submit_grids", "engine.submit_grids")
        if os.environ.get("TRACE_FINE") and eng.endswith("CudaIpcEngine"):
            from pdc.runtime import descriptor_copy
            from pdc.runtime.engines import cuda_ipc

            for n in ("_alive", "_mapped_grid", "_queue", "written_event", "_watch"):
                _wrap(owner, n, f"cuda_ipc.{n}")
            _wrap(cuda_ipc, "check_grids", "cuda_ipc.check_grids")
            _wrap(descriptor_copy, "launch_grids", "descriptor_copy.launch_grids")
            _wrap(descriptor_copy, "_launch_cuda", "descriptor_copy._launch_cuda")

    def dump() -> None:
        out = os.environ.get("TRACE_OUT", "trace/t")
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out}.{os.getpid()}.json").write_text(json.dumps(STAMPS))
        if graphs:
            Path(f"{out}.{os.getpid()}.graphs").write_text(json.dumps([g.stats for g in graphs]))
        if _PROFILERS:
            with open(f"{out}.{os.getpid()}.prof.txt", "w") as fh:
                stats = pstats.Stats(_PROFILERS[0], stream=fh)
                for prof in _PROFILERS[1:]:
                    stats.add(prof)
                stats.sort_stats(os.environ.get("TRACE_PROFILE_SORT", "tottime")).print_stats(int(os.environ.get("TRACE_PROFILE_LINES", "40")))

    atexit.register(dump)


def show(prefix: str, reps: int, cases: list[str]) -> None:
    """Medians per case; requests are split at decode's init(), `reps + 1` per case (the
    first, the warm-up, left out)."""
    stamps = sorted((s for f in glob.glob(prefix + ".*.json") for s in json.loads(
        Path(f).read_text())), key=lambda s: s[1])
    for f in sorted(glob.glob(prefix + ".*.graphs")):
        print(f"staging graphs of process {f.split('.')[-2]}: {Path(f).read_text()}")
    requests: list[list] = []
    for s in stamps:
        if s[0] == "DecodeReceiver.init":
            requests.append([])
        if requests:
            requests[-1].append(s)
    for i, case in enumerate(cases):
        steps = collections.defaultdict(list)
        for req in requests[i * (reps + 1) + 1:(i + 1) * (reps + 1)]:
            t0, seen = req[0][1], collections.Counter()
            for label, a, b, *cpu in req:
                seen[label] += 1
                steps[(label, seen[label])].append(((a - t0) * 1e3, (b - a) * 1e3,
                                                    cpu[0] * 1e3 if cpu else float("nan")))
        print(f"== {case}: ms from decode's init()")
        for (label, k), v in sorted(steps.items(),
                                    key=lambda x: statistics.median(y[0] for y in x[1])):
            if len(v) * 2 < reps:
                continue  # a heartbeat or registration, not a step of every request
            start = statistics.median(y[0] for y in v)
            end = statistics.median(y[0] + y[1] for y in v)
            print(f"  {label:32s}#{k}  start {start:8.3f}  end {end:8.3f}  "
                  f"took {statistics.median(y[1] for y in v):7.3f}  "
                  f"cpu {statistics.median(y[2] for y in v):7.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--show":
        import argparse

        ap = argparse.ArgumentParser()
        ap.add_argument("--show", required=True)
        ap.add_argument("--reps", type=int, default=5)
        ap.add_argument("--cases", default="staged-8K,direct-8K,staged-1K,direct-1K")
        a = ap.parse_args()
        show(a.show, a.reps, a.cases.split(","))
        sys.exit(0)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    install()
    import endpoints_processes

    if len(sys.argv) > 2 and sys.argv[1].endswith("python3"):  # BENCH_WRAP prefixes it
        sys.argv = sys.argv[2:]
    sys.exit(endpoints_processes.main())
elif __name__ == "__mp_main__":
    install()  # the spawned prefill process runs this file again under that name
