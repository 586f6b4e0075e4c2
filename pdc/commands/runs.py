"""The subcommands that run pdc's own ranks on this machine: `pdc demo` (requests through a
family's plan over a real transfer engine) and `pdc parity` (a tiny model's cache through
the plan, tokens and logits against one process).
"""

from __future__ import annotations

import argparse
import sys

from .common import (
    JSON_ARG,
    MAX_DEMO_CONCURRENCY,
    MAX_DEMO_PROCESSES,
    MAX_DEMO_REQUESTS,
    arg,
    command,
    print_json,
    range_problem,
    usage_error,
)


@command(
    "demo",
    arg("spec", nargs="?", default=None, metavar="SPEC",
        help="family spec (default: specs/qwen38.yaml)"),
    arg("--prefill", default="tp=2", metavar="SIDE",
        help="prefill layout, e.g. tp=4,pp=2,dp=1 (default: tp=2)"),
    arg("--decode", default=None, metavar="SIDE",
        help="decode layout (default: tp=1, or the prefill tp when the backend matrix forbids "
             "heterogeneous attention TP)"),
    arg("--engine", default="mooncake", choices=["mooncake", "nixl", "local"],
        help="transfer engine (default: mooncake over loopback TCP)"),
    arg("--requests", type=int, default=20, metavar="N", help="requests to run (default: 20)"),
    arg("--concurrency", type=int, default=4, metavar="N",
        help="requests in flight at once (default: 4)"),
    arg("--seed", type=int, default=0, help="seed of lengths, chunking, prefix hits and pages"),
    arg("--timeout", type=float, default=60.0, metavar="S",
        help="per-request transfer deadline in seconds (default: 60)"),
    arg("--stream", action="store_true",
        help="send per layer: prefill calls layer_done(layer) in forward order, then "
             "forward_done(), and each layer leaves in its own batch"),
    arg("--metrics-port", type=int, default=None, metavar="PORT",
        help="serve the per-request transfer metrics of every rank (Prometheus text format, "
             "pdc:kv_transfer_*) on 127.0.0.1:PORT/metrics while the demo runs; 0 picks a "
             "free port"),
    arg("--hosts", default="local", choices=["local", "netns", "netns6"],
        help="local: every rank on this host's loopback (default); netns: each DP group of "
             "each side on a host of its own, a network namespace with a private address "
             "(needs root and iproute2), the control plane authenticated (docs/deploy.md); "
             "netns6: the same with IPv6 addresses"),
    JSON_ARG,
)
def cmd_demo(args: argparse.Namespace) -> int:
    """Run prefill and decode ranks as local processes and verify every transferred byte.

    Lowers the plan for SPEC and the given layouts, starts one process per prefill rank and
    per decode rank, fills the prefill pools with deterministic per-byte labels of each
    request's aggregate state, runs the requests (mixed lengths, chunked prefill, some with
    decode prefix-cache hits, fragmented and contiguous pages) through the real transfer
    engine, and checks every byte of every decode item against the aggregate reference.
    Prints requests ok/failed, bytes, descriptors, transfer GB/s and latency p50/p99.
    With --json the text goes to stderr and stdout holds one JSON object: the spec, the
    topology, "requests" (total, ok, failed), "bytes_verified", descriptors, batches, links,
    "transfer_gb_s", "latency_ms" (p50, p99), "transports", "failures" and "errors".

    Exit status: 0 when every request was verified, 1 otherwise, 2 for a usage error.
    """
    from pdc.compiler.driver import SPECS_DIR, display_path
    from pdc.demo import default_decode, run_demo

    bad = _demo_arg_problem(args)
    if bad:
        return usage_error("demo", *bad, args.json)
    out = sys.stderr if args.json else sys.stdout  # Note [JSON output]
    spec = args.spec or str(display_path(SPECS_DIR / "qwen38.yaml"))
    decode = args.decode
    if decode is None:
        decode, note = default_decode(spec, args.prefill, args.engine)
        if note:
            print(f"pdc demo: {note}", file=out)
    metrics, port = None, None
    if args.metrics_port is not None:
        from pdc.runtime.metrics import TransferMetrics

        metrics = TransferMetrics()
        try:
            port = metrics.serve(args.metrics_port)
        except OSError as e:
            return usage_error("demo", f"cannot serve metrics on port {args.metrics_port}: "
                                f"{e.strerror}", "give a free port, or 0 to pick one",
                                args.json)
        print(f"pdc demo: metrics on http://127.0.0.1:{port}/metrics", file=out)
    summary: dict = {}
    try:
        code = run_demo(spec, args.prefill, decode, args.engine, args.requests,
                        concurrency=args.concurrency, seed=args.seed, timeout_s=args.timeout,
                        stream=args.stream, metrics=metrics, out=out, summary=summary,
                        hosts=args.hosts)
    finally:
        if metrics is not None:
            metrics.close()
    if not args.json:
        return code
    ran = "ok" in summary
    figures = {k: summary.get(k) for k in ("descriptors", "batches", "links", "staged_links")}
    figures.update({k: None if summary.get(v) is None else round(summary[v], 6) for k, v in (
        ("transfer_s", "transfer_s"), ("wall_s", "wall_s"), ("transfer_gb_s", "gbps"))})
    return print_json(
        "demo", code, summary.get("errors", []), spec=spec, prefill=args.prefill,
        decode=decode, engine=args.engine, seed=args.seed, stream=args.stream,
        family=summary.get("family"), topology=summary.get("topology"),
        rank_processes=summary.get("rank_processes"),
        ran=ran, requests={"total": args.requests, "ok": summary.get("ok", 0),
                           "failed": summary.get("failed", 0)},
        bytes_verified=summary.get("bytes", 0), **figures,
        latency_ms={q: None if summary.get(f"{q}_ms") is None else round(summary[f"{q}_ms"], 3)
                    for q in ("p50", "p99")},
        transports=summary.get("transports", []), failures=summary.get("failures", []),
        faults=summary.get("faults", []), metrics_port=port, hosts=summary.get("hosts", []))


