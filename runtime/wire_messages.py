"""The wire format (runtime/wire.py): its constants and limits, its error, the messages
(frozen dataclasses that validate themselves on construction); a registration's sections are
in runtime/wire_sections.py."""

from __future__ import annotations

import enum
import operator
import struct
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from .plan_types import RankId

WIRE_MAGIC = b"PDCW"
WIRE_VERSION = 5  # 3: TransferRequest.layer_slots; 4: staging rings (runtime/wire_ring.py);
# 5: Status.written_event (Note [Success by event])

# magic, version, type, flags, fingerprint, body length, crc32
_HEADER = struct.Struct("<4sHBBQII")
HEADER_BYTES = _HEADER.size  # 24
_CRC_OFFSET = 20  # the CRC covers header bytes [0, _CRC_OFFSET) and the body

# ~~~ limits ~~~
# Each bound is what a decoder accepts at most; they are part of the format (a peer that
# needs more must wait for a new wire version), and they cap what a malformed length field
# can make a decoder allocate.
MAX_PAGE_IDS = 1 << 21  # per page-id array: a 2M-token request at page size 1
MAX_AGENT_INFO_BYTES = 1 << 20  # engine peer info (NIXL agent metadata is tens of KiB)
MAX_INSTANCE_BYTES = 1024  # a serving engine instance such as "10.1.2.3:30000"
MAX_REASON_BYTES = 4096  # a failure reason, UTF-8
MAX_EVENT_BYTES = 64  # an engine's handle of a write's completion event (CUDA IPC: 64)
MAX_SECTION_ENTRIES = 1 << 16  # registered entries of one component on one rank
# The largest body any message needs (two full page-id arrays plus the fixed fields of a
# TransferRequest is 32 MiB), with room to spare; the control plane can use HEADER_BYTES +
# MAX_BODY_BYTES as the transport's maximum message size.
MAX_BODY_BYTES = 64 << 20

PLAN_DIGEST_BYTES = 32  # sha256 of the plan (Plan.digest() as raw bytes)
NO_INDEX = -1  # "none" for TransferRequest.slot / ring_slot / aux_row

_U8, _U16, _U32, _U64 = (1 << 8) - 1, (1 << 16) - 1, (1 << 32) - 1, (1 << 64) - 1
_I64_MAX = (1 << 63) - 1
_I64 = np.dtype("<i8")
_U64_DT = np.dtype("<u8")


class WireError(ValueError):
    """A message is malformed or invalid. `field` names where (e.g. "Status.reason",
    "header.fingerprint"), `reason` says what is wrong; str() is "field: reason".

    The only exception `decode` raises, and the one the encoders and message constructors
    raise for invalid values.
    """

    def __init__(self, field: str, reason: str):
        # args = (field, reason) keeps the exception picklable across processes.
        super().__init__(field, reason)
        self.field = field
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


class MessageType(enum.IntEnum):
    # 0 is never used, so an all-zero buffer is not a message.
    REGISTER = 1
    TRANSFER_REQUEST = 2
    STATUS = 3
    ABORT = 4
    ABORT_ACK = 5
    HEARTBEAT = 6
    RING_FILLED = 7  # runtime/wire_ring.py
    RING_FREED = 8


class PeerSide(enum.IntEnum):
    PREFILL = 0
    DECODE = 1


class KVPoll(enum.IntEnum):
    """State of one request on one rank, as reported in Status. Named (members included)
    after the engines' KVPoll so integrators feel at home, but numbered in progress order
    (the engines put Failed at 0): a request's state only ever moves up, Failed is terminal."""

    Bootstrapping = 0
    WaitingForInput = 1
    Transferring = 2
    Success = 3
    Failed = 4


# ~~~ validation helpers (messages call these in __post_init__) ~~~


