"""Fuzz the wire decoders with mutated valid messages of every family in specs/.

    python bench/fuzz_wire.py [--iterations 2000000] [--seed 0] [--json out.json]

Each input starts as a valid encoding (a random message of a random family and type) and is
then mutated: bit flips, byte replacements, truncations, extensions, length fields set to
huge values, header/body splices across message types, or plain random garbage. Most
mutated inputs are then "repaired" (body length and/or CRC recomputed), because an input with
a wrong CRC never reaches the body parser; repaired inputs are what a buggy or hostile peer
with a correct CRC routine would send.

The oracle, per input:
- unrepaired (CRC left as the mutation left it): decode returns exactly the message that was
  encoded (the mutation was a no-op) or raises WireError;
- repaired: decode raises WireError, or returns a message m with encode(m) == input (the
  format is canonical, so an accepted input has exactly one meaning);
- every WireError has a non-empty field and reason; any other exception is a failure.

tests/runtime/test_wire.py runs `run_fuzz` with 100,000 inputs in CI; this script is the
long run. It exits 1 when any input broke the oracle.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from pdc.runtime import wire
from pdc.runtime.family import Family, FamilyNotFound
from pdc.runtime.plan_types import RankId

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))


# ~~~ family bindings ~~~


def load_family_wire(spec_path: Path) -> Family:
    """The family of a spec, the codec of its messages: loaded from generated/<family>/ when
    it is compiled, else built from the spec (so the fuzzer also runs before the first
    `pdc compile`)."""
    from pdc.compiler.family import family_of  # only the fallback needs the compiler
    from pdc.compiler.frontend import load_spec

    spec = load_spec(spec_path)
    try:
        return Family.load(spec.py_name)
    except FamilyNotFound:
        return family_of(spec)


# ~~~ random valid messages ~~~

_TEXT_CHARS = "abcXYZ0189:/._- üßé中文🙂\u0300"


def _u(rnd: random.Random, top: int) -> int:
    """0..top, with the edges (0, 1, top) drawn often: they are where range checks live."""
    roll = rnd.random()
    if roll < 0.1:
        return 0
    if roll < 0.2:
        return min(1, top)
    if roll < 0.3:
        return top
    return rnd.randint(0, top)


def _rank(rnd: random.Random) -> RankId:
    return RankId(_u(rnd, 0xFFFF), _u(rnd, 0xFFFF))


def _text(rnd: random.Random, max_chars: int) -> str:
    n = rnd.choice((0, 1, rnd.randint(0, max_chars)))
    return "".join(rnd.choice(_TEXT_CHARS) for _ in range(n))


def _ids(rnd: random.Random) -> np.ndarray:
    n = rnd.choice((0, 1, rnd.randint(0, 8), rnd.randint(0, 300)))
    top = rnd.choice((100, 1 << 20, (1 << 63) - 1))
    return np.array([rnd.randint(0, top) for _ in range(n)], dtype=np.int64)


def _opt_index(rnd: random.Random) -> int:
    return rnd.choice((-1, 0, rnd.randint(0, 1 << 20), (1 << 63) - 1))


def _sections(rnd: random.Random, components) -> tuple[wire.Section, ...]:
    keep = rnd.choice((0.0, 0.3, 1.0))  # empty rank, partial (a PP stage), everything
    buffers = {}
    for comp in components:
        entries = []
        for tensor in comp.tensors:
            for layer_id in comp.layer_ids:
                if rnd.random() < keep:
                    entries.append(wire.RegEntry(
                        layer_id=layer_id, tensor=tensor,
                        base_addr=rnd.randint(1, 1 << 48), item_bytes=rnd.randint(1, 1 << 20),
                        capacity_items=rnd.randint(1, 1 << 20)))
        rnd.shuffle(entries)  # registration_sections puts them in layout order
        buffers[comp.name] = entries
    return wire.registration_sections(components, buffers)


def random_message(rnd: random.Random, components) -> wire.Message:
    kind = rnd.randrange(8)
    if kind == 0:
        return wire.Register(
            side=rnd.choice(list(wire.PeerSide)), dp_group=_u(rnd, 0xFFFF), rank=_rank(rnd),
            page_size=max(1, _u(rnd, 0xFFFFFFFF)), plan_digest=rnd.randbytes(32),
            agent_info=rnd.randbytes(rnd.choice((0, 16, rnd.randint(0, 2000)))),
            instance=_text(rnd, 40), sections=_sections(rnd, components))
    if kind == 1:
        return wire.TransferRequest(
            room=_u(rnd, (1 << 64) - 1), generation=_u(rnd, 0xFFFFFFFF), decode_rank=_rank(rnd),
            chunk_id=_u(rnd, 0xFFFFFFFF), decode_prefix_tokens=_u(rnd, (1 << 64) - 1),
            slot=_opt_index(rnd), ring_slot=_opt_index(rnd), aux_row=_opt_index(rnd),
            dst_page_ids=_ids(rnd), window_page_ids=_ids(rnd))
    if kind == 2:
        state = rnd.choice(list(wire.KVPoll))
        reason = _text(rnd, 60)
        if state is wire.KVPoll.Failed and not reason:
            reason = "peer died"
        return wire.Status(
            room=_u(rnd, (1 << 64) - 1), generation=_u(rnd, 0xFFFFFFFF), prefill_rank=_rank(rnd),
            state=state, chunk_id=_u(rnd, 0xFFFFFFFF), page_start=_u(rnd, (1 << 64) - 1),
            page_count=_u(rnd, 0xFFFFFFFF), bytes_written=_u(rnd, (1 << 64) - 1),
            checksum=rnd.choice((None, _u(rnd, (1 << 64) - 1))), reason=reason)
    if kind == 3:
        return wire.Abort(room=_u(rnd, (1 << 64) - 1), generation=_u(rnd, 0xFFFFFFFF),
                          decode_rank=_rank(rnd))
    if kind == 4:
        return wire.AbortAck(room=_u(rnd, (1 << 64) - 1), generation=_u(rnd, 0xFFFFFFFF),
                             prefill_rank=_rank(rnd), drained=rnd.random() < 0.5)
    if kind == 6:
        blocks = _ids(rnd)
        return wire.RingFilled(
            room=_u(rnd, (1 << 64) - 1), generation=_u(rnd, 0xFFFFFFFF), prefill_rank=_rank(rnd),
            slot=_u(rnd, 0xFFFFFFFF), first_item=_u(rnd, (1 << 64) - 1),
            items=max(1, _u(rnd, 0xFFFFFFFF)), blocks=blocks[:1 << 16] if len(blocks) else [0])
    if kind == 7:
        return wire.RingFreed(room=_u(rnd, (1 << 64) - 1), generation=_u(rnd, 0xFFFFFFFF),
                              decode_rank=_rank(rnd), slot=_u(rnd, 0xFFFFFFFF))
    return wire.Heartbeat(side=rnd.choice(list(wire.PeerSide)), rank=_rank(rnd),
                          sequence=_u(rnd, (1 << 64) - 1), monotonic_ns=_u(rnd, (1 << 64) - 1))


@dataclass(frozen=True)
class Seed:
    family: Family
    message: wire.Message
    data: bytes
    length_fields: tuple[wire.FieldSpan, ...]  # u32 counts/lengths, and header.body_length
    u16_counts: tuple[wire.FieldSpan, ...]  # Register.sections.count


def make_seeds(rnd: random.Random, families, per_family: int) -> list[Seed]:
    seeds = []
    for fam in families:
        for _ in range(per_family):
            msg = random_message(rnd, fam.wire_components)
            data = fam.encode(msg)
            spans = wire.field_map(msg, fam.fingerprint, fam.wire_components)
            lengths = tuple(s for s in spans
                            if s.kind == "count" or s.name == "header.body_length")
            u16s = tuple(s for s in spans if s.name == "Register.sections.count")
            seeds.append(Seed(fam, msg, data, lengths, u16s))
    return seeds


# ~~~ mutations ~~~

MUTATIONS = ("bit_flip", "byte_replace", "truncate", "extend", "huge_length", "splice",
             "garbage")


def _huge(rnd: random.Random, old: int) -> int:
    return rnd.choice((0xFFFFFFFF, 0x80000000, 0x7FFFFFFF, wire.MAX_PAGE_IDS + 1,
                       wire.MAX_BODY_BYTES + 1, old + 1, max(old - 1, 0),
                       rnd.randint(0, 0xFFFFFFFF)))


def mutate(rnd: random.Random, seed: Seed, seeds: list[Seed]) -> tuple[str, bytearray]:
    buf = bytearray(seed.data)
    kind = rnd.choice(MUTATIONS)
    if kind == "bit_flip":
        for _ in range(rnd.choice((1, 1, 2, 3, 8))):
            i = rnd.randrange(len(buf))
            buf[i] ^= 1 << rnd.randrange(8)
    elif kind == "byte_replace":
        for _ in range(rnd.choice((1, 1, 2, 4))):
            buf[rnd.randrange(len(buf))] = rnd.choice((0, 0xFF, 0x80, 0x7F, rnd.randrange(256)))
    elif kind == "truncate":
        del buf[rnd.randrange(len(buf)):]
    elif kind == "extend":
        buf += rnd.randbytes(rnd.choice((1, 8, rnd.randint(1, 64))))
    elif kind == "huge_length":
        if seed.u16_counts and rnd.random() < 0.2:
            span = rnd.choice(seed.u16_counts)
            buf[span.offset:span.offset + 2] = rnd.randrange(1 << 16).to_bytes(2, "little")
        else:
            span = rnd.choice(seed.length_fields)
            old = int.from_bytes(buf[span.offset:span.offset + 4], "little")
            buf[span.offset:span.offset + 4] = _huge(rnd, old).to_bytes(4, "little")
    elif kind == "splice":
        # One message's header on another's body: type confusion, lengths that disagree.
        other = rnd.choice(seeds).data
        buf = bytearray(seed.data[:wire.HEADER_BYTES]) + other[wire.HEADER_BYTES:]
    else:  # garbage, sometimes behind a plausible header so the body parser sees it
        buf = bytearray(rnd.randbytes(rnd.choice((0, 3, 24, rnd.randint(0, 200)))))
        if rnd.random() < 0.7 and len(buf) >= wire.HEADER_BYTES:
            buf[:wire.HEADER_BYTES] = seed.data[:wire.HEADER_BYTES]
    return kind, buf


def repair(rnd: random.Random, buf: bytearray) -> str:
    """Make the header consistent again so the body parser sees the damage: recompute the
    CRC and, usually, the body length. Returns the repair applied ("" for none)."""
    if len(buf) < wire.HEADER_BYTES or rnd.random() < 0.25:
        return ""
    done = "crc"
    if rnd.random() < 0.7:
        buf[16:20] = (len(buf) - wire.HEADER_BYTES).to_bytes(4, "little")
        done = "length+crc"
    crc = zlib.crc32(memoryview(buf)[wire.HEADER_BYTES:], zlib.crc32(memoryview(buf)[:20]))
    buf[20:24] = crc.to_bytes(4, "little")
    return done


# ~~~ the run ~~~

_INDEX = re.compile(r"\[\d+\]")


@dataclass
class FuzzResult:
    iterations: int
    seed: int
    families: list[str]
    inputs: int = 0
    decoded_same: int = 0  # decoded to exactly the encoded message (the mutation was a no-op)
    decoded_other: int = 0  # repaired input, decoded to another valid message, canonical
    rejected: int = 0  # WireError with a field and a reason
    other_exceptions: int = 0  # anything but WireError: must be 0
    undetected_corruptions: int = 0  # unrepaired change accepted (a CRC-32 collision): 0
    noncanonical_accepts: int = 0  # accepted, but re-encodes to other bytes: must be 0
    empty_reasons: int = 0  # WireError without field or reason: must be 0
    seconds: float = 0.0
    inputs_per_s: float = 0.0
    max_decode_us: float = 0.0  # slowest single decode (a hang would show here)
    slowest_input: str = ""  # which input that was: mutation, repair, length
    by_mutation: dict[str, int] = field(default_factory=dict)
    rejected_by_field: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the first few, reproducible

    @property
    def ok(self) -> bool:
        return not (self.other_exceptions or self.undetected_corruptions
                    or self.noncanonical_accepts or self.empty_reasons)


def run_fuzz(iterations: int, seed: int = 0, seeds_per_family: int = 48,
             families: list[Family] | None = None) -> FuzzResult:
    rnd = random.Random(seed)
    fams = families if families is not None else [load_family_wire(p) for p in SPECS]
    seeds = make_seeds(rnd, fams, seeds_per_family)
    res = FuzzResult(iterations, seed, [f.name for f in fams])
    by_mutation: Counter[str] = Counter()
    by_field: Counter[str] = Counter()
    clock = time.perf_counter
    max_decode = 0.0
    slowest = (0, "", "", 0)
    start = clock()
    for it in range(iterations):
        s = seeds[rnd.randrange(len(seeds))]
        kind, buf = mutate(rnd, s, seeds)
        repaired = repair(rnd, buf) if kind != "garbage" or rnd.random() < 0.5 else ""
        data = bytes(buf)
        by_mutation[kind] += 1
        t0 = clock()
        try:
            got = s.family.decode(data)
        except wire.WireError as e:
            took = clock() - t0
            if took > max_decode:
                max_decode, slowest = took, (it, kind, repaired, len(data))
            res.rejected += 1
            by_field[_INDEX.sub("[]", e.field)] += 1
            if not e.field or not e.reason or not str(e):
                res.empty_reasons += 1
                _fail(res, it, kind, repaired, data, f"WireError without a reason: {e!r}")
            continue
        except Exception as e:  # noqa: BLE001 - the point: anything else is a finding
            res.other_exceptions += 1
            _fail(res, it, kind, repaired, data, f"{type(e).__name__}: {e}")
            continue
        took = clock() - t0
        if took > max_decode:
            max_decode, slowest = took, (it, kind, repaired, len(data))
        if data == s.data:
            if got == s.message:
                res.decoded_same += 1
            else:
                res.noncanonical_accepts += 1
                _fail(res, it, kind, repaired, data, "unchanged input decoded differently")
        elif not repaired:
            res.undetected_corruptions += 1
            _fail(res, it, kind, repaired, data, f"damaged input accepted as {got!r}")
        elif s.family.encode(got) == data:
            res.decoded_other += 1
        else:
            res.noncanonical_accepts += 1
            _fail(res, it, kind, repaired, data, f"accepted {got!r}, which re-encodes "
                                                 f"differently")
    res.seconds = clock() - start
    res.inputs = iterations
    res.inputs_per_s = iterations / res.seconds if res.seconds else 0.0
    res.max_decode_us = max_decode * 1e6
    it, kind, repaired, n = slowest
    res.slowest_input = f"input {it}: {kind}, repair={repaired or 'none'}, {n} bytes"
    res.by_mutation = dict(sorted(by_mutation.items()))
    res.rejected_by_field = dict(by_field.most_common())
    return res


def _fail(res: FuzzResult, it: int, kind: str, repaired: str, data: bytes, what: str) -> None:
    if len(res.failures) < 20:
        res.failures.append(f"input {it} (seed {res.seed}, {kind}, repair={repaired or 'none'}):"
                            f" {what}; bytes {data[:96].hex()}")


def table(res: FuzzResult) -> str:
    rows = [
        ("families", ", ".join(res.families)),
        ("inputs", f"{res.inputs:,}"),
        ("decoded (unchanged)", f"{res.decoded_same:,}"),
        ("decoded (repaired, canonical)", f"{res.decoded_other:,}"),
        ("rejected (WireError)", f"{res.rejected:,}"),
        ("other exceptions (must be 0)", f"{res.other_exceptions:,}"),
        ("undetected corruptions (must be 0)", f"{res.undetected_corruptions:,}"),
        ("non-canonical accepts (must be 0)", f"{res.noncanonical_accepts:,}"),
        ("errors without reason (must be 0)", f"{res.empty_reasons:,}"),
        ("wall time", f"{res.seconds:.1f} s"),
        ("inputs/s", f"{res.inputs_per_s:,.0f}"),
        ("slowest decode", f"{res.max_decode_us:,.0f} µs ({res.slowest_input})"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("")
    lines.append("mutations: " + ", ".join(f"{k} {v:,}" for k, v in res.by_mutation.items()))
    top = list(res.rejected_by_field.items())[:12]
    lines.append("most frequent rejections: " + ", ".join(f"{k} {v:,}" for k, v in top))
    lines.extend(res.failures)
    return "\n".join(lines)


# ~~~ authenticated frames (Note [Control authentication]) ~~~

AUTH_MUTATIONS = MUTATIONS + ("replay", "other_session", "reseal_other_key")


@dataclass
class AuthFuzzResult:
    iterations: int
    seed: int
    accepted_intact: int = 0  # unmutated frames: must all be accepted, payload unchanged
    refused: int = 0  # mutated, replayed or foreign frames refused
    accepted_forgeries: int = 0  # a changed, replayed or foreign frame accepted: must be 0
    lost_intact: int = 0  # an intact frame refused: must be 0
    other_exceptions: int = 0  # must be 0
    by_mutation: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.accepted_forgeries or self.lost_intact or self.other_exceptions)


def run_auth_fuzz(iterations: int, seed: int = 0, families: list[Family] | None = None
                  ) -> AuthFuzzResult:
    """Valid messages sealed in authenticated frames (hub DATA frames and bootstrap requests),
    then mutated like run_fuzz's inputs, replayed, sent on another connection or sealed with
    another key. Oracle: the receiving side returns the payload of exactly the intact, fresh
    frames, byte for byte, refuses everything else, and never raises."""
    from pdc.runtime import auth

    rnd = random.Random(seed)
    fams = families if families is not None else [load_family_wire(p) for p in SPECS]
    seeds = make_seeds(rnd, fams, 8)
    res = AuthFuzzResult(iterations, seed)
    by_mutation: Counter[str] = Counter()
    key, other_key = rnd.randbytes(32), rnd.randbytes(32)
    server = auth.ServerSessions(key, "fuzz")
    nonces = auth.BootstrapNonces(key, "fuzz")

    def session(k: bytes, identity: bytes) -> auth.ClientSession:
        c = auth.ClientSession(k)
        _, ch = server.on_frame(identity, c.hello(), "fuzz")
        if not c.on_challenge(ch):
            c.session = auth.ClientSession(k).cnonce * 2  # another key: a made-up session
        return c

    clients = [session(key, b"a"), session(key, b"b")]
    spent: list[bytes] = []
    for it in range(iterations):
        s = seeds[rnd.randrange(len(seeds))]
        boot = rnd.random() < 0.25
        if boot:
            snonce = bytes.fromhex(json.loads(nonces.issue())["nonce"])
            frame, _ = auth.seal_boot_request(key, snonce, s.data)
        else:
            i = rnd.randrange(2)
            frame = clients[i].seal(s.data)
        intact = rnd.random() < 0.3
        kind = "intact"
        buf = bytearray(frame)
        if not intact:
            kind = rnd.choice(AUTH_MUTATIONS)
            if kind == "replay" and spent:
                buf = bytearray(rnd.choice(spent))
            elif kind == "other_session" and not boot:
                i = 1 - i
            elif kind == "reseal_other_key":
                if boot:
                    buf = bytearray(auth.seal_boot_request(other_key, snonce, s.data)[0])
                else:
                    buf = bytearray(session(other_key, b"x%d" % it).seal(s.data))
            elif kind in MUTATIONS:
                # the message's length fields, where they lie inside the frame
                shift = len(frame) - len(s.data)
                moved = [dataclasses.replace(f, offset=f.offset + shift)
                         for f in s.length_fields + s.u16_counts]
                kind, buf = mutate(rnd, Seed(s.family, s.message, frame,
                                             tuple(moved[:len(s.length_fields)]),
                                             tuple(moved[len(s.length_fields):])), seeds)
            else:
                kind = "intact"  # a replay before anything was sent: nothing to replay
        data = bytes(buf)
        changed = data != frame or kind in ("replay", "other_session", "reseal_other_key")
        by_mutation[kind] += 1
        try:
            if boot:
                opened = nonces.open(data)
                got = opened[2] if opened is not None else None
            else:
                got, answer = server.on_frame(b"ab"[i:i + 1], data, "fuzz")
                if answer is not None and auth.parse_refuse(answer) is None:
                    raise AssertionError(f"answered a DATA frame with {answer[:8]!r}")
        except Exception as e:  # noqa: BLE001 - the point: anything else is a finding
            res.other_exceptions += 1
            _auth_fail(res, it, kind, data, f"{type(e).__name__}: {e}")
            continue
        if got is None:
            if changed:
                res.refused += 1
            else:
                res.lost_intact += 1
                _auth_fail(res, it, kind, data, "an intact frame was refused")
        elif changed:
            res.accepted_forgeries += 1
            _auth_fail(res, it, kind, data, "a changed, replayed or foreign frame was accepted")
        elif got != s.data:
            res.accepted_forgeries += 1
            _auth_fail(res, it, kind, data, "accepted with another payload")
        else:
            res.accepted_intact += 1
            spent.append(data)
            if len(spent) > 64:
                spent.pop(0)
    res.by_mutation = dict(sorted(by_mutation.items()))
    return res


def _auth_fail(res: AuthFuzzResult, it: int, kind: str, data: bytes, what: str) -> None:
    if len(res.failures) < 20:
        res.failures.append(f"input {it} (seed {res.seed}, {kind}): {what}; bytes "
                            f"{data[:96].hex()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=2_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the result as JSON here")
    args = ap.parse_args(argv)
    res = run_fuzz(args.iterations, args.seed)
    print(table(res))
    ares = run_auth_fuzz(max(args.iterations // 10, 1), args.seed)
    print(f"\nauthenticated frames: {ares.iterations:,} inputs, {ares.accepted_intact:,} intact "
          f"accepted, {ares.refused:,} refused, {ares.accepted_forgeries} forgeries accepted "
          f"(must be 0), {ares.lost_intact} intact lost (must be 0), {ares.other_exceptions} "
          "other exceptions (must be 0)")
    print("auth mutations: " + ", ".join(f"{k} {v:,}" for k, v in ares.by_mutation.items()))
    ares.failures and print("\n".join(ares.failures))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**asdict(res), "ok": res.ok and ares.ok,
                                         "auth": {**asdict(ares), "ok": ares.ok}},
                                        indent=2) + "\n")
    return 0 if res.ok and ares.ok else 1


if __name__ == "__main__":
    sys.exit(main())