def _parity_arg_problem(args) -> tuple[str, str] | None:
    """(message, hint) of the first argument `pdc parity` refuses, before any process."""
    from pdc.compiler.topology import parse_side_arg

    chunk = 1 if args.chunk is None else args.chunk  # None: two pages, the spec's page size
    bad = range_problem((("--tokens", args.tokens, 1, 4096), ("--steps", args.steps, 2, 1000),
                          ("--chunk", chunk, 1, 4096), ("--threads", args.threads, 1, 64)))
    if bad:
        return bad
    if not args.timeout > 0 or args.timeout > 3600:
        return (f"--timeout {args.timeout} is not a deadline", "give seconds, more than 0 "
                "and at most 3600")
    n_p, e1 = _side_processes(args.prefill, "--prefill")
    n_d, e2 = _side_processes(args.decode, "--decode")
    if e1 or e2:
        d = (e1 + e2)[0]
        return f"{d.loc}: {d.message}", d.hint
    # One request: one prefill DP group. A decode dp > 1 runs it on one group with the
    # others idle, for a model that pads DP batches (pdc.verify.parity.prepare says which).
    if parse_side_arg(args.prefill, "--prefill")[0].get("dp", 1) != 1:
        return (f"--prefill {args.prefill}: pdc parity runs one request, so one DP group",
                "use dp=1 (or leave dp out)")
    if n_p + n_d > MAX_DEMO_PROCESSES:
        return (f"--prefill and --decode need {n_p + n_d} rank processes, more than "
                f"{MAX_DEMO_PROCESSES}", "use smaller tp or pp")
    return None


def _side_processes(text: str | None, flag: str) -> tuple[int, list]:
    from pdc.compiler.topology import parse_side_arg

    if text is None:
        return 1, []
    side, errors = parse_side_arg(text, flag)
    if "stages" in side:
        side.setdefault("pp", len(side["stages"]))
    return side.get("tp", 1) * side.get("pp", 1) * side.get("dp", 1), errors


def _demo_arg_problem(args) -> tuple[str, str] | None:
    """(message, hint) of the first argument `pdc demo` refuses, before any process starts."""
    bad = range_problem((("--requests", args.requests, 1, MAX_DEMO_REQUESTS),
                          ("--concurrency", args.concurrency, 1, MAX_DEMO_CONCURRENCY)))
    if bad:
        return bad
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        return (f"--metrics-port {args.metrics_port} is not a TCP port",
                "give 0-65535; 0 picks a free one")
    if not args.timeout > 0 or args.timeout > 3600:
        return (f"--timeout {args.timeout} is not a deadline", "give seconds, more than 0 "
                "and at most 3600")
    n_p, e1 = _side_processes(args.prefill, "--prefill")
    n_d, e2 = _side_processes(args.decode, "--decode")
    if e1 or e2:
        d = (e1 + e2)[0]
        return f"{d.loc}: {d.message}", d.hint
    if n_p + n_d > MAX_DEMO_PROCESSES:
        return (f"--prefill {args.prefill} and --decode {args.decode or 'tp=1'} need {n_p + n_d} "
                f"rank processes, more than the {MAX_DEMO_PROCESSES} a demo starts",
                "use smaller tp, pp or dp")
    return None