def _int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise WireError(name, "must be an integer, not a bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise WireError(name, f"must be an integer, got {type(value).__name__}") from None


def _uint(name: str, value: object, top: int) -> int:
    v = _int(name, value)
    if not 0 <= v <= top:
        raise WireError(name, f"{v} is outside 0..{top}")
    return v


def _opt_index(name: str, value: object) -> int:
    """An index that may be NO_INDEX (-1) for "none"; any other negative value is invalid."""
    v = _int(name, value)
    if not NO_INDEX <= v <= _I64_MAX:
        raise WireError(name, f"{v} is not an index: use 0..{_I64_MAX}, or -1 for none")
    return v


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise WireError(name, f"must be a bool, got {type(value).__name__}")
    return bool(value)


_E = TypeVar("_E", bound=enum.IntEnum)


def _enum(name: str, value: object, cls: type[_E]) -> _E:
    v = _int(name, value)
    try:
        return cls(v)
    except ValueError:
        valid = ", ".join(f"{m.value} {m.name}" for m in cls)
        raise WireError(name, f"{v} is not a {cls.__name__} (valid: {valid})") from None


def _rank(name: str, value: object) -> RankId:
    if not isinstance(value, RankId):
        raise WireError(name, f"must be a RankId, got {type(value).__name__}")
    _uint(f"{name}.pp", value.pp, _U16)
    _uint(f"{name}.tp", value.tp, _U16)
    return RankId(int(value.pp), int(value.tp))


def _text(name: str, value: object, max_bytes: int) -> str:
    if not isinstance(value, str):
        raise WireError(name, f"must be a str, got {type(value).__name__}")
    try:
        n = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise WireError(name, f"is not encodable as UTF-8 (character {e.start} is a lone "
                              f"surrogate)") from None
    if n > max_bytes:
        raise WireError(name, f"{n} bytes of UTF-8 exceed the maximum of {max_bytes}")
    return value


def _blob(name: str, value: object, max_bytes: int) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise WireError(name, f"must be bytes, got {type(value).__name__}")
    b = bytes(value)
    if len(b) > max_bytes:
        raise WireError(name, f"{len(b)} bytes exceed the maximum of {max_bytes}")
    return b


def _empty_ids() -> np.ndarray:
    a = np.zeros(0, _I64)
    a.flags.writeable = False
    return a


def _id_array(name: str, value: object) -> np.ndarray:
    """A read-only little-endian int64 array of non-negative ids, at most MAX_PAGE_IDS long.

    A decoded array (read-only, '<i8', a view of the immutable input bytes) is kept as is;
    anything else is copied, so a message never aliases memory its caller may change.
    """
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.ndim != 1:
        raise WireError(name, f"must be a 1-D array, got shape {arr.shape}")
    if arr.size > MAX_PAGE_IDS:
        raise WireError(name, f"{arr.size} ids exceed the maximum of {MAX_PAGE_IDS}")
    if arr.size == 0:
        return _empty_ids()
    if arr.dtype.kind not in "iu":
        raise WireError(name, f"must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and int(arr.max()) > _I64_MAX:
        i = int(np.argmax(arr > _I64_MAX))
        raise WireError(f"{name}[{i}]", f"{int(arr[i])} does not fit in an int64 page id")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        i = int(np.argmax(arr < 0))
        raise WireError(f"{name}[{i}]", f"{int(arr[i])} is negative; page ids are >= 0")
    if arr.dtype != _I64 or arr.flags.writeable:
        arr = arr.astype(_I64)  # always a copy here (a writable or foreign array)
        arr.flags.writeable = False
    return arr


def _plain(values: tuple, bounds: tuple) -> bool:
    """Note [Plain message fields]: a message that pdc builds, or that the decoder reads from
    bytes, holds plain ints within their ranges. One loop over its integer fields admits it;
    only a message that fails it takes the per-field checks, which name the bad field and turn
    numpy integers into ints. Each message runs it twice on a request's path, where it is
    built and where it is decoded; on the 2-core box (bench/request_steps.py, 8K, before /
    after in one run) TransferRequest() 8.8 -> 7.7-8.0 µs and its decoding 13.7 -> 12.9 µs
    (bench/results/2026-12-07-cpu-wire)."""
    for v, (_, lo, hi) in zip(values, bounds, strict=True):
        if type(v) is not int or not lo <= v <= hi:
            return False
    return True


def _checked_ints(obj: object, msg: str, fields: tuple) -> None:
    """The per-field checks of Note [Plain message fields]: each (name, lo, hi) of `fields`
    checked in order and stored as an int; the first bad one raises, naming itself."""
    for name, lo, hi in fields:
        at, v = f"{msg}.{name}", getattr(obj, name)
        object.__setattr__(obj, name, _opt_index(at, v) if lo == NO_INDEX else _uint(at, v, hi))


def _plain_rank(r: object) -> bool:
    return type(r) is RankId and _plain((r.pp, r.tp), _RANK_FIELDS)


_RANK_FIELDS = (("pp", 0, _U16), ("tp", 0, _U16))


# ~~~ messages ~~~


@dataclass(frozen=True, slots=True, kw_only=True)
class RegEntry:
    """One registered buffer: item i of this (tensor, layer) lives at base_addr + i*item_bytes
    (base_addr + i*pitch for a component with an item pitch: Note [Item pitch])."""

    layer_id: int  # global layer id, or the component's sentinel for request-wide state
    tensor: str  # tensor name within the component ("k", "v", or "data")
    base_addr: int  # address of item 0 in the registering process's (engine's) memory
    item_bytes: int  # bytes of one item on this rank (after TP sharding)
    capacity_items: int  # items the buffer holds: every index a peer sends is checked below it

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "layer_id", _uint("RegEntry.layer_id", self.layer_id, _U32))
        if not isinstance(self.tensor, str) or not self.tensor:
            raise WireError("RegEntry.tensor", "must be a non-empty tensor name")
        base = _uint("RegEntry.base_addr", self.base_addr, _U64)
        item = _uint("RegEntry.item_bytes", self.item_bytes, _U64)
        cap = _uint("RegEntry.capacity_items", self.capacity_items, _U64)
        if base == 0:
            raise WireError("RegEntry.base_addr", "0 is not a buffer address")
        if item == 0:
            raise WireError("RegEntry.item_bytes", "an item holds at least one byte")
        if cap == 0:
            raise WireError("RegEntry.capacity_items", "a buffer holds at least one item")
        if base + item * cap > _U64 + 1:
            # Descriptors are base + index * item_bytes in u64: the buffer may not wrap.
            raise WireError("RegEntry.capacity_items",
                            f"{cap} items of {item} bytes from {base:#x} run past 2^64")
        s(self, "base_addr", base)
        s(self, "item_bytes", item)
        s(self, "capacity_items", cap)


@dataclass(frozen=True, slots=True, kw_only=True)
class Section:
    """The entries one rank registers for one component. A component the rank holds no
    layer of still has its section, with no entries: sections are positional."""

    component: str
    entries: tuple[RegEntry, ...] = ()

    def __post_init__(self) -> None:
        entries = tuple(self.entries)
        for i, e in enumerate(entries):
            if not isinstance(e, RegEntry):
                raise WireError(f"Section({self.component}).entries[{i}]",
                                f"must be a RegEntry, got {type(e).__name__}")
        object.__setattr__(self, "entries", entries)


@dataclass(frozen=True, slots=True, kw_only=True)
class Register:
    """A rank introduces itself to a peer, once per peer (not per request)."""

    side: PeerSide
    dp_group: int  # attention-DP group of the rank
    rank: RankId
    page_size: int  # tokens per KV page; both sides must agree (checked at the handshake)
    plan_digest: bytes  # sha256 of the plan, 32 raw bytes: both sides lowered the same plan
    agent_info: bytes  # transfer engine peer info (Mooncake session id, NIXL agent metadata)
    # The serving engine instance (server) the rank belongs to: ranks of one instance share it,
    # and a prefill rank keeps the registrations and rooms of instances apart (Note [Decode
    # instances] in runtime/endpoints/handshake.py). "": the deployment's only instance.
    instance: str
    sections: tuple[Section, ...]  # one per component of the family, in spec order
    # Decode's registered staging arena (Note [Staging layout] in runtime/staging.py): every
    # TransferRequest.staging region must lie inside it. 0 bytes: this rank never stages.
    staging_addr: int = 0
    staging_bytes: int = 0

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "side", _enum("Register.side", self.side, PeerSide))
        s(self, "dp_group", _uint("Register.dp_group", self.dp_group, _U16))
        s(self, "rank", _rank("Register.rank", self.rank))
        ps = _uint("Register.page_size", self.page_size, _U32)
        if ps == 0:
            raise WireError("Register.page_size", "a page holds at least one token")
        s(self, "page_size", ps)
        digest = _blob("Register.plan_digest", self.plan_digest, PLAN_DIGEST_BYTES)
        if len(digest) != PLAN_DIGEST_BYTES:
            raise WireError("Register.plan_digest",
                            f"{len(digest)} bytes; a sha256 digest is {PLAN_DIGEST_BYTES}")
        s(self, "plan_digest", digest)
        s(self, "agent_info", _blob("Register.agent_info", self.agent_info,
                                    MAX_AGENT_INFO_BYTES))
        s(self, "instance", _text("Register.instance", self.instance, MAX_INSTANCE_BYTES))
        sections = tuple(self.sections)
        for i, sec in enumerate(sections):
            if not isinstance(sec, Section):
                raise WireError(f"Register.sections[{i}]",
                                f"must be a Section, got {type(sec).__name__}")
        s(self, "sections", sections)
        addr, nbytes = _staging("Register", self.staging_addr, self.staging_bytes)
        s(self, "staging_addr", addr)
        s(self, "staging_bytes", nbytes)


