"""Wire format, version 2 (runtime/wire.py): bounds-checked `Reader` and `Writer`, the body
codec of each message, and `encode` / `decode` with the header and its CRC."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .plan_types import RankId
from .wire_messages import (
    _CRC_OFFSET,
    _HEADER,
    _I64,
    _U64,
    _U64_DT,
    HEADER_BYTES,
    MAX_AGENT_INFO_BYTES,
    MAX_BODY_BYTES,
    MAX_EVENT_BYTES,
    MAX_INSTANCE_BYTES,
    MAX_PAGE_IDS,
    MAX_REASON_BYTES,
    PLAN_DIGEST_BYTES,
    WIRE_MAGIC,
    WIRE_VERSION,
    Abort,
    AbortAck,
    Heartbeat,
    KVPoll,
    Message,
    MessageType,
    PeerSide,
    RegEntry,
    Register,
    Section,
    Status,
    TransferRequest,
    WireError,
    _enum,
    _uint,
)
from .wire_ring import MAX_RING_BLOCKS, RingFilled, RingFreed
from .wire_sections import WireComponent, _check_entry_order, _check_sections, _names

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

    def fixed(self, prefix: str, st: struct.Struct, fields: tuple) -> tuple:
        """Note [Scalars at once]: a run of scalar fields ((kind, name) pairs) read by one
        unpack; a buffer too short for all of them takes the field-by-field reads, whose
        error names the field that is cut."""
        if self._end - self._pos >= st.size:
            return st.unpack_from(self._buf, self._need(prefix, st.size))
        return tuple(getattr(self, kind)(f"{prefix}.{name}") for kind, name in fields)

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

    def fixed(self, prefix: str, st: struct.Struct, fields: tuple, values: tuple) -> None:
        """Note [Scalars at once]: one pack, or a FieldSpan per field when spans are kept."""
        if self._spans is None:
            self._buf += st.pack(*values)
            return
        for (kind, name), v in zip(fields, values, strict=True):
            getattr(self, kind)(f"{prefix}.{name}", v)

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


def _write_register(w: Writer, m: Register, components: Sequence[WireComponent]) -> None:
    _check_sections(m.sections, components, "Register.sections")
    w.u8("Register.side", m.side)
    w.u16("Register.dp_group", m.dp_group)
    w.u16("Register.rank.pp", m.rank.pp)
    w.u16("Register.rank.tp", m.rank.tp)
    w.u32("Register.page_size", m.page_size)
    w.raw("Register.plan_digest", m.plan_digest)
    w.blob("Register.agent_info", m.agent_info)
    w.text("Register.instance", m.instance)
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
    instance = r.text("Register.instance", MAX_INSTANCE_BYTES)
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
    return Register(side=_enum("Register.side", side, PeerSide), dp_group=dp_group, rank=rank,
                    page_size=page_size, plan_digest=digest, agent_info=agent,
                    instance=instance, sections=tuple(sections), staging_addr=staging_addr,
                    staging_bytes=staging_bytes)


# Note [Scalars at once]: the scalars in front of a TransferRequest's and a Status's arrays
# and texts are one fixed struct each, written and read by one pack on every request's path
# (field by field, as the other messages, when spans are kept or the buffer is short).
_REQUEST = (("u64", "room"), ("u32", "generation"), ("u16", "decode_rank.pp"),
            ("u16", "decode_rank.tp"), ("u32", "chunk_id"), ("u64", "decode_prefix_tokens"),
            ("i64", "slot"), ("i64", "ring_slot"), ("i64", "aux_row"), ("u64", "staging_addr"),
            ("u64", "staging_bytes"), ("u32", "staging_slots"))
_STATUS = (("u64", "room"), ("u32", "generation"), ("u16", "prefill_rank.pp"),
           ("u16", "prefill_rank.tp"), ("u8", "state"), ("u32", "chunk_id"),
           ("u64", "page_start"), ("u32", "page_count"), ("u64", "bytes_written"),
           ("u32", "descriptors"))
_FORMAT = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "i64": "q"}
_S_REQUEST, _S_STATUS = (struct.Struct("<" + "".join(_FORMAT[k] for k, _ in f))
                         for f in (_REQUEST, _STATUS))


def _write_transfer_request(w: Writer, m: TransferRequest, _c: object) -> None:
    w.fixed("TransferRequest", _S_REQUEST, _REQUEST, (
        m.room, m.generation, m.decode_rank.pp, m.decode_rank.tp, m.chunk_id,
        m.decode_prefix_tokens, m.slot, m.ring_slot, m.aux_row, m.staging_addr,
        m.staging_bytes, m.staging_slots))
    w.i64_array("TransferRequest.dst_page_ids", m.dst_page_ids)
    w.i64_array("TransferRequest.window_page_ids", m.window_page_ids)
    w.i64_array("TransferRequest.layer_slots", m.layer_slots)


def _read_transfer_request(r: Reader, _c: object) -> TransferRequest:
    (room, generation, pp, tp, chunk_id, prefix, slot, ring_slot, aux_row, staging_addr,
     staging_bytes, staging_slots) = r.fixed("TransferRequest", _S_REQUEST, _REQUEST)
    return TransferRequest(
        room=room, generation=generation, decode_rank=RankId(pp, tp), chunk_id=chunk_id,
        decode_prefix_tokens=prefix, slot=slot, ring_slot=ring_slot, aux_row=aux_row,
        staging_addr=staging_addr, staging_bytes=staging_bytes, staging_slots=staging_slots,
        dst_page_ids=r.i64_array("TransferRequest.dst_page_ids.count", MAX_PAGE_IDS),
        window_page_ids=r.i64_array("TransferRequest.window_page_ids.count", MAX_PAGE_IDS),
        layer_slots=r.i64_array("TransferRequest.layer_slots.count", MAX_PAGE_IDS),
    )


def _write_status(w: Writer, m: Status, _c: object) -> None:
    w.fixed("Status", _S_STATUS, _STATUS, (
        m.room, m.generation, m.prefill_rank.pp, m.prefill_rank.tp, m.state, m.chunk_id,
        m.page_start, m.page_count, m.bytes_written, m.descriptors))
    # A presence byte, then the checksum only when present: no don't-care bytes.
    w.flag("Status.has_checksum", m.checksum is not None)
    if m.checksum is not None:
        w.u64("Status.checksum", m.checksum)
    w.text("Status.reason", m.reason)
    w.blob("Status.written_event", m.written_event)


def _read_status(r: Reader, _c: object) -> Status:
    (room, generation, pp, tp, state, chunk_id, page_start, page_count, nbytes,
     descriptors) = r.fixed("Status", _S_STATUS, _STATUS)
    rank = RankId(pp, tp)
    checksum = r.u64("Status.checksum") if r.flag("Status.has_checksum") else None
    reason = r.text("Status.reason", MAX_REASON_BYTES)
    event = r.blob("Status.written_event", MAX_EVENT_BYTES)
    return Status(room=room, generation=generation, prefill_rank=rank,
                  state=_enum("Status.state", state, KVPoll),
                  chunk_id=chunk_id, page_start=page_start, page_count=page_count,
                  bytes_written=nbytes, descriptors=descriptors, checksum=checksum, reason=reason,
                  written_event=event)


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
    side = r.u8("Heartbeat.side")  # checked after every read: a short body is reported first
    rank = RankId(r.u16("Heartbeat.rank.pp"), r.u16("Heartbeat.rank.tp"))
    sequence = r.u64("Heartbeat.sequence")
    monotonic_ns = r.u64("Heartbeat.monotonic_ns")
    return Heartbeat(side=_enum("Heartbeat.side", side, PeerSide), rank=rank,
                     sequence=sequence, monotonic_ns=monotonic_ns)


def _write_ring_filled(w: Writer, m: RingFilled, _c: object) -> None:
    w.u64("RingFilled.room", m.room)
    w.u32("RingFilled.generation", m.generation)
    w.u16("RingFilled.prefill_rank.pp", m.prefill_rank.pp)
    w.u16("RingFilled.prefill_rank.tp", m.prefill_rank.tp)
    w.u32("RingFilled.slot", m.slot)
    w.u64("RingFilled.first_item", m.first_item)
    w.u32("RingFilled.items", m.items)
    w.i64_array("RingFilled.blocks", m.blocks)


def _read_ring_filled(r: Reader, _c: object) -> RingFilled:
    return RingFilled(room=r.u64("RingFilled.room"), generation=r.u32("RingFilled.generation"),
                      prefill_rank=RankId(r.u16("RingFilled.prefill_rank.pp"),
                                          r.u16("RingFilled.prefill_rank.tp")),
                      slot=r.u32("RingFilled.slot"), first_item=r.u64("RingFilled.first_item"),
                      items=r.u32("RingFilled.items"),
                      blocks=r.i64_array("RingFilled.blocks.count", MAX_RING_BLOCKS))


def _write_ring_freed(w: Writer, m: RingFreed, _c: object) -> None:
    w.u64("RingFreed.room", m.room)
    w.u32("RingFreed.generation", m.generation)
    w.u16("RingFreed.decode_rank.pp", m.decode_rank.pp)
    w.u16("RingFreed.decode_rank.tp", m.decode_rank.tp)
    w.u32("RingFreed.slot", m.slot)


def _read_ring_freed(r: Reader, _c: object) -> RingFreed:
    return RingFreed(room=r.u64("RingFreed.room"), generation=r.u32("RingFreed.generation"),
                     decode_rank=RankId(r.u16("RingFreed.decode_rank.pp"),
                                        r.u16("RingFreed.decode_rank.tp")),
                     slot=r.u32("RingFreed.slot"))


_Codec = tuple[MessageType, Callable[..., None], Callable[..., Any]]
_CODECS: dict[type, _Codec] = {
    Register: (MessageType.REGISTER, _write_register, _read_register),
    TransferRequest: (MessageType.TRANSFER_REQUEST, _write_transfer_request,
                      _read_transfer_request),
    Status: (MessageType.STATUS, _write_status, _read_status),
    Abort: (MessageType.ABORT, _write_abort, _read_abort),
    AbortAck: (MessageType.ABORT_ACK, _write_abort_ack, _read_abort_ack),
    Heartbeat: (MessageType.HEARTBEAT, _write_heartbeat, _read_heartbeat),
    RingFilled: (MessageType.RING_FILLED, _write_ring_filled, _read_ring_filled),
    RingFreed: (MessageType.RING_FREED, _write_ring_freed, _read_ring_freed),
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


