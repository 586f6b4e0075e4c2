"""What both endpoints share: the request and page states, the backend check, peer names."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .. import knobs
from .. import wire as W
from ..engines.base import TransferEngine
from ..plan_types import Plan, RankId

REG_ROOM = 2**64 - 1


KVPoll = W.KVPoll  # one enum for the API and the wire (Note [Request states], states.py)


def no_signal() -> None:
    """An endpoint's `on_change` until its engine sets one (Note [State-change signal])."""


class PageState(enum.Enum):
    """May the decode pages of a request be given to another request?"""

    IN_USE = "in_use"  # the request is not finished: prefill may write
    PENDING = "pending"  # failed; waiting for every prefill rank to confirm its writes drained
    REUSABLE = "reusable"  # no write of this request can land any more
    QUARANTINED = "quarantined"  # unknown: never reuse these pages


@dataclass
class RequestStats:
    bytes: int = 0
    descriptors: int = 0
    batches: int = 0
    layer_batches: int = 0  # of `batches`: one layer's pages, before the forward was done
    t_init: float = 0.0
    t_done: float = 0.0


def check_backend(plan: Plan, engine: TransferEngine) -> None:
    """A plan runs only over the engine it was lowered for (Note [Plan backend]).

    Note [Plan backend]: lowering applies the backend's rules (NIXL and MORI refuse
    heterogeneous attention TP, MORI refuses PP), so a plan lowered for Mooncake and run over
    NIXL would bypass NIXL's refusal. Each endpoint refuses a plan for another engine before
    it registers anything; the plan digest exchanged in the handshake covers the backend, so
    two sides that pass this check with different plans are refused there. An engine names
    the backend its plans use (`TransferEngine.backend`): its own name, or "local" for
    cuda_ipc, which moves any descriptor list within one host as the local engines do.
    """
    if plan.topology.backend != engine.backend:
        runs = f"'{engine.name}'" if engine.backend == engine.name else \
            f"'{engine.name}' (plans for '{engine.backend}')"
        raise ValueError(
            f"the plan was lowered for backend '{plan.topology.backend}' but this endpoint's "
            f"engine is {runs}; hint: lower the plan for '{engine.backend}' (its "
            "backend rules may refuse this topology) or run the "
            f"'{plan.topology.backend}' engine")


def check_knobs() -> None:
    """Refuse to start with a knob set to a value it does not take (Note [Knobs checked at
    start] in runtime/knobs.py), naming every such knob at once."""
    bad = knobs.errors()
    if bad:
        raise ValueError("; ".join(bad) + "; hint: fix or unset these (docs/knobs.md lists "
                         "each knob's values)")


def _peer_name(side: str, dp: int, rank: RankId, instance: str = "") -> str:
    """`decode.dp0.pp0.tp0`, with `@instance` when the rank names its decode instance (Note
    [Decode instances] in handshake.py)."""
    return f"{side}.dp{dp}.{rank}" + (f"@{instance}" if instance else "")


def _clip(reason: str) -> str:
    return reason.encode()[:W.MAX_REASON_BYTES].decode(errors="ignore") or "failed"
