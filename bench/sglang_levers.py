"""TTFT through real SGLang PD servers with per-layer sends off, on (lever A), and on with the
cached-prefix early send (A+B), at 0, 50 and 90 % prefix hit on prefill.

Three PD pairs run side by side (pdc backend, Mooncake engine over TCP, `--sleep-on-idle`), one
per setting (knobs sglang_layer_send / sglang_cached_send; Note [SGLang per-layer sends]); one
request is in flight at a time, and the repetitions go round the settings and hit rates in turn,
so that a change of the machine's load hits every setting alike. A request of hit h is a fresh
random prompt of `--tokens` tokens whose first h * tokens tokens were sent just before (one
output token, not timed) to the same pair, so that prefill's radix cache holds them; the
timed request asks for one token, and TTFT is the time to its first streamed token at the
client, through SGLang's router. The model is a random-weight Llama whose shape (`--layers`,
`--hidden`, `--heads`, `--head-dim`, `--ffn`) sets the ratio of prefill compute to KV bytes;
BENCHMARKS.md says which was chosen and why. Each pair's prefill writes pdc's transfer log
(knob transfer_log), from which the JSON keeps per request the transfer's tail (its end
minus the last chunk's send after the forward: the part on TTFT's path) and the batches of
single layers sent during the forward.

    python bench/sglang_levers.py --reps 7 --json bench/results/<date>-cpu-sglang-levers/levers.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from pdc.serving import sglang_harness as H

SETTINGS = {"off": {}, "A": {"PDC_SGLANG_LAYER_SEND": "1"},
            "A+B": {"PDC_SGLANG_LAYER_SEND": "1", "PDC_SGLANG_CACHED_SEND": "1"}}
VOCAB = 512


def make_model(python: str, out_dir: str, a) -> str:
    cfg = dict(vocab_size=VOCAB, hidden_size=a.hidden, intermediate_size=a.ffn,
               num_hidden_layers=a.layers, num_attention_heads=a.heads,
               num_key_value_heads=a.heads, head_dim=a.head_dim,
               max_position_embeddings=max(4096, 2 * a.tokens))
    code = ("import sys, torch\nfrom transformers import LlamaConfig, LlamaForCausalLM\n"
            f"cfg = LlamaConfig(**{cfg!r}, torch_dtype='bfloat16', bos_token_id=1, "
            "eos_token_id=2)\ntorch.manual_seed(0)\n"
            "LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])\n")
    subprocess.run([python, "-c", code, out_dir], check=True, capture_output=True, timeout=600)
    return out_dir


def tail_ms(pair: H.PDPair, since: int) -> tuple[list[tuple[float, int]], int]:
    """Of the prefill transfer log's records past line `since`: the time from the last
    chunk's send (after the forward and the sampling) to the transfer's end, the part of the
    transfer on TTFT's path, and the batches of single layers sent during the forward."""
    with open(pair.prefill.log, errors="replace") as f:
        lines = f.readlines()
    recs = [json.loads(x[x.index('{"'):]) for x in lines[since:]
            if '"event": "kv_transfer"' in x]
    return [(round((r["t"]["done"] - r["t"]["forward_done"]) * 1e3, 1), r["layer_batches"])
            for r in recs], len(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--hits", default="0,50,90", help="prefix hit rates, percent")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--settings", default="off,A,A+B")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    python = H.sglang_python()
    if python is None:
        print("no SGLang environment: run scripts/install-sglang.sh", file=sys.stderr)
        return 1
    hits = [int(h) for h in a.hits.split(",")]
    settings = a.settings.split(",")
    workdir = tempfile.mkdtemp(prefix="pdc-bench-sglang-levers-")
    model = make_model(python, f"{workdir}/llama", a)
    args = ("--chunked-prefill-size", str(a.chunk), "--max-total-tokens",
            str(max(8192, 8 * a.tokens)), "--context-length", str(max(4096, 2 * a.tokens)),
            "--sleep-on-idle")
    pairs = {}
    rng = random.Random(0)
    ttft: dict[str, dict[int, list[float]]] = {s: {h: [] for h in hits} for s in settings}
    xfer: dict[str, dict[int, list[float]]] = {s: {h: [] for h in hits} for s in settings}
    early: dict[str, dict[int, list[int]]] = {s: {h: [] for h in hits} for s in settings}
    lines = dict.fromkeys(settings, 0)
    try:
        for s in settings:
            env = {"PDC_TRANSFER_LOG": "1", **SETTINGS[s]}
            os.makedirs(f"{workdir}/{s}")
            pairs[s] = H.PDPair.start(python, model, f"{workdir}/{s}", prefill_env=env,
                                      server_args=args)
        warm = [rng.randrange(3, VOCAB) for _ in range(a.tokens)]
        for s in settings:  # first requests pay the link setup: not timed
            r = H.generate(pairs[s].router.url, warm, 1, timeout_s=600)
            assert not r.error, r.error
            _, lines[s] = tail_ms(pairs[s], 0)
        for rep in range(a.reps):
            for h in hits:
                for s in settings:
                    prompt = [rng.randrange(3, VOCAB) for _ in range(a.tokens)]
                    cached = a.tokens * h // 100
                    if cached:
                        r = H.generate(pairs[s].router.url, prompt[:cached], 1, timeout_s=600)
                        assert not r.error, r.error
                    _, lines[s] = tail_ms(pairs[s], lines[s])
                    r = H.generate(pairs[s].router.url, prompt, 1, timeout_s=600)
                    assert not r.error, r.error
                    ttft[s][h].append(r.ttft_s * 1e3)
                    time.sleep(0.5)  # prefill logs the transfer once decode confirmed it
                    recs, lines[s] = tail_ms(pairs[s], lines[s])
                    xfer[s][h] += [ms for ms, _ in recs[-1:]]
                    early[s][h] += [n for _, n in recs[-1:]]
                    print(f"rep {rep} hit {h:2d} % {s:4s}: TTFT {r.ttft_s * 1e3:7.1f} ms, "
                          f"transfer after the forward {recs[-1][0] if recs else -1:7.1f} ms, "
                          f"layer batches {recs[-1][1] if recs else -1}", flush=True)
    finally:
        for p in pairs.values():
            p.stop()
    med = {s: {h: round(statistics.median(v), 1) for h, v in d.items() if v}
           for s, d in ttft.items()}
    print("median TTFT ms (rows: hit %, columns: " + ", ".join(settings) + ")")
    for h in hits:
        print(f"  {h:2d} %: " + "  ".join(f"{med[s].get(h, float('nan')):8.1f}"
                                         for s in settings))
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "load_average": os.getloadavg(),
                       "kv_bytes_per_token": a.layers * 2 * a.heads * a.head_dim * 2,
                       "ttft_ms": ttft, "median_ttft_ms": med, "tail_ms": xfer,
                       "layer_batches": early, "median_tail_ms": {s: {h: round(statistics.median(v), 1)
                                                  for h, v in d.items() if v}
                                              for s, d in xfer.items()},
                       "logs": workdir}, f, indent=1)
    print(f"logs in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
