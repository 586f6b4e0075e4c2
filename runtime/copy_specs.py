"""The copy kernels' data model (runtime/copy_kernels.py): which bytes of a pool's items an entry
moves (`SegmentSpec`, made from a plan `Segment` by `SegmentSpec.of`), the pools (`Entry`), how
a launch is tiled (`Tiling`, `default_tiling`), and the one power-of-two alignment rule every
kernel launcher of the runtime uses (`pow2_alignment`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from numbers import Integral

import numpy as np
import torch


def pow2_alignment(*values, limit: int = 16) -> int:
    """The largest power of two, at most `limit`, that divides every value (ints or integer
    arrays, e.g. addresses, offsets and lengths of one launch); `limit` when all are 0.

    The lowest set bit of the values OR-ed together is the lowest set bit of their gcd."""
    g = 0
    for v in values:
        if isinstance(v, np.ndarray):
            g |= int(np.bitwise_or.reduce(v.astype(np.uint64, copy=False).ravel(),
                                               initial=np.uint64(0)))
        else:
            g |= int(v)
    return limit if g == 0 else min(limit, g & -g)


def _as_int(owner: str, name: str, value: object) -> int:
    # bool is an Integral too, and a spec field set to True is always a mistake.
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{owner}.{name} must be an int, got {type(value).__name__}")
    return int(value)


@dataclass(frozen=True)
class SegmentSpec:
    """Which bytes of each item an entry moves: `repeat` pieces of `seg_bytes` bytes, the first at
    `seg_offset`, each `seg_stride` bytes after the previous one.

    A whole item is `SegmentSpec.whole(item_bytes)`. A head range [h0, h1) of a KV page laid out
    as [page_size, heads, head_dim] of `b`-byte values is
    `SegmentSpec(h0 * head_dim * b, (h1 - h0) * head_dim * b, page_size, heads * head_dim * b,
    page_size * heads * head_dim * b)`.
    """

    seg_offset: int
    seg_bytes: int
    repeat: int
    seg_stride: int
    item_bytes: int

    def __post_init__(self) -> None:
        for name in ("seg_offset", "seg_bytes", "repeat", "seg_stride", "item_bytes"):
            object.__setattr__(self, name, _as_int("SegmentSpec", name, getattr(self, name)))
        if self.item_bytes <= 0:
            raise ValueError(f"SegmentSpec.item_bytes must be positive, got {self.item_bytes}")
        if self.seg_bytes <= 0:
            raise ValueError(f"SegmentSpec.seg_bytes must be positive, got {self.seg_bytes}")
        if self.repeat < 1:
            raise ValueError(f"SegmentSpec.repeat must be >= 1, got {self.repeat}")
        if self.seg_offset < 0:
            raise ValueError(f"SegmentSpec.seg_offset must be >= 0, got {self.seg_offset}")
        # Overlapping pieces would make scatter write the same bytes twice in one launch.
        if self.repeat > 1 and self.seg_stride < self.seg_bytes:
            raise ValueError(
                f"SegmentSpec.seg_stride must be >= seg_bytes ({self.seg_bytes}) when repeat > 1, "
                f"got {self.seg_stride}"
            )
        if self.seg_stride < 0:
            raise ValueError(f"SegmentSpec.seg_stride must be >= 0, got {self.seg_stride}")
        if self.end > self.item_bytes:
            raise ValueError(
                f"SegmentSpec ends at byte {self.end} but item_bytes is {self.item_bytes}"
            )

    @classmethod
    def whole(cls, item_bytes: int) -> SegmentSpec:
        """The whole item as one piece."""
        return cls(seg_offset=0, seg_bytes=item_bytes, repeat=1, seg_stride=item_bytes,
                   item_bytes=item_bytes)

    @property
    def packed_bytes(self) -> int:
        """Bytes one item's segment takes in the staging buffer."""
        return self.repeat * self.seg_bytes

    @property
    def end(self) -> int:
        """One past the last byte of the item that the segment touches."""
        return self.seg_offset + (self.repeat - 1) * self.seg_stride + self.seg_bytes

    @classmethod
    def of(cls, segment, item_bytes: int, side: str) -> SegmentSpec:
        """One side of a plan `Segment` (runtime/plan_types.py) in items of `item_bytes`: its
        source ("src") or destination ("dst") offset and stride. The one conversion from plan
        segments to kernel specs."""
        if side == "src":
            return cls(segment.src_offset, segment.nbytes, segment.repeat, segment.src_stride,
                       item_bytes)
        if side == "dst":
            return cls(segment.dst_offset, segment.nbytes, segment.repeat, segment.dst_stride,
                       item_bytes)
        raise ValueError(f"SegmentSpec.of: side is 'src' or 'dst', not {side!r}")

    def alignment(self) -> int:
        """Largest power of two dividing every offset and length of the segment (capped at 16)."""
        return pow2_alignment(self.seg_offset, self.seg_bytes, self.seg_stride, self.item_bytes)


