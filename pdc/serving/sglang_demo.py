"""`pdc sglang-demo`: real SGLang prefill and decode servers with pdc's transfer backend.

Starts a plain SGLang server for the reference (greedy tokens of every prompt, then stopped),
then a prefill and a decode server with `--disaggregation-transfer-backend pdc` behind SGLang's
router, sends N prompts of mixed lengths (several chunked-prefill chunks, 16-token pages,
`--in-flight` at once), checks every generated token against the reference and prints
prompts ok/failed, MB moved, transfer ms and TTFT p50/p99. `--compare` runs the same prompts
through a pdc pair behind pdc's router (the first token from prefill: Note [SGLang first
token from prefill]), SGLang's own `mooncake` backend on the same settings and one plain server
alone, and prints each PD backend's TTFT overhead over that server. `--pdc-knobs` adds pdc rows
with other runtime knobs (Note [Knob rows]).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..console import Counter, print_table, wrap
from . import sglang_harness as H
from . import sglang_variants as V
from .host_load import busy_text, load_average
from .knob_rows import folder_name, knob_label


@dataclass
class Row:
    backend: str
    engine: str
    ok: int
    failed: int
    mismatched: int
    mb: float
    transfers: int
    transfer_ms_mean: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    wall_s: float
    errors: list
    rep: int = 0
    logs: str = ""


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _progress(label: str, total: int) -> tuple[Counter, Callable]:
    """A progress counter of `total` prompts and the harness's on_done that ticks it."""
    counter = Counter(label, total)
    return counter, lambda result: counter.tick(failed=int(bool(result.error)))


def _waiting(text: str) -> None:
    print(f"pdc sglang-demo: {text}", file=sys.stderr, flush=True)


ONE_ENGINE = "one engine"

def run_alone(python: str, model: str, workdir: str, prompts: list[list[int]],
              reference: list[list[int]], new_tokens: int, in_flight: int, rep: int,
              variant: V.Variant, env: dict, warmup: list[list[int]] = ()) -> Row:
    """The prompts through one plain server (no router): the TTFT a PD backend adds to."""
    logs = os.path.join(workdir, f"rep{rep}-one-engine")
    os.makedirs(logs, exist_ok=True)
    _waiting("starting one plain server alone ...")
    plain = H.start_plain(python, model, logs, extra_args=variant.plain_args, tp=variant.tp,
                          progress=_waiting, extra_env=env)
    try:
        H.run_prompts(plain.url, list(warmup), new_tokens, 1)  # Note [Warm servers]
        progress, on_done = _progress(ONE_ENGINE, len(prompts))
        t0 = time.monotonic()
        try:
            results = H.run_prompts(plain.url, prompts, new_tokens, in_flight, on_done=on_done)
        finally:
            progress.close()
        wall = time.monotonic() - t0
    finally:
        plain.stop()
    return _row(ONE_ENGINE, "-", results, reference, wall, rep, logs, "the first plain server")


FIRST_TOKEN = "pdc, first token from prefill"
# SGLang's own option: prefill runs a request's forward before decode has asked for it. The
# first-token row runs with it (its client waits for prefill's forward only, and decode's
# request then arrives during that forward), and SGLang's mooncake backend runs with it too.
OPTIMISTIC = ("--optimistic-prefill-attempts", "1")
MOONCAKE_OPTIMISTIC = "mooncake, optimistic prefill"

# Note [Warm servers]: every server setup of a run (each PD pair with its router, the plain
# server alone) first answers `--warmup` requests of other prompts, outside the figures. A
# fresh setup's first request pays one-time costs that differ by backend and say nothing of
# its steady state: SGLang's router opens its connections (its first request took ~300 ms on
# the 2-core box), a decode server of the pdc backend opens its endpoint for the prefill
# server, and the first forward of a new shape is slow. With 8 prompts per run that one
# request was the p99 of most rows (BENCHMARKS.md (n)). `--warmup 0` measures them cold.
# A server counts as started only once SGLang's own warm-up has ended (WARMED in
# sglang_harness): before, the server alone's third request met SGLang's gc freeze (~0.7 s)
# in every repetition, and every PD row's p99 overhead came out below zero.


