"""Extra pdc rows of a demo's comparison, each with its own runtime knobs.

Note [Knob rows]
~~~~~~~~~~~~~~~~
A runtime knob's effect inside a serving engine is measured as its own row of the same run:
`--pdc-knobs worker_poll=1` adds a pdc backend whose servers get PDC_WORKER_POLL=1,
interleaved with the other backends across repetitions, so a before/after meets the same load
and prompts. Its label carries the knobs ("pdc[worker_poll=1]"); names and values are
checked against runtime/knobs.py before any server starts.
"""

from __future__ import annotations


def knob_env(text: str) -> dict[str, str]:
    """'name=value,name=value' -> {'PDC_NAME': 'value'}; ValueError names a wrong part."""
    from pdc.runtime import knobs

    env = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        name, eq, value = part.partition("=")
        knob = knobs.KNOBS.get(name.strip())
        if not eq or knob is None:
            raise ValueError(f"'{part}' is not NAME=VALUE of a runtime knob; known: "
                             f"{', '.join(sorted(knobs.KNOBS))}")
        try:
            type(knob.default)(value.strip())
        except ValueError:
            raise ValueError(f"'{part}': {value.strip()!r} is not a {knob.unit} value "
                             f"(default {knob.default})") from None
        env["PDC_" + knob.name.upper()] = value.strip()
    if not env:
        raise ValueError(f"{text!r} names no knob")
    return env


def knob_label(env: dict[str, str]) -> str:
    return "pdc[" + ",".join(f"{k[4:].lower()}={v}" for k, v in env.items()) + "]"


def folder_name(label: str) -> str:
    """A row's label as a log folder's name ("pdc[a=1,b=2]" -> "pdc-a-1-b-2-")."""
    return "".join(c if c.isalnum() or c in "_-" else "-" for c in label)
