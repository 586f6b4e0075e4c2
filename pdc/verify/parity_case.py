"""The case of one `pdc parity` run and what its workers bring back (pdc/verify/parity.py
prepares cases, pdc/verify/parity_workers.py plays them, pdc/verify/parity_judge.py judges
them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .hf_adapter import Binding

DTYPES = ("float32", "bfloat16")
ROOM = 1001  # odd: allocate() gives it shuffled (fragmented) pages
POISON = 0xA5  # decode items before the transfer: every state byte must be overwritten
DEFAULT_THREADS = 1  # torch threads per worker; equal everywhere (thread count changes bits)


class ParityError(Exception):
    """A problem with the request (spec, topology, options): printed, never a traceback.
    `diagnostics` holds the compiler's Diagnostics when the text is theirs (file:line:
    error: ...)."""

    def __init__(self, message: str, diagnostics: tuple = ()):
        super().__init__(message)
        self.diagnostics = diagnostics


@dataclass(frozen=True)
class Case:
    """Everything the workers need for one run; travels to them pickled."""

    job: int
    family: str
    py_name: str
    binding: Binding
    dtype: str
    engine: str
    plan_json: str
    layout: object | None  # a FamilyLayout when overrides make it differ from generated/
    prompt: tuple[int, ...]
    chunk_tokens: int
    steps: int
    ids: dict  # side -> the request's pool ids (pdc.verify.ranks.allocate)
    pages: int
    slots: int
    roles: tuple  # per worker index: (side, pp, tp, dp group) of the rank it plays
    model_worker: int
    timeout_s: float
    describe: str = ""  # the topology, for messages
    fingerprint: int = 0  # of the spec as evaluated, when `layout` is shipped
    params: tuple[tuple[str, int], ...] = ()  # the spec's evaluated params (the toys' sizes)
    decode_group: int = 0  # the request's decode DP group; the other groups' ranks idle


@dataclass
class Outcome:
    prefill: dict = field(default_factory=dict)  # (pp, tp) -> result dict
    decode: dict = field(default_factory=dict)  # (pp, tp) of the request's DP group
    idle: dict = field(default_factory=dict)  # (dp group, pp, tp) of the idle decode ranks
    model: dict | None = None
    wall_s: float = 0.0
