"""Control plane plumbing over ZeroMQ: the bootstrap table and the sockets' common settings.

Bootstrap: the prefill leader runs `BootstrapServer` (a REP socket). Every prefill rank puts
its control endpoint under (dp group, pp, tp); decode ranks get the table once it is
complete. Requests are small JSON objects; anything else gets an error reply, never a crash.

Each endpoint's own sockets, the thread that reads them and its timers are its `Hub`
(runtime/hub.py; Note [Sends from the caller's thread]).
"""

from __future__ import annotations

import errno
import ipaddress
import json
import threading
import time
from dataclasses import dataclass

import zmq

from . import auth, knobs
from .bringup import not_an_address, not_local, silent

LOOPBACK = "127.0.0.1"
_WILDCARDS = ("0.0.0.0", "::", "*")


class ControlError(RuntimeError):
    """The control plane could not do what was asked; the message says why."""


@dataclass(frozen=True)
class HostSettings:
    """Where a process's control sockets listen and what address its peers are told.

    Note [Bind and advertise]: prefill and decode run on different nodes, so a socket must
    listen on an interface the peer can reach (`bind_host`, possibly a wildcard) and the
    bootstrap table must carry an address the peer can dial (`advertise_host`, never a
    wildcard). The same advertise host is handed to the transfer engines that take one
    (Mooncake's `hostname`), so control and data paths name the same interface. Both are IP
    literals: a name lookup may leave the machine or resolve differently on the peer.
    """

    bind_host: str = LOOPBACK
    advertise_host: str = ""  # "" = bind_host

    @staticmethod
    def from_knobs() -> HostSettings:
        return HostSettings(str(knobs.get("bind_host")), str(knobs.get("advertise_host")))

    def __post_init__(self) -> None:
        for what, host in (("bind_host", self.bind_host), ("advertise_host", self.advertise)):
            if host in _WILDCARDS and what == "bind_host":
                continue
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ControlError(not_an_address(what, host)) from None
        if self.advertise in _WILDCARDS:
            raise ControlError(
                f"bind_host {self.bind_host!r} is a wildcard, so peers need an address to "
                f"dial; hint: set advertise_host (PDC_ADVERTISE_HOST) to this node's IP")

    @property
    def advertise(self) -> str:
        return self.advertise_host or self.bind_host

    @property
    def ipv6(self) -> bool:
        return ":" in self.bind_host or ":" in self.advertise


def _key(bind_host: str | None, what: str) -> bytes | None:
    """This process's control key (Note [Control authentication]); a listening socket also
    checks Note [Auth default] for its bind host."""
    try:
        return auth.control_key() if bind_host is None else auth.listening_key(bind_host, what)
    except auth.AuthError as e:
        raise ControlError(str(e)) from None


def peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, TypeError):
        return ""


def _tcp(host: str, port: int | None = None) -> str:
    h = f"[{host}]" if ":" in host else host
    return f"tcp://{h}" if port is None else f"tcp://{h}:{port}"


def enable_ipv6(sock: zmq.Socket, address: str) -> None:
    """ZeroMQ refuses IPv6 endpoints on a socket without the IPV6 option."""
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)


def _bind_random(sock: zmq.Socket, hosts: HostSettings) -> str:
    if hosts.ipv6:
        sock.setsockopt(zmq.IPV6, 1)
    bind = "*" if hosts.bind_host in _WILDCARDS else hosts.bind_host
    try:
        port = sock.bind_to_random_port(_tcp(bind) if bind != "*" else "tcp://*")
    except zmq.ZMQError as e:
        sock.close(0)
        raise ControlError(_bind_error(hosts.bind_host, None, e)) from None
    return _tcp(hosts.advertise, port)


