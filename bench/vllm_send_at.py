"""TTFT through real vLLM engines with prefill's sends queued at the first `save_kv_layer`
against sends queued after the forward (at `start_load_kv`), in one run on the same engines.

Note [Sends at the first layer] (integrations/vllm/worker.py) queues a step's sends at its
first `save_kv_layer`; a request whose proxy passes `pdc_send_at: "after_forward"` in its
kv_transfer_params is queued after the forward instead, as PdcConnector did before. The bench
makes pairs of prompts of one length (different tokens), gives one of each pair each mode,
alternating which goes first, and sends them one at a time through one prefill and one decode
engine (the tiny random-weight Llama of `pdc vllm-demo`), so both modes meet the same engines,
the same load and the same lengths. Every prompt must be token-identical to one engine alone
(the demo's reference); the TTFT is the client's (prefill, hand-over, decode's first token).

    python bench/vllm_send_at.py --pairs 16 --engine mooncake [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pdc.serving.vllm_env import HINT, vllm_python
from pdc.serving.vllm_proxy import Engine, Flow, engine_env, run_pd, run_single

MODES = ("first_layer", "after_forward")


@dataclass(frozen=True)
class SendAtFlow(Flow):
    """PdcConnector's flow, each prompt's sends queued as `modes[i]` says."""

    modes: tuple[str, ...] = ()

    def to_prefill(self, i: int) -> dict:
        return {"do_remote_decode": True, "pdc_send_at": self.modes[i]}


def paired_prompts(pairs: int, seed: int) -> tuple[list[list[int]], list[str]]:
    """Two prompts of each drawn length, one per mode, the first mode alternating by pair."""
    rng = random.Random(seed)
    prompts, modes = [], []
    for k in range(pairs):
        length = rng.choice([17, 32, 45, 64, 100, 150, 200, 300])
        order = MODES if k % 2 == 0 else MODES[::-1]
        for mode in order:
            prompts.append([rng.randrange(3, 1000) for _ in range(length)])
            modes.append(mode)
    return prompts, modes


def _pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(q * (len(ys) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--engine", choices=("mooncake", "nixl"), default="mooncake")
    ap.add_argument("--family", default="vllm-llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    python = vllm_python()
    if python is None:
        print(f"no vLLM environment: {HINT}", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="pdc-bench-send-at-"))
    load_before = os.getloadavg()
    t0 = time.monotonic()
    try:
        model = str(work / "model")
        subprocess.run([python, "-m", "pdc.serving.vllm_engine", "--make-model", model,
                        args.family], check=True, capture_output=True, env=engine_env(0))
        prompts, modes = paired_prompts(args.pairs, args.seed)
        ref_engine = Engine(python, work, "single", model, args.family, args.engine, core=1)
        try:
            ref_engine.wait_up()
            ref = run_single(ref_engine, prompts, args.tokens)
        finally:
            ref_engine.stop()
        pre = Engine(python, work, "prefill", model, args.family, args.engine, core=0)
        dec = Engine(python, work, "decode", model, args.family, args.engine, core=1)
        try:
            pre.wait_up()
            dec.wait_up()
            tokens, transfers, ttft, errors, _ = run_pd(
                pre, dec, prompts, args.tokens, concurrency=1,
                flow=SendAtFlow(modes=tuple(modes)))
        finally:
            pre.stop()
            dec.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    ok = [not e and t == r and bool(x and x.get("ok"))
          for e, t, r, x in zip(errors, tokens, ref, transfers, strict=True)]
    rows = []
    for mode in MODES:
        ms = [ttft[i] * 1e3 for i in range(len(prompts)) if modes[i] == mode]
        rows.append({"mode": mode, "prompts": len(ms),
                     "identical": sum(ok[i] for i in range(len(prompts)) if modes[i] == mode),
                     "ttft_p50_ms": round(_pct(ms, 0.5), 1),
                     "ttft_p99_ms": round(_pct(ms, 0.99), 1),
                     "ttft_mean_ms": round(statistics.mean(ms), 1)})
    # each pair's difference (after_forward - first_layer), same length, adjacent in time
    diffs = [(ttft[2 * k + (modes[2 * k] == "first_layer")] -
              ttft[2 * k + (modes[2 * k] != "first_layer")]) * 1e3 for k in range(args.pairs)]
    load = (f"load average {', '.join(f'{x:.2f}' for x in load_before)} before, "
            f"{', '.join(f'{x:.2f}' for x in load_after)} after")
    print(f"vllm_send_at: {args.pairs} pairs, {args.tokens} tokens, engine {args.engine}, "
          f"{time.monotonic() - t0:.0f} s; {load}")
    print(f"{'mode':<14} {'prompts':>7} {'identical':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'mean ms':>8}")
    for r in rows:
        print(f"{r['mode']:<14} {r['prompts']:>7} {r['identical']:>9} {r['ttft_p50_ms']:>8} "
              f"{r['ttft_p99_ms']:>8} {r['ttft_mean_ms']:>8}")
    print(f"per pair, after_forward - first_layer: median {statistics.median(diffs):.1f} ms, "
          f"{sum(d > 0 for d in diffs)} of {len(diffs)} pairs slower after the forward")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "bench": "vllm_send_at", "args": vars(args), "rows": rows,
            "pair_diffs_ms": [round(d, 1) for d in diffs], "load_before": load_before,
            "load_after": load_after, "ttft_ms": [round(t * 1e3, 1) for t in ttft],
            "modes": modes, "all_checks_passed": all(ok)}, indent=1))
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