def run_pair(python: str, model: str, workdir: str, backend: str, engine: str,
             prompts: list[list[int]], reference: list[list[int]], new_tokens: int,
             in_flight: int, rep: int = 0, server_args: tuple[str, ...] = (), tp: int = 1,
             env: dict | None = None, label: str = "", warmup: list[list[int]] = ()) -> Row:
    """`tp` ranks per server (`--dp` runs one per attention-DP group), `env` for both;
    `label` names the row (default: the backend); the FIRST_TOKEN rows (its knob rows too)
    send the prompts through pdc's router instead of SGLang's (Note [SGLang first token from
    prefill])."""
    label = label or backend
    print(f"pdc sglang-demo: starting prefill + decode ({label}/{engine}) and the router ...",
          file=sys.stderr)
    logs = os.path.join(workdir, f"rep{rep}-{folder_name(label)}-{engine}")
    os.makedirs(logs, exist_ok=True)
    t_start = time.monotonic()
    pair = H.PDPair.start(python, model, logs, backend=backend, engine=engine,
                          server_args=server_args, progress=_waiting, prefill_tp=tp,
                          decode_tp=tp, prefill_env=env, decode_env=env)
    _waiting(f"{label}/{engine}: the pair and the router answered after "
             f"{time.monotonic() - t_start:.0f} s")
    # a process of its own, as SGLang's router is: not the client's interpreter lock
    router = pair.first_token_router(process=True) if label.startswith(FIRST_TOKEN) else None
    try:
        H.run_prompts((router or pair.router).url, list(warmup), new_tokens, 1)
        before = H.metrics(pair.prefill.url)
        t0 = time.monotonic()
        progress, on_done = _progress(f"{label}/{engine}", len(prompts))
        try:
            results = H.run_prompts((router or pair.router).url, prompts, new_tokens,
                                    in_flight, on_done=on_done)
        finally:
            progress.close()
        wall = time.monotonic() - t0
        time.sleep(0.5)  # the prefill scheduler observes its last transfer after replying
        after = H.metrics(pair.prefill.url)
        if router is not None:
            _waiting(f"{label}/{engine}: first tokens {router.stats}")
    finally:
        if router is not None:
            router.stop()
        pair.stop()

    def delta(name: str) -> float:
        return H.metric_sum(after, name) - H.metric_sum(before, name)

    count = delta("sglang:kv_transfer_latency_ms_count")
    return _row(label, engine, results, reference, wall, rep, logs, "the plain server",
                delta("sglang:kv_transfer_total_mb_sum"), int(count),
                delta("sglang:kv_transfer_latency_ms_sum") / count if count else 0.0)


def _row(label: str, engine: str, results, reference: list[list[int]], wall: float, rep: int,
         logs: str, reference_name: str, mb: float = 0.0, transfers: int = 0,
         transfer_ms: float = 0.0) -> Row:
    """One run's row: prompts ok (token-identical), failed, TTFT p50 / p99, errors."""
    ok = [r for r in results if not r.error]
    mismatched = [r.prompt for r in ok if r.tokens != reference[r.prompt]]
    ttfts = [r.ttft_s * 1e3 for r in ok]
    return Row(label, engine, len(ok) - len(mismatched),
               len(results) - len(ok) + len(mismatched), len(mismatched), mb, transfers,
               transfer_ms, _percentile(ttfts, 0.5), _percentile(ttfts, 0.99), wall,
               [f"prompt {r.prompt}: {r.error}" for r in results if r.error] +
               [f"prompt {i}: tokens differ from {reference_name}" for i in mismatched],
               rep, logs)


def dp_groups(logs: str, dp: int) -> str:
    """Which attention-DP groups pdc's managers registered under, per server (their logs)."""
    out = []
    for side in ("prefill", "decode"):
        text = ""
        for name in sorted(os.listdir(logs)):
            if name.endswith(f"-{side}.log"):
                with open(os.path.join(logs, name), errors="replace") as f:
                    text += f.read()
        seen = [g for g in range(dp) if f"attention-DP group {g} of {dp}" in text]
        out.append(f"{side} groups {', '.join(map(str, seen)) or 'none'} of {dp}")
    return "pdc's managers registered on " + " and ".join(out)


