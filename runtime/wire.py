"""Wire format, version 1: the family-independent codec of pdc's control-plane messages.

Every message is a 24-byte header followed by a body. All integers are little-endian; there
is no padding anywhere. docs/wire-format.md is the byte-level reference.

    offset  size  field
    0       4     magic b"PDCW"
    4       2     wire version (WIRE_VERSION)
    6       1     message type (MessageType)
    7       1     flags: none are defined in version 1, so the byte must be 0
    8       8     spec fingerprint: the first 8 bytes of the spec's sha256, as a u64
    16      4     body length in bytes
    20      4     CRC-32 (zlib) of header bytes 0..19 followed by the body
    24      ...   body

Decoder invariants (bench/fuzz_wire.py checks them on millions of mutated inputs):
- `decode` raises WireError and nothing else, and every WireError names the field;
- no length read from the wire is trusted: each is checked against the bytes left AND a
  declared maximum before anything is allocated, so a decoder never over-reads, never
  allocates more than the input justifies and never loops longer than the input is long;
- the encoding is canonical: `decode(buf)` succeeds only when `encode(decode(buf)) == buf`.
  No byte is padding or "don't care", so a message means exactly one thing.

Note [Why a checksum]: DESIGN.md §5 asks for magic, version, type and fingerprint; the
CRC-32 is our addition. Without it a flipped bit in a room id or a page id decodes to
another *valid* message, and the decode side would free or fill the wrong request's pages:
exactly the silent cross-request corruption that PD deployments keep hitting. ZeroMQ over TCP protects the hop, not a sender that overruns a buffer or a
relay that rewrites frames. CRC-32 catches every burst of up to 32 bits and all but 2^-32
of random damage, and costs ~1 µs per KiB in zlib's C code.

Generated modules `generated/<family>/wire.py` bind a family: its FINGERPRINT and its
components (names in spec order, tensor names, allowed layer ids), and wrap encode/decode.
Messages are frozen dataclasses that validate themselves on construction, so an encoder
can only be handed, and a decoder can only return, a message that is valid on its own.
"""

from __future__ import annotations

import enum
import operator
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .plan_types import RankId

WIRE_MAGIC = b"PDCW"
WIRE_VERSION = 1

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
MAX_ENDPOINT_BYTES = 1024  # a ZeroMQ endpoint such as "tcp://10.1.2.3:5757"
MAX_REASON_BYTES = 4096  # a failure reason, UTF-8
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


def _enum(name: str, value: object, cls: type[enum.IntEnum]) -> Any:
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


# ~~~ messages ~~~


