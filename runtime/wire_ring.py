"""The two messages of a staging ring (Note [Staging ring] in runtime/staging_ring.py), part
of the wire format (runtime/wire.py; codec in runtime/wire_codec.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .plan_types import RankId
from .wire_messages import _U32, _U64, WireError, _id_array, _rank, _uint

MAX_RING_BLOCKS = 1 << 16  # staging blocks one piece names (a link has ~2 per layer)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RingFilled:
    """Prefill wrote one piece of a staged request into a slot of decode's ring: items
    [first_item, first_item + items) of the staging blocks `blocks` (indices into the link's
    blocks, Note [Staging layout]), packed in that order, each block's items back to back."""

    room: int
    generation: int
    prefill_rank: RankId
    slot: int
    first_item: int
    items: int
    blocks: np.ndarray

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "room", _uint("RingFilled.room", self.room, _U64))
        s(self, "generation", _uint("RingFilled.generation", self.generation, _U32))
        s(self, "prefill_rank", _rank("RingFilled.prefill_rank", self.prefill_rank))
        s(self, "slot", _uint("RingFilled.slot", self.slot, _U32))
        s(self, "first_item", _uint("RingFilled.first_item", self.first_item, _U64))
        s(self, "items", _uint("RingFilled.items", self.items, _U32))
        if not self.items:
            raise WireError("RingFilled.items", "a piece moves at least one item")
        blocks = _id_array("RingFilled.blocks", self.blocks)
        if not 0 < len(blocks) <= MAX_RING_BLOCKS:
            raise WireError("RingFilled.blocks",
                            f"{len(blocks)} blocks; a piece names 1..{MAX_RING_BLOCKS}")
        s(self, "blocks", blocks)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RingFilled):
            return NotImplemented
        return ((self.room, self.generation, self.prefill_rank, self.slot, self.first_item,
                 self.items) == (other.room, other.generation, other.prefill_rank, other.slot,
                                 other.first_item, other.items)
                and np.array_equal(self.blocks, other.blocks))

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True, kw_only=True)
class RingFreed:
    """Decode scattered the piece in `slot` into its pools: prefill may fill the slot again."""

    room: int
    generation: int
    decode_rank: RankId
    slot: int

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "room", _uint("RingFreed.room", self.room, _U64))
        s(self, "generation", _uint("RingFreed.generation", self.generation, _U32))
        s(self, "decode_rank", _rank("RingFreed.decode_rank", self.decode_rank))
        s(self, "slot", _uint("RingFreed.slot", self.slot, _U32))