@dataclass(frozen=True, eq=False)
class Entry:
    """One pool buffer and the segment of its items that a transfer moves.

    `pool` is the pool tensor (any dtype and shape, contiguous; capacity defaults to its bytes
    over `spec.item_bytes`) or the pool's base address as an int, for memory that torch does not
    own (then `capacity` is required and the caller guarantees the device). The entry keeps the
    tensor alive for as long as a table holds its address.
    """

    pool: torch.Tensor | int
    spec: SegmentSpec
    capacity: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.spec, SegmentSpec):
            raise ValueError(f"Entry.spec must be a SegmentSpec, got {type(self.spec).__name__}")
        if self.capacity is not None:
            object.__setattr__(self, "capacity", _as_int("Entry", "capacity", self.capacity))
            if self.capacity < 1:
                raise ValueError(f"Entry.capacity must be >= 1, got {self.capacity}")
        item = self.spec.item_bytes
        if isinstance(self.pool, torch.Tensor):
            if not self.pool.is_contiguous():
                raise ValueError("Entry.pool must be a contiguous tensor")
            nbytes = self.pool.numel() * self.pool.element_size()
            if self.capacity is None:
                if nbytes == 0 or nbytes % item:
                    raise ValueError(
                        f"Entry.pool holds {nbytes} bytes, not a positive multiple of "
                        f"item_bytes {item}"
                    )
                object.__setattr__(self, "capacity", nbytes // item)
            elif self.capacity * item > nbytes:
                raise ValueError(
                    f"Entry.capacity {self.capacity} items of {item} bytes exceed the pool's "
                    f"{nbytes} bytes"
                )
        elif isinstance(self.pool, Integral) and not isinstance(self.pool, bool):
            object.__setattr__(self, "pool", int(self.pool))
            if self.pool <= 0:
                raise ValueError(f"Entry.pool address must be positive, got {self.pool}")
            if self.capacity is None:
                raise ValueError("Entry.capacity is required when Entry.pool is an address")
        else:
            raise ValueError(
                f"Entry.pool must be a torch.Tensor or an int address, got "
                f"{type(self.pool).__name__}"
            )

    @property
    def address(self) -> int:
        return self.pool.data_ptr() if isinstance(self.pool, torch.Tensor) else self.pool

    @property
    def device(self) -> torch.device | None:
        return self.pool.device if isinstance(self.pool, torch.Tensor) else None


@dataclass(frozen=True)
class Tiling:
    """How one launch is cut into programs (performance only; results never depend on it).

    Each program copies `rows` pieces (index position x piece) times `iters` column blocks of
    `block_bytes` bytes. `rows` and `block_bytes` must be powers of two (Triton tile shapes).
    """

    rows: int
    block_bytes: int
    iters: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("rows", "block_bytes", "iters", "num_warps"):
            value = _as_int("Tiling", name, getattr(self, name))
            if value < 1:
                raise ValueError(f"Tiling.{name} must be >= 1, got {value}")
        for name in ("rows", "block_bytes", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"Tiling.{name} must be a power of two, got {value}")
        if self.rows * self.block_bytes > 2**20:
            # Triton caps a tile at 2^20 elements; bytes bound the elements for every word size.
            raise ValueError(
                f"Tiling tile of {self.rows} x {self.block_bytes} bytes exceeds 2^20 bytes"
            )


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a constexpr_function; its wrapper costs microseconds on every launch.
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


@functools.lru_cache(maxsize=1024)
def default_tiling(max_seg_bytes: int, max_rows: int, device: torch.device) -> Tiling:
    """Tile choice for a launch whose widest piece is `max_seg_bytes` and whose longest entry has
    `max_rows` pieces in total.

    On a GPU a program moves up to 32 KiB per loop iteration (16 warps: four 16-byte vectors per
    thread in flight) and up to 128 KiB in all, so a 1 MiB state item is spread over 8 programs
    while small pieces are batched by rows. On an H200 this beat 16 KiB tiles with 8 warps by
    0.7-3.3 points of the copy limit for 16- and 64-token pages and matched it for page 1;
    64 KiB tiles lost 10 points at page 1 (BENCHMARKS.md (a)). The interpreter runs programs one
    after another at about 0.5 ms each plus the bytes, so there the tiles are as large as allowed.
    """
    seg_pow2 = _next_pow2(max(1, max_seg_bytes))
    rows_pow2 = _next_pow2(max(1, max_rows))
    if device.type == "cpu":
        tile, per_program = 2**18, 2**24
    else:
        tile, per_program = 2**15, 2**17
    block = min(seg_pow2, tile)
    rows = max(1, min(rows_pow2, tile // block, 64 if device.type != "cpu" else 2**12))
    iters = max(1, min(_cdiv(max_seg_bytes, block), per_program // (rows * block)))
    num_warps = 16 if rows * block >= 2**15 else (8 if rows * block >= 2**14 else 4)
    return Tiling(rows=rows, block_bytes=block, iters=iters, num_warps=num_warps)
