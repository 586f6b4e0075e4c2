"""The serving-engine demos' subcommands: `pdc vllm-demo` and `pdc sglang-demo` (the
harnesses are in pdc/serving/)."""

from __future__ import annotations

import argparse
import functools

from .common import (
    MAX_DEMO_CONCURRENCY,
    MAX_DEMO_ENGINES,
    MAX_DEMO_NEW_TOKENS,
    MAX_DEMO_PROMPTS,
    arg,
    command,
    err,
    range_problem,
    spec_family,
    usage_error,
)

# Repetitions of a demo's backends: each starts fresh engines (a minute or more on a CPU).
MAX_DEMO_REPEAT = 20
# Busy processes of a demo's `--load` (Note [Demo load]): a few per core is a busy host
MAX_DEMO_LOAD = 64
# Attention-DP groups of `pdc sglang-demo --dp`: one rank (a scheduler process) each per server
MAX_SGLANG_DP = 8


def _knob_rows(texts: list[str]) -> tuple[list[dict], tuple[str, str] | None]:
    """--pdc-knobs values as environments (Note [Knob rows]), or (message, hint)."""
    from pdc.serving.knob_rows import knob_env

    rows = []
    for text in texts:
        try:
            rows.append(knob_env(text))
        except ValueError as e:
            return [], (f"--pdc-knobs {e}",
                        "give NAME=VALUE pairs of docs/knobs.md, comma-separated")
    return rows, None


@command(
    "vllm-demo",
    arg("--spec", default="specs/vllm-llama.yaml", metavar="SPEC",
        help="family spec in vLLM's cache layout (default: specs/vllm-llama.yaml)"),
    arg("--prompts", type=int, default=16, metavar="N", help="prompts to run (default: 16)"),
    arg("--tokens", type=int, default=16, metavar="N",
        help="tokens to generate per prompt (default: 16)"),
    arg("--engine", default="mooncake", choices=["mooncake", "nixl"],
        help="transfer engine (default: mooncake over loopback TCP)"),
    arg("--seed", type=int, default=0, help="seed of the prompts"),
    arg("--keep", action="store_true", help="keep the model and the engines' logs"),
    arg("--compare", action="store_true",
        help="also run pdc with the first token from prefill, vLLM's own NixlConnector and "
             "MooncakeConnector and one engine alone on the same engines' settings; a TTFT "
             "table with the overhead over one engine"),
    arg("--in-flight", type=int, default=4, metavar="N",
        help="prompts in flight at once (default: 4)"),
    arg("--repeat", type=int, default=1, metavar="N",
        help="run every backend N times, each repetition in another order (default: 1)"),
    arg("--timeline", action="store_true",
        help="log pdc's transfers and print where its time to first token went, by phase"),
    arg("--prefill-engines", type=int, default=1, metavar="N",
        help="prefill engines; the proxy spreads the prompts over them (default: 1)"),
    arg("--decode-engines", type=int, default=1, metavar="N",
        help="decode engines; each loads from every prefill engine (default: 1)"),
    arg("--kill-prefill-after", type=int, default=None, metavar="K",
        help="kill the last prefill engine once K prompts finished: its prompts may fail, "
             "no other may"),
    arg("--prefix-caching", default="auto", choices=["auto", "on", "off"],
        help="vLLM's prefix caching on the prefill and decode engines (default: auto, on "
             "except for a hybrid family; 'on' runs a hybrid in mamba_cache_mode 'align')"),
    arg("--pdc-knobs", action="append", default=[], metavar="NAME=VALUE[,...]",
        help="with --compare or --repeat: one more pdc row whose engines run with these "
             "runtime knobs (docs/knobs.md); repeat the flag for more rows"),
    arg("--tie-tolerance", type=float, default=None, metavar="NATS",
        help="compare logprobs instead of tokens: each within NATS of the reference's, a "
             "differing token only at a near tie (default: 0.25 for a hybrid family, 0, "
             "token identity, otherwise; 0.1 for an MLA family)"),
    arg("--warmup", type=int, default=1, metavar="N",
        help="with --compare or --repeat: requests of other prompts each engine setup answers "
             "before the measured ones, outside the figures (default: 1; 0: cold engines)"),
    arg("--load", type=int, default=0, metavar="N",
        help="N processes that keep the cores busy beside the servers for the whole run, "
             "a reproducible busy host (Note [Demo load]; default: 0)"),
)
def cmd_vllm_demo(args: argparse.Namespace) -> int:
    """Run prefill and decode as two real vLLM engines with pdc's KV connector between them.

    Makes a tiny random-weight Llama whose cache matches SPEC, starts one vLLM engine alone
    for the reference, then a prefill and a decode engine (separate processes, PdcConnector
    as kv_producer and kv_consumer), sends every prompt through a minimal PD proxy and
    compares each generated token with the reference. `--compare` runs the same prompts
    through pdc with the first token from prefill, vLLM's own NixlConnector and
    MooncakeConnector and one engine alone too, and prints TTFT p50/p99 per backend with its
    overhead over the engine alone, TTFT's parts and the time to the second token
    (docs/vllm.md). `--load N` keeps the cores busy with N more processes throughout (Note
    [Demo load]).
    Needs the vLLM environment (scripts/install-vllm.sh). The table goes to stdout, progress
    to stderr.

    Exit status: 0 when every prompt is token-identical (or, with a tie tolerance, within
    it: Note [Logprob tolerance] in pdc/serving/drift.py), 1 otherwise (a spec error, no
    vLLM environment, a failed prompt), 2 for a usage error.
    """
    from pdc.serving.host_load import busy_cores
    from pdc.serving.vllm_compare import run_comparison
    from pdc.serving.vllm_demo import run_demo

    bad = range_problem((("--prompts", args.prompts, 1, MAX_DEMO_PROMPTS),
                          ("--tokens", args.tokens, 1, MAX_DEMO_NEW_TOKENS),
                          ("--in-flight", args.in_flight, 1, MAX_DEMO_CONCURRENCY),
                          ("--repeat", args.repeat, 1, MAX_DEMO_REPEAT),
                          ("--warmup", args.warmup, 0, MAX_DEMO_PROMPTS),
                          ("--load", args.load, 0, MAX_DEMO_LOAD),
                          ("--prefill-engines", args.prefill_engines, 1, MAX_DEMO_ENGINES),
                          ("--decode-engines", args.decode_engines, 1, MAX_DEMO_ENGINES)))
    if bad is None and args.kill_prefill_after is not None:
        bad = range_problem((("--kill-prefill-after", args.kill_prefill_after, 0,
                              args.prompts - 1),))
        if bad is None and args.prefill_engines < 2:
            bad = ("--kill-prefill-after needs another prefill engine to serve the rest",
                   "add --prefill-engines 2")
    tol = args.tie_tolerance
    if bad is None and tol is not None and not 0.0 <= tol <= 10.0:  # also refuses nan
        bad = (f"--tie-tolerance {tol} is not a logprob gap",
               "give a value from 0 (identity) to 10")
    knob_rows, bad = _knob_rows(args.pdc_knobs) if bad is None else ([], bad)
    if bad is None and knob_rows and not (args.compare or args.repeat > 1):
        bad = ("--pdc-knobs adds rows to a comparison", "add --compare (or --repeat N)")
    if bad:
        return usage_error("vllm-demo", *bad, False)
    family = spec_family(args.spec, "vllm-demo")
    if family is None:
        return 1
    with busy_cores(args.load):
        return run_demo(family, args.engine, args.prompts, args.tokens, args.seed,
                        keep=args.keep, compare=args.compare, in_flight=args.in_flight,
                        repeat=args.repeat,
                        timeline=args.timeline, prefill_engines=args.prefill_engines,
                        comparison=functools.partial(run_comparison,
                                                     knob_rows=tuple(knob_rows)),
                        decode_engines=args.decode_engines,
                        kill_prefill_after=args.kill_prefill_after,
                        tie_tolerance=args.tie_tolerance, prefix_caching=args.prefix_caching,
                        warmup=args.warmup)


