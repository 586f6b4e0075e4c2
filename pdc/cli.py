"""The `pdc` command line: `pdc validate | compile | check | demo ...`.

Exit codes: 0 success; 1 a spec error, stale generated code or a failed command; 2 a usage
error (argparse's own exit code). Diagnostics go to stderr, results to stdout. A mistake in a
spec or a path never produces a Python traceback; a bug in pdc still does.

Note [Subcommands]: each subcommand is one function decorated with `@command(name, *args)`.
Its docstring is the help: the first line is the summary shown by `pdc --help`, the rest the
description shown by `pdc NAME --help`; `args` are `arg(...)` calls taking
`ArgumentParser.add_argument`'s parameters. The function receives the parsed namespace and
returns the exit code. Import heavy modules (the compiler, torch, engines) inside the
function, so that `pdc --help` and unrelated subcommands stay fast and independent.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdc import __version__


@dataclass(frozen=True, slots=True)
class Arg:
    flags: tuple[str, ...]
    options: dict


def arg(*flags: str, **options) -> Arg:
    """One argument of a subcommand, as for `ArgumentParser.add_argument`."""
    return Arg(flags, options)


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    run: Callable[[argparse.Namespace], int]
    args: tuple[Arg, ...]

    @property
    def doc(self) -> str:
        return inspect.cleandoc(self.run.__doc__ or self.name)

    @property
    def summary(self) -> str:
        return self.doc.splitlines()[0]


# Subcommands in the order `pdc --help` lists them (Note [Subcommands]).
COMMANDS: dict[str, Command] = {}


def command(name: str, *args: Arg) -> Callable:
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in COMMANDS:
            raise ValueError(f"subcommand {name!r} is registered twice")
        COMMANDS[name] = Command(name, fn, args)
        return fn

    return register


def _err(*lines: str) -> None:
    for line in lines:
        print(line, file=sys.stderr)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# ~~~ machine-readable output (Note [JSON output]) ~~~
# Note [JSON output]: with --json a command prints exactly one JSON object on stdout, on
# success and on failure alike, and nothing else: {"command", "ok", "exit", ...its result...,
# "errors": [{"file", "line", "col", "message", "hint"}]}. A usage error, a spec error and a
# failed run differ only in "exit" (2, 1, 1) and where the errors point ("<command line>" for
# a flag). argparse's own refusals are answered so too (main, _Parser). Diagnostics, reports
# and progress go to stderr as text (Note [Console output] in pdc/console.py). The keys per
# command are listed in docs/cli.md.

_JSON_ARG = arg("--json", action="store_true",
                help="print one JSON object on stdout (errors included) instead of text")


def diagnostic_json(d) -> dict:
    return {"file": d.loc.file, "line": d.loc.line, "col": d.loc.col, "message": d.message,
            "hint": d.hint}


def _print_json(command: str, code: int, errors=(), **result) -> int:
    import json

    out = {"command": command, "ok": code == 0, "exit": code, **result,
           "errors": [e if isinstance(e, dict) else diagnostic_json(e) for e in errors]}
    sys.stdout.write(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return code


def _usage_error(command: str, message: str, hint: str, as_json: bool) -> int:
    """A wrong argument: exit status 2 (argparse's), as text on stderr or a JSON object."""
    _err(f"pdc {command}: error: {message}", f"  hint: {hint}")
    if as_json:
        return _print_json(command, 2, [{"file": "<command line>", "line": 0, "col": 0,
                                         "message": message, "hint": hint}])
    return 2


def _is_usage(diagnostics) -> bool:
    """Diagnostics about a flag (`--prefill: error: ...`), not about a spec."""
    return bool(diagnostics) and all(d.loc.file.startswith("--") for d in diagnostics)


# ~~~ compiler subcommands ~~~

_SPEC_ARG = arg("specs", nargs="*", metavar="SPEC",
                help="spec files (default: every specs/*.yaml of the repository)")
_OUT_ARG = arg("--out", metavar="DIR", type=Path, default=None,
               help="root of the generated package (default: generated/ of the repository)")


def _spec_paths(name: str, given: list[str]) -> list[str | Path] | None:
    """The specs to work on: those given, else every spec of the repository (None and a
    message when there is none)."""
    from pdc.compiler.driver import SPECS_DIR, all_spec_paths, display_path

    if given:
        return list(given)
    found = all_spec_paths()
    if not found:
        _err(f"pdc {name}: error: no spec given and none found in {display_path(SPECS_DIR)}/")
        return None
    return list(found)


def _report_errors(name: str, build, n_specs: int, suffix: str = "") -> None:
    _err(build.render_diagnostics(),
         f"pdc {name}: {_plural(len(build.diagnostics), 'error')} in {len(build.failed)} of "
         f"{_plural(n_specs, 'spec')}{suffix}")


@command("validate", _SPEC_ARG, _JSON_ARG)
def cmd_validate(args: argparse.Namespace) -> int:
    """Check specs and report every error in them.

    Each spec is loaded (YAML with source locations), checked against the JSON Schema
    (schema/pdc-spec.schema.json), modelled, checked for cross-entity rules (layer ids,
    sentinels, shard geometry, constraints, backends, deployments) and rendered in memory.
    Every error of every spec is printed as file:line:col with the source line, a caret and
    a hint, followed by a one-line summary. Nothing is written.

    Exit status: 0 when every spec is valid, 1 otherwise.
    """
    from pdc.compiler.driver import build

    paths = _spec_paths("validate", args.specs)
    if paths is None:
        return _print_json("validate", 2) if args.json else 2
    b = build(paths)
    specs = [str(p) for p in paths]
    if not b.ok:
        _report_errors("validate", b, len(paths))
        return _print_json("validate", 1, b.diagnostics, specs=specs, failed=b.failed) \
            if args.json else 1
    if args.json:
        return _print_json("validate", 0, specs=specs, failed=[])
    print(f"pdc validate: {_plural(len(paths), 'spec')} ok")
    return 0


@command("compile", _SPEC_ARG, _OUT_ARG, _JSON_ARG)
def cmd_compile(args: argparse.Namespace) -> int:
    """Validate specs and write their generated modules.

    Writes generated/<family>/__init__.py and layout.py (and every other module the compiler
    emits) for each spec, touching only files whose content changed. With no SPEC, compiles
    every specs/*.yaml and also deletes generated files of families that no longer have a
    spec (only files that carry pdc's @generated header). If any spec has an error, nothing
    is written.

    Every entry of a spec's `deployments` is proven first: it must be accepted or rejected
    (with its `error` text) exactly as the spec says, and every accepted one must pass the
    coverage proof (every decode byte written exactly once, with the aggregate's byte).

    Exit status: 0 on success, 1 on a spec error or when a file cannot be written.
    """
    from pdc.compiler.driver import DEFAULT_OUT, build, display_path

    paths = _spec_paths("compile", args.specs)
    if paths is None:
        return _print_json("compile", 2) if args.json else 2
    b = build(paths, deployments="prove")
    if not b.ok:
        _report_errors("compile", b, len(paths), "; nothing written")
        return _print_json("compile", 1, b.diagnostics, failed=b.failed, written=[]) \
            if args.json else 1
    out = args.out if args.out is not None else DEFAULT_OUT
    label = display_path(out)
    try:
        changed = b.output.commit(out)
        removed, kept = ([], []) if args.specs else b.output.remove_orphans(out)
    except OSError as e:
        _err(f"pdc compile: error: cannot write {e.filename or label}: {e.strerror or e}")
        return _print_json("compile", 1, [{"file": str(e.filename or label), "line": 0,
                                           "col": 0, "message": f"cannot write: {e.strerror}",
                                           "hint": "check the output folder"}]) \
            if args.json else 1
    if args.json:
        for p in kept:
            _err(f"pdc compile: warning: {label}/{p} is produced by no spec and has no "
                 "@generated header; delete it by hand")
        return _print_json("compile", 0, written=[f"{label}/{p}" for p in changed],
                           removed=[f"{label}/{p}" for p in removed],
                           files=len(b.output), specs=len(b.specs))
    for p in changed:
        print(f"wrote {label}/{p}")
    for p in removed:
        print(f"removed {label}/{p} (no spec produces it)")
    for p in kept:
        _err(f"pdc compile: warning: {label}/{p} is produced by no spec and has no @generated "
             "header; delete it by hand")
    n = len(b.output)
    state = f"{len(changed)} of {_plural(n, 'file')} changed" if changed else \
        f"{_plural(n, 'file')} up to date"
    print(f"pdc compile: {state} ({_plural(len(b.specs), 'spec')})")
    return 0


@command("check", _OUT_ARG, _JSON_ARG)
def cmd_check(args: argparse.Namespace) -> int:
    """Fail if generated/ is not exactly what the specs compile to.

    Renders every specs/*.yaml in memory and compares the bytes with the files under the
    output root. When a file differs or is missing, or a .py file there is produced by no
    spec (an orphan), prints a unified diff, the list of stale and orphan files and the
    command that regenerates them. CI runs this on every change.

    Exit status: 0 when up to date, 1 when stale or when a spec has an error.
    """
    from pdc.compiler.driver import DEFAULT_OUT, build, display_path

    paths = _spec_paths("check", [])
    if paths is None:
        return _print_json("check", 2) if args.json else 2
    b = build(paths, deployments="skip")
    if not b.ok:
        _report_errors("check", b, len(paths))
        return _print_json("check", 1, b.diagnostics, stale=[], orphans=[]) if args.json else 1
    out = args.out if args.out is not None else DEFAULT_OUT
    label = display_path(out)
    try:
        diff, stale, orphans = b.output.diff(out, label)
    except OSError as e:
        _err(f"pdc check: error: cannot read {e.filename or label}: {e.strerror or e}")
        return _print_json("check", 1, [{"file": str(e.filename or label), "line": 0,
                                         "col": 0, "message": f"cannot read: {e.strerror}",
                                         "hint": "check the output folder"}]) \
            if args.json else 1
    if args.json:
        if stale or orphans:
            _err(f"pdc check: {label}/ is out of date; regenerate with: pdc compile")
        return _print_json("check", 1 if stale or orphans else 0,
                           stale=[f"{label}/{p}" for p in stale],
                           orphans=[f"{label}/{p}" for p in orphans], files=len(b.output),
                           specs=len(b.specs))
    if not stale and not orphans:
        print(f"pdc check: {label}/ is up to date ({_plural(len(b.specs), 'spec')}, "
              f"{_plural(len(b.output), 'file')})")
        return 0
    sys.stdout.write(diff)
    regenerate = "pdc compile" + (f" --out {label}" if args.out is not None else "")
    problems = [_plural(len(stale), "stale file")] if stale else []
    problems += [_plural(len(orphans), "orphan file")] if orphans else []
    _err(f"pdc check: {label}/ is out of date: {', '.join(problems)}",
         *(f"  {'stale' if (out / p).exists() else 'missing'}: {label}/{p}" for p in stale),
         *(f"  orphan: {label}/{p} (produced by no spec)" for p in orphans),
         f"regenerate with: {regenerate}")
    return 1


@command(
    "plan",
    arg("spec", metavar="SPEC", help="family spec"),
    arg("--prefill", required=True, metavar="SIDE", help="prefill layout, e.g. tp=4,pp=2"),
    arg("--decode", required=True, metavar="SIDE", help="decode layout, e.g. tp=1,dp=8"),
    arg("--backend", default="mooncake", help="transfer backend (default: mooncake)"),
    arg("--tokens", type=int, default=8192, metavar="N",
        help="request length for the byte and descriptor counts (default: 8192)"),
    arg("--json", action="store_true", help="print the report and the whole plan as JSON"),
    arg("--svg", metavar="FILE", type=Path, default=None,
        help="also draw the plan as an SVG picture into FILE"),
    arg("--png", metavar="FILE", type=Path, default=None,
        help="also draw it as a PNG (needs rsvg-convert or the cairosvg package)"),
)
def cmd_plan(args: argparse.Namespace) -> int:
    """Lower a transfer plan for a topology, prove it and print it per link.

    SIDE is a comma-separated list of tp, pp, dp and page_size (defaults: 1, 1, 1 and the
    spec's page_size). The topology is checked against the static rules (the spec's backend
    matrix, equal page sizes, TP divisibility); a rejection names the rule and its spec line.
    An accepted plan goes through the coverage proof and is printed as a table per
    (prefill rank -> decode rank) link: entries, bytes of an N-token request, descriptors with
    contiguous and with fragmented pages and on the staged path, and the replicated
    components the link writes as elected writer. --svg FILE (and --png FILE) draw it:
    prefill and decode ranks by stage, links with bytes and descriptors, direct or staged,
    elected writers and broadcasts.

    Exit status: 0 for a proven plan, 1 for a rejected topology or a spec error, 2 for a
    usage error (a malformed or out-of-range --prefill/--decode, --tokens < 1).
    """
    from pdc.compiler.coverage import prove
    from pdc.compiler.diagnostics import SpecErrors
    from pdc.compiler.driver import spec_display_path
    from pdc.compiler.family import plan_spec
    from pdc.compiler.frontend import parse_spec_text, read_spec_text
    from pdc.compiler.report import plan_report, render_json
    from pdc.compiler.topology import parse_side_arg

    if args.tokens < 1 or args.tokens > 2**24:
        return _usage_error("plan", f"--tokens is {args.tokens}", "give a request length "
                            "from 1 to 16777216 tokens", args.json)
    name = spec_display_path(args.spec)
    text = read_spec_text(args.spec, name)
    if not isinstance(text, str):
        _err(text.render(), "1 error")
        return _print_json("plan", 1, [text]) if args.json else 1
    try:
        errs = parse_side_arg(args.prefill, "--prefill")[1] + \
            parse_side_arg(args.decode, "--decode")[1]
        if errs:
            raise SpecErrors(errs)
        page = parse_side_arg(args.prefill, "--prefill")[0].get("page_size")
        spec = parse_spec_text(text, name, {"page_size": page} if page else None)
        family, plan = plan_spec(spec, args.prefill, args.decode, args.backend)
    except SpecErrors as e:
        _err(str(e))
        code = 2 if _is_usage(e.diagnostics) else 1
        return _print_json("plan", code, e.diagnostics) if args.json else code
    layout = family.layout
    problems = prove(layout, plan)
    report = plan_report(layout, plan, args.tokens, problems)
    code = 0 if not problems else 1
    if args.svg is not None or args.png is not None:
        drawn = _draw_plan(layout, plan, report, args.svg, args.png)
        if drawn:
            _err(f"pdc plan: error: {drawn}")
            return _print_json("plan", 1, [{"file": "--svg/--png", "line": 0, "col": 0,
                                            "message": drawn, "hint": ""}]) if args.json else 1
    if args.json:
        # A coverage problem is the plan's own failure, at no spec line: located at the spec.
        errors = [{"file": name, "line": 0, "col": 0, "message": str(pr),
                   "hint": "a plan the lowering made broke coverage: report it as a pdc bug"}
                  for pr in problems]
        sys.stdout.write(render_json(report, plan, code, errors))
    else:
        print_plan(report, sys.stdout)
    return code


def print_plan(report: dict, out) -> None:
    """The plan report as text: head, the per-link table (rich, Note [Console output]) and
    the tail, every line within 100 columns."""
    from pdc.compiler.report import report_head, report_tail, table_rows
    from pdc.console import print_table, wrap

    cols, rows = table_rows(report)
    head = [wrap(part) for line in report_head(report) for part in line.split("\n")]
    out.write("\n".join(head) + "\n\n")
    print_table(cols, rows, out, right=(1, 2, 3, 4, 5), indent=0)
    out.write("\n" + "\n".join(report_tail(report)) + "\n")


def _draw_plan(layout, plan, report, svg: Path | None, png: Path | None) -> str:
    """Write the drawing (compiler/drawing.py); the reason it could not be, or ""."""
    import shutil
    import subprocess
    import tempfile

    from pdc.compiler.drawing import draw_plan, drawable

    why = drawable(plan)
    if why:
        return f"cannot draw this plan: {why}"
    text = draw_plan(layout, plan, report)
    try:
        if svg is not None:
            svg.write_text(text, encoding="utf-8")
            _err(f"pdc plan: drew {svg}")
        if png is not None:
            try:
                import cairosvg  # optional: a maintained renderer from PyPI
            except ImportError:
                cairosvg = None
            if cairosvg is not None:
                cairosvg.svg2png(bytestring=text.encode(), write_to=str(png))
            elif shutil.which("rsvg-convert"):
                with tempfile.NamedTemporaryFile("w", suffix=".svg", delete=False) as f:
                    f.write(text)
                try:
                    subprocess.run(["rsvg-convert", "-o", str(png), f.name], check=True,
                                   capture_output=True, timeout=60)
                finally:
                    Path(f.name).unlink(missing_ok=True)
            else:
                return ("no PNG renderer: install rsvg-convert (apt install librsvg2-bin) or "
                        "`pip install cairosvg`, or use --svg")
            _err(f"pdc plan: drew {png}")
    except OSError as e:
        return f"cannot write {e.filename}: {e.strerror or e}"
    except subprocess.CalledProcessError as e:
        return f"rsvg-convert failed: {e.stderr.decode(errors='replace').strip()}"
    return ""


# ~~~ runtime subcommands ~~~


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
)
def cmd_vllm_demo(args: argparse.Namespace) -> int:
    """Run prefill and decode as two real vLLM engines with pdc's KV connector between them.

    Makes a tiny random-weight Llama whose cache matches SPEC, starts one vLLM engine alone
    for the reference, then a prefill and a decode engine (separate processes, PdcConnector
    as kv_producer and kv_consumer), sends every prompt through a minimal PD proxy and
    compares each generated token with the reference. Needs the vLLM environment
    (scripts/install-vllm.sh). The table goes to stdout, progress to stderr.

    Exit status: 0 when every prompt is token-identical, 1 otherwise (a spec error, no vLLM
    environment, a failed prompt), 2 for a usage error.
    """
    from .vllm_demo import run_demo

    bad = _range_problem((("--prompts", args.prompts, 1, MAX_DEMO_PROMPTS),
                          ("--tokens", args.tokens, 1, MAX_DEMO_NEW_TOKENS)))
    if bad:
        return _usage_error("vllm-demo", *bad, False)
    family = _spec_family(args.spec, "vllm-demo")
    if family is None:
        return 1
    return run_demo(family, args.engine, args.prompts, args.tokens, args.seed, keep=args.keep)


