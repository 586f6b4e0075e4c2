"""Python source fragments for view models: literals, wrapped tuples, comment blocks.

Generated files are excluded from formatters (a formatter's version would change their
bytes), so the layout of the text is decided here, deterministically: a value goes on one
line when it fits in LINE_WIDTH columns, otherwise its items are packed onto indented lines.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Callable
from typing import Any

LINE_WIDTH = 100
INDENT = "    "


class Name(str):
    """A bare Python name to write as is (a constant defined earlier), not as a string."""

    __slots__ = ()


def py_str(s: str) -> str:
    """A double-quoted Python string literal (JSON escapes are valid Python escapes)."""
    return json.dumps(s, ensure_ascii=False)


def py_hex32(v: int) -> str:
    return f"0x{v:08X}"


def py_value(value: object, indent: int = 0, used: int = 0,
             fields: dict[str, Callable[[Any], str]] | None = None) -> str:
    """Source text of `value` (None, bool, int, str, tuple, dict with str keys, or a dataclass
    instance).

    `indent` is the nesting level of the line the value starts on; `used` is how many
    columns of that line are already taken (e.g. by `name=`). Dataclasses are written as
    `Type(field=value, ...)` with keyword arguments; `fields` overrides the formatting of
    scalar fields by name (e.g. a sentinel in hex).
    """
    fields = fields or {}
    if isinstance(value, Name):
        return str(value)
    if value is None or isinstance(value, bool | int):
        return repr(value)
    if isinstance(value, str):
        return py_str(value)
    if isinstance(value, dict):
        items = [f"{py_str(k)}: " + py_value(v, indent + 1, len(k) + 4, fields)
                 for k, v in value.items()]
        one = "{" + ", ".join(items) + "}"
        if "\n" not in one and len(INDENT) * indent + used + len(one) <= LINE_WIDTH - 1:
            return one
        return _packed("{", items, "}", indent)
    if isinstance(value, tuple):
        items = [py_value(v, indent + 1, 0, fields) for v in value]
        one = "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if "\n" not in one and len(INDENT) * indent + used + len(one) <= LINE_WIDTH - 1:
            return one
        return _packed("(", items, ")", indent)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        args = []
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            prefix = f"{f.name}="
            if f.name in fields and v is not None:
                args.append(prefix + fields[f.name](v))
            else:
                args.append(prefix + py_value(v, indent + 1, len(prefix), fields))
        name = type(value).__name__
        one = f"{name}(" + ", ".join(args) + ")"
        if "\n" not in one and len(INDENT) * indent + used + len(one) <= LINE_WIDTH - 1:
            return one
        inner = INDENT * (indent + 1)
        return f"{name}(\n" + "".join(f"{inner}{a},\n" for a in args) + INDENT * indent + ")"
    raise TypeError(f"no Python literal for {type(value).__name__}: {value!r}")


def _packed(open_: str, items: list[str], close: str, indent: int) -> str:
    """Items packed onto lines at indent + 1 (one per line when any item is multi-line)."""
    inner = INDENT * (indent + 1)
    if any("\n" in i for i in items):
        return open_ + "\n" + "".join(f"{inner}{i},\n" for i in items) + INDENT * indent + close
    lines, line = [], ""
    for i in items:
        piece = f"{i},"
        if line and len(inner) + len(line) + 1 + len(piece) > LINE_WIDTH:
            lines.append(line)
            line = piece
        else:
            line = f"{line} {piece}" if line else piece
    lines.append(line)
    return open_ + "\n" + "".join(f"{inner}{ln}\n" for ln in lines) + INDENT * indent + close


def wrap(text: str, indent: int = 0) -> list[str]:
    """`text` as lines of at most LINE_WIDTH columns (at `indent` levels)."""
    return textwrap.wrap(text, LINE_WIDTH - len(INDENT) * indent, break_long_words=False,
                         break_on_hyphens=False) or [""]


def comment_lines(text: str, indent: int = 0) -> tuple[str, ...]:
    """`text` as `# ...` lines wrapped to LINE_WIDTH; blank lines of the text are kept."""
    width = LINE_WIDTH - len(INDENT) * indent - 2
    out: list[str] = []
    for para in text.strip().splitlines():
        wrapped = textwrap.wrap(para.strip(), width, break_long_words=False,
                                break_on_hyphens=False)
        if wrapped:
            out.extend(f"# {w}" for w in wrapped)
        else:
            out.append("#")
    return tuple(out)


def docstring_text(text: str) -> str:
    """`text` made safe inside a triple-quoted docstring."""
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