def _bind_error(host: str, port: int | None, e: zmq.ZMQError) -> str:
    """Why a control socket cannot listen, with the fix."""
    if e.errno == errno.EADDRNOTAVAIL:
        return not_local(host, "bind_host")
    where = f"{host}:{port}" if port is not None else host
    if e.errno == errno.EADDRINUSE:
        return (f"cannot listen on {where}: the port is in use (another process listens on "
                "it, e.g. an earlier server still running); hint: stop that process or choose "
                "another port")
    return f"cannot listen on {where}: {e}"


class BootstrapServer:
    """Prefill leader's table of prefill control endpoints: (dp, pp, tp) -> address.

    `expected` is the number of prefill ranks; None when the process that runs the table does
    not know it (a serving engine starts it before its ranks exist): the first `put` that
    carries `expected` sets it. `port` is a fixed port (a serving engine's bootstrap port);
    default a random one."""

    def __init__(self, expected: int | None, ctx: zmq.Context | None = None,
                 hosts: HostSettings | None = None, port: int | None = None):
        self.expected = expected
        self.table: dict[str, str] = {}
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 64 << 10)
        hosts = hosts or HostSettings.from_knobs()
        key = _key(hosts.bind_host, "the bootstrap server")
        if port is None:
            self.address = _bind_random(self.sock, hosts)
        else:
            if hosts.ipv6:
                self.sock.setsockopt(zmq.IPV6, 1)
            bind = "*" if hosts.bind_host in _WILDCARDS else hosts.bind_host
            try:
                self.sock.bind(f"tcp://*:{port}" if bind == "*" else _tcp(bind, port))
            except zmq.ZMQError as e:
                self.sock.close(0)
                raise ControlError("bootstrap server: " + _bind_error(hosts.bind_host, port, e)) \
                    from None
            self.address = _tcp(hosts.advertise, port)
        self._nonces = auth.BootstrapNonces(key, self.address) if key else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdc-bootstrap", daemon=True)
        self._thread.start()

    def _answer(self, req: bytes, peer: str) -> bytes:
        """The reply to one request, authenticated when this table has a key."""
        nonces = self._nonces
        if nonces is None:
            if auth.is_auth_frame(req) or _op(req) == "nonce":
                return json.dumps({"error": "this bootstrap server runs without a control "
                                   "secret, and the client has one; hint: give both sides "
                                   "the same secret, or neither"}).encode()
            return json.dumps(self._reply(req)).encode()
        if _op(req) == "nonce":
            return nonces.issue()
        opened = nonces.open(req)
        if opened is None:
            nonces.refused.refuse(b"", peer, auth.NOT_AUTHENTICATED)
            return json.dumps({"error": "unauthenticated request refused (no control secret, "
                               "or a different one); hint: give every prefill and decode "
                               "process the same secret (PDC_CONTROL_SECRET_FILE)"}).encode()
        snonce, cnonce, body = opened
        return nonces.seal_reply(snonce, cnonce, json.dumps(self._reply(body)).encode())

    @property
    def refused(self) -> int:
        return self._nonces.refused.count if self._nonces is not None else 0

    def _reply(self, req: bytes) -> dict:
        try:
            msg = json.loads(req)
            op = msg["op"]
        except (ValueError, KeyError, TypeError):
            return {"error": "bad request: expected JSON with an 'op'"}
        if op == "put":
            try:
                key = f"{int(msg['dp'])}/{int(msg['pp'])}/{int(msg['tp'])}"
                addr = str(msg["endpoint"])
                expected = int(msg.get("expected", self.expected or 0))
            except (KeyError, ValueError, TypeError):
                return {"error": "put needs integer dp, pp, tp and an endpoint"}
            if self.expected is None:
                if expected < 1:
                    return {"error": "put needs 'expected' (the number of prefill ranks): "
                                     "this table was started without it"}
                self.expected = expected
            elif expected != self.expected:
                return {"error": f"put says {expected} prefill ranks, the table holds "
                                 f"{self.expected}"}
            if key not in self.table and len(self.table) >= self.expected:
                return {"error": f"table already holds {self.expected} ranks"}
            self.table[key] = addr
            return {"ok": True}
        if op == "get":
            return {"ready": self.expected is not None and len(self.table) >= self.expected,
                    "table": self.table}
        return {"error": f"unknown op '{op}'"}

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            try:
                frame = self.sock.recv(copy=False)
            except zmq.ZMQError:
                continue
            self.sock.send(self._answer(frame.bytes, peer_address(frame)))
        self.sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def _op(req: bytes) -> str:
    try:
        return str(json.loads(req).get("op", ""))
    except (ValueError, AttributeError, UnicodeDecodeError):
        return ""