def _staging(msg: str, addr: object, nbytes: object) -> tuple[int, int]:
    """A staging region (address, bytes): 0 bytes means none."""
    addr = _uint(f"{msg}.staging_addr", addr, _U64)
    nbytes = _uint(f"{msg}.staging_bytes", nbytes, _U64)
    if nbytes and not addr:
        raise WireError(f"{msg}.staging_addr", "0 is not a staging address")
    if addr + nbytes > _U64 + 1:
        raise WireError(f"{msg}.staging_bytes", f"{nbytes} bytes from {addr:#x} run past 2^64")
    return addr, nbytes


# TransferRequest's integers, (name, lo, hi), in the order they are checked (Note [Plain
# message fields]); lo NO_INDEX: an index that may be -1 for none. The last two, the staging
# region, are checked together by `_staging` on every path.
_REQUEST_INTS = (("room", 0, _U64), ("generation", 0, _U32), ("chunk_id", 0, _U32),
                 ("decode_prefix_tokens", 0, _U64), ("slot", NO_INDEX, _I64_MAX),
                 ("ring_slot", NO_INDEX, _I64_MAX), ("aux_row", NO_INDEX, _I64_MAX),
                 ("staging_slots", 0, _U32), ("staging_addr", 0, _U64),
                 ("staging_bytes", 0, _U64))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TransferRequest:
    """Decode asks one prefill rank for a request's state (once per request and decode rank;
    re-sent with a new chunk_id to retry). Ids are decode-side pool ids."""

    room: int  # request id (bootstrap room)
    generation: int  # bumps when decode reuses the room; stale messages are ignored
    decode_rank: RankId
    chunk_id: int = 0  # 0 for the first request; decode re-sends with a higher id
    decode_prefix_tokens: int = 0  # tokens decode already holds (prefix cache): not sent
    slot: int = NO_INDEX  # slot-state index (mamba slot), or -1 when the family has none
    ring_slot: int = NO_INDEX  # req_pool_idx for ring state, or -1
    aux_row: int = NO_INDEX  # metadata row, or -1
    # Staged path (Note [Staging layout] in runtime/staging.py): a region of decode's
    # registered staging arena for this request and this prefill rank; 0 bytes = direct path.
    staging_addr: int = 0
    staging_bytes: int = 0
    # 0: the region holds the whole request; n > 0: it is a ring of n equal slots that the
    # request moves through piece by piece (Note [Staging ring] in runtime/staging_ring.py).
    staging_slots: int = 0
    dst_page_ids: np.ndarray = field(default_factory=_empty_ids)  # one per absolute page position
    window_page_ids: np.ndarray = field(default_factory=_empty_ids)  # sliding-window pages
    # Note [Layer slots] in runtime/indices.py: layer id, slot, layer id, slot, ... for a
    # request whose state layers have a slot each; empty: `slot` serves every layer.
    layer_slots: np.ndarray = field(default_factory=_empty_ids)

    def __post_init__(self) -> None:
        s = object.__setattr__
        if not (_plain((self.room, self.generation, self.chunk_id, self.decode_prefix_tokens,
                        self.slot, self.ring_slot, self.aux_row, self.staging_slots,
                        self.staging_addr, self.staging_bytes), _REQUEST_INTS)
                and _plain_rank(self.decode_rank)):  # Note [Plain message fields]
            _checked_ints(self, "TransferRequest", _REQUEST_INTS[:2])
            s(self, "decode_rank", _rank("TransferRequest.decode_rank", self.decode_rank))
            _checked_ints(self, "TransferRequest", _REQUEST_INTS[2:-2])
        addr, nbytes = _staging("TransferRequest", self.staging_addr, self.staging_bytes)
        s(self, "staging_addr", addr)
        s(self, "staging_bytes", nbytes)
        slots = self.staging_slots
        if slots and (not nbytes or nbytes % slots):
            raise WireError("TransferRequest.staging_slots",
                            f"{slots} slots do not split a region of {nbytes} bytes evenly")
        s(self, "dst_page_ids", _id_array("TransferRequest.dst_page_ids", self.dst_page_ids))
        s(self, "window_page_ids",
          _id_array("TransferRequest.window_page_ids", self.window_page_ids))
        pairs = _id_array("TransferRequest.layer_slots", self.layer_slots)
        if len(pairs) % 2:
            raise WireError("TransferRequest.layer_slots",
                            f"holds {len(pairs)} values, not (layer id, slot) pairs")
        if len(pairs) and int(pairs[0::2].max()) > _U32:
            raise WireError("TransferRequest.layer_slots",
                            f"layer id {int(pairs[0::2].max())} is not a u32")
        s(self, "layer_slots", pairs)

    def __eq__(self, other: object) -> bool:
        # Generated __eq__ would compare numpy arrays with ==, whose truth is ambiguous.
        if not isinstance(other, TransferRequest):
            return NotImplemented
        return (
            (self.room, self.generation, self.decode_rank, self.chunk_id,
             self.decode_prefix_tokens, self.slot, self.ring_slot, self.aux_row,
             self.staging_addr, self.staging_bytes, self.staging_slots)
            == (other.room, other.generation, other.decode_rank, other.chunk_id,
                other.decode_prefix_tokens, other.slot, other.ring_slot, other.aux_row,
                other.staging_addr, other.staging_bytes, other.staging_slots)
            and np.array_equal(self.dst_page_ids, other.dst_page_ids)
            and np.array_equal(self.window_page_ids, other.window_page_ids)
            and np.array_equal(self.layer_slots, other.layer_slots)
        )

    __hash__ = None  # type: ignore[assignment]  # equal messages hold equal arrays


