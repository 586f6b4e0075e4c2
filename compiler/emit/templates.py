"""The one Jinja environment of the compiler, and rendering with a syntax check.

Templates live in compiler/templates/ and are named `<output>.py.j2`. They are thin: loops
and substitutions over a view model (a frozen dataclass of ready-made strings and ints,
passed as `view`); every name, number and indentation is computed in Python. StrictUndefined
turns a misspelt view field into an error instead of an empty string.

Every rendered text is parsed with `ast.parse` before it leaves here, so a template bug
fails at compile time, naming the template, rather than when the runtime imports the file.
"""

from __future__ import annotations

import ast
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"

ENV = Environment(
    loader=FileSystemLoader(TEMPLATE_DIR),
    undefined=StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)


class TemplateOutputError(RuntimeError):
    """A template rendered text that is not valid Python (a compiler bug, not a spec error)."""


def render(template: str, view: object) -> str:
    """Render `template` with `view` bound to the name `view`; the result parses as Python."""
    text = ENV.get_template(template).render(view=view)
    try:
        ast.parse(text, filename=template)
    except SyntaxError as e:
        lines = text.splitlines()
        line = lines[e.lineno - 1] if e.lineno and 0 < e.lineno <= len(lines) else ""
        raise TemplateOutputError(
            f"template {template} rendered invalid Python at output line {e.lineno}: {e.msg}\n"
            f"  {line}"
        ) from None
    return text
