"""The @generated header every generated file starts with, and the spec's hash.

The header names the spec (path relative to the repository), the command that regenerates
the file and the spec's sha256. It holds no timestamp and no absolute path, so rendering is
a pure function of the spec and the compiler: `pdc check` can compare bytes.

Note [Spec hash]: the hash is taken over the canonical JSON of the spec's data
(`json.dumps(spec.raw, sort_keys=True, separators=(",", ":"))`), not over the file bytes,
so comments, key order and YAML spelling (`0xFFFFFFFF` vs `4294967295`) do not change it.
The `parity` block is left out: it says how the harness checks the family, not what the
family is (Note [Parity recipe] in compiler/model_parity.py).
It is provenance, and the wire format's fingerprint; staleness is decided by comparing
rendered bytes, never by the hash.
"""

from __future__ import annotations

import hashlib
import json

from pdc import __version__

from ..model import Spec

# Spelled in two parts so that this file itself is not taken for a generated one.
GENERATED_TAG = "@" + "generated"
_FIRST_LINE_START = f"# {GENERATED_TAG} by pdc "


def canonical_json(spec: Spec) -> str:
    data = {k: v for k, v in spec.raw.items() if k != "parity"}
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def spec_sha256(spec: Spec) -> str:
    """Hex sha256 of the spec's canonical JSON (Note [Spec hash])."""
    return hashlib.sha256(canonical_json(spec).encode()).hexdigest()


def spec_fingerprint(spec: Spec) -> int:
    """The first 8 bytes of `spec_sha256` as a little-endian u64: the wire header's field
    that both sides compare to prove they compiled the same spec."""
    return int.from_bytes(bytes.fromhex(spec_sha256(spec))[:8], "little")


def regenerate_command(spec: Spec) -> str:
    return f"pdc compile {spec.path}"


def generated_header(spec: Spec) -> str:
    """The three header lines, each ending in a newline."""
    return (
        f"{_FIRST_LINE_START}{__version__} from {spec.path} — DO NOT EDIT\n"
        f"# regenerate: {regenerate_command(spec)}\n"
        f"# spec-sha256: {spec_sha256(spec)}\n"
    )


def is_generated(text: str) -> bool:
    """Whether `text` starts with a pdc @generated header (of any version)."""
    return text.startswith(_FIRST_LINE_START)