@dataclass(frozen=True, slots=True, kw_only=True)
class RegEntry:
    """One registered buffer: item i of this (tensor, layer) lives at base_addr + i*item_bytes."""

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
    control_endpoint: str  # ZeroMQ endpoint where this rank receives control messages
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
        s(self, "control_endpoint", _text("Register.control_endpoint", self.control_endpoint,
                                          MAX_ENDPOINT_BYTES))
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
    dst_page_ids: np.ndarray = field(default_factory=_empty_ids)  # one per absolute page position
    window_page_ids: np.ndarray = field(default_factory=_empty_ids)  # sliding-window pages

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "room", _uint("TransferRequest.room", self.room, _U64))
        s(self, "generation", _uint("TransferRequest.generation", self.generation, _U32))
        s(self, "decode_rank", _rank("TransferRequest.decode_rank", self.decode_rank))
        s(self, "chunk_id", _uint("TransferRequest.chunk_id", self.chunk_id, _U32))
        s(self, "decode_prefix_tokens",
          _uint("TransferRequest.decode_prefix_tokens", self.decode_prefix_tokens, _U64))
        s(self, "slot", _opt_index("TransferRequest.slot", self.slot))
        s(self, "ring_slot", _opt_index("TransferRequest.ring_slot", self.ring_slot))
        s(self, "aux_row", _opt_index("TransferRequest.aux_row", self.aux_row))
        addr, nbytes = _staging("TransferRequest", self.staging_addr, self.staging_bytes)
        s(self, "staging_addr", addr)
        s(self, "staging_bytes", nbytes)
        s(self, "dst_page_ids", _id_array("TransferRequest.dst_page_ids", self.dst_page_ids))
        s(self, "window_page_ids",
          _id_array("TransferRequest.window_page_ids", self.window_page_ids))

    def __eq__(self, other: object) -> bool:
        # Generated __eq__ would compare numpy arrays with ==, whose truth is ambiguous.
        if not isinstance(other, TransferRequest):
            return NotImplemented
        return (
            (self.room, self.generation, self.decode_rank, self.chunk_id,
             self.decode_prefix_tokens, self.slot, self.ring_slot, self.aux_row,
             self.staging_addr, self.staging_bytes)
            == (other.room, other.generation, other.decode_rank, other.chunk_id,
                other.decode_prefix_tokens, other.slot, other.ring_slot, other.aux_row,
                other.staging_addr, other.staging_bytes)
            and np.array_equal(self.dst_page_ids, other.dst_page_ids)
            and np.array_equal(self.window_page_ids, other.window_page_ids)
        )

    __hash__ = None  # type: ignore[assignment]  # equal messages hold equal arrays


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
    checksum: int | None = None  # optional digest of the bytes written (None: not computed)
    reason: str = ""  # why, when state is Failed (required then); free text otherwise

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "room", _uint("Status.room", self.room, _U64))
        s(self, "generation", _uint("Status.generation", self.generation, _U32))
        s(self, "prefill_rank", _rank("Status.prefill_rank", self.prefill_rank))
        s(self, "state", _enum("Status.state", self.state, KVPoll))
        s(self, "chunk_id", _uint("Status.chunk_id", self.chunk_id, _U32))
        s(self, "page_start", _uint("Status.page_start", self.page_start, _U64))
        s(self, "page_count", _uint("Status.page_count", self.page_count, _U32))
        s(self, "bytes_written", _uint("Status.bytes_written", self.bytes_written, _U64))
        if self.checksum is not None:
            s(self, "checksum", _uint("Status.checksum", self.checksum, _U64))
        s(self, "reason", _text("Status.reason", self.reason, MAX_REASON_BYTES))
        if self.state is KVPoll.Failed and not self.reason:
            raise WireError("Status.reason", "a Failed status must say why")


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


@dataclass(frozen=True, slots=True)
class WireComponent:
    """What the wire knows of one component of a family (generated modules build these)."""

    name: str
    tensors: tuple[str, ...]  # tensor names; a RegEntry's tensor index points into these
    layer_ids: tuple[int, ...]  # ids an entry may carry: global layer ids, or (sentinel,)
    _tensor_index: dict[str, int] = field(init=False, repr=False, compare=False)
    _layer_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tensors or len(self.tensors) > _U8 + 1:
            raise ValueError(f"component {self.name!r}: 1..256 tensors, got {len(self.tensors)}")
        if len(set(self.tensors)) != len(self.tensors):
            raise ValueError(f"component {self.name!r} names a tensor twice")
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids) or not all(
                0 <= i <= _U32 for i in self.layer_ids):
            raise ValueError(f"component {self.name!r}: layer ids must be distinct u32s")
        object.__setattr__(self, "_tensor_index", {t: i for i, t in enumerate(self.tensors)})
        object.__setattr__(self, "_layer_set", frozenset(self.layer_ids))

    @property
    def max_entries(self) -> int:
        """Entries one rank can register: every (tensor, layer) at most once."""
        return min(len(self.tensors) * len(self.layer_ids), MAX_SECTION_ENTRIES)


# ~~~ Reader / Writer ~~~

_S_U8, _S_U16, _S_U32, _S_U64, _S_I64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q", "<q"))
# One registered entry: layer id u32, tensor index u8, base u64, item bytes u64, capacity u64.
_ENTRY = struct.Struct("<IBQQQ")
ENTRY_BYTES = _ENTRY.size  # 29