@command(
    "parity",
    arg("specs", nargs="+", metavar="SPEC",
        help="family specs bound to a transformers model (specs/hf-*.yaml)"),
    arg("--prefill", default="tp=1", metavar="SIDE",
        help="prefill layout, e.g. tp=2 or tp=1,pp=2 (default: tp=1)"),
    arg("--decode", default="tp=1", metavar="SIDE", help="decode layout (default: tp=1)"),
    arg("--engine", default="mooncake", choices=["mooncake", "nixl", "local"],
        help="transfer engine (default: mooncake over loopback TCP)"),
    arg("--dtype", default=None, choices=["float32", "bfloat16"],
        help="model dtype (default: the spec's `dtypes` model entry)"),
    arg("--tokens", type=int, default=20, metavar="N", help="prompt length (default: 20)"),
    arg("--chunk", type=int, default=None, metavar="N",
        help="tokens per chunked-prefill chunk, a multiple of the page size (default: two "
             "pages)"),
    arg("--steps", type=int, default=10, metavar="N",
        help="tokens to generate; step 0 comes from the prefill (default: 10)"),
    arg("--seed", type=int, default=0, help="seed of the prompt and of the page assignment"),
    arg("--threads", type=int, default=1, metavar="N",
        help="torch threads of every process (default: 1)"),
    arg("--timeout", type=float, default=30.0, metavar="S",
        help="transfer deadline in seconds (default: 30)"),
    arg("--drop", action="append", default=[], metavar="COMPONENT",
        help="negative control: remove COMPONENT from the plan's links (of every SPEC that "
             "has it); parity must fail and name it"),
    arg("--param", action="append", default=[], metavar="NAME=VALUE",
        help="override a spec param (over the toy sizes a seed spec's `parity.params` give)"),
    JSON_ARG,
)
def cmd_parity(args: argparse.Namespace) -> int:
    """Run tiny transformers models through pdc and check tokens and logits bit for bit.

    For each SPEC (a family whose `parity` block names its tiny model and what each component
    carries, Note [Parity recipe]), starts worker processes that play the prefill and decode ranks of the given layouts.
    Prefill ranks build the tiny random-weight model, run the prompt as chunked prefill and
    place their TP share of the cache in their pools after each chunk; pdc moves it through the
    lowered plan and the real engine; the decode ranks' items are gathered in one decode-model
    process, which rebuilds the cache and generates greedily. Tokens and logits of every step
    must equal single-process generation (the same chunked prefill on one cache in one process)
    bit for bit; on a mismatch the report names the first differing step and the layer and
    component whose transferred state differs from the prefill export. The processes are shared
    by all SPECs of one call. Progress goes to stderr. With --json the report goes to stderr
    too and stdout holds one JSON object: "specs", one entry per SPEC ("ok", "ran", family,
    topology, "tokens", "report" lines, wall_s), and "errors".

    Exit status: 0 when every SPEC reaches parity, 1 otherwise, 2 for a usage error.
    """
    from pdc.console import phase_printer
    from pdc.verify.parity import run_parity
    from pdc.verify.parity_workers import ParityWorkers

    bad = _parity_arg_problem(args)
    if bad:
        return usage_error("parity", *bad, args.json)
    params = []
    for text in args.param:
        name, sep, value = text.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit():
            return usage_error("parity", f"cannot read --param {text}",
                                "write NAME=VALUE with a param the spec declares and a "
                                "non-negative integer, e.g. --param num_layers=8", args.json)
        params.append((name.strip(), int(value)))
    report: dict = {}
    with ParityWorkers(threads=args.threads,
                       progress=phase_printer("parity", last="decode model")) as workers:
        code = run_parity(args.specs, args.prefill, args.decode, args.engine, args.dtype,
                          workers=workers, out=sys.stderr if args.json else sys.stdout,
                          report=report, tokens=args.tokens, chunk_tokens=args.chunk,
                          steps=args.steps, seed=args.seed, timeout_s=args.timeout,
                          drop=tuple(args.drop), params=tuple(params))
    if not args.json:
        return code
    return print_json("parity", code, report["errors"], specs=report["specs"],
                       prefill=args.prefill, decode=args.decode, engine=args.engine,
                       dtype=args.dtype, threads=args.threads)
