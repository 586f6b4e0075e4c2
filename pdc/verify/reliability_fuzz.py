"""Hostile input for the reliability harness (pdc/verify/reliability.py): clients that send
garbage, mutated and truncated valid messages, wrong fingerprints, unknown rooms,
impersonations, registration floods and oversized messages to every prefill rank's control
socket while the well-formed traffic goes on."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Protocol

import numpy as np

from pdc.runtime import auth
from pdc.verify.ranks import ROLE_DECODE
from pdc.verify.reliability_ranks import load_family
from pdc.verify.reliability_types import RelConfig, normalise


class FuzzTarget(Protocol):
    """What the fuzzer reads of the running harness (the Harness of pdc/verify/reliability.py;
    `next_room` changes while it runs)."""

    cfg: RelConfig
    sources: dict
    hub_addr: dict
    topo: Any
    dgroups: list
    plan: Any
    next_room: int


class Fuzzer:
    """Hostile clients against every prefill rank's control socket, in a thread."""

    def __init__(self, h: FuzzTarget):
        self.h = h
        self.counts: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdc-fuzzer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import zmq

        from pdc.runtime import wire as W
        from pdc.runtime.endpoints import REG_ROOM
        from pdc.runtime.plan_types import RankId

        h = self.h
        _, wire = load_family(h.sources)
        fp, comps = wire.fingerprint, wire.wire_components
        rng = np.random.default_rng(h.cfg.seed + 1)
        ctx = zmq.Context.instance()
        addrs = [a for _, a in sorted(h.hub_addr.items())]
        secret = str(h.cfg.knobs.get("control_secret", ""))
        self.key = auth.key_of(secret.encode()) if secret else None
        socks = [_Sealed(ctx, a, self.key) for a in addrs]
        # Outsiders: connections without the secret (only when the ranks have one)
        outsiders = [_Sealed(ctx, a, None) for a in addrs] if self.key else []
        topo = h.topo
        idle = [g for g in range(topo.decode.dp) if g not in h.dgroups]
        reg_src = h.plan.registration(ROLE_DECODE, RankId(0, 0))
        valid = self._valid_messages(W, wire, reg_src, rng)
        imp_socks: dict = {}  # impersonated idle decode groups: connection per prefill rank
        n = 0
        while not self._stop.is_set():
            i = int(rng.integers(len(socks)))
            s = socks[i]
            n += 1
            kind = ("garbage", "flip", "truncate", "fingerprint", "unregistered", "register",
                    "unexpected", "oversize", "impostor")[n % 9]
            if self.key is not None and n % 7 == 3:
                kind = ("outsider", "forged", "replay")[(n // 7) % 3]
                self._unauthenticated(kind, s, outsiders[i], valid, rng)
            elif kind == "garbage":
                s.send(rng.bytes(int(rng.integers(0, 300))))
            elif kind == "flip":
                b = bytearray(valid[int(rng.integers(len(valid)))])
                for _ in range(int(rng.integers(1, 4))):
                    b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
                s.send(bytes(b))
            elif kind == "truncate":
                b = valid[int(rng.integers(len(valid)))]
                s.send(b[:int(rng.integers(0, len(b)))])
            elif kind == "fingerprint":
                msg = W.Heartbeat(side=W.PeerSide.DECODE, rank=RankId(0, 0), sequence=n,
                                  monotonic_ns=1)
                s.send(W.encode(msg, fp ^ 0x5A5A, comps))
            elif kind == "unregistered":
                # Requests and aborts naming a real decode rank, from a connection that is not
                # it: for unknown rooms and for rooms the real rank uses.
                room = int(rng.integers(0, 2**40)) if rng.random() < 0.5 else h.next_room + int(
                    rng.integers(-4, 4))
                room = max(room, 0)
                m = W.TransferRequest(room=room, generation=0, decode_rank=RankId(0, 0),
                                      dst_page_ids=np.arange(2)) if n % 2 else W.Abort(
                    room=room, generation=0, decode_rank=RankId(0, 0))
                s.send(wire.encode(m))
            elif kind == "register":
                s.send(wire.encode(self._bad_register(W, wire, reg_src, rng, n)))
            elif kind == "unexpected":
                s.send(wire.encode(W.Status(room=1, generation=0, prefill_rank=RankId(0, 0),
                                            state=W.KVPoll.Success)))
            elif kind == "oversize" and n % 90 == 16:
                big = ctx.socket(zmq.DEALER)
                big.setsockopt(zmq.LINGER, 0)
                big.connect(addrs[i])
                big.send(b"\0" * (int(h.cfg.knobs.get("max_message_bytes", 1 << 20)) + 1))
                self.counts["sent_oversize"] += 1
                big.close(0)
            elif kind == "impostor" and idle:
                self._impostor(ctx, W, wire, reg_src, rng, addrs, idle, imp_socks, n)
            self.counts["sent"] += 1
            for s2 in socks + outsiders + [x for xs in imp_socks.values() for x in xs]:
                while True:
                    try:
                        reply = s2.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._count_reply(wire, reply, REG_ROOM)
            time.sleep(0.0005)
        for s in socks + outsiders + [x for xs in imp_socks.values() for x in xs]:
            s.close(0)

    def _unauthenticated(self, kind: str, s: _Sealed, outsider: _Sealed, valid, rng) -> None:
        """Frames that must die at the authentication (Note [Control authentication]): valid
        messages from a connection without the secret, DATA frames with a made-up MAC, and
        replays of frames this connection sent before."""
        payload = valid[int(rng.integers(len(valid)))]
        if kind == "outsider":
            outsider.send(payload)
        elif kind == "forged":
            s.raw(auth.MAGIC + bytes([auth.DATA]) + (2**62 + int(rng.integers(2**20))).to_bytes(
                8, "little") + rng.bytes(auth.MAC_BYTES) + payload)
        elif s.sent:
            s.raw(s.sent[int(rng.integers(len(s.sent)))])
        else:
            return  # nothing sent on this connection yet: nothing to replay
        self.counts[f"sent_{kind}"] += 1

    def _count_reply(self, wire, reply, reg_room) -> None:
        from pdc.runtime import wire as W

        refused = auth.parse_refuse(reply)
        if refused is not None:
            self.counts[f"refused by authentication: {refused[0].decode()}"] += 1
            return
        try:
            m = wire.decode(reply)
        except W.WireError:
            self.counts["unreadable_reply"] += 1
            return
        if isinstance(m, W.Status) and m.state == W.KVPoll.Failed:
            why = m.reason
            for prefix in ("malformed message: header.checksum", "malformed message: header",
                           "malformed message", "abort refused", "room ",
                           "unexpected message", "too many", "page size differs",
                           "plan digest differs", "decode dp group", "cannot connect",
                           "no transfer request", "decode rank"):
                if why.startswith(prefix):
                    self.counts[f"rejected: {prefix}"] += 1
                    return
            self.counts[f"rejected: {normalise(why)[:60]}"] += 1
        else:
            self.counts[f"reply: {type(m).__name__}"] += 1

    def _valid_messages(self, W, wire, reg_src, rng) -> list[bytes]:
        from pdc.runtime.plan_types import RankId

        return [wire.encode(m) for m in (
            W.Heartbeat(side=W.PeerSide.DECODE, rank=RankId(0, 0), sequence=1, monotonic_ns=2),
            W.TransferRequest(room=5, generation=1, decode_rank=RankId(0, 0),
                              dst_page_ids=np.arange(4), slot=1, aux_row=1),
            W.Abort(room=5, generation=1, decode_rank=RankId(0, 0)),
            self._register(W, wire, reg_src, 0, b"127.0.0.1:1"),
        )]

    def _register(self, W, wire, reg, dp, agent, page_size=None, digest=None):
        h = self.h
        buffers = {}
        for name, entries, item in reg.components:
            buffers[name] = [W.RegEntry(layer_id=lid, tensor=t, base_addr=(1 << 20) * (i + 1),
                                        item_bytes=item, capacity_items=h.cfg.pages)
                             for i, (t, lid) in enumerate(entries)]
        return W.Register(side=W.PeerSide.DECODE, dp_group=dp, rank=reg.rank,
                          page_size=page_size or h.topo.decode.page_size,
                          plan_digest=digest or bytes.fromhex(h.plan.digest()),
                          agent_info=agent, instance="",
                          sections=wire.registration_sections(buffers))

    def _bad_register(self, W, wire, reg, rng, n):
        h = self.h
        which = n % 4
        if which == 0:
            return self._register(W, wire, reg, 0, b"x", digest=rng.bytes(32))
        if which == 1:
            return self._register(W, wire, reg, 0, b"x", page_size=h.topo.decode.page_size + 1)
        if which == 2:
            return self._register(W, wire, reg, h.topo.decode.dp + 3, b"x")
        return self._register(W, wire, reg, 0, b"not a session")

    def _impostor(self, ctx, W, wire, reg, rng, addrs, idle, imp_socks, n) -> None:
        """Register as an idle decode group (a valid registration with a bogus engine
        session), re-register with new sessions (floods the engine-peer cap), and send it
        requests for rooms no prefill will ever serve, and aborts of random rooms."""

        from pdc.runtime.plan_types import RankId

        g = idle[n % len(idle)]
        if g not in imp_socks or n % 45 == 17:
            for s in imp_socks.get(g, []):
                s.close(0)
            imp_socks[g] = []
            agent = f"127.0.0.1:{int(rng.integers(20000, 30000))}".encode()
            for a in addrs:
                s = _Sealed(ctx, a, self.key)
                s.send(wire.encode(self._register(W, wire, reg, g, agent)))
                imp_socks[g].append(s)
            self.counts["impostor_registrations"] += 1
            return
        dp = self.h.topo.decode.dp
        for s in imp_socks[g]:
            room = int(rng.integers(0, 2**30)) * dp + g
            if n % 3:
                s.send(wire.encode(W.TransferRequest(
                    room=room, generation=int(rng.integers(0, 3)), decode_rank=RankId(0, 0),
                    dst_page_ids=np.arange(2), slot=0, aux_row=0)))
            else:
                s.send(wire.encode(W.Abort(room=room, generation=0, decode_rank=RankId(0, 0))))
        self.counts["impostor_messages"] += 1


class _Sealed:
    """A DEALER to a prefill rank that speaks the authenticated control plane when it has the
    key (Note [Control authentication]): the fuzzer is then an insider whose hostile messages
    pass the authentication and reach the message checks. Without a key, a plain DEALER."""

    def __init__(self, ctx, address: str, key: bytes | None):
        import zmq

        self.s = ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(address)
        self.session: auth.ClientSession | None = None
        self.sent: list[bytes] = []  # the last sealed frames, for replays
        if key is not None:
            c = auth.ClientSession(key)
            self.s.send(c.hello())
            if self.s.poll(5000) and c.on_challenge(self.s.recv()):
                self.session = c

    def send(self, payload: bytes) -> None:
        if self.session is not None:
            payload = self.session.seal(payload)
            self.sent = (self.sent + [payload])[-8:]
        self.s.send(payload)

    def raw(self, frame: bytes) -> None:
        self.s.send(frame)

    def recv(self, flags: int = 0) -> bytes:
        frame = self.s.recv(flags)
        if self.session is None:
            return frame
        opened = self.session.open(frame)
        return frame if opened is None else opened  # a REFUSE frame comes as it is

    def close(self, linger: int = 0) -> None:
        self.s.close(linger)