@command(
    "sglang-demo",
    arg("--prompts", type=int, default=16, metavar="N", help="prompts to send (default: 16)"),
    arg("--engine", default="mooncake", choices=["mooncake", "nixl"],
        help="the engine pdc moves the bytes with (default: mooncake over loopback TCP)"),
    arg("--compare", action="store_true",
        help="also run the prompts through pdc's router with the first token from prefill, "
             "SGLang's own mooncake backend (as is, and with SGLang's optimistic prefill) and "
             "one plain server, and print them all"),
    arg("--family", default="llama", choices=["llama", "qwen3", "qwen3-next", "deepseek-mla"],
        help="the tiny random-weight model to serve: llama (default) or qwen3 (dense Qwen3; "
             "specs/sglang-llama.yaml serves both), qwen3-next (hybrid Gated DeltaNet + "
             "attention, specs/sglang-qwen3-next.yaml) or deepseek-mla (MLA latent, "
             "specs/sglang-deepseek-mla.yaml); each spec is bound to the model at start"),
    arg("--in-flight", type=int, default=4, metavar="N",
        help="prompts in flight at once (default: 4)"),
    arg("--tokens", type=int, default=16, metavar="N",
        help="greedy tokens per prompt (default: 16)"),
    arg("--seed", type=int, default=0, help="seed of the prompts' token ids"),
    arg("--keep-logs", action="store_true", help="keep the servers' logs and the model"),
    arg("--repeat", type=int, default=1, metavar="N",
        help="run every backend N times, each repetition in another order (default: 1)"),
    arg("--timeline", action="store_true",
        help="log pdc's transfers and print the phases of its requests"),
    arg("--dp", type=int, default=1, metavar="N",
        help="N attention-DP groups on every server (--tp N --dp N --enable-dp-attention; "
             "on a CPU deepseek-mla only; default: 1)"),
    arg("--spec-decode", action="store_true",
        help="speculative decoding, the draft state from prefill: EAGLE with a tiny draft "
             "(llama, qwen3) or MTP (deepseek-mla); needs CUDA"),
    arg("--pdc-knobs", action="append", default=[], metavar="NAME=VALUE[,...]",
        help="one more pdc row whose servers run with these runtime knobs (docs/knobs.md), "
             "interleaved with the others (with --compare, one in each pdc flow); repeat "
             "the flag for more rows"),
    arg("--warmup", type=int, default=1, metavar="N",
        help="requests of other prompts each server setup answers before the measured ones, "
             "outside the figures (default: 1; 0: measure cold servers)"),
    arg("--server-cores", default="pinned", choices=["pinned", "shared"],
        help="pinned: a prefill server on the first core, decode and lone servers on the "
             "last (Note [Server cores]); shared: every server on every core (default: "
             "pinned)"),
    arg("--load", type=int, default=0, metavar="N",
        help="N processes that keep the cores busy beside the servers for the whole run, "
             "a reproducible busy host (Note [Demo load]; default: 0)"),
)
def cmd_sglang_demo(args: argparse.Namespace) -> int:
    """Real SGLang prefill and decode servers with pdc's transfer backend, checked token by token.

    Needs the SGLang environment of scripts/install-sglang.sh (a venv outside the clone; or
    PDC_SGLANG_PYTHON). Starts a plain SGLang server for the reference tokens, then a prefill
    and a decode server with `--disaggregation-transfer-backend pdc` behind SGLang's router,
    sends N prompts of mixed lengths (several 64-token chunks, 16-token pages, 4 in flight),
    checks every generated token against the plain server and prints prompts ok/failed, MB
    moved, transfer ms and TTFT p50/p99. `--compare` adds a pdc pair behind pdc's router, which
    streams the first token from prefill, SGLang's own mooncake backend on the same settings
    (as is, and with SGLang's `--optimistic-prefill-attempts 1`) and one plain server alone,
    with each PD backend's TTFT overhead over it; every setup first answers `--warmup`
    requests outside the figures; `--pdc-knobs` adds pdc rows with other runtime knobs;
    `--load N` keeps the cores busy with N more processes throughout (Note [Demo load]).
    `--family qwen3` serves a tiny dense Qwen3 instead of the tiny Llama, `qwen3-next` a hybrid Gated DeltaNet model (slot state), `deepseek-mla` an MLA
    model (latent pool). `--dp N` runs N attention-DP groups on every server, the plain one
    too; `--spec-decode` speculates on both PD servers (a tiny EAGLE draft, or DeepSeek's MTP
    layer) while the plain server does not. A combination SGLang cannot run on this machine
    is refused before any server starts, with SGLang's reason. The table goes to stdout,
    progress to stderr.

    Exit status: 0 when every prompt of every run was token-identical, 1 otherwise (no
    SGLang environment included), 2 for a usage error.
    """
    from pdc.serving.host_load import busy_cores
    from pdc.serving.sglang_demo import run_demo

    bad = range_problem((("--prompts", args.prompts, 1, MAX_DEMO_PROMPTS),
                          ("--in-flight", args.in_flight, 1, MAX_DEMO_CONCURRENCY),
                          ("--tokens", args.tokens, 1, MAX_DEMO_NEW_TOKENS),
                          ("--repeat", args.repeat, 1, MAX_DEMO_REPEAT),
                          ("--warmup", args.warmup, 0, MAX_DEMO_PROMPTS),
                          ("--load", args.load, 0, MAX_DEMO_LOAD),
                          ("--dp", args.dp, 1, MAX_SGLANG_DP)))
    if bad:
        return usage_error("sglang-demo", *bad, False)
    knob_rows, bad = _knob_rows(args.pdc_knobs)
    if bad:
        return usage_error("sglang-demo", *bad, False)
    from pdc.serving.sglang_variants import Refusal, cuda_machine, plan_variant

    variant = plan_variant(args.family, args.dp, args.spec_decode, cuda_machine())
    if isinstance(variant, Refusal):  # before any server starts (Note [Demo variants])
        err(f"pdc sglang-demo: error: {variant.message}", f"  hint: {variant.hint}")
        return 1
    with busy_cores(args.load):
        return run_demo(args.prompts, args.engine, args.compare, args.in_flight, args.tokens,
                        args.seed, args.keep_logs, family=args.family, repeat=args.repeat,
                        timeline=args.timeline, variant=variant, knob_rows=tuple(knob_rows),
                        warmup=args.warmup, shared_cores=args.server_cores == "shared")