class Reader:
    """Bounds-checked little-endian reads from `buf[start:end]`. Every read checks that its
    bytes are there, and every length prefix is checked against a declared maximum and
    against what is left, before anything is allocated. Errors are WireError(field, ...)."""

    __slots__ = ("_buf", "_pos", "_end")

    def __init__(self, buf: bytes, start: int = 0, end: int | None = None):
        self._buf = buf
        self._pos = start
        self._end = len(buf) if end is None else end

    @property
    def pos(self) -> int:
        return self._pos

    @property
    def remaining(self) -> int:
        return self._end - self._pos

    def _need(self, name: str, n: int) -> int:
        """Reserve n bytes; returns their offset."""
        left = self._end - self._pos
        if n > left:
            raise WireError(name, f"needs {n} bytes but only {left} remain (truncated)")
        at = self._pos
        self._pos = at + n
        return at

    def u8(self, name: str) -> int:
        return _S_U8.unpack_from(self._buf, self._need(name, 1))[0]

    def u16(self, name: str) -> int:
        return _S_U16.unpack_from(self._buf, self._need(name, 2))[0]

    def u32(self, name: str) -> int:
        return _S_U32.unpack_from(self._buf, self._need(name, 4))[0]

    def u64(self, name: str) -> int:
        return _S_U64.unpack_from(self._buf, self._need(name, 8))[0]

    def i64(self, name: str) -> int:
        return _S_I64.unpack_from(self._buf, self._need(name, 8))[0]

    def flag(self, name: str) -> bool:
        """A bool byte: exactly 0 or 1 (anything else would be a second spelling)."""
        v = self.u8(name)
        if v > 1:
            raise WireError(name, f"{v} is not a bool (0 or 1)")
        return v == 1

    def count(self, name: str, max_count: int, unit_bytes: int) -> int:
        """A u32 element count, checked against max_count and against the bytes left for
        count elements of unit_bytes each."""
        n = self.u32(name)
        if n > max_count:
            raise WireError(name, f"{n} exceeds the maximum of {max_count}")
        left = self._end - self._pos
        if n * unit_bytes > left:
            raise WireError(name, f"{n} elements need {n * unit_bytes} bytes but only {left} "
                                  f"remain (truncated)")
        return n

    def raw(self, name: str, n: int) -> bytes:
        at = self._need(name, n)
        return self._buf[at:at + n]

    def blob(self, name: str, max_bytes: int) -> bytes:
        """A u32 length, then that many bytes."""
        return self.raw(name, self.count(name, max_bytes, 1))

    def text(self, name: str, max_bytes: int) -> str:
        """A u32 length, then that many bytes of UTF-8 (strict: no surrogates, no overlong
        forms, so the text has one spelling)."""
        b = self.blob(name, max_bytes)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise WireError(name, f"is not valid UTF-8 (byte {e.start}: {e.reason})") from None

    def _array(self, name: str, max_count: int, dtype: np.dtype) -> np.ndarray:
        n = self.count(name, max_count, dtype.itemsize)
        at = self._need(name, n * dtype.itemsize)
        # A view of the (immutable) input: no copy, and read-only like the bytes under it.
        return np.frombuffer(self._buf, dtype=dtype, count=n, offset=at)

    def u64_array(self, name: str, max_count: int) -> np.ndarray:
        """A u32 count, then that many little-endian u64s (read-only array)."""
        return self._array(name, max_count, _U64_DT)

    def i64_array(self, name: str, max_count: int) -> np.ndarray:
        """A u32 count, then that many little-endian i64s (read-only array)."""
        return self._array(name, max_count, _I64)

    def expect_end(self, name: str) -> None:
        if self._pos != self._end:
            raise WireError(name, f"{self._end - self._pos} bytes left over after the last "
                                  f"field")


@dataclass(frozen=True, slots=True)
class FieldSpan:
    """Where one field of an encoded message lies (see `field_map`)."""

    offset: int  # from the start of the message, header included
    size: int  # bytes
    name: str  # e.g. "TransferRequest.dst_page_ids.count"
    kind: str  # u8 | u16 | u32 | u64 | i64 | bool | count | bytes | array | header


