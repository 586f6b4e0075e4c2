"""What every subcommand of the `pdc` command line shares: the registry of subcommands, the
`--json` output and the checks of arguments that several commands take.

Note [Subcommands]: each subcommand is one function decorated with `@command(name, *args)`.
Its docstring is the help: the first line is the summary shown by `pdc --help`, the rest the
description shown by `pdc NAME --help`; `args` are `arg(...)` calls taking
`ArgumentParser.add_argument`'s parameters. The function receives the parsed namespace and
returns the exit code. Import heavy modules (the compiler, torch, engines) inside the
function, so that `pdc --help` and unrelated subcommands stay fast and independent. One
module of pdc/commands/ per group of subcommands; pdc/cli.py imports them and says the order
`pdc --help` lists them in (HELP_ORDER).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass


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


# Every subcommand, by name (Note [Subcommands]).
COMMANDS: dict[str, Command] = {}


def command(name: str, *args: Arg) -> Callable:
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in COMMANDS:
            raise ValueError(f"subcommand {name!r} is registered twice")
        COMMANDS[name] = Command(name, fn, args)
        return fn

    return register


def err(*lines: str) -> None:
    for line in lines:
        print(line, file=sys.stderr)


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# ~~~ machine-readable output (Note [JSON output]) ~~~
# Note [JSON output]: with --json a command prints exactly one JSON object on stdout, on
# success and on failure alike, and nothing else: {"command", "ok", "exit", ...its result...,
# "errors": [{"file", "line", "col", "message", "hint"}]}. A usage error, a spec error and a
# failed run differ only in "exit" (2, 1, 1) and where the errors point ("<command line>" for
# a flag). argparse's own refusals are answered so too (main and _Parser in pdc/cli.py).
# Diagnostics, reports and progress go to stderr as text (Note [Console output] in
# pdc/console.py). The keys per command are listed in docs/cli.md.

JSON_ARG = arg("--json", action="store_true",
               help="print one JSON object on stdout (errors included) instead of text")


def diagnostic_json(d) -> dict:
    return {"file": d.loc.file, "line": d.loc.line, "col": d.loc.col, "message": d.message,
            "hint": d.hint}


def print_json(command: str, code: int, errors=(), **result) -> int:
    import json

    out = {"command": command, "ok": code == 0, "exit": code, **result,
           "errors": [e if isinstance(e, dict) else diagnostic_json(e) for e in errors]}
    sys.stdout.write(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return code


def usage_error(command: str, message: str, hint: str, as_json: bool) -> int:
    """A wrong argument: exit status 2 (argparse's), as text on stderr or a JSON object."""
    err(f"pdc {command}: error: {message}", f"  hint: {hint}")
    if as_json:
        return print_json(command, 2, [{"file": "<command line>", "line": 0, "col": 0,
                                         "message": message, "hint": hint}])
    return 2


def is_usage(diagnostics) -> bool:
    """Diagnostics about a flag (`--prefill: error: ...`), not about a spec."""
    return bool(diagnostics) and all(d.loc.file.startswith("--") for d in diagnostics)


# Caps of the demos with real servers: prompts and greedy tokens per prompt.
MAX_DEMO_PROMPTS = 10_000
MAX_DEMO_NEW_TOKENS = 1024
MAX_DEMO_ENGINES = 4  # of each side in `pdc vllm-demo`, on the 2-core box it is made for

# Caps of `pdc demo` (Note [Spec limits]): each rank is a process on this machine.
MAX_DEMO_PROCESSES = 64
MAX_DEMO_REQUESTS = 100_000
MAX_DEMO_CONCURRENCY = 256


def range_problem(checks) -> tuple[str, str] | None:
    """(message, hint) for the first (flag, value, low, high) whose value is out of range."""
    for flag, value, low, high in checks:
        if not low <= value <= high:
            return f"{flag} is {value}", f"give {flag} from {low} to {high}"
    return None


def spec_family(path: str, cmd: str) -> str | None:
    from pdc.compiler.diagnostics import SpecErrors
    from pdc.compiler.frontend import load_spec

    try:
        return load_spec(path).family
    except SpecErrors as e:
        err(str(e))
        return None
    except OSError as e:
        print(f"pdc {cmd}: error: cannot read {path}: {e.strerror}", file=sys.stderr)
        return None