# Status's integers, (name, lo, hi), in the order they are checked (Note [Plain message fields])
_STATUS_INTS = (("room", 0, _U64), ("generation", 0, _U32), ("chunk_id", 0, _U32),
                ("page_start", 0, _U64), ("page_count", 0, _U32), ("bytes_written", 0, _U64),
                ("descriptors", 0, _U32))


@dataclass(frozen=True, slots=True, kw_only=True)
class Status:
    """Prefill reports a request's state to one decode rank (per chunk, and at the end)."""

    room: int
    generation: int  # echoes the TransferRequest's generation
    prefill_rank: RankId
    state: KVPoll
    chunk_id: int = 0  # the TransferRequest chunk_id this answers
    page_start: int = 0  # absolute position of the first page of the chunk reported
    page_count: int = 0  # pages of that chunk
    bytes_written: int = 0  # bytes this prefill rank wrote for the request so far
    descriptors: int = 0  # descriptors this prefill rank submitted for the request so far
    checksum: int | None = None  # optional digest of the bytes written (None: not computed)
    reason: str = ""  # why, when state is Failed (required then); free text otherwise
    # Transferring only: every write of this rank for the request is queued, and they have
    # all landed once this event (the engine's handle) completes (Note [Success by event])
    written_event: bytes = b""

    def __post_init__(self) -> None:
        s = object.__setattr__
        event = self.written_event
        if not (_plain((self.room, self.generation, self.chunk_id, self.page_start,
                        self.page_count, self.bytes_written, self.descriptors),
                       _STATUS_INTS) and _plain_rank(self.prefill_rank)
                and type(self.state) is KVPoll and self.checksum is None
                and self.reason == "" and type(event) is bytes
                and len(event) <= MAX_EVENT_BYTES):  # Note [Plain message fields]
            _checked_ints(self, "Status", _STATUS_INTS[:2])
            s(self, "prefill_rank", _rank("Status.prefill_rank", self.prefill_rank))
            s(self, "state", _enum("Status.state", self.state, KVPoll))
            _checked_ints(self, "Status", _STATUS_INTS[2:])
            if self.checksum is not None:
                s(self, "checksum", _uint("Status.checksum", self.checksum, _U64))
            s(self, "reason", _text("Status.reason", self.reason, MAX_REASON_BYTES))
            s(self, "written_event", _blob("Status.written_event", event, MAX_EVENT_BYTES))
        if self.state is KVPoll.Failed and not self.reason:
            raise WireError("Status.reason", "a Failed status must say why")
        if self.written_event and self.state is not KVPoll.Transferring:
            raise WireError("Status.written_event", "only a Transferring status carries a "
                                                    "written event")


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort:
    """Decode tells a prefill rank to stop writing a request (then waits for AbortAck before
    it frees the request's pages)."""

    room: int
    generation: int
    decode_rank: RankId

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "room", _uint("Abort.room", self.room, _U64))
        s(self, "generation", _uint("Abort.generation", self.generation, _U32))
        s(self, "decode_rank", _rank("Abort.decode_rank", self.decode_rank))


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortAck:
    """Prefill confirms an Abort. `drained` is True when no write of the request is still
    in flight, so decode may reuse its pages; False means writes stayed stuck past prefill's
    drain deadline, and decode quarantines the pages at once (they are never reused)."""

    room: int
    generation: int  # the Abort's generation
    prefill_rank: RankId
    drained: bool

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "room", _uint("AbortAck.room", self.room, _U64))
        s(self, "generation", _uint("AbortAck.generation", self.generation, _U32))
        s(self, "prefill_rank", _rank("AbortAck.prefill_rank", self.prefill_rank))
        s(self, "drained", _flag("AbortAck.drained", self.drained))


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    side: PeerSide  # side of the sender
    rank: RankId  # rank of the sender
    sequence: int  # increments by one per heartbeat of this sender
    monotonic_ns: int  # sender's time.monotonic_ns(): only differences mean anything

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "side", _enum("Heartbeat.side", self.side, PeerSide))
        s(self, "rank", _rank("Heartbeat.rank", self.rank))
        s(self, "sequence", _uint("Heartbeat.sequence", self.sequence, _U64))
        s(self, "monotonic_ns", _uint("Heartbeat.monotonic_ns", self.monotonic_ns, _U64))


Message = Register | TransferRequest | Status | Abort | AbortAck | Heartbeat