class Writer:
    """Little-endian writes into a growing buffer. It does not validate: messages are valid
    by construction, so a value out of range here is a bug (struct.error says which).

    With `spans` it records a FieldSpan per field, offsets counted from `base`."""

    __slots__ = ("_buf", "_spans", "_base")

    def __init__(self, spans: list[FieldSpan] | None = None, base: int = 0):
        self._buf = bytearray()
        self._spans = spans
        self._base = base

    def _put(self, name: str, kind: str, data: bytes) -> None:
        if self._spans is not None:
            self._spans.append(FieldSpan(self._base + len(self._buf), len(data), name, kind))
        self._buf += data

    def u8(self, name: str, v: int) -> None:
        self._put(name, "u8", _S_U8.pack(v))

    def u16(self, name: str, v: int) -> None:
        self._put(name, "u16", _S_U16.pack(v))

    def u32(self, name: str, v: int) -> None:
        self._put(name, "u32", _S_U32.pack(v))

    def u64(self, name: str, v: int) -> None:
        self._put(name, "u64", _S_U64.pack(v))

    def i64(self, name: str, v: int) -> None:
        self._put(name, "i64", _S_I64.pack(v))

    def flag(self, name: str, v: bool) -> None:
        self._put(name, "bool", b"\x01" if v else b"\x00")

    def count(self, name: str, n: int) -> None:
        self._put(name, "count", _S_U32.pack(n))

    def raw(self, name: str, b: bytes) -> None:
        self._put(name, "bytes", b)

    def blob(self, name: str, b: bytes) -> None:
        self.count(f"{name}.length", len(b))
        self.raw(name, b)

    def text(self, name: str, s: str) -> None:
        self.blob(name, s.encode("utf-8"))

    def u64_array(self, name: str, arr: np.ndarray) -> None:
        self.count(f"{name}.count", len(arr))
        self._put(name, "array", np.ascontiguousarray(arr, _U64_DT).tobytes())

    def i64_array(self, name: str, arr: np.ndarray) -> None:
        self.count(f"{name}.count", len(arr))
        self._put(name, "array", np.ascontiguousarray(arr, _I64).tobytes())

    def getvalue(self) -> bytes:
        return bytes(self._buf)

    def __len__(self) -> int:
        return len(self._buf)


# ~~~ per-message bodies ~~~
# Each message has a writer and a reader with the same field order; docs/wire-format.md
# lists them. Readers return raw values to the message constructor, whose validation
# (negative ids, enum values, Failed without a reason, ...) then applies to decoding too.


def _check_sections(sections: tuple[Section, ...], components: Sequence[WireComponent],
                    where: str) -> None:
    """Sections match the family: one per component in spec order, valid tensor names and
    layer ids, entries in layout order (tensor-major, then ascending layer id) without repeats.

    Layout order is the order `ComponentLayout.entries_for` gives and plan positions
    (LinkEntry.src_pos / dst_pos) index, so a registration can be paired by position."""
    if len(sections) != len(components):
        raise WireError(where, f"{len(sections)} sections, but the family has "
                               f"{len(components)} components ({_names(components)}): both "
                               f"sides must compile the same spec")
    for i, (sec, comp) in enumerate(zip(sections, components, strict=True)):
        at = f"{where}[{i}]"
        if sec.component != comp.name:
            raise WireError(f"{at}.component", f"is {sec.component!r}, but section {i} "
                                                f"belongs to component {comp.name!r}")
        if len(sec.entries) > comp.max_entries:
            raise WireError(f"{at}.entries", f"{len(sec.entries)} entries exceed the maximum "
                                             f"of {comp.max_entries} for {comp.name!r}")
        prev: tuple[int, int] | None = None
        for j, e in enumerate(sec.entries):
            t = comp._tensor_index.get(e.tensor)
            if t is None:
                raise WireError(f"{at}.entries[{j}].tensor",
                                f"{e.tensor!r} is not a tensor of {comp.name!r} "
                                f"({', '.join(comp.tensors)})")
            prev = _check_entry_order(f"{at}.entries[{j}]", comp, t, e.layer_id, prev)


def _check_entry_order(at: str, comp: WireComponent, tensor: int, layer_id: int,
                       prev: tuple[int, int] | None) -> tuple[int, int]:
    if layer_id not in comp._layer_set:
        raise WireError(f"{at}.layer_id", f"{layer_id} is not a layer of {comp.name!r}")
    key = (tensor, layer_id)
    if prev is not None and key <= prev:
        what = "repeats" if key == prev else "comes after"
        raise WireError(at, f"(tensor {comp.tensors[tensor]!r}, layer {layer_id}) {what} "
                            f"(tensor {comp.tensors[prev[0]]!r}, layer {prev[1]}): entries go "
                            f"tensor-major, then by ascending layer id, each once")
    return key


def _names(components: Sequence[WireComponent]) -> str:
    return ", ".join(c.name for c in components)