def bootstrap_call(address: str, request: dict, timeout_s: float,
                   ctx: zmq.Context | None = None) -> dict:
    key = _key(None, "")
    # A context of its own unless the caller lends one, so the call connects from its caller's
    # namespace (Note [ZMQ threads and namespaces], pdc/netns.py); a call at setup can afford
    # the thread, and a polling caller (fetch_table) makes one context for all its calls.
    own = ctx is None
    ctx = zmq.Context(io_threads=1) if ctx is None else ctx
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    body = json.dumps(request).encode()
    try:
        enable_ipv6(sock, address)
        sock.connect(address)
        if key is None:
            sock.send(body)
            raw = sock.recv()
        else:
            sock.send(auth.NONCE_REQUEST)
            got = _json(sock.recv(), address)
            if "error" in got:
                raise ControlError(f"bootstrap server {address}: {got['error']}")
            try:
                snonce = bytes.fromhex(str(got.get("nonce", "")))
            except ValueError:
                raise ControlError(f"bootstrap server {address} sent a bad nonce") from None
            frame, cnonce = auth.seal_boot_request(key, snonce, body)
            sock.send(frame)
            answer = sock.recv()
            opened = auth.open_boot_reply(key, snonce, cnonce, answer)
            if opened is None and not answer.startswith(b"{"):
                raise ControlError(f"bootstrap server {address} answered without the same "
                                   "control secret; hint: give every prefill and decode "
                                   "process the same secret (PDC_CONTROL_SECRET_FILE)")
            raw = answer if opened is None else opened
        reply = _json(raw, address)
    except zmq.Again:
        raise ControlError(silent(f"bootstrap server {address}", timeout_s,
                                  HostSettings.from_knobs().advertise)) from None
    finally:
        sock.close(0)
        if own:
            ctx.term()
    if "error" in reply:
        raise ControlError(f"bootstrap server {address}: {reply['error']}")
    return reply


def _json(raw: bytes, address: str) -> dict:
    try:
        out = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        out = None
    if not isinstance(out, dict):
        raise ControlError(f"bootstrap server {address} sent a reply that is not a JSON object "
                           "(is it a pdc bootstrap server?)")
    return out


def _rank_key(key: str) -> tuple[int, int, int]:
    """(dp, pp, tp) from the table's "dp/pp/tp" key."""
    dp, pp, tp = (int(x) for x in key.split("/"))
    return dp, pp, tp


def fetch_table(address: str, timeout_s: float) -> dict[tuple[int, int, int], str]:
    """Wait until every prefill rank has registered, then return the table."""
    deadline = time.monotonic() + timeout_s
    ctx = zmq.Context(io_threads=1)  # one for the whole poll (Note [ZMQ threads and namespaces])
    try:
        while True:
            reply = bootstrap_call(address, {"op": "get"},
                                   max(0.1, deadline - time.monotonic()), ctx)
            if reply["ready"]:
                return {_rank_key(k): v for k, v in reply["table"].items()}
            if time.monotonic() > deadline:
                raise ControlError(f"bootstrap table at {address} incomplete after "
                                   f"{timeout_s} s: {len(reply['table'])} prefill ranks "
                                   "registered")
            time.sleep(0.02)
    finally:
        ctx.term()
