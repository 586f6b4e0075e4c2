"""What the SGLang backend's modules share: SGLang's buffers as regions, and the refusal."""

from __future__ import annotations

from dataclasses import dataclass


class RefusedModel(RuntimeError):
    """pdc cannot serve this model (or these SGLang settings); the message says why."""


@dataclass(frozen=True)
class Region:
    """One SGLang buffer as KVArgs describes it: address, bytes, bytes per item."""

    addr: int
    nbytes: int
    item_bytes: int
    what: str  # in SGLang's words, for messages
    device: str = "cpu"  # "cuda:N" for a GPU's memory (Note [SGLang memory kinds])


def state_entry(state_indices, state_types, kind: str):
    """The entry of `state_indices` (one per KVArgs.state_types) whose state type is `kind`
    ("mamba", "dsa", ...), None when SGLang registered none of that type."""
    for t, entry in zip(state_types or (), state_indices or (), strict=False):
        if str(getattr(t, "value", t)) == kind:
            return entry
    return None