def _write_register(w: Writer, m: Register, components: Sequence[WireComponent]) -> None:
    _check_sections(m.sections, components, "Register.sections")
    w.u8("Register.side", m.side)
    w.u16("Register.dp_group", m.dp_group)
    w.u16("Register.rank.pp", m.rank.pp)
    w.u16("Register.rank.tp", m.rank.tp)
    w.u32("Register.page_size", m.page_size)
    w.raw("Register.plan_digest", m.plan_digest)
    w.blob("Register.agent_info", m.agent_info)
    w.text("Register.control_endpoint", m.control_endpoint)
    w.u64("Register.staging_addr", m.staging_addr)
    w.u64("Register.staging_bytes", m.staging_bytes)
    w.u16("Register.sections.count", len(m.sections))
    for i, (sec, comp) in enumerate(zip(m.sections, components, strict=True)):
        at = f"Register.sections[{i}]"
        w.count(f"{at}.entries.count", len(sec.entries))
        if sec.entries:
            index = comp._tensor_index
            w.raw(f"{at}.entries", b"".join(
                _ENTRY.pack(e.layer_id, index[e.tensor], e.base_addr, e.item_bytes,
                            e.capacity_items) for e in sec.entries))


def _read_register(r: Reader, components: Sequence[WireComponent]) -> Register:
    side = r.u8("Register.side")
    dp_group = r.u16("Register.dp_group")
    rank = RankId(r.u16("Register.rank.pp"), r.u16("Register.rank.tp"))
    page_size = r.u32("Register.page_size")
    digest = r.raw("Register.plan_digest", PLAN_DIGEST_BYTES)
    agent = r.blob("Register.agent_info", MAX_AGENT_INFO_BYTES)
    endpoint = r.text("Register.control_endpoint", MAX_ENDPOINT_BYTES)
    staging_addr = r.u64("Register.staging_addr")
    staging_bytes = r.u64("Register.staging_bytes")
    n_sections = r.u16("Register.sections.count")
    if n_sections != len(components):
        raise WireError("Register.sections.count",
                        f"{n_sections} sections, but the family has {len(components)} "
                        f"components ({_names(components)}): both sides must compile the "
                        f"same spec")
    sections = []
    for i, comp in enumerate(components):
        at = f"Register.sections[{i}]"
        n = r.count(f"{at}.entries.count", comp.max_entries, ENTRY_BYTES)
        raw = r.raw(f"{at}.entries", n * ENTRY_BYTES)
        entries = []
        prev = None
        for j, (layer_id, t, base, item, cap) in enumerate(_ENTRY.iter_unpack(raw)):
            if t >= len(comp.tensors):
                raise WireError(f"{at}.entries[{j}].tensor",
                                f"index {t} is out of range: {comp.name!r} has "
                                f"{len(comp.tensors)} tensors ({', '.join(comp.tensors)})")
            prev = _check_entry_order(f"{at}.entries[{j}]", comp, t, layer_id, prev)
            try:
                entries.append(RegEntry(layer_id=layer_id, tensor=comp.tensors[t],
                                        base_addr=base, item_bytes=item, capacity_items=cap))
            except WireError as e:
                raise WireError(f"{at}.entries[{j}].{e.field.removeprefix('RegEntry.')}",
                                e.reason) from None
        sections.append(Section(component=comp.name, entries=tuple(entries)))
    return Register(side=side, dp_group=dp_group, rank=rank, page_size=page_size,
                    plan_digest=digest, agent_info=agent, control_endpoint=endpoint,
                    sections=tuple(sections), staging_addr=staging_addr,
                    staging_bytes=staging_bytes)


def _write_transfer_request(w: Writer, m: TransferRequest, _c: object) -> None:
    w.u64("TransferRequest.room", m.room)
    w.u32("TransferRequest.generation", m.generation)
    w.u16("TransferRequest.decode_rank.pp", m.decode_rank.pp)
    w.u16("TransferRequest.decode_rank.tp", m.decode_rank.tp)
    w.u32("TransferRequest.chunk_id", m.chunk_id)
    w.u64("TransferRequest.decode_prefix_tokens", m.decode_prefix_tokens)
    w.i64("TransferRequest.slot", m.slot)
    w.i64("TransferRequest.ring_slot", m.ring_slot)
    w.i64("TransferRequest.aux_row", m.aux_row)
    w.u64("TransferRequest.staging_addr", m.staging_addr)
    w.u64("TransferRequest.staging_bytes", m.staging_bytes)
    w.i64_array("TransferRequest.dst_page_ids", m.dst_page_ids)
    w.i64_array("TransferRequest.window_page_ids", m.window_page_ids)


