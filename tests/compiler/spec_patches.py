"""Bad-spec cases as patches of one base spec (Note [Bad specs as patches]).

Note [Bad specs as patches]: every case under bad_specs/ is `NAME.patch`, a unified diff
(no context lines) that turns good_specs/mini.yaml into a spec breaking exactly one rule; its
first hunk replaces the base's header comment with a line saying which rule. `NAME.expected`
is the complete stderr of `pdc validate bad_specs/NAME.yaml` with the patched spec written
to bad_specs/NAME.yaml under the working directory (the `bad_spec` fixture of
tests/conftest.py does that), so each diagnostic's file:line:col points into the spec as
patched. A patch says only what a case changes, and a change of the base that a patch did
not expect fails loudly here, naming the case and the line, instead of silently testing
another spec. To add a case: copy mini.yaml, break it, and write
`diff -U0 tests/compiler/good_specs/mini.yaml broken.yaml` to bad_specs/NAME.patch (the
`---`/`+++` lines name the two files), then accept its output as test_bad_specs.py says.
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = HERE / "good_specs" / "mini.yaml"
BAD = HERE / "bad_specs"
CASES = sorted(p.stem for p in BAD.glob("*.patch"))

_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A patch does not apply to the base spec as it is."""


def apply_patch(base: str, patch: str, name: str) -> str:
    """`base` with the hunks of the unified diff `patch` applied; every removed line must be
    in `base` where the hunk says, else PatchError naming `name` and the line."""
    lines = base.splitlines(keepends=True)
    out: list[str] = []
    done = 0  # base lines consumed
    hunk: re.Match[str] | None = None
    for raw in patch.splitlines(keepends=True):
        head = _HUNK.match(raw)
        if head:
            hunk = head
            start, count = int(head[1]), 1 if head[2] is None else int(head[2])
            first = start if count == 0 else start - 1  # count 0: insert after line `start`
            if first < done:
                raise PatchError(f"{name}: hunk {raw.strip()} overlaps the previous one")
            out += lines[done:first]
            done = first
        elif hunk is None or raw.startswith(("---", "+++")):
            continue  # the file header
        elif raw.startswith("-"):
            if done >= len(lines) or lines[done] != raw[1:]:
                got = lines[done].rstrip("\n") if done < len(lines) else "end of file"
                raise PatchError(f"{name}: line {done + 1} of {BASE.name} is {got!r}, the patch "
                                 f"removes {raw[1:].rstrip()!r}; regenerate the patch")
            done += 1
        elif raw.startswith("+"):
            out.append(raw[1:])
        else:
            raise PatchError(f"{name}: {raw.rstrip()!r} is no line of a context-free hunk")
    return "".join(out + lines[done:])


def bad_spec_text(name: str) -> str:
    """The spec of case `name`: the base spec with bad_specs/NAME.patch applied."""
    return apply_patch(BASE.read_text(), (BAD / f"{name}.patch").read_text(), name)


def write_bad_spec(root: Path, name: str) -> str:
    """Write case `name` to root/bad_specs/NAME.yaml; returns that path relative to `root`
    (the name its diagnostics print when `root` is the working directory)."""
    rel = f"bad_specs/{name}.yaml"
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(bad_spec_text(name))
    return rel
