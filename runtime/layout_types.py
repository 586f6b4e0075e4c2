"""Layout types shared by the compiler and the runtime.

The compiler's layout stage (pdc.compiler.layout) builds these from a spec; generated
`generated/<family>/layout.py` modules instantiate them as constants; the runtime reads
them. They live in the runtime package because the runtime never imports the compiler.

Note [Shard ownership]: a sub-block of G units on T attention-TP ranks gives rank r the
units [r*G/T, (r+1)*G/T) when G >= T, and the single unit r // (T/G) when G < T (GQA
replication: never r % G, which pairs the wrong heads). Local units are laid out sub-block
by sub-block, so a rank's sharded axis is [q_r, k_r, v_r] for a GDN conv state. Both the
lowering and the runtime use this rule; the coverage checker re-derives it independently
from array slices.
"""

from __future__ import annotations

from dataclasses import dataclass

from .diagnostics import Location

# Transfer backends a spec's `backends` matrix and a topology may name.
KNOWN_BACKENDS = ("mooncake", "nixl", "mori", "local")


@dataclass(frozen=True, slots=True)
class EntryKey:
    """One registered buffer of a component: (tensor, global layer id or sentinel)."""

    tensor: str
    layer_id: int


@dataclass(frozen=True, slots=True)
class ShardGeometry:
    axis: int
    outer: int  # product of the axes before the sharded axis (elements)
    inner_bytes: int  # bytes of one element of the sharded axis, trailing axes included
    group_units: tuple[int, ...]  # units per independently sharded sub-block
    # Elements of the sharded axis per unit: one int for every sub-block, or one size per
    # sub-block (Mamba2 conv [x | B | C]: x by head, B and C by group, of another size).
    unit_elems: int | tuple[int, ...]

    def divisible(self, tp: int) -> bool:
        return all((g % tp == 0) if g >= tp else (tp % g == 0) for g in self.group_units)

    @property
    def unit_sizes(self) -> tuple[int, ...]:
        """Elements per unit of each sub-block."""
        u = self.unit_elems
        return u if isinstance(u, tuple) else (u,) * len(self.group_units)

    @property
    def axis_elems(self) -> int:
        """Elements of the whole (unsharded) sharded axis."""
        return sum(n * u for n, u in zip(self.group_units, self.unit_sizes, strict=True))

    def units_per_rank(self, g: int, tp: int) -> int:
        n = self.group_units[g]
        return n // tp if n >= tp else 1

    def local_units(self, tp: int, rank: int) -> tuple[tuple[int, int], ...]:
        """(sub-block, unit) pairs held by `rank`, in local order (Note [Shard ownership])."""
        out: list[tuple[int, int]] = []
        for g, n in enumerate(self.group_units):
            if n >= tp:
                per = n // tp
                out.extend((g, rank * per + i) for i in range(per))
            else:
                out.append((g, rank // (tp // n)))
        return tuple(out)

    def unit_offset(self, g: int, unit: int) -> int:
        """Element offset of unit `unit` of sub-block `g` in the whole sharded axis."""
        sizes = self.unit_sizes
        start = sum(n * u for n, u in zip(self.group_units[:g], sizes[:g], strict=True))
        return start + unit * sizes[g]

    def local_axis(self, tp: int) -> int:
        """Elements of the sharded axis on one rank."""
        sizes = self.unit_sizes
        return sum(self.units_per_rank(g, tp) * sizes[g] for g in range(len(self.group_units)))


@dataclass(frozen=True, slots=True)
class ComponentLayout:
    name: str
    index: str  # page | slot | ring | window | aux
    ring_rows: int
    window_tokens: int
    tensors: tuple[str, ...]
    layer_ids: tuple[int, ...]  # sorted; empty for request-wide
    sentinel: int | None
    request_wide: bool
    dtype: str
    dtype_bytes: int
    shape: tuple[int, ...]
    item_bytes: int  # bytes of one full (unsharded) item
    shard: ShardGeometry | None  # None = replicated across attention TP
    send: str  # every_chunk | last_chunk
    stages: str  # request-wide ownership: all | first | last | kind:<k> | none
    loc: str  # "spec.yaml:line:col" of the component, for messages
    # Page state on a decode prefix-cache hit (Note [Prefix skip]): "skip" = pages decode
    # already holds are not sent; "send" = every page is sent (decode's cache lacks this state).
    on_prefix_hit: str = "skip"
    # What the items hold (Note [Slot-valued state]): "data"; "token_positions" = integers
    # that are logical positions (sent as bytes); "kv_slots" = integers that are physical
    # token slots of the KV page pool (page id * page_size + offset; < 0 padding), remapped.
    holds: str = "data"
    # Bytes from one item's start to the next in the engine's memory at TP 1 (Note [Item
    # pitch] in compiler/model_build.py); 0: items are packed, item_bytes apart. Slot state only.
    pitch: int = 0

    def prefix_pages(self, prefix_tokens: int, page_size: int) -> int:
        """Pages at the start of a request that decode holds already for this component.

        Note [Prefix skip]: decode's prefix cache holds the pages of the tokens it matched,
        so prefill sends a page-indexed component only from the first page that is not
        wholly inside the prefix (a partly covered page is sent: decode's copy of its tail
        is not guaranteed to match). State that decode's cache does not keep, such as an
        indexer cache or the draft layers' KV, says `on_prefix_hit: send` in its spec and is
        sent from page 0 even on a hit. A window component (Note [Window pages] in
        indices.py) is sent whole by default (`send`); with `skip` its pages start past the
        prefix when the window reaches into it (SGLang's SWA radix cache keeps them).
        """
        return 0 if self.on_prefix_hit == "send" else prefix_tokens // page_size

    def item_bytes_at(self, tp: int) -> int:
        """Bytes of one item on a rank of an attention-TP group of size tp."""
        if self.shard is None:
            return self.item_bytes
        s = self.shard
        return s.outer * s.local_axis(tp) * s.inner_bytes

    def pitch_at(self, tp: int) -> int:
        """Bytes between consecutive items' starts on a rank of attention TP `tp`: the pitch
        shrinks with the item's shard (an engine that shards the state shards its block)."""
        return self.pitch_for(self.item_bytes_at(tp))

    def pitch_for(self, item: int) -> int:
        """The pitch of this component's items of `item` bytes (one rank's shard)."""
        if not self.pitch:
            return item
        scaled, rest = divmod(self.pitch * item, self.item_bytes)
        if rest:
            raise ValueError(f"{self.loc}: error: component '{self.name}' has a pitch of "
                             f"{self.pitch} B for {self.item_bytes} B items, which does not "
                             f"scale to its {item} B items on a rank of this TP")
        return scaled

    def entries_for(self, layer_ids) -> tuple[EntryKey, ...]:
        """Registered entries for a rank holding `layer_ids` (tensor-major, then id)."""
        if self.request_wide and self.sentinel is not None:
            return tuple(EntryKey(t, self.sentinel) for t in self.tensors)
        wanted = set(layer_ids)  # once: `in set(...)` per id made this quadratic
        held = [i for i in self.layer_ids if i in wanted]
        return tuple(EntryKey(t, i) for t in self.tensors for i in held)


@dataclass(frozen=True, slots=True)
class BackendRule:
    """What one transfer backend supports for a family (the spec's `backends` matrix)."""

    name: str
    hetero_attention_tp: bool  # may prefill and decode attention TP differ?
    max_pp: int | None  # largest pipeline size the backend's protocol supports
    why: str
    loc: Location


@dataclass(frozen=True, slots=True)
class FamilyLayout:
    family: str
    py_name: str
    num_layers: int
    draft_ids: tuple[int, ...]
    kind_of: tuple[tuple[int, str], ...]
    components: tuple[ComponentLayout, ...]  # spec order = wire order
    default_page_size: int
    spec_path: str
    # Note [Bound families] in runtime/binding.py: the digest of the values a bindable spec
    # was bound to at start ("" for a layout as compiled); plans and fingerprints cover it.
    bound: str = ""

    def component(self, name: str) -> ComponentLayout:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def all_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, _ in self.kind_of)
