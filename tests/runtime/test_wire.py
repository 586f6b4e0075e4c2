"""The wire codec (pdc.runtime.wire): round trips, exact rejections, and a CI-sized fuzz run.

Family bindings are the runtime's `Family` of each spec, loaded from generated/ when it is
compiled, else built from the spec (bench/fuzz_wire.load_family_wire).
Exact-message tests use a small hand-made family, so their expected text does not move when
a spec changes.
"""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdc.runtime import wire
from pdc.runtime.plan_types import RankId
from pdc.runtime.wire import (
    Abort,
    AbortAck,
    Heartbeat,
    KVPoll,
    PeerSide,
    Reader,
    RegEntry,
    Register,
    RingFilled,
    RingFreed,
    Section,
    Status,
    TransferRequest,
    WireComponent,
    WireError,
    Writer,
)

ROOT = Path(__file__).resolve().parents[2]


def _load_fuzzer():
    spec = importlib.util.spec_from_file_location("pdc_bench_fuzz_wire",
                                                  ROOT / "bench" / "fuzz_wire.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzzer()
FAMILIES = {p.stem: fuzz.load_family_wire(p) for p in fuzz.SPECS}

# A small family of our own for exact error texts.
FP = 0x0123456789ABCDEF
COMPS = (
    WireComponent("kv", ("k", "v"), (0, 1, 2, 3)),
    WireComponent("state", ("data",), (0xFFFFFFFF,)),
)


def entry(layer_id=0, tensor="k", base_addr=0x1000, item_bytes=64, capacity_items=8):
    return RegEntry(layer_id=layer_id, tensor=tensor, base_addr=base_addr,
                    item_bytes=item_bytes, capacity_items=capacity_items)


def register(sections=None, **kw):
    args = dict(side=PeerSide.DECODE, dp_group=0, rank=RankId(0, 1), page_size=64,
                plan_digest=bytes(range(32)), agent_info=b"10.0.0.2:17001",
                instance="10.0.0.2:30000",
                sections=sections if sections is not None else wire.registration_sections(
                    COMPS, {"kv": [entry(1, "v"), entry(0, "k"), entry(1, "k")]}))
    args.update(kw)
    return Register(**args)


def transfer_request(**kw):
    args = dict(room=42, generation=3, decode_rank=RankId(0, 1), chunk_id=0,
                decode_prefix_tokens=64, slot=5, ring_slot=-1, aux_row=7,
                dst_page_ids=np.array([10, 11, 12]), window_page_ids=np.array([], np.int64))
    args.update(kw)
    return TransferRequest(**args)


def enc(msg, comps=COMPS, fp=FP):
    return wire.encode(msg, fp, comps)


def dec(buf, comps=COMPS, fp=FP):
    return wire.decode(buf, fp, comps)


def reseal(buf: bytearray | bytes, fix_length: bool = True) -> bytes:
    """Recompute body length and CRC after editing `buf`, as a peer with a correct CRC
    routine but a wrong body would send it."""
    buf = bytearray(buf)
    if fix_length:
        buf[16:20] = (len(buf) - wire.HEADER_BYTES).to_bytes(4, "little")
    buf[20:24] = zlib.crc32(bytes(buf[24:]), zlib.crc32(bytes(buf[:20]))).to_bytes(4, "little")
    return bytes(buf)


def span(msg, name, comps=COMPS) -> wire.FieldSpan:
    (s,) = [s for s in wire.field_map(msg, FP, comps) if s.name == name]
    return s


def rejects(buf, comps=COMPS, fp=FP) -> str:
    with pytest.raises(WireError) as e:
        dec(buf, comps, fp)
    assert e.value.field and e.value.reason
    return str(e.value)


# ~~~ round trips (hypothesis) ~~~

U16, U32, U64 = st.integers(0, 2**16 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
RANKS = st.builds(RankId, U16, U16)
IDS = st.lists(st.integers(0, 2**63 - 1), max_size=40).map(lambda v: np.array(v, np.int64))
OPT_INDEX = st.one_of(st.just(-1), st.integers(0, 2**63 - 1))


def utf8_text(max_bytes: int):
    return st.text(max_size=max_bytes // 4)


@st.composite
def sections(draw, components):
    buffers = {}
    for comp in components:
        pairs = [(t, i) for t in comp.tensors for i in comp.layer_ids]
        # a draft component of a spec bound to no draft layers has none (Note [Draft
        # components] in runtime/binding.py)
        chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs))) \
            if pairs else []
        entries = []
        for t, i in chosen:
            base = draw(st.integers(1, 2**48))
            entries.append(RegEntry(layer_id=i, tensor=t, base_addr=base,
                                    item_bytes=draw(st.integers(1, 2**24)),
                                    capacity_items=draw(st.integers(1, 2**24))))
        buffers[comp.name] = entries
    return wire.registration_sections(components, buffers)


