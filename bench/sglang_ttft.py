"""TTFT per prompt through a real SGLang PD pair, cold (first requests to a new prefill server)
and warm: pdc's backend or SGLang's own mooncake backend on the same server settings, or one
plain server (`--backend plain`).

The first requests a decode server gets for a prefill server pay whatever the backend does to
link the two (pdc: the decode endpoint opens, registers with every prefill rank); the next
rounds show the steady state. One PD pair behind SGLang's router (pdc/serving/sglang_harness.py),
the tiny random-weight Llama, `--prompts` mixed-length prompts (1-300 tokens) `--in-flight`
at a time, `--rounds` times; per round the wall time and every prompt's TTFT in prompt order.

    python bench/sglang_ttft.py --backend pdc --engine mooncake
    python bench/sglang_ttft.py --backend mooncake
    python bench/sglang_ttft.py --backend plain --prompts 24 --in-flight 1 --warmup 1

`--warmup N` sends N other prompts first (the demo's Note [Warm servers]); a plain server on
the last core, as the demo's server alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from pdc.serving import sglang_harness as H


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("pdc", "mooncake", "plain"), default="pdc")
    ap.add_argument("--engine", choices=("mooncake", "nixl"), default="mooncake",
                    help="pdc's engine (SGLang's mooncake backend always uses Mooncake)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per prompt")
    ap.add_argument("--warmup", type=int, default=0, help="other prompts sent first")
    args = ap.parse_args()
    python = H.sglang_python()
    if python is None:
        print("no SGLang environment: run scripts/install-sglang.sh", file=sys.stderr)
        return 1
    workdir = tempfile.mkdtemp(prefix="pdc-bench-sglang-ttft-")
    model = H.make_tiny_model(python, f"{workdir}/tiny-llama")
    if args.backend == "plain":
        server = H.start_plain(python, model, workdir)
        url, stop = server.url, server.stop
    else:
        pair = H.PDPair.start(python, model, workdir, backend=args.backend, engine=args.engine)
        url, stop = pair.router.url, pair.stop
    failed = 0
    try:
        H.run_prompts(url, H.mixed_prompts(args.warmup, seed=1), args.tokens, in_flight=1)
        prompts = H.mixed_prompts(args.prompts, seed=0)
        for rnd in range(args.rounds):
            t0 = time.monotonic()
            results = H.run_prompts(url, prompts, args.tokens,
                                    in_flight=args.in_flight)
            wall_s = time.monotonic() - t0
            ttft_ms = [round(r.ttft_s * 1e3) for r in results]
            errors = [r.error for r in results if r.error]
            failed += len(errors)
            print(f"{args.backend}/{args.engine} round {rnd} ({'cold' if rnd == 0 else 'warm'}):"
                  f" wall {wall_s:.2f} s, TTFT median {statistics.median(ttft_ms)} ms, "
                  f"first {args.in_flight}: {ttft_ms[:args.in_flight]} ms, "
                  f"errors {len(errors)}")
            print(f"  TTFT ms in prompt order: {ttft_ms}")
    finally:
        stop()
    print(f"logs in {workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
