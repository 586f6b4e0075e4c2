"""The `pdc` command line: `pdc validate | compile | check | demo ...`.

Exit codes: 0 success; 1 a spec error, stale generated code or a failed command; 2 a usage
error (argparse's own exit code). Diagnostics go to stderr, results to stdout. A mistake in a
spec or a path never produces a Python traceback; a bug in pdc still does.

The subcommands live in pdc/commands/, one module per group (Note [Subcommands] in
pdc/commands/common.py); importing them registers them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from pdc import __version__

from .commands import common, runs, serving, specs
from .commands.common import err, print_json

# The groups of subcommands, imported for their registration, and the order `pdc --help`
# lists the subcommands in (the spec tools first; one registered elsewhere comes last).
GROUPS = (specs, runs, serving)
HELP_ORDER = ("validate", "compile", "check", "plan", "vllm-demo", "demo", "sglang-demo",
              "parity")


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
        err(f"{self.prog}: error: {message}")
        raise UsageError(self.prog, message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pdc",
        description="Compiler and lean runtime for prefill/decode disaggregated LLM state "
        "transfer: one YAML spec per model family, generated layout code under generated/.",
    )
    parser.add_argument("--version", action="version", version=f"pdc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    listed = sorted(common.COMMANDS.values(), key=lambda c: (
        HELP_ORDER.index(c.name) if c.name in HELP_ORDER else len(HELP_ORDER)))
    for c in listed:
        p = sub.add_parser(c.name, help=c.summary, description=c.doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        for a in c.args:
            p.add_argument(*a.flags, **a.options)
    return parser


def _argv_error(name: str | None, message: str, argv: list[str]) -> int:
    """Exit status 2 for a command line argparse refused; the JSON object under --json."""
    if "--json" in argv:
        help_cmd = f"pdc {name} --help" if name else "pdc --help"
        print_json(name, 2, [{"file": "<command line>", "line": 0, "col": 0,
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
        name = argv[0] if argv and argv[0] in common.COMMANDS else None
        return _argv_error(name, str(e), argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        err("pdc: error: a command is required (see pdc --help)")
        return _argv_error(None, "a command is required", argv)
    try:
        return common.COMMANDS[args.command].run(args)
    except BrokenPipeError:
        # The reader left (`pdc plan ... | head`): no traceback, and none again at exit when
        # Python flushes stdout into the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
