"""Faults an endpoint commits on purpose (Note [Fault hooks])."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Faults:
    """Note [Fault hooks]: a harness shows that one side detects the other side's misbehaviour
    (the sabotage runs of pdc/verify/reliability.py, tests of the refusals) by making an
    endpoint misbehave at a named point of its protocol. The endpoint takes them as an explicit
    argument (`faults=`, or its public `faults` attribute) and consults them only at the points
    named here; nothing patches its methods. Serving passes none (NO_FAULTS), which changes
    nothing.
    """

    # Prefill, on an Abort (prefill_control.py, _on_abort): acknowledge it at once with
    # AbortAck(drained=true) and change nothing else, although writes of the room may still be
    # in flight. Decode then reuses pages that a late write can land in, which is exactly what
    # the drain-ack exists to prevent (the reliability harness's canaries must catch it).
    ack_abort_before_drain: bool = False
    # Decode, in DecodeReceiver.init (decode.py): every (address, bytes) of a staging region it
    # is about to ask a prefill rank for goes through this function first, so that a test can
    # name memory outside the registered arena or a region of the wrong size (prefill must
    # refuse the request before any write).
    staging_region: Callable[[int, int], tuple[int, int]] | None = None


NO_FAULTS = Faults()