def print_rows(rows: list[Row], n: int, in_flight: int, out=None, load: str = "") -> None:
    """One row per backend run (Note [Console output] in pdc/console.py)."""
    out = out if out is not None else sys.stdout
    reps = len({r.rep for r in rows}) > 1
    head = ("backend", "engine", *(("rep",) if reps else ()), "ok", "failed", "MB moved",
            "transfers", "transfer ms", "TTFT p50 ms", "TTFT p99 ms", "wall s")
    lines = [(r.backend, r.engine, *((str(r.rep + 1),) if reps else ()), str(r.ok),
              str(r.failed), f"{r.mb:.3f}", str(r.transfers), f"{r.transfer_ms_mean:.2f}",
              f"{r.ttft_p50_ms:.0f}", f"{r.ttft_p99_ms:.0f}", f"{r.wall_s:.1f}") for r in rows]
    print_table(head, lines, out, right=range(2, len(head)), title=wrap(
        f"pdc sglang-demo: {n} prompts, {in_flight} in flight, tokens checked against a "
        "plain SGLang server (transfer ms: mean per request, from SGLang's "
        f"sglang:kv_transfer_latency_ms){load}"))
    if reps or any(r.backend == ONE_ENGINE for r in rows):
        med = {}
        for r in rows:
            med.setdefault((r.backend, r.engine), []).append(r)
        p50 = {k: statistics.median(r.ttft_p50_ms for r in rs) for k, rs in med.items()}
        p99 = {k: statistics.median(r.ttft_p99_ms for r in rs) for k, rs in med.items()}
        one = (ONE_ENGINE, "-")
        print_table(("backend", "engine", "runs", "TTFT p50 ms", "TTFT p99 ms",
                     "over one engine p50 / p99 ms"),
                    [(b, e, str(len(rs)), f"{p50[b, e]:.0f}", f"{p99[b, e]:.0f}",
                      f"{p50[b, e] - p50[one]:+.0f} / {p99[b, e] - p99[one]:+.0f}"
                      if one in med and b != ONE_ENGINE else "-")
                     for (b, e), rs in med.items()], out, right=range(2, 6),
                    title=f"median over {len({r.rep for r in rows})} repetition(s)")
    for r in rows:
        for e in r.errors[:10]:
            print(wrap(f"  FAILED {r.backend}/{r.engine} {e}", indent="    "), file=out)


def backend_rows(engine: str, compare: bool, knob_rows: tuple[dict, ...] = ()) -> list[tuple]:
    """(label, backend, engine, extra environment, extra server arguments) of every row of a
    run; backend None: the plain server alone. With `compare`, each knob row comes in both of
    pdc's flows (through SGLang's router and with the first token from prefill)."""
    rows = [("pdc", "pdc", engine, {}, ())] + [
        (knob_label(k), "pdc", engine, k, ()) for k in knob_rows]
    if compare:
        rows += [(FIRST_TOKEN, "pdc", engine, {}, OPTIMISTIC)] + [
            (FIRST_TOKEN + knob_label(k)[3:], "pdc", engine, k, OPTIMISTIC)
            for k in knob_rows] + [
            ("mooncake", "mooncake", "mooncake", {}, ()),
            (MOONCAKE_OPTIMISTIC, "mooncake", "mooncake", {}, OPTIMISTIC),
            (ONE_ENGINE, None, "-", {}, ())]
    return rows