def _read_transfer_request(r: Reader, _c: object) -> TransferRequest:
    return TransferRequest(
        room=r.u64("TransferRequest.room"),
        generation=r.u32("TransferRequest.generation"),
        decode_rank=RankId(r.u16("TransferRequest.decode_rank.pp"),
                           r.u16("TransferRequest.decode_rank.tp")),
        chunk_id=r.u32("TransferRequest.chunk_id"),
        decode_prefix_tokens=r.u64("TransferRequest.decode_prefix_tokens"),
        slot=r.i64("TransferRequest.slot"),
        ring_slot=r.i64("TransferRequest.ring_slot"),
        aux_row=r.i64("TransferRequest.aux_row"),
        staging_addr=r.u64("TransferRequest.staging_addr"),
        staging_bytes=r.u64("TransferRequest.staging_bytes"),
        dst_page_ids=r.i64_array("TransferRequest.dst_page_ids.count", MAX_PAGE_IDS),
        window_page_ids=r.i64_array("TransferRequest.window_page_ids.count", MAX_PAGE_IDS),
    )


def _write_status(w: Writer, m: Status, _c: object) -> None:
    w.u64("Status.room", m.room)
    w.u32("Status.generation", m.generation)
    w.u16("Status.prefill_rank.pp", m.prefill_rank.pp)
    w.u16("Status.prefill_rank.tp", m.prefill_rank.tp)
    w.u8("Status.state", m.state)
    w.u32("Status.chunk_id", m.chunk_id)
    w.u64("Status.page_start", m.page_start)
    w.u32("Status.page_count", m.page_count)
    w.u64("Status.bytes_written", m.bytes_written)
    # A presence byte, then the checksum only when present: no don't-care bytes.
    w.flag("Status.has_checksum", m.checksum is not None)
    if m.checksum is not None:
        w.u64("Status.checksum", m.checksum)
    w.text("Status.reason", m.reason)


def _read_status(r: Reader, _c: object) -> Status:
    room = r.u64("Status.room")
    generation = r.u32("Status.generation")
    rank = RankId(r.u16("Status.prefill_rank.pp"), r.u16("Status.prefill_rank.tp"))
    state = r.u8("Status.state")
    chunk_id = r.u32("Status.chunk_id")
    page_start = r.u64("Status.page_start")
    page_count = r.u32("Status.page_count")
    nbytes = r.u64("Status.bytes_written")
    checksum = r.u64("Status.checksum") if r.flag("Status.has_checksum") else None
    reason = r.text("Status.reason", MAX_REASON_BYTES)
    return Status(room=room, generation=generation, prefill_rank=rank, state=state,
                  chunk_id=chunk_id, page_start=page_start, page_count=page_count,
                  bytes_written=nbytes, checksum=checksum, reason=reason)


def _write_abort(w: Writer, m: Abort, _c: object) -> None:
    w.u64("Abort.room", m.room)
    w.u32("Abort.generation", m.generation)
    w.u16("Abort.decode_rank.pp", m.decode_rank.pp)
    w.u16("Abort.decode_rank.tp", m.decode_rank.tp)


def _read_abort(r: Reader, _c: object) -> Abort:
    return Abort(room=r.u64("Abort.room"), generation=r.u32("Abort.generation"),
                 decode_rank=RankId(r.u16("Abort.decode_rank.pp"),
                                    r.u16("Abort.decode_rank.tp")))


def _write_abort_ack(w: Writer, m: AbortAck, _c: object) -> None:
    w.u64("AbortAck.room", m.room)
    w.u32("AbortAck.generation", m.generation)
    w.u16("AbortAck.prefill_rank.pp", m.prefill_rank.pp)
    w.u16("AbortAck.prefill_rank.tp", m.prefill_rank.tp)
    w.flag("AbortAck.drained", m.drained)


def _read_abort_ack(r: Reader, _c: object) -> AbortAck:
    return AbortAck(room=r.u64("AbortAck.room"), generation=r.u32("AbortAck.generation"),
                    prefill_rank=RankId(r.u16("AbortAck.prefill_rank.pp"),
                                        r.u16("AbortAck.prefill_rank.tp")),
                    drained=r.flag("AbortAck.drained"))


def _write_heartbeat(w: Writer, m: Heartbeat, _c: object) -> None:
    w.u8("Heartbeat.side", m.side)
    w.u16("Heartbeat.rank.pp", m.rank.pp)
    w.u16("Heartbeat.rank.tp", m.rank.tp)
    w.u64("Heartbeat.sequence", m.sequence)
    w.u64("Heartbeat.monotonic_ns", m.monotonic_ns)