# Caps of the demos with real servers: prompts and greedy tokens per prompt.
MAX_DEMO_PROMPTS = 10_000
MAX_DEMO_NEW_TOKENS = 1024


def _range_problem(checks) -> tuple[str, str] | None:
    """(message, hint) for the first (flag, value, low, high) whose value is out of range."""
    for flag, value, low, high in checks:
        if not low <= value <= high:
            return f"{flag} is {value}", f"give {flag} from {low} to {high}"
    return None


def _spec_family(path: str, cmd: str) -> str | None:
    from pdc.compiler.diagnostics import SpecErrors
    from pdc.compiler.frontend import load_spec

    try:
        return load_spec(path).family
    except SpecErrors as e:
        _err(str(e))
        return None
    except OSError as e:
        print(f"pdc {cmd}: error: cannot read {path}: {e.strerror}", file=sys.stderr)
        return None


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
    _JSON_ARG,
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
        return _usage_error("demo", *bad, args.json)
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
            return _usage_error("demo", f"cannot serve metrics on port {args.metrics_port}: "
                                f"{e.strerror}", "give a free port, or 0 to pick one",
                                args.json)
        print(f"pdc demo: metrics on http://127.0.0.1:{port}/metrics", file=out)
    summary: dict = {}
    try:
        code = run_demo(spec, args.prefill, decode, args.engine, args.requests,
                        concurrency=args.concurrency, seed=args.seed, timeout_s=args.timeout,
                        stream=args.stream, metrics=metrics, out=out, summary=summary)
    finally:
        if metrics is not None:
            metrics.close()
    if not args.json:
        return code
    ran = "ok" in summary
    figures = {k: summary.get(k) for k in ("descriptors", "batches", "links", "staged_links")}
    figures.update({k: None if summary.get(v) is None else round(summary[v], 6) for k, v in (
        ("transfer_s", "transfer_s"), ("wall_s", "wall_s"), ("transfer_gb_s", "gbps"))})
    return _print_json(
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
        faults=summary.get("faults", []), metrics_port=port)


