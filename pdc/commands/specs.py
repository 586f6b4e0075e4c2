"""The compiler's subcommands: `pdc validate`, `compile`, `check`, `bind` and `plan`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import JSON_ARG, arg, command, err, is_usage, plural, print_json, usage_error

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
        err(f"pdc {name}: error: no spec given and none found in {display_path(SPECS_DIR)}/")
        return None
    return list(found)


def _report_errors(name: str, build, n_specs: int, suffix: str = "") -> None:
    err(build.render_diagnostics(),
         f"pdc {name}: {plural(len(build.diagnostics), 'error')} in {len(build.failed)} of "
         f"{plural(n_specs, 'spec')}{suffix}")


@command("validate", _SPEC_ARG, JSON_ARG)
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
        return print_json("validate", 2) if args.json else 2
    b = build(paths)
    specs = [str(p) for p in paths]
    if not b.ok:
        _report_errors("validate", b, len(paths))
        return print_json("validate", 1, b.diagnostics, specs=specs, failed=b.failed) \
            if args.json else 1
    if args.json:
        return print_json("validate", 0, specs=specs, failed=[])
    print(f"pdc validate: {plural(len(paths), 'spec')} ok")
    return 0


@command("compile", _SPEC_ARG, _OUT_ARG, JSON_ARG)
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
        return print_json("compile", 2) if args.json else 2
    b = build(paths, deployments="prove")
    if not b.ok:
        _report_errors("compile", b, len(paths), "; nothing written")
        return print_json("compile", 1, b.diagnostics, failed=b.failed, written=[]) \
            if args.json else 1
    out = args.out if args.out is not None else DEFAULT_OUT
    label = display_path(out)
    try:
        changed = b.output.commit(out)
        removed, kept = ([], []) if args.specs else b.output.remove_orphans(out)
    except OSError as e:
        err(f"pdc compile: error: cannot write {e.filename or label}: {e.strerror or e}")
        return print_json("compile", 1, [{"file": str(e.filename or label), "line": 0,
                                           "col": 0, "message": f"cannot write: {e.strerror}",
                                           "hint": "check the output folder"}]) \
            if args.json else 1
    if args.json:
        for p in kept:
            err(f"pdc compile: warning: {label}/{p} is produced by no spec and has no "
                 "@generated header; delete it by hand")
        return print_json("compile", 0, written=[f"{label}/{p}" for p in changed],
                           removed=[f"{label}/{p}" for p in removed],
                           files=len(b.output), specs=len(b.specs))
    for p in changed:
        print(f"wrote {label}/{p}")
    for p in removed:
        print(f"removed {label}/{p} (no spec produces it)")
    for p in kept:
        err(f"pdc compile: warning: {label}/{p} is produced by no spec and has no @generated "
             "header; delete it by hand")
    n = len(b.output)
    state = f"{len(changed)} of {plural(n, 'file')} changed" if changed else \
        f"{plural(n, 'file')} up to date"
    print(f"pdc compile: {state} ({plural(len(b.specs), 'spec')})")
    return 0


@command("check", _OUT_ARG, JSON_ARG)
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
        return print_json("check", 2) if args.json else 2
    b = build(paths, deployments="skip")
    if not b.ok:
        _report_errors("check", b, len(paths))
        return print_json("check", 1, b.diagnostics, stale=[], orphans=[]) if args.json else 1
    out = args.out if args.out is not None else DEFAULT_OUT
    label = display_path(out)
    try:
        diff, stale, orphans = b.output.diff(out, label)
    except OSError as e:
        err(f"pdc check: error: cannot read {e.filename or label}: {e.strerror or e}")
        return print_json("check", 1, [{"file": str(e.filename or label), "line": 0,
                                         "col": 0, "message": f"cannot read: {e.strerror}",
                                         "hint": "check the output folder"}]) \
            if args.json else 1
    if args.json:
        if stale or orphans:
            err(f"pdc check: {label}/ is out of date; regenerate with: pdc compile")
        return print_json("check", 1 if stale or orphans else 0,
                           stale=[f"{label}/{p}" for p in stale],
                           orphans=[f"{label}/{p}" for p in orphans], files=len(b.output),
                           specs=len(b.specs))
    if not stale and not orphans:
        print(f"pdc check: {label}/ is up to date ({plural(len(b.specs), 'spec')}, "
              f"{plural(len(b.output), 'file')})")
        return 0
    sys.stdout.write(diff)
    regenerate = "pdc compile" + (f" --out {label}" if args.out is not None else "")
    problems = [plural(len(stale), "stale file")] if stale else []
    problems += [plural(len(orphans), "orphan file")] if orphans else []
    err(f"pdc check: {label}/ is out of date: {', '.join(problems)}",
         *(f"  {'stale' if (out / p).exists() else 'missing'}: {label}/{p}" for p in stale),
         *(f"  orphan: {label}/{p} (produced by no spec)" for p in orphans),
         f"regenerate with: {regenerate}")
    return 1


@command(
    "bind",
    arg("spec", metavar="SPEC", help="family spec"),
    arg("--config", required=True, metavar="FILE", type=Path,
        help="the model's config.json (Hugging Face)"),
    arg("--engine-page-size", type=int, default=None, metavar="N",
        help="the engine's KV page size in tokens (engine.page_size)"),
    arg("--engine-kv-dtype", default=None, metavar="DTYPE",
        help="the engine's KV cache dtype (engine.kv_dtype), e.g. bfloat16"),
    arg("--engine-ssm-dtype", default=None, metavar="DTYPE",
        help="the engine's SSM state dtype (engine.ssm_dtype), e.g. float32"),
    arg("--tp", type=int, default=1, metavar="N",
        help="attention TP size for the bytes per rank (default: 1)"),
)
def cmd_bind(args: argparse.Namespace) -> int:
    """Bind a spec to a model's config and print the bound family.

    The spec's params that say `{from: config.KEY}` take the config's values, those that
    say `{from: engine.page_size}` and dtypes `{from: engine.kv_dtype}` (or
    `engine.ssm_dtype`) the --engine-*
    values (Note [Bound families] in runtime/binding.py): exactly what a serving process
    binds at start. Prints every param with where it came from, the layer kinds, every
    component's item and the bytes per token and per request on one rank of --tp.
    Params the spec writes by hand, its `model` dtype and its layer kinds are checked
    against the config too (Note [Config cross-check] in pdc/bind.py).

    Exit status: 0 when the spec binds, 1 with located errors (spec line, config key and
    value) when it does not, 2 on a usage error.
    """
    from pdc.bind import run_bind

    if args.tp < 1:
        return usage_error("bind", f"--tp {args.tp} is not a TP size", "give --tp >= 1", False)
    engine = {k: v for k, v in (("page_size", args.engine_page_size),
                                ("kv_dtype", args.engine_kv_dtype),
                                ("ssm_dtype", args.engine_ssm_dtype)) if v is not None}
    return run_bind(args.spec, args.config, engine, args.tp, sys.stdout)


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
    from pdc.compiler.family import declared_as, plan_spec
    from pdc.compiler.frontend import parse_spec_text, read_spec_text
    from pdc.compiler.report import plan_report, render_json
    from pdc.compiler.topology import parse_side_arg

    if args.tokens < 1 or args.tokens > 2**24:
        return usage_error("plan", f"--tokens is {args.tokens}", "give a request length "
                            "from 1 to 16777216 tokens", args.json)
    name = spec_display_path(args.spec)
    text = read_spec_text(args.spec, name)
    if not isinstance(text, str):
        err(text.render(), "1 error")
        return print_json("plan", 1, [text]) if args.json else 1
    try:
        errs = parse_side_arg(args.prefill, "--prefill")[1] + \
            parse_side_arg(args.decode, "--decode")[1]
        if errs:
            raise SpecErrors(errs)
        page = parse_side_arg(args.prefill, "--prefill")[0].get("page_size")
        spec = parse_spec_text(text, name, {"page_size": page} if page else None)
        family, plan = plan_spec(spec, args.prefill, args.decode, args.backend)
    except SpecErrors as e:
        err(str(e))
        code = 2 if is_usage(e.diagnostics) else 1
        return print_json("plan", code, e.diagnostics) if args.json else code
    layout = family.layout
    problems = prove(layout, plan)
    # Only the spec as written has generated plans (a --prefill page_size re-evaluates it).
    declared = "" if page else declared_as(spec, family, plan.topology)
    report = plan_report(layout, plan, args.tokens, problems, declared)
    code = 0 if not problems else 1
    if args.svg is not None or args.png is not None:
        drawn = _draw_plan(layout, plan, report, args.svg, args.png)
        if drawn:
            err(f"pdc plan: error: {drawn}")
            return print_json("plan", 1, [{"file": "--svg/--png", "line": 0, "col": 0,
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
            err(f"pdc plan: drew {svg}")
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
            err(f"pdc plan: drew {png}")
    except OSError as e:
        return f"cannot write {e.filename}: {e.strerror or e}"
    except subprocess.CalledProcessError as e:
        return f"rsvg-convert failed: {e.stderr.decode(errors='replace').strip()}"
    return ""