def _read_heartbeat(r: Reader, _c: object) -> Heartbeat:
    return Heartbeat(side=r.u8("Heartbeat.side"),
                     rank=RankId(r.u16("Heartbeat.rank.pp"), r.u16("Heartbeat.rank.tp")),
                     sequence=r.u64("Heartbeat.sequence"),
                     monotonic_ns=r.u64("Heartbeat.monotonic_ns"))


_Codec = tuple[MessageType, Callable[..., None], Callable[..., Any]]
_CODECS: dict[type, _Codec] = {
    Register: (MessageType.REGISTER, _write_register, _read_register),
    TransferRequest: (MessageType.TRANSFER_REQUEST, _write_transfer_request,
                      _read_transfer_request),
    Status: (MessageType.STATUS, _write_status, _read_status),
    Abort: (MessageType.ABORT, _write_abort, _read_abort),
    AbortAck: (MessageType.ABORT_ACK, _write_abort_ack, _read_abort_ack),
    Heartbeat: (MessageType.HEARTBEAT, _write_heartbeat, _read_heartbeat),
}
_READERS = {mtype: read for mtype, _, read in _CODECS.values()}


# ~~~ encode / decode ~~~


def _encode(msg: Message, fingerprint: int, components: Sequence[WireComponent],
            spans: list[FieldSpan] | None) -> bytes:
    codec = _CODECS.get(type(msg))
    if codec is None:
        raise WireError("message", f"{type(msg).__name__} is not a wire message")
    fp = _uint("header.fingerprint", fingerprint, _U64)
    mtype, write, _ = codec
    body = Writer(spans, HEADER_BYTES)
    write(body, msg, components)
    if len(body) > MAX_BODY_BYTES:
        raise WireError("header.body_length", f"{len(body)} bytes exceed the maximum of "
                                              f"{MAX_BODY_BYTES}")
    payload = body.getvalue()
    head = _HEADER.pack(WIRE_MAGIC, WIRE_VERSION, mtype, 0, fp, len(payload), 0)
    crc = zlib.crc32(payload, zlib.crc32(memoryview(head)[:_CRC_OFFSET]))
    if spans is not None:
        spans[:0] = [FieldSpan(o, n, f"header.{name}", "header") for o, n, name in (
            (0, 4, "magic"), (4, 2, "version"), (6, 1, "type"), (7, 1, "flags"),
            (8, 8, "fingerprint"), (16, 4, "body_length"), (20, 4, "checksum"))]
    return b"".join((head[:_CRC_OFFSET], _S_U32.pack(crc), payload))


def encode(msg: Message, fingerprint: int, components: Sequence[WireComponent]) -> bytes:
    """`msg` as a complete message (header and body) of the family with `fingerprint` and
    `components` (spec order). Raises WireError when msg does not fit the family (e.g. a
    Register whose sections do not match its components)."""
    return _encode(msg, fingerprint, components, None)


def field_map(msg: Message, fingerprint: int,
              components: Sequence[WireComponent]) -> tuple[FieldSpan, ...]:
    """Where each field of `encode(msg, ...)` lies, in order, covering every byte once.

    For annotated hex dumps when debugging a peer, and for the fuzzer, which uses it to aim
    mutations at length fields."""
    spans: list[FieldSpan] = []
    _encode(msg, fingerprint, components, spans)
    return tuple(spans)


def _as_bytes(buf: object) -> bytes:
    if type(buf) is bytes:
        return buf
    try:
        # A private immutable copy: decoded arrays are views of it, so a caller that reuses
        # its receive buffer cannot change a message it already holds.
        return memoryview(buf).tobytes()  # type: ignore[arg-type]
    except TypeError:
        raise WireError("message", f"expected a bytes-like object, got "
                                   f"{type(buf).__name__}") from None


