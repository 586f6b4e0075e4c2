"""Every runtime timeout and limit, declared once with its default and its meaning.

Read a knob with `knobs.get("name")`; set one for a process with the environment variable
`PDC_<NAME>` (upper case) or in code with `knobs.override(name=value)`. Code never reads
os.environ for these directly, so this file is the complete list (docs/knobs.md mirrors it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    name: str
    default: float | int
    unit: str
    doc: str


KNOBS = {k.name: k for k in (
    Knob("bootstrap_timeout_s", 30.0, "s", "how long a decode rank waits for the prefill "
         "bootstrap table and for every linked prefill rank to accept its registration"),
    Knob("transfer_timeout_s", 60.0, "s", "deadline of one request on decode, from init() to "
         "Success; past it the request is Failed (prefill side: per engine batch wait)"),
    Knob("abort_ack_timeout_s", 10.0, "s", "how long decode keeps an aborted request's pages "
         "waiting for the prefill ack before quarantining them"),
    Knob("heartbeat_interval_s", 1.0, "s", "period of heartbeats between linked ranks"),
    Knob("peer_dead_after_s", 5.0, "s", "a linked peer silent for this long is declared dead "
         "and its in-flight requests fail"),
    Knob("max_descriptors_per_submit", 1024, "entries", "engine batches are split at this "
         "size (Mooncake's per-peer TCP queue holds 1024)"),
    Knob("max_message_bytes", 64 << 20, "bytes", "control messages above this are rejected "
         "before decoding"),
    Knob("max_pending_rooms", 65536, "rooms", "rooms a prefill rank tracks at once; more "
         "are rejected with a reason (bounds memory under floods)"),
    Knob("max_registrations", 1024, "peers", "decode registrations a prefill rank keeps"),
    Knob("staged_min_descriptors", 4096, "descriptors", "a chunk whose direct path needs more "
         "descriptors than this per peer goes through the staged (gather/scatter) path"),
    Knob("poll_sleep_s", 0.0002, "s", "idle sleep of the transfer worker between polls"),
)}

_overrides: dict[str, float | int] = {}


def get(name: str):
    knob = KNOBS[name]
    if name in _overrides:
        return _overrides[name]
    env = os.environ.get("PDC_" + name.upper())
    if env is not None:
        try:
            return type(knob.default)(env)
        except ValueError:
            raise ValueError(f"PDC_{name.upper()}={env!r} is not a valid {knob.unit} value "
                             f"(default {knob.default})") from None
    return knob.default


def override(**values) -> None:
    for name, value in values.items():
        if name not in KNOBS:
            raise KeyError(f"unknown knob '{name}'; known: {', '.join(sorted(KNOBS))}")
        _overrides[name] = value


def table() -> str:
    rows = [f"| `{k.name}` | `PDC_{k.name.upper()}` | {k.default} {k.unit} | {k.doc} |"
            for k in KNOBS.values()]
    return "| knob | env | default | meaning |\n|---|---|---|---|\n" + "\n".join(rows)
