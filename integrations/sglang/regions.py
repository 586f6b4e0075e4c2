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