def decode(buf: bytes | bytearray | memoryview, fingerprint: int,
           components: Sequence[WireComponent]) -> Message:
    """The message in `buf`, which must hold exactly one message of the family with
    `fingerprint` and `components`. Raises WireError, naming the field, on anything else."""
    data = _as_bytes(buf)
    n = len(data)
    if n < HEADER_BYTES:
        raise WireError("header", f"truncated: {n} bytes, but a header alone is "
                                  f"{HEADER_BYTES}")
    magic, version, mtype, flags, fp, body_len, crc = _HEADER.unpack_from(data)
    # Magic and version come first and sit at fixed offsets in every version, so a peer of
    # another version is told so instead of failing on a field that moved.
    if magic != WIRE_MAGIC:
        raise WireError("header.magic", f"{magic!r} is not {WIRE_MAGIC!r}: not a pdc wire "
                                        f"message")
    if version != WIRE_VERSION:
        raise WireError("header.version", f"peer speaks wire version {version}, this side "
                                          f"speaks {WIRE_VERSION}: run the same pdc release "
                                          f"on both sides")
    if body_len > MAX_BODY_BYTES:
        raise WireError("header.body_length", f"{body_len} bytes exceed the maximum of "
                                              f"{MAX_BODY_BYTES}")
    if body_len != n - HEADER_BYTES:
        what = "truncated" if body_len > n - HEADER_BYTES else "trailing bytes"
        raise WireError("header.body_length", f"{what}: the header declares {body_len} body "
                                              f"bytes, {n - HEADER_BYTES} follow it")
    view = memoryview(data)
    actual = zlib.crc32(view[HEADER_BYTES:], zlib.crc32(view[:_CRC_OFFSET]))
    if actual != crc:
        raise WireError("header.checksum", f"CRC-32 of the message is {actual:#010x}, the "
                                           f"header says {crc:#010x}: corrupted in transit")
    if mtype not in _READERS:
        raise WireError("header.type", f"{mtype} is not a message type (valid: "
                                       f"{', '.join(f'{t.value} {t.name}' for t in MessageType)})")
    if flags:
        raise WireError("header.flags", f"{flags:#04x} sets flags that wire version "
                                        f"{WIRE_VERSION} does not define")
    if fp != fingerprint:
        raise WireError("header.fingerprint", f"peer's spec fingerprint is {fp:#018x}, this "
                                              f"side's is {fingerprint:#018x}: both sides must "
                                              f"compile the same spec")
    r = Reader(data, HEADER_BYTES, n)
    msg = _READERS[mtype](r, components)
    r.expect_end(type(msg).__name__)
    return msg


def registration_sections(components: Sequence[WireComponent],
                          buffers: Mapping[str, Iterable[RegEntry]]) -> tuple[Section, ...]:
    """Register.sections for a rank that registered `buffers` (component name -> entries).

    Components missing from `buffers` get an empty section (the rank holds none of their
    layers), entries are put in layout order (tensor-major, then layer id: the order plan
    positions refer to), and everything is checked as `encode` would: unknown component or
    tensor names, layer ids outside the component and repeated entries raise WireError.
    """
    known = {c.name for c in components}
    unknown = sorted(set(buffers) - known)
    if unknown:
        raise WireError("sections", f"unknown component(s) {', '.join(map(repr, unknown))}; "
                                    f"the family has {_names(components)}")
    sections = []
    for i, comp in enumerate(components):
        entries = tuple(buffers.get(comp.name, ()))
        for j, e in enumerate(entries):
            if not isinstance(e, RegEntry):
                raise WireError(f"sections[{i}].entries[{j}]",
                                f"must be a RegEntry, got {type(e).__name__}")
            if e.tensor not in comp._tensor_index:
                raise WireError(f"sections[{i}].entries[{j}].tensor",
                                f"{e.tensor!r} is not a tensor of {comp.name!r} "
                                f"({', '.join(comp.tensors)})")
        ordered = tuple(sorted(entries, key=lambda e, c=comp: (c._tensor_index[e.tensor],
                                                                e.layer_id)))
        sections.append(Section(component=comp.name, entries=ordered))
    out = tuple(sections)
    _check_sections(out, components, "sections")
    return out


__all__ = [
    "ENTRY_BYTES",
    "HEADER_BYTES",
    "MAX_AGENT_INFO_BYTES",
    "MAX_BODY_BYTES",
    "MAX_ENDPOINT_BYTES",
    "MAX_PAGE_IDS",
    "MAX_REASON_BYTES",
    "MAX_SECTION_ENTRIES",
    "NO_INDEX",
    "PLAN_DIGEST_BYTES",
    "WIRE_MAGIC",
    "WIRE_VERSION",
    "Abort",
    "AbortAck",
    "FieldSpan",
    "Heartbeat",
    "KVPoll",
    "Message",
    "MessageType",
    "PeerSide",
    "Reader",
    "RegEntry",
    "Register",
    "Section",
    "Status",
    "TransferRequest",
    "WireComponent",
    "WireError",
    "Writer",
    "decode",
    "encode",
    "field_map",
    "registration_sections",
]
