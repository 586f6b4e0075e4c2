"""The spec model: one frozen dataclass per spec concept.

~~~ DATA MODEL ~~~
Every object carries `loc`, the place in the spec it came from, so that later stages
(check, lowering) can report errors at the user's line. Symbolic sizes are already evaluated
(by compiler/model_parser.py and compiler/model_build.py, which build these objects from the
validated YAML); the original text is kept for messages and for the generated code's comments.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdc.runtime.layout_types import KNOWN_BACKENDS as KNOWN_BACKENDS
from pdc.runtime.layout_types import BackendRule as BackendRule

from .diagnostics import Location
from .model_parity import Parity

UINT32_MAX = 2**32 - 1

# Bytes per element of every dtype a spec may name.
DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
}  # fmt: skip


class IndexKind(enum.Enum):
    PAGE = "page"  # item = one KV page; request sends its page ids
    SLOT = "slot"  # item = one request's state (req_pool_idx / mamba slot)
    RING = "ring"  # R rows per request: row = slot * R + pos % R
    WINDOW = "window"  # pages of the last W tokens only
    AUX = "aux"  # one metadata row per request


class Send(enum.Enum):
    EVERY_CHUNK = "every_chunk"
    LAST_CHUNK = "last_chunk"


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    value: int
    text: str  # as written: "2 * key_dim + value_dim" or "48"
    loc: Location
    # Note [Bound families] in runtime/binding.py: where a bindable param comes from at start
    # ("config.num_hidden_layers", "engine.page_size"); `value` is then its `example`.
    source: str = ""
    default: int | str | None = None  # the formula used when the config lacks the key


@dataclass(frozen=True, slots=True)
class DraftBand:
    """MTP / EAGLE draft layers: their own band of global ids, after the real layers."""

    kind: str
    count: int
    first_id: int
    loc: Location

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(range(self.first_id, self.first_id + self.count))


@dataclass(frozen=True, slots=True)
class Layers:
    count: int  # real (non-draft) layers; global ids 0..count-1
    kind_of: tuple[tuple[int, str], ...]  # (global id, kind) for real and draft layers, sorted
    draft: DraftBand | None
    pattern: tuple[str, ...]  # empty when explicit `kinds` were given
    loc: Location

    def kinds(self) -> dict[int, str]:
        return dict(self.kind_of)

    def ids_of_kind(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in self.kind_of if k == kind)

    @property
    def all_kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for _, k in self.kind_of))


@dataclass(frozen=True, slots=True)
class DtypeName:
    """A dtype name of the spec's own (`dtypes:`), e.g. `model: bfloat16`: items may name it
    instead of a dtype, and a run may override it (`load_spec(path, dtypes={...})`)."""

    name: str
    dtype: str
    loc: Location
    source: str = ""  # Note [Bound families]: "engine.kv_dtype"; `dtype` is the example


@dataclass(frozen=True, slots=True)
class Item:
    shape: tuple[int, ...]  # elements per axis
    shape_text: tuple[str, ...]  # each axis as written in the spec
    dtype: str  # resolved: always one of DTYPE_BYTES
    loc: Location
    dtype_text: str = ""  # as written, when it names a `dtypes` entry ("model")
    pitch: int = 0  # bytes between items' starts in the engine's memory at TP 1; 0 = nbytes

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = self.dtype_bytes
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class Shard:
    """TP rule `shard: dim`: the axis is split across attention-TP ranks.

    The axis holds `sum(groups)` elements made of independent sub-blocks (`groups`; a single
    group when none are given); each sub-block is split into units (a head) of its own size
    and sharded across ranks on its own, so a rank holds a slice of every sub-block and no
    slice ever crosses a sub-block boundary. When a sub-block has fewer units than TP ranks,
    units are replicated: rank r holds unit r // (tp / units) (GQA replication).
    """

    axis: int
    groups: tuple[int, ...]  # elements per sub-block, in item order
    units: tuple[int, ...]  # elements per shard unit of each sub-block (1 = per element/head)
    loc: Location


@dataclass(frozen=True, slots=True)
class Component:
    name: str
    layer_ids: tuple[int, ...]  # global layer ids, sorted; empty for request-wide state
    request_wide: bool
    sentinel: int | None  # uint32 id carried on the wire instead of a layer id
    index: IndexKind
    ring_rows: int  # rows per request for RING, else 1
    window_tokens: int  # W for WINDOW, else 0
    tensors: tuple[str, ...]
    item: Item
    shard: Shard | None  # None = replicated across attention TP
    send: Send
    stages: str  # "all" | "first" | "last" | "kind:<k>" | "none" (request-wide state only)
    loc: Location
    why: str = ""  # the spec's own explanation, copied into generated code as a comment
    on_prefix_hit: str = "skip"  # page/window state: "skip" or "send" (Note [Prefix skip])
    holds: str = "data"  # "data" or "kv_slots" (Note [Slot-valued state])


@dataclass(frozen=True, slots=True)
class Constraint:
    expr: str
    why: str
    loc: Location


@dataclass(frozen=True, slots=True)
class SideSpec:
    """One side of a deployment as written (defaults are applied by the topology stage)."""

    tp: int
    pp: int
    dp: int
    page_size: int | None
    stages: tuple[tuple[int, ...], ...] | None  # explicit per-stage layer lists
    loc: Location


@dataclass(frozen=True, slots=True)
class Deployment:
    prefill: SideSpec
    decode: SideSpec
    backend: str
    expect_rejected: bool
    error: str  # substring a rejection must contain
    loc: Location


@dataclass(frozen=True, slots=True)
class Spec:
    family: str
    params: tuple[Param, ...]
    layers: Layers
    components: tuple[Component, ...]  # spec order: the wire order
    constraints: tuple[Constraint, ...]
    backends: tuple[BackendRule, ...]
    deployments: tuple[Deployment, ...]
    path: str
    loc: Location
    description: str = ""
    raw: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    dtypes: tuple[DtypeName, ...] = ()
    # `serves`: (engine, architectures) the integrations find the spec by; None when absent
    serves: tuple[str, tuple[str, ...]] | None = None
    # `parity`: how `pdc parity` runs the family (Note [Parity recipe]); None when absent
    parity: Parity | None = None

    @property
    def bindable(self) -> bool:
        """Whether a param, dtype or the layer kinds are taken from the served model (Note
        [Bound families] in runtime/binding.py)."""
        return any(p.source for p in self.params) or any(d.source for d in self.dtypes) \
            or "from" in self.raw.get("layers", {})

    @property
    def env(self) -> dict[str, int]:
        return {p.name: p.value for p in self.params}

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    def backend(self, name: str) -> BackendRule | None:
        for b in self.backends:
            if b.name == name:
                return b
        return None

    @property
    def py_name(self) -> str:
        """Python identifier of the family (generated/<py_name>/)."""
        return self.family.replace("-", "_")