def message_strategy(kind: str, components):
    if kind == "Register":
        return st.builds(Register, side=st.sampled_from(PeerSide), dp_group=U16, rank=RANKS,
                         page_size=st.integers(1, 2**32 - 1), plan_digest=st.binary(min_size=32, max_size=32),
                         agent_info=st.binary(max_size=256), instance=utf8_text(64),
                         sections=sections(components))
    if kind == "TransferRequest":
        return st.builds(TransferRequest, room=U64, generation=U32, decode_rank=RANKS,
                         chunk_id=U32, decode_prefix_tokens=U64, slot=OPT_INDEX,
                         ring_slot=OPT_INDEX, aux_row=OPT_INDEX,
                         staging_addr=st.integers(1, 2**48), staging_bytes=st.integers(0, 2**40),
                         dst_page_ids=IDS, window_page_ids=IDS,
                         layer_slots=IDS.map(lambda a: np.asarray(a, np.int64)[:len(a) // 2 * 2]
                                             % 2**32))
    if kind == "Status":
        return st.builds(Status, room=U64, generation=U32, prefill_rank=RANKS,
                         state=st.sampled_from([s for s in KVPoll if s is not KVPoll.Failed]),
                         chunk_id=U32, page_start=U64, page_count=U32, bytes_written=U64,
                         checksum=st.one_of(st.none(), U64), reason=utf8_text(200)) | \
            st.builds(Status, room=U64, generation=U32, prefill_rank=RANKS,
                      state=st.just(KVPoll.Failed), reason=st.text(min_size=1, max_size=100))
    if kind == "Abort":
        return st.builds(Abort, room=U64, generation=U32, decode_rank=RANKS)
    if kind == "AbortAck":
        return st.builds(AbortAck, room=U64, generation=U32, prefill_rank=RANKS,
                         drained=st.booleans())
    if kind == "RingFilled":
        return st.builds(RingFilled, room=U64, generation=U32, prefill_rank=RANKS, slot=U32,
                         first_item=U64, items=st.integers(1, 2**32 - 1),
                         blocks=IDS.filter(lambda a: len(a) > 0))
    if kind == "RingFreed":
        return st.builds(RingFreed, room=U64, generation=U32, decode_rank=RANKS, slot=U32)
    return st.builds(Heartbeat, side=st.sampled_from(PeerSide), rank=RANKS, sequence=U64,
                     monotonic_ns=U64)


KINDS = ["Register", "TransferRequest", "Status", "Abort", "AbortAck", "Heartbeat",
         "RingFilled", "RingFreed"]
RING_SAMPLES = {
    "RingFilled": RingFilled(room=1, generation=1, prefill_rank=RankId(0, 0), slot=1,
                             first_item=2, items=3, blocks=np.array([0, 1])),
    "RingFreed": RingFreed(room=1, generation=1, decode_rank=RankId(0, 0), slot=1),
}
ROUND_TRIP = settings(max_examples=40, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@ROUND_TRIP
@given(data=st.data())
def test_round_trip_every_message_and_family(family, kind, data):
    fam = FAMILIES[family]
    msg = data.draw(message_strategy(kind, fam.wire_components))
    buf = fam.encode(msg)
    assert fam.decode(buf) == msg
    assert fam.encode(fam.decode(buf)) == buf  # canonical: one spelling per message
    assert fam.decode(bytearray(buf)) == msg
    assert fam.decode(memoryview(buf)) == msg
    # The field map tiles the message exactly, and the header says what it is.
    spans = wire.field_map(msg, fam.fingerprint, fam.wire_components)
    assert [s.offset for s in spans] == list(np.cumsum([0] + [s.size for s in spans[:-1]]))
    assert spans[-1].offset + spans[-1].size == len(buf)
    assert buf[:4] == b"PDCW" and int.from_bytes(buf[8:16], "little") == fam.fingerprint


@settings(max_examples=300, deadline=None, derandomize=True)
@given(garbage=st.binary(max_size=120), header_from=st.sampled_from(KINDS))
def test_arbitrary_bodies_behind_a_valid_header_raise_only_wire_error(garbage, header_from):
    fam = FAMILIES["qwen38"]
    msg = {"Register": register(sections=wire.registration_sections(fam.wire_components, {})),
           "TransferRequest": transfer_request(), "Heartbeat": Heartbeat(
               side=PeerSide.PREFILL, rank=RankId(0, 0), sequence=1, monotonic_ns=2),
           "Status": Status(room=1, generation=1, prefill_rank=RankId(0, 0),
                            state=KVPoll.Success),
           "Abort": Abort(room=1, generation=1, decode_rank=RankId(0, 0)),
           "AbortAck": AbortAck(room=1, generation=1, prefill_rank=RankId(0, 0), drained=True),
           **RING_SAMPLES}[header_from]
    buf = reseal(fam.encode(msg)[:wire.HEADER_BYTES] + garbage)
    try:
        got = fam.decode(buf)
    except WireError as e:
        assert e.field and e.reason
    else:
        assert fam.encode(got) == buf


# ~~~ the fuzz run (CI size; bench/fuzz_wire.py is the long run) ~~~


def test_fuzz_100k_mutated_inputs_decode_exactly_or_raise_wire_error():
    res = fuzz.run_fuzz(100_000, seed=20261130, families=list(FAMILIES.values()))
    assert res.ok, fuzz.table(res)
    assert res.other_exceptions == res.undetected_corruptions == res.noncanonical_accepts == 0
    assert res.inputs == res.decoded_same + res.decoded_other + res.rejected
    # Every mutation class ran, and the damage reached the body parsers, not only the header.
    assert set(res.by_mutation) == set(fuzz.MUTATIONS)
    assert min(res.decoded_same, res.decoded_other, res.rejected) > 0
    fields = set(res.rejected_by_field)
    for must in ("header", "header.magic", "header.version", "header.checksum",
                 "header.body_length", "header.fingerprint", "header.type", "header.flags",
                 "Register.sections.count", "Register.sections[].entries.count",
                 "TransferRequest.dst_page_ids.count", "Status.reason", "Status.state",
                 "AbortAck.drained"):
        assert must in fields, (must, sorted(fields))
    print("\n" + fuzz.table(res))


# ~~~ exact rejections ~~~


def test_bad_magic():
    buf = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    assert rejects(buf) == ("header.magic: b'GET ' is not b'PDCW': not a pdc wire message")


def test_wrong_fingerprint():
    buf = wire.encode(Abort(room=1, generation=0, decode_rank=RankId(0, 0)), 0xFEDCBA9876543210,
                      COMPS)
    assert rejects(buf) == (
        "header.fingerprint: peer's spec fingerprint is 0xfedcba9876543210, this side's is "
        "0x0123456789abcdef: both sides must compile the same spec")


def test_other_wire_version():
    buf = bytearray(enc(Abort(room=1, generation=0, decode_rank=RankId(0, 0))))
    buf[4:6] = (2).to_bytes(2, "little")
    assert rejects(reseal(buf)) == (
        "header.version: peer speaks wire version 2, this side speaks 5: run the same pdc "
        "release on both sides")


def test_truncated_header():
    buf = enc(Abort(room=1, generation=0, decode_rank=RankId(0, 0)))
    assert rejects(buf[:10]) == "header: truncated: 10 bytes, but a header alone is 24"
    assert rejects(b"") == "header: truncated: 0 bytes, but a header alone is 24"


def test_truncated_body_and_trailing_bytes():
    buf = enc(Abort(room=1, generation=0, decode_rank=RankId(0, 0)))
    assert rejects(buf[:-1]) == ("header.body_length: truncated: the header declares 16 body "
                                 "bytes, 15 follow it")
    assert rejects(buf + b"\0") == ("header.body_length: trailing bytes: the header declares "
                                    "16 body bytes, 17 follow it")
    # Trailing bytes that the header does count: the body parser finds them.
    assert rejects(reseal(buf + b"\0")) == "Abort: 1 bytes left over after the last field"


def test_checksum_mismatch():
    buf = bytearray(enc(Abort(room=1, generation=0, decode_rank=RankId(0, 0))))
    buf[24] ^= 0x01  # room 1 -> 0: a valid message, but not the one that was sent
    assert rejects(bytes(buf)).startswith("header.checksum: CRC-32 of the message is 0x")
    assert rejects(bytes(buf)).endswith(": corrupted in transit")


def test_unknown_type_and_flags():
    buf = bytearray(enc(Abort(room=1, generation=0, decode_rank=RankId(0, 0))))
    buf[6] = 9
    assert rejects(reseal(buf)) == (
        "header.type: 9 is not a message type (valid: 1 REGISTER, 2 TRANSFER_REQUEST, 3 STATUS, "
        "4 ABORT, 5 ABORT_ACK, 6 HEARTBEAT, 7 RING_FILLED, 8 RING_FREED)")
    buf[6] = 4
    buf[7] = 0x80
    assert rejects(reseal(buf)) == ("header.flags: 0x80 sets flags that wire version 5 does "
                                    "not define")


def test_oversize_array_length():
    msg = transfer_request()
    s = span(msg, "TransferRequest.dst_page_ids.count")
    buf = bytearray(enc(msg))
    buf[s.offset:s.offset + 4] = (0xFFFFFFFF).to_bytes(4, "little")
    assert rejects(reseal(buf)) == ("TransferRequest.dst_page_ids.count: 4294967295 exceeds the "
                                    "maximum of 2097152")
    # Under the maximum but more than the bytes that follow: refused before allocating.
    buf[s.offset:s.offset + 4] = (1000).to_bytes(4, "little")
    assert rejects(reseal(buf)) == ("TransferRequest.dst_page_ids.count: 1000 elements need "
                                    "8000 bytes but only 32 remain (truncated)")


def test_oversize_header_body_length():
    buf = bytearray(enc(Abort(room=1, generation=0, decode_rank=RankId(0, 0))))
    buf[16:20] = (0xFFFFFFFF).to_bytes(4, "little")
    assert rejects(reseal(buf, fix_length=False)) == (
        "header.body_length: 4294967295 bytes exceed the maximum of 67108864")


def test_bad_enum_values():
    msg = Status(room=1, generation=0, prefill_rank=RankId(0, 0), state=KVPoll.Success)
    s = span(msg, "Status.state")
    buf = bytearray(enc(msg))
    buf[s.offset] = 7
    assert rejects(reseal(buf)) == (
        "Status.state: 7 is not a KVPoll (valid: 0 Bootstrapping, 1 WaitingForInput, "
        "2 Transferring, 3 Success, 4 Failed)")
    hb = Heartbeat(side=PeerSide.DECODE, rank=RankId(0, 0), sequence=0, monotonic_ns=0)
    buf = bytearray(enc(hb))
    buf[span(hb, "Heartbeat.side").offset] = 2
    assert rejects(reseal(buf)) == ("Heartbeat.side: 2 is not a PeerSide (valid: 0 PREFILL, "
                                    "1 DECODE)")
    ack = AbortAck(room=1, generation=0, prefill_rank=RankId(0, 0), drained=False)
    buf = bytearray(enc(ack))
    buf[span(ack, "AbortAck.drained").offset] = 2
    assert rejects(reseal(buf)) == "AbortAck.drained: 2 is not a bool (0 or 1)"


def test_section_count_mismatch():
    msg = register()
    # A peer whose family has one more component (same fingerprint only in this test).
    three = (*COMPS, WireComponent("extra", ("data",), (0xFFFFFFFE,)))
    assert rejects(enc(msg), comps=three) == (
        "Register.sections.count: 2 sections, but the family has 3 components (kv, state, "
        "extra): both sides must compile the same spec")
    with pytest.raises(WireError) as e:
        enc(msg, comps=three)
    assert str(e.value) == ("Register.sections: 2 sections, but the family has 3 components "
                            "(kv, state, extra): both sides must compile the same spec")


def test_register_entry_checks():
    msg = register()
    s = span(msg, "Register.sections[0].entries")
    good = enc(msg)

    def with_entry(j, field_offset, value: bytes):
        buf = bytearray(good)
        at = s.offset + j * wire.ENTRY_BYTES + field_offset
        buf[at:at + len(value)] = value
        return reseal(buf)

    assert rejects(with_entry(0, 4, b"\x02")) == (
        "Register.sections[0].entries[0].tensor: index 2 is out of range: 'kv' has 2 tensors "
        "(k, v)")
    assert rejects(with_entry(0, 0, (9).to_bytes(4, "little"))) == (
        "Register.sections[0].entries[0].layer_id: 9 is not a layer of 'kv'")
    # Entries are (k,0), (k,1), (v,1); make the second one (k,0) again.
    assert rejects(with_entry(1, 0, (0).to_bytes(4, "little"))) == (
        "Register.sections[0].entries[1]: (tensor 'k', layer 0) repeats (tensor 'k', layer 0): "
        "entries go tensor-major, then by ascending layer id, each once")
    assert rejects(with_entry(2, 13, bytes(8))) == (
        "Register.sections[0].entries[2].item_bytes: an item holds at least one byte")
    assert rejects(with_entry(2, 5, (2**64 - 8).to_bytes(8, "little"))) == (
        "Register.sections[0].entries[2].capacity_items: 8 items of 64 bytes from "
        "0xfffffffffffffff8 run past 2^64")


def test_invalid_text_and_ids():
    msg = Status(room=1, generation=0, prefill_rank=RankId(0, 0), state=KVPoll.Failed,
                 reason="boom")
    s = span(msg, "Status.reason")
    buf = bytearray(enc(msg))
    buf[s.offset:s.offset + 2] = b"\xed\xa0"  # the start of an encoded surrogate
    assert rejects(reseal(buf)) == ("Status.reason: is not valid UTF-8 (byte 0: invalid "
                                    "continuation byte)")
    req = transfer_request()
    buf = bytearray(enc(req))
    at = span(req, "TransferRequest.dst_page_ids").offset + 8
    buf[at:at + 8] = (-5).to_bytes(8, "little", signed=True)
    assert rejects(reseal(buf)) == ("TransferRequest.dst_page_ids[1]: -5 is negative; page ids "
                                    "are >= 0")
    buf = bytearray(enc(req))
    at = span(req, "TransferRequest.ring_slot").offset
    buf[at:at + 8] = (-2).to_bytes(8, "little", signed=True)
    assert rejects(reseal(buf)) == ("TransferRequest.ring_slot: -2 is not an index: use "
                                    "0..9223372036854775807, or -1 for none")


def test_failed_status_must_carry_a_reason_on_the_wire_too():
    ok = Status(room=1, generation=0, prefill_rank=RankId(0, 0), state=KVPoll.Success)
    buf = bytearray(enc(ok))
    buf[span(ok, "Status.state").offset] = KVPoll.Failed
    assert rejects(reseal(buf)) == "Status.reason: a Failed status must say why"


def test_a_written_event_rides_a_transferring_status_only():
    # Note [Success by event]: the handle of the event after a rank's last write
    msg = Status(room=1, generation=0, prefill_rank=RankId(0, 0), state=KVPoll.Transferring,
                 bytes_written=4096, written_event=bytes(range(64)))
    assert wire.decode(enc(msg), FP, COMPS) == msg
    buf = bytearray(enc(msg))
    buf[span(msg, "Status.state").offset] = KVPoll.Success
    assert rejects(reseal(buf)) == ("Status.written_event: only a Transferring status carries "
                                    "a written event")
    with pytest.raises(WireError, match=r"^Status.written_event: 65 bytes exceed the maximum "
                                        r"of 64$"):
        Status(room=1, generation=0, prefill_rank=RankId(0, 0), state=KVPoll.Transferring,
               written_event=bytes(65))


def test_non_bytes_input():
    assert rejects("PDCW") == "message: expected a bytes-like object, got str"
    assert rejects(None) == "message: expected a bytes-like object, got NoneType"


# ~~~ message construction ~~~


def test_constructors_validate_like_the_decoder():
    with pytest.raises(WireError, match=r"^Abort.decode_rank.tp: 65536 is outside 0..65535$"):
        Abort(room=0, generation=0, decode_rank=RankId(0, 65536))
    with pytest.raises(WireError, match="must be an integer, not a bool"):
        Abort(room=True, generation=0, decode_rank=RankId(0, 0))
    with pytest.raises(WireError, match="lone surrogate"):
        Status(room=0, generation=0, prefill_rank=RankId(0, 0), state=0, reason="\ud800")
    with pytest.raises(WireError, match="4097 bytes of UTF-8 exceed the maximum of 4096"):
        Status(room=0, generation=0, prefill_rank=RankId(0, 0), state=0, reason="x" * 4097)
    with pytest.raises(WireError, match="must hold integers, got dtype float64"):
        transfer_request(dst_page_ids=np.array([1.0]))
    with pytest.raises(WireError, match=r"must be a 1-D array, got shape \(1, 1\)"):
        transfer_request(dst_page_ids=np.zeros((1, 1), np.int64))
    with pytest.raises(WireError, match="does not fit in an int64 page id"):
        transfer_request(dst_page_ids=np.array([2**63], np.uint64))
    with pytest.raises(WireError, match="a sha256 digest is 32"):
        register(plan_digest=b"short")
    with pytest.raises(WireError, match="0 is not a buffer address"):
        entry(base_addr=0)
    with pytest.raises(WireError, match=r"^Register.page_size: a page holds at least one token$"):
        register(page_size=0)
    # Numpy integers are accepted and stored as Python ints.
    m = Abort(room=np.uint64(5), generation=np.int32(1), decode_rank=RankId(0, 0))
    assert type(m.room) is int and m == Abort(room=5, generation=1, decode_rank=RankId(0, 0))


def test_messages_do_not_alias_caller_memory():
    ids = np.array([1, 2, 3])
    req = transfer_request(dst_page_ids=ids)
    ids[0] = 99
    assert req.dst_page_ids.tolist() == [1, 2, 3]
    assert not req.dst_page_ids.flags.writeable
    recv = bytearray(enc(req))
    got = dec(recv)
    recv[:] = bytes(len(recv))  # the receive buffer is reused for the next message
    assert got == req and got.dst_page_ids.dtype == np.dtype("<i8")


def test_transfer_request_equality_compares_arrays():
    assert transfer_request() == transfer_request(dst_page_ids=[10, 11, 12])
    assert transfer_request() != transfer_request(dst_page_ids=[10, 11])
    assert transfer_request() != transfer_request(window_page_ids=[1])
    assert transfer_request() != transfer_request(chunk_id=1)
    assert transfer_request() != transfer_request(layer_slots=[0, 5])


def test_layer_slots_round_trip_as_pairs():
    """Note [Layer slots]: (layer id, slot) pairs, one per state layer with its own slot."""
    req = transfer_request(slot=-1, layer_slots=[0, 7, 1, 9, 4, 7])
    got = dec(enc(req))
    assert got == req and got.layer_slots.tolist() == [0, 7, 1, 9, 4, 7]


def test_layer_slots_that_are_not_pairs_are_refused():
    with pytest.raises(WireError) as e:
        transfer_request(layer_slots=[0, 7, 1])
    assert str(e.value) == ("TransferRequest.layer_slots: holds 3 values, not (layer id, "
                            "slot) pairs")
    with pytest.raises(WireError) as e:
        transfer_request(layer_slots=[2**32, 1])
    assert str(e.value) == "TransferRequest.layer_slots: layer id 4294967296 is not a u32"


def test_wire_error_pickles():
    e = pickle.loads(pickle.dumps(WireError("Status.reason", "too long")))
    assert (e.field, e.reason, str(e)) == ("Status.reason", "too long", "Status.reason: too long")


# ~~~ registration sections ~~~


def test_registration_sections_orders_fills_and_checks():
    secs = wire.registration_sections(COMPS, {"kv": [entry(3, "v"), entry(2, "k"), entry(0, "v")]})
    assert [s.component for s in secs] == ["kv", "state"]
    assert [(e.tensor, e.layer_id) for e in secs[0].entries] == [("k", 2), ("v", 0), ("v", 3)]
    assert secs[1] == Section(component="state", entries=())
    with pytest.raises(WireError, match=r"unknown component\(s\) 'kv2'; the family has kv, state"):
        wire.registration_sections(COMPS, {"kv2": []})
    with pytest.raises(WireError, match=r"'q' is not a tensor of 'kv' \(k, v\)"):
        wire.registration_sections(COMPS, {"kv": [entry(0, "q")]})
    with pytest.raises(WireError, match="7 is not a layer of 'kv'"):
        wire.registration_sections(COMPS, {"kv": [entry(7)]})
    with pytest.raises(WireError, match=r"\(tensor 'k', layer 1\) repeats"):
        wire.registration_sections(COMPS, {"kv": [entry(1), entry(1)]})
    with pytest.raises(WireError, match="is not a layer of 'state'"):
        wire.registration_sections(COMPS, {"state": [entry(0, "data")]})


def test_encode_checks_sections_against_the_family():
    bad = (Section(component="state", entries=()), Section(component="kv", entries=()))
    with pytest.raises(WireError, match=r"^Register.sections\[0\].component: is 'state', but "
                                        r"section 0 belongs to component 'kv'$"):
        enc(register(sections=bad))
    unsorted = (Section(component="kv", entries=(entry(1), entry(0))),
                Section(component="state"))
    with pytest.raises(WireError, match=r"\(tensor 'k', layer 0\) comes after \(tensor 'k', "
                                        r"layer 1\)"):
        enc(register(sections=unsorted))


# ~~~ Reader / Writer ~~~


def test_reader_writer_primitives_round_trip():
    w = Writer()
    w.u8("a", 255)
    w.u16("b", 65535)
    w.u32("c", 2**32 - 1)
    w.u64("d", 2**64 - 1)
    w.i64("e", -(2**63))
    w.flag("f", True)
    w.text("g", "héllo")
    w.blob("h", b"\x00\x01")
    w.u64_array("i", np.array([0, 2**64 - 1], np.uint64))
    w.i64_array("j", np.array([-1, 2**63 - 1], np.int64))
    r = Reader(w.getvalue())
    assert (r.u8("a"), r.u16("b"), r.u32("c"), r.u64("d"), r.i64("e"), r.flag("f")) == (
        255, 65535, 2**32 - 1, 2**64 - 1, -(2**63), True)
    assert (r.text("g", 16), r.blob("h", 2)) == ("héllo", b"\x00\x01")
    assert r.u64_array("i", 2).tolist() == [0, 2**64 - 1]
    assert r.i64_array("j", 2).tolist() == [-1, 2**63 - 1]
    r.expect_end("x")
    assert r.remaining == 0


def test_reader_checks_lengths_before_allocating():
    w = Writer()
    w.count("n", 3)
    r = Reader(w.getvalue() + bytes(16))
    with pytest.raises(WireError, match=r"^arr: 3 elements need 24 bytes but only 16 remain"):
        r.u64_array("arr", 10)
    r = Reader(w.getvalue())
    with pytest.raises(WireError, match=r"^blob: 3 exceeds the maximum of 2$"):
        r.blob("blob", 2)
    with pytest.raises(WireError, match=r"^x: needs 8 bytes but only 2 remain \(truncated\)$"):
        Reader(b"\0\0").u64("x")


# ~~~ runtime stays lean ~~~


def test_runtime_wire_does_not_import_the_compiler():
    code = ("import sys, pdc.runtime.wire; "
            "assert not [m for m in sys.modules if m.startswith('pdc.compiler')]")
    subprocess.run([sys.executable, "-c", code], check=True)


# ~~~ docs/wire-format.md matches the encoder ~~~

_DOC_KIND = {"u8": "u8", "u16": "u16", "u32": "u32", "u64": "u64", "i64": "i64", "bool": "bool",
             "u32 length": "count", "bytes": "bytes", "bytes[32]": "bytes", "utf-8": "bytes",
             "entry[n]": "bytes", "i64[n]": "array"}


def _doc_tables() -> dict[str, list[list[str]]]:
    """Table rows under each `## ` heading (heading's first word -> rows of cells); rows of
    the entry table under Register go to "Register.entry". Header rows are skipped."""
    tables: dict[str, list[list[str]]] = {}
    heading = ""
    lines = (ROOT / "docs" / "wire-format.md").read_text().splitlines()
    for line, after in zip(lines, [*lines[1:], ""], strict=True):
        if line.startswith("## "):
            heading = line[3:].split()[0]
        elif line.startswith("| entry offset"):
            heading = f"{heading}.entry"
        elif line.startswith("| ") and not after.startswith("|---"):
            tables.setdefault(heading, []).append([c.strip() for c in line.strip("|").split("|")])
    return tables


def test_doc_tables_match_the_field_map():
    one = (WireComponent("kv", ("k", "v"), (0, 1)),)
    samples = {
        "Register": register(sections=wire.registration_sections(one, {"kv": [entry(0)]})),
        "TransferRequest": transfer_request(),
        "Status": Status(room=1, generation=0, prefill_rank=RankId(0, 0), state=0, checksum=5),
        "Abort": Abort(room=1, generation=0, decode_rank=RankId(0, 0)),
        "AbortAck": AbortAck(room=1, generation=0, prefill_rank=RankId(0, 0), drained=True),
        "Heartbeat": Heartbeat(side=0, rank=RankId(0, 0), sequence=0, monotonic_ns=0),
        **RING_SAMPLES,
    }
    tables = _doc_tables()
    for name, msg in samples.items():
        spans = wire.field_map(msg, FP, one)
        for table, prefix, base in (("Header", "header.", 0), (name, f"{name}.", 24)):
            got = [s for s in spans if s.name.startswith(prefix)]
            rows = tables[table]
            assert [r[3] for r in rows] == [s.name.removeprefix(prefix).replace("[0]", "[i]")
                                            for s in got], table
            for (offset, size, kind, field_name, _), s in zip(rows, got, strict=True):
                if offset != "+":
                    assert int(offset) == s.offset - base, (table, field_name)
                if size != "+":
                    assert int(size) == s.size, (table, field_name)
                if table != "Header":
                    assert _DOC_KIND[kind] == s.kind, (table, field_name)
    entry_rows = tables["Register.entry"]
    sizes = [int(r[1]) for r in entry_rows]
    assert sum(sizes) == wire.ENTRY_BYTES
    assert [int(r[0]) for r in entry_rows] == list(np.cumsum([0, *sizes[:-1]]))
    assert [r[2] for r in entry_rows] == ["u32", "u8", "u64", "u64", "u64"]  # "<IBQQQ"


def test_doc_limits_match_the_constants():
    limits = {}
    for row in _doc_tables()["Limits"]:
        value = row[1].replace(",", "")
        limits[row[0].strip("`")] = int(value[:-4]) << 20 if value.endswith(" MiB") else int(value)
    assert limits == {name: getattr(wire, name) for name in (
        "MAX_BODY_BYTES", "MAX_PAGE_IDS", "MAX_AGENT_INFO_BYTES", "MAX_INSTANCE_BYTES",
        "MAX_REASON_BYTES", "MAX_EVENT_BYTES", "MAX_SECTION_ENTRIES", "MAX_RING_BLOCKS")}