def run_demo(prompts: int, engine: str, compare: bool, in_flight: int, new_tokens: int,
             seed: int, keep: bool, family: str = "llama", repeat: int = 1,
             timeline: bool = False, variant: V.Variant | None = None,
             knob_rows: tuple[dict, ...] = (), warmup: int = 1,
             shared_cores: bool = False) -> int:
    """`repeat` runs every backend that many times, each repetition in another order;
    `timeline` has pdc log its transfers and prints their phases (pdc/serving/timeline.py);
    `variant` the servers' DP attention and speculation (Note [Demo variants]); `knob_rows`
    one more pdc row per environment of knobs (Note [Knob rows]); `shared_cores` leaves
    every server unbound instead of a core per role (Note [Server cores])."""
    variant = variant if variant is not None else V.plan_variant(family)
    assert isinstance(variant, V.Variant), variant
    env = dict(variant.env)
    if shared_cores:
        env["OMP_PROC_BIND"] = "false"
    if timeline:
        os.environ["PDC_TRANSFER_LOG"] = "1"  # the servers inherit it
    python = H.sglang_python()
    if python is None:
        print("pdc sglang-demo: error: no SGLang environment; run scripts/install-sglang.sh "
              "(or set PDC_SGLANG_PYTHON)", file=sys.stderr)
        return 1
    workdir = tempfile.mkdtemp(prefix="pdc-sglang-demo-")
    try:
        model, variant = V.make_models(python, workdir, variant)
        batch = H.mixed_prompts(prompts, seed)
        print(wrap(f"pdc sglang-demo: {prompts} prompts to a tiny {family} "
                   f"({H.served_dtype(family)}) of "
                   f"{min(map(len, batch))}..{max(map(len, batch))} tokens "
                   f"({H.CHUNK_TOKENS}-token chunks, {H.PAGE_SIZE}-token pages), "
                   f"{new_tokens} greedy tokens each; "
                   + ("servers on shared cores; " if shared_cores else
                      "TP-1 servers on a core per role; ")
                   + (f"{variant.label()}; " if variant.label() else "")
                   + (f"logs in {workdir}" if keep else "servers' logs kept only on a failure "
                      "or with --keep-logs")), file=sys.stderr)
        print("pdc sglang-demo: starting a plain server for the reference tokens ...",
              file=sys.stderr)
        t_start = time.monotonic()
        plain = H.start_plain(python, model, workdir, extra_args=variant.plain_args,
                              tp=variant.tp, progress=_waiting, extra_env=env)
        _waiting(f"plain: answered after {time.monotonic() - t_start:.0f} s")
        try:
            progress, on_done = _progress("plain", len(batch))
            try:
                ref = H.run_prompts(plain.url, batch, new_tokens, in_flight, on_done=on_done)
            finally:
                progress.close()
        finally:
            plain.stop()
        bad = [r for r in ref if r.error]
        if bad:
            print(f"pdc sglang-demo: error: the plain server failed prompt {bad[0].prompt}: "
                  f"{bad[0].error}", file=sys.stderr)
            return 1
        reference = [r.tokens for r in ref]
        warm = H.mixed_prompts(warmup, seed + 1)  # Note [Warm servers]
        backends = backend_rows(engine, compare, knob_rows)
        load = load_average()
        rows = []
        for rep in range(repeat):
            k = rep % len(backends)
            for label, backend, eng, extra, args in backends[k:] + backends[:k]:  # interleaved
                if backend is None:
                    rows.append(run_alone(python, model, workdir, batch, reference,
                                          new_tokens, in_flight, rep, variant, env, warm))
                    continue
                rows.append(run_pair(python, model, workdir, backend, eng, batch, reference,
                                     new_tokens, in_flight, rep, variant.pd_args + args,
                                     variant.tp, {**env, **extra}, label, warm))
        after = load_average()
        if variant.dp > 1:
            for r in rows:
                if r.backend.startswith("pdc"):
                    _waiting(f"{r.backend}/{r.engine}: {dp_groups(r.logs, variant.dp)}")
        print_rows(rows, prompts, in_flight,
                   load=f"; load average {load} before, {after} after{busy_text()}")
        if timeline:
            from .timeline import print_summary, read_runs, summarize

            for label in dict.fromkeys(r.backend for r in rows if r.backend.startswith("pdc")):
                phases = summarize(read_runs([r.logs for r in rows if r.backend == label]))
                if phases:
                    print_summary(phases, sys.stdout, f"{label} timeline ({engine}; the first "
                                  "token is the client's TTFT above: SGLang's router picks "
                                  "the rooms)")
        failed = [r for r in rows if r.failed]
        keep = keep or bool(failed)
        return 0 if not failed else 1
    except H.HarnessError as e:
        print(f"pdc sglang-demo: error: {e}", file=sys.stderr)
        keep = True
        return 1
    finally:
        if keep:
            print(f"pdc sglang-demo: logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