def _parity_arg_problem(args) -> tuple[str, str] | None:
    """(message, hint) of the first argument `pdc parity` refuses, before any process."""
    from pdc.compiler.topology import parse_side_arg

    chunk = 1 if args.chunk is None else args.chunk  # None: two pages, the spec's page size
    bad = _range_problem((("--tokens", args.tokens, 1, 4096), ("--steps", args.steps, 2, 1000),
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


# Caps of `pdc demo` (Note [Spec limits]): each rank is a process on this machine.
MAX_DEMO_PROCESSES = 64
MAX_DEMO_REQUESTS = 100_000
MAX_DEMO_CONCURRENCY = 256


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
    bad = _range_problem((("--requests", args.requests, 1, MAX_DEMO_REQUESTS),
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
    "sglang-demo",
    arg("--prompts", type=int, default=16, metavar="N", help="prompts to send (default: 16)"),
    arg("--engine", default="mooncake", choices=["mooncake", "nixl"],
        help="the engine pdc moves the bytes with (default: mooncake over loopback TCP)"),
    arg("--compare", action="store_true",
        help="also run the prompts through SGLang's own mooncake backend and print both"),
    arg("--family", default="llama", choices=["llama", "qwen3"],
        help="the tiny random-weight model to serve: llama (specs/sglang-tiny-llama.yaml, "
             "default) or qwen3 (dense Qwen3, specs/sglang-tiny-qwen3.yaml)"),
    arg("--in-flight", type=int, default=4, metavar="N",
        help="prompts in flight at once (default: 4)"),
    arg("--tokens", type=int, default=16, metavar="N",
        help="greedy tokens per prompt (default: 16)"),
    arg("--seed", type=int, default=0, help="seed of the prompts' token ids"),
    arg("--keep-logs", action="store_true", help="keep the servers' logs and the model"),
)
def cmd_sglang_demo(args: argparse.Namespace) -> int:
    """Real SGLang prefill and decode servers with pdc's transfer backend, checked token by token.

    Needs the SGLang environment of scripts/install-sglang.sh (a venv outside the clone; or
    PDC_SGLANG_PYTHON). Starts a plain SGLang server for the reference tokens, then a prefill
    and a decode server with `--disaggregation-transfer-backend pdc` behind SGLang's router,
    sends N prompts of mixed lengths (several 64-token chunks, 16-token pages, 4 in flight),
    checks every generated token against the plain server and prints prompts ok/failed, MB
    moved, transfer ms and TTFT p50/p99. `--compare` adds SGLang's own mooncake backend on the
    same settings, side by side. `--family qwen3` serves a tiny dense Qwen3 instead of the
    tiny Llama. The table goes to stdout, progress to stderr.

    Exit status: 0 when every prompt of every run was token-identical, 1 otherwise (no
    SGLang environment included), 2 for a usage error.
    """
    from pdc.sglang_demo import run_demo

    bad = _range_problem((("--prompts", args.prompts, 1, MAX_DEMO_PROMPTS),
                          ("--in-flight", args.in_flight, 1, MAX_DEMO_CONCURRENCY),
                          ("--tokens", args.tokens, 1, MAX_DEMO_NEW_TOKENS)))
    if bad:
        return _usage_error("sglang-demo", *bad, False)
    return run_demo(args.prompts, args.engine, args.compare, args.in_flight, args.tokens,
                    args.seed, args.keep_logs, family=args.family)


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
        help="override a spec param (over the toy sizes a seed spec's binding scales it to)"),
    _JSON_ARG,
)
def cmd_parity(args: argparse.Namespace) -> int:
    """Run tiny transformers models through pdc and check tokens and logits bit for bit.

    For each SPEC (a family bound to a pdc.verify.hf_state model in pdc/verify/hf_adapter.py),
    starts worker processes that play the prefill and decode ranks of the given layouts.
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
    from pdc.verify.parity import ParityWorkers, run_parity

    bad = _parity_arg_problem(args)
    if bad:
        return _usage_error("parity", *bad, args.json)
    params = []
    for text in args.param:
        name, sep, value = text.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit():
            return _usage_error("parity", f"cannot read --param {text}",
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
    return _print_json("parity", code, report["errors"], specs=report["specs"],
                       prefill=args.prefill, decode=args.decode, engine=args.engine,
                       dtype=args.dtype, threads=args.threads)


# ~~~ entry point ~~~


class UsageError(Exception):
    """argparse refused the command line (raised by _Parser.error instead of exiting)."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse, but a refused command line raises UsageError, so that `main` can answer
    it as JSON under --json (Note [JSON output]); the text on stderr is argparse's own."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        _err(f"{self.prog}: error: {message}")
        raise UsageError(self.prog, message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pdc",
        description="Compiler and lean runtime for prefill/decode disaggregated LLM state "
        "transfer: one YAML spec per model family, generated layout code under generated/.",
    )
    parser.add_argument("--version", action="version", version=f"pdc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for c in COMMANDS.values():
        p = sub.add_parser(c.name, help=c.summary, description=c.doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        for a in c.args:
            p.add_argument(*a.flags, **a.options)
    return parser


def _argv_error(name: str | None, message: str, argv: list[str]) -> int:
    """Exit status 2 for a command line argparse refused; the JSON object under --json."""
    if "--json" in argv:
        help_cmd = f"pdc {name} --help" if name else "pdc --help"
        _print_json(name, 2, [{"file": "<command line>", "line": 0, "col": 0,
                               "message": message, "hint": f"see `{help_cmd}`"}])
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else 0
    except UsageError as e:
        # argv[0] names the subcommand (the top level has only --help and --version), also
        # when the top-level parser refuses the rest ("unrecognized arguments").
        name = argv[0] if argv and argv[0] in COMMANDS else None
        return _argv_error(name, str(e), argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        _err("pdc: error: a command is required (see pdc --help)")
        return _argv_error(None, "a command is required", argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    raise SystemExit(main())
