"""Authenticated control messages: a shared secret, HMAC-SHA256 and a per-connection challenge.

Note [Control authentication]: every control socket (the bootstrap table, every hub) accepts
a message only when it carries an HMAC-SHA256 made with a key derived from a secret that all
prefill and decode processes of a deployment share. The secret comes from a file
(`control_secret_file`) or the environment (`control_secret`), never from a command-line flag
(`ps` shows flags to every user of the host).

Hubs (ROUTER <-> DEALER) run a challenge per connection before anything else:

    client -> server  HELLO      cnonce
    server -> client  CHALLENGE  snonce, cnonce, HMAC(K, "challenge" cnonce snonce)
    either way        DATA       seq, HMAC(S, direction seq payload), payload
                      with the session key S = HMAC(K, "session" cnonce snonce)

The server's fresh nonce makes every session key new, so a frame recorded on one connection
is worth nothing on another; inside a session the sequence number only grows, so a replayed
frame is refused. The CHALLENGE's HMAC proves the server knows the secret (a decode rank
takes statuses only from a real prefill rank). The server keeps no state for a peer that has
not proven the key beyond one pending challenge, bounded by `max_control_sessions`. Messages
a client sends before its challenge completes wait in a queue (bounded by
`control_queue_depth`).

The bootstrap table (REQ/REP, JSON) does the same per request: the client asks for a
single-use nonce, then sends the request with HMAC(K, "bootstrap request" snonce cnonce body)
and checks the reply's HMAC(K, "bootstrap reply" snonce cnonce reply). Asking for a nonce
reveals nothing; `put` and `get` (the addresses) need the key.

What it does not do: encrypt. Messages (addresses, page ids) cross the network in clear; the
secret itself never does. Run the control plane on a private network or under IPsec /
WireGuard where confidentiality matters (docs/deploy.md).

A peer that fails any check is refused with a REFUSE frame (which carries no secret and no
address) and logged once per source address on the `pdc.control` logger; its later failures
are counted, not logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from . import knobs
from .bringup import is_loopback

MAGIC = b"PDA1"
HELLO, CHALLENGE, DATA, REFUSE, BOOT_REQUEST, BOOT_REPLY = 1, 2, 3, 4, 5, 6
NONCE_BYTES = 16
MAC_BYTES = 32
MIN_SECRET_BYTES = 16
_SEQ = struct.Struct("<Q")
_HEAD = len(MAGIC) + 1
# REFUSE codes: why the frame was refused (one byte, then a UTF-8 reason)
NOT_AUTHENTICATED = b"A"  # no MAC, a bad MAC, a replay: the sender lacks the secret
UNKNOWN_SESSION = b"S"  # a DATA frame of a session this server does not hold (it restarted)
NO_SECRET = b"N"  # this server runs without a secret and the sender asked for a challenge

REFUSED_TEXT = {
    NOT_AUTHENTICATED: "refused an unauthenticated control message (no control secret, or a "
                       "different one); hint: give every prefill and decode process the same "
                       "secret (PDC_CONTROL_SECRET_FILE)",
    UNKNOWN_SESSION: "holds no session for this connection (it restarted)",
    NO_SECRET: "runs without a control secret, and this process has one; hint: give both "
               "sides the same secret, or neither",
}

log = logging.getLogger("pdc.control")


class AuthError(RuntimeError):
    """The secret cannot be used (missing where required, unreadable, too short)."""


# ~~~ the key ~~~


def _read_secret() -> bytes | None:
    path = str(knobs.get("control_secret_file"))
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise AuthError(f"control_secret_file {path!r} cannot be read: {e.strerror}; hint: "
                            "PDC_CONTROL_SECRET_FILE names a file this process can read") \
                from None
        secret = data.strip()
        where = f"control_secret_file {path!r}"
    else:
        text = str(knobs.get("control_secret"))
        if not text:
            return None
        secret, where = text.encode(), "PDC_CONTROL_SECRET"
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"{where} holds {len(secret)} bytes; a control secret needs at least "
                        f"{MIN_SECRET_BYTES}; hint: `head -c 32 /dev/urandom | base64 > FILE`")
    return secret


def control_key() -> bytes | None:
    """The HMAC key of this process's control plane, or None when it runs unauthenticated
    (control_auth=off, or auto without a secret)."""
    mode = str(knobs.get("control_auth"))
    if mode not in ("auto", "on", "off"):
        raise AuthError(f"control_auth {mode!r} is not auto, on or off")
    if mode == "off":
        return None
    secret = _read_secret()
    if secret is None:
        if mode == "on":
            raise AuthError("control_auth is on and no control secret is set; hint: write a "
                            "secret to a file and set PDC_CONTROL_SECRET_FILE on every prefill "
                            "and decode process")
        return None
    return key_of(secret)


def key_of(secret: bytes) -> bytes:
    """The HMAC key derived from a control secret (the secret itself is never a MAC key)."""
    return hmac.new(secret, b"pdc control plane v1", hashlib.sha256).digest()


def listening_key(bind_host: str, what: str) -> bytes | None:
    """The key of a socket that listens on `bind_host`. Note [Auth default]: with no secret a
    socket may listen on loopback only (one host: the peers are this host's processes, as
    before authentication existed); anywhere else it would take any peer that reaches the
    port, so it refuses to start unless control_auth=off says that is intended."""
    key = control_key()
    if key is None and str(knobs.get("control_auth")) == "auto" and not is_loopback(bind_host):
        raise AuthError(
            f"{what} would listen on {bind_host} without a control secret, so any host that "
            "reaches it could register, request, abort or read addresses; hint: write a secret "
            "of 16+ bytes to a file and set PDC_CONTROL_SECRET_FILE on every prefill and decode "
            "process (or PDC_CONTROL_AUTH=off on a network you trust)")
    return key


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def refuse_frame(code: bytes, text: str = "") -> bytes:
    return MAGIC + bytes([REFUSE]) + code + (text or REFUSED_TEXT[code]).encode()[:400]


def parse_refuse(frame: bytes) -> tuple[bytes, str] | None:
    """(code, reason) of a REFUSE frame, None for any other frame."""
    if len(frame) < _HEAD + 1 or frame[:_HEAD] != MAGIC + bytes([REFUSE]):
        return None
    return frame[_HEAD:_HEAD + 1], frame[_HEAD + 1:].decode(errors="replace")


def is_auth_frame(frame: bytes) -> bool:
    return frame[:len(MAGIC)] == MAGIC


def _kind(frame: bytes) -> int:
    return frame[len(MAGIC)] if len(frame) >= _HEAD and frame[:len(MAGIC)] == MAGIC else -1


# ~~~ hub sessions ~~~


@dataclass
class ClientSession:
    """The DEALER side of one connection: HELLO, then DATA once the CHALLENGE checked out."""

    key: bytes
    cnonce: bytes = field(default_factory=lambda: os.urandom(NONCE_BYTES))
    session: bytes = b""  # the session key; empty until the challenge checked out
    seq_out: int = 0
    seq_in: int = 0
    queue: list[bytes] = field(default_factory=list)  # payloads sent before the challenge
    restarted_at: float = 0.0

    def hello(self) -> bytes:
        return MAGIC + bytes([HELLO]) + self.cnonce

    def restart(self) -> bytes | None:
        """A new handshake after the server lost our session (at most one per 0.5 s)."""
        now = time.monotonic()
        if now - self.restarted_at < 0.5:
            return None
        self.restarted_at = now
        self.cnonce, self.session, self.seq_out, self.seq_in = os.urandom(NONCE_BYTES), b"", 0, 0
        return self.hello()

    def on_challenge(self, frame: bytes) -> bool:
        n = NONCE_BYTES
        if _kind(frame) != CHALLENGE or len(frame) != _HEAD + 2 * n + MAC_BYTES:
            return False
        snonce, cnonce, mac = frame[_HEAD:_HEAD + n], frame[_HEAD + n:_HEAD + 2 * n], \
            frame[_HEAD + 2 * n:]
        if cnonce != self.cnonce or not hmac.compare_digest(
                mac, _mac(self.key, b"challenge", cnonce, snonce)):
            return False
        self.session = _mac(self.key, b"session", cnonce, snonce)
        return True

    def seal(self, payload: bytes) -> bytes:
        self.seq_out += 1
        return _seal(self.session, b"C", self.seq_out, payload)

    def open(self, frame: bytes) -> bytes | None:
        got = _open(self.session, b"S", self.seq_in, frame) if self.session else None
        if got is None:
            return None
        self.seq_in, payload = got
        return payload


def _seal(session: bytes, direction: bytes, seq: int, payload: bytes) -> bytes:
    s = _SEQ.pack(seq)
    return MAGIC + bytes([DATA]) + s + _mac(session, direction, s, payload) + payload


def _open(session: bytes, direction: bytes, last_seq: int, frame: bytes
          ) -> tuple[int, bytes] | None:
    """(seq, payload) of a DATA frame whose MAC checks out and whose seq is new."""
    start = _HEAD + _SEQ.size + MAC_BYTES
    if _kind(frame) != DATA or len(frame) < start:
        return None
    s = frame[_HEAD:_HEAD + _SEQ.size]
    mac, payload = frame[_HEAD + _SEQ.size:start], frame[start:]
    if not hmac.compare_digest(mac, _mac(session, direction, s, payload)):
        return None
    seq = _SEQ.unpack(s)[0]
    return (seq, payload) if seq > last_seq else None


@dataclass
class _Server:
    session: bytes
    seq_in: int = 0
    seq_out: int = 0


class ServerSessions:
    """The ROUTER side: a pending challenge or a session per peer identity, both bounded."""

    def __init__(self, key: bytes, where: str):
        self.key = key
        self.where = where  # the socket's address, for the log
        self.cap = int(knobs.get("max_control_sessions"))
        self.pending: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        self.sessions: OrderedDict[bytes, _Server] = OrderedDict()
        self.refused = Refusals(where)

    def on_frame(self, identity: bytes, frame: bytes, peer_address: str
                 ) -> tuple[bytes | None, bytes | None]:
        """(payload for the handler, frame to answer with); either may be None."""
        kind = _kind(frame)
        if kind == HELLO and len(frame) == _HEAD + NONCE_BYTES:
            cnonce, snonce = frame[_HEAD:], os.urandom(NONCE_BYTES)
            self.pending[identity] = (cnonce, snonce)
            self.pending.move_to_end(identity)
            while len(self.pending) > self.cap:
                self.pending.popitem(last=False)
            return None, MAGIC + bytes([CHALLENGE]) + snonce + cnonce + _mac(
                self.key, b"challenge", cnonce, snonce)
        if kind == DATA:
            s = self.sessions.get(identity)
            got = _open(s.session, b"C", s.seq_in, frame) if s is not None else None
            if got is None and identity in self.pending:
                # The first DATA of a new handshake proves the key; it then replaces any
                # older session of this identity.
                cnonce, snonce = self.pending[identity]
                key = _mac(self.key, b"session", cnonce, snonce)
                got = _open(key, b"C", 0, frame)
                if got is not None:
                    del self.pending[identity]
                    s = self.sessions[identity] = _Server(key)
                    while len(self.sessions) > self.cap:
                        self.sessions.popitem(last=False)
            if got is not None and s is not None:
                s.seq_in = got[0]
                self.sessions.move_to_end(identity)
                return got[1], None
            code = UNKNOWN_SESSION if s is None and identity not in self.pending \
                else NOT_AUTHENTICATED
            return None, self.refused.refuse(identity, peer_address, code)
        return None, self.refused.refuse(identity, peer_address, NOT_AUTHENTICATED)

    def seal(self, identity: bytes, payload: bytes) -> bytes | None:
        """The DATA frame of a reply; None for a peer without a session (it gets nothing)."""
        s = self.sessions.get(identity)
        if s is None:
            return None
        s.seq_out += 1
        return _seal(s.session, b"S", s.seq_out, payload)


class Refusals:
    """Counts refused frames; logs the first one per source address and answers the first
    one per connection (a flood gets no echo)."""

    def __init__(self, where: str):
        self.where = where
        self.count = 0
        self._logged: OrderedDict[str, None] = OrderedDict()
        self._answered: OrderedDict[bytes, None] = OrderedDict()

    def refuse(self, identity: bytes, peer_address: str, code: bytes) -> bytes | None:
        self.count += 1
        if peer_address not in self._logged:
            self._logged[peer_address] = None
            if len(self._logged) > 4096:
                self._logged.popitem(last=False)
            why = ("of a session it does not hold (a peer from before a restart, or one "
                   "without the secret)") if code == UNKNOWN_SESSION else \
                "(no control secret, or a different one)"
            log.warning("pdc: %s refused an unauthenticated control message from %s %s; later "
                        "ones from this address are counted, not logged", self.where,
                        peer_address or "an unknown address", why)
        if identity in self._answered:
            return None
        self._answered[identity] = None
        if len(self._answered) > 4096:
            self._answered.popitem(last=False)
        return refuse_frame(code)


# ~~~ the bootstrap table ~~~

NONCE_REQUEST = b'{"op": "nonce"}'


class BootstrapNonces:
    """Single-use nonces handed out by the bootstrap server (bounded, expiring)."""

    def __init__(self, key: bytes, where: str):
        self.key = key
        self.outstanding: OrderedDict[bytes, float] = OrderedDict()
        self.refused = Refusals(where)

    def issue(self) -> bytes:
        n = os.urandom(NONCE_BYTES)
        now = time.monotonic()
        self.outstanding[n] = now
        while self.outstanding and (len(self.outstanding) > 4096 or
                                    next(iter(self.outstanding.values())) < now - 60):
            self.outstanding.popitem(last=False)
        return json.dumps({"nonce": n.hex()}).encode()

    def open(self, frame: bytes) -> tuple[bytes, bytes, bytes] | None:
        """(snonce, cnonce, body) of an authenticated request, its nonce used up."""
        n = NONCE_BYTES
        if _kind(frame) != BOOT_REQUEST or len(frame) < _HEAD + 2 * n + MAC_BYTES:
            return None
        snonce, cnonce = frame[_HEAD:_HEAD + n], frame[_HEAD + n:_HEAD + 2 * n]
        mac, body = frame[_HEAD + 2 * n:_HEAD + 2 * n + MAC_BYTES], frame[_HEAD + 2 * n +
                                                                          MAC_BYTES:]
        if snonce not in self.outstanding or not hmac.compare_digest(
                mac, _mac(self.key, b"bootstrap request", snonce, cnonce, body)):
            return None
        del self.outstanding[snonce]
        return snonce, cnonce, body

    def seal_reply(self, snonce: bytes, cnonce: bytes, reply: bytes) -> bytes:
        return MAGIC + bytes([BOOT_REPLY]) + _mac(self.key, b"bootstrap reply", snonce, cnonce,
                                                  reply) + reply


def seal_boot_request(key: bytes, snonce: bytes, body: bytes) -> tuple[bytes, bytes]:
    """(frame, cnonce) of an authenticated bootstrap request."""
    cnonce = os.urandom(NONCE_BYTES)
    return MAGIC + bytes([BOOT_REQUEST]) + snonce + cnonce + _mac(
        key, b"bootstrap request", snonce, cnonce, body) + body, cnonce


def open_boot_reply(key: bytes, snonce: bytes, cnonce: bytes, frame: bytes) -> bytes | None:
    if _kind(frame) != BOOT_REPLY or len(frame) < _HEAD + MAC_BYTES:
        return None
    mac, reply = frame[_HEAD:_HEAD + MAC_BYTES], frame[_HEAD + MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, b"bootstrap reply", snonce, cnonce, reply)):
        return None
    return reply
