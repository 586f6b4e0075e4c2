"""Control plane plumbing over ZeroMQ: the bootstrap table and a threaded message hub.

Bootstrap: the prefill leader runs `BootstrapServer` (a REP socket). Every prefill rank puts
its control endpoint under (dp group, pp, tp); decode ranks get the table once it is
complete. Requests are small JSON objects; anything else gets an error reply, never a crash.

Hub: each endpoint owns one `Hub` thread that alone touches its sockets (ZeroMQ sockets are
not thread-safe). Other threads hand it outgoing frames through `send()`, which pushes onto
an inproc socket the hub polls beside its network sockets; incoming frames go to a handler
callback running on the hub thread.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import threading
import time
import uuid
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


class Hub:
    """One thread owning a ROUTER (server) or DEALERs (client side) plus an inproc outbox.

    Server mode (`bind=True`): peers connect; incoming frames carry the peer identity, and
    `send(identity, payload)` answers a peer. Client mode: `connect(name, address)` opens one
    DEALER per peer (connecting a name again replaces its socket: a restarted peer);
    `send(name, payload)` writes to it.

    Sends never block the hub thread: a handler or timer running on the hub thread writes to
    the socket directly (posting to its own outbox could fill it and deadlock), and a message
    that a full queue (`control_queue_depth`) or a vanished peer refuses is dropped and
    counted in `dropped`; the request it belonged to fails by its deadline. The hub handles at
    most `max_messages_per_tick` incoming messages before serving its outbox and timers again,
    so a flood from one peer cannot starve them.
    """

    def __init__(self, handler, bind: bool, on_tick=None, ctx: zmq.Context | None = None,
                 hosts: HostSettings | None = None, on_refused=None):
        self.ctx = ctx or zmq.Context.instance()
        self.handler = handler  # handler(peer_key: bytes|str, payload: bytes) on the hub thread
        self.on_tick = on_tick  # called on the hub thread at least every 50 ms
        # on_refused(name, reason), client side, hub thread: a peer refused our messages
        # (authentication, Note [Control authentication]); once per connection
        self.on_refused = on_refused
        hosts = hosts or HostSettings.from_knobs()
        self._key = _key(hosts.bind_host if bind else None, "a control socket")
        self._server_auth: auth.ServerSessions | None = None
        self._client_auth: dict[str, auth.ClientSession] = {}
        self._peer_addr: dict[str, str] = {}
        self._told: set[str] = set()  # names whose refusal went to on_refused
        self.bind = bind
        self.dropped = 0  # outgoing messages refused by a full queue or a vanished peer
        self.handler_errors = 0
        self._depth = int(knobs.get("control_queue_depth"))
        self._outbox_addr = f"inproc://pdc-outbox-{uuid.uuid4().hex}"
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, self._depth)
        self._pull.bind(self._outbox_addr)
        self._push = self.ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, self._depth)
        self._push.connect(self._outbox_addr)
        self._push_lock = threading.Lock()
        self._closed = False
        self._dealers: dict[str, zmq.Socket] = {}
        self._names: dict[zmq.Socket, str] = {}
        self.address = ""
        self._router = None
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        if bind:
            self._router = self.ctx.socket(zmq.ROUTER)
            self._configure(self._router)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.address = _bind_random(self._router, hosts)
            if self._key is not None:
                self._server_auth = auth.ServerSessions(self._key, self.address)
            self._poller.register(self._router, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdc-hub", daemon=True)
        self._thread.start()

    def _configure(self, s: zmq.Socket) -> None:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, knobs.get("max_message_bytes"))
        s.setsockopt(zmq.SNDHWM, self._depth)
        s.setsockopt(zmq.RCVHWM, self._depth)

    def connect(self, name: str, address: str) -> None:
        self._post([b"C", name.encode(), address.encode()])

    def send(self, peer, payload: bytes) -> None:
        key = peer if isinstance(peer, bytes) else peer.encode()
        if threading.get_ident() == self._thread.ident:
            self._deliver(key, payload)
        else:
            self._post([b"S", key, payload])

    def _post(self, frames: list[bytes]) -> None:
        with self._push_lock:
            if self._closed:
                self.dropped += 1  # a late sender (e.g. a reconnect thread) after close()
                return
            self._push.send_multipart(frames)

    def _open(self, name: str, address: str) -> None:
        old = self._dealers.pop(name, None)
        if old is not None:
            self._poller.unregister(old)
            self._names.pop(old, None)
            old.close(0)
        s = self.ctx.socket(zmq.DEALER)
        self._configure(s)
        # A routing id of our own: the peer keeps knowing us across a TCP reconnect.
        s.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        enable_ipv6(s, address)
        s.connect(address)
        self._dealers[name] = s
        self._names[s] = name
        self._peer_addr[name] = address
        self._told.discard(name)
        self._poller.register(s, zmq.POLLIN)
        if self._key is not None:
            session = self._client_auth[name] = auth.ClientSession(self._key)
            self._send(s, session.hello())

    def _send(self, s: zmq.Socket, frame: bytes) -> None:
        try:
            s.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.dropped += 1

    @property
    def refused(self) -> int:
        """Frames this hub's socket refused as unauthenticated."""
        return self._server_auth.refused.count if self._server_auth is not None else 0

    def _deliver(self, key: bytes, payload: bytes) -> None:
        try:
            if self._router is not None:
                if self._server_auth is not None:
                    sealed = self._server_auth.seal(key, payload)
                    if sealed is None:  # never answer a peer that has not proven the key
                        self.dropped += 1
                        return
                    payload = sealed
                self._router.send_multipart([key, payload], zmq.NOBLOCK)
            else:
                name = key.decode(errors="replace")
                s = self._dealers.get(name)
                if s is None:
                    self.dropped += 1
                    return
                session = self._client_auth.get(name)
                if session is not None:
                    if not session.session:  # the challenge is not done yet
                        if len(session.queue) < self._depth:
                            session.queue.append(payload)
                        else:
                            self.dropped += 1
                        return
                    payload = session.seal(payload)
                s.send(payload, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.dropped += 1  # full queue or peer gone: its requests fail by deadline

    def _from_peer(self, identity: bytes, frame: zmq.Frame) -> None:
        """A frame at the ROUTER: authenticated (or not required), then to the handler."""
        payload = frame.bytes
        if self._server_auth is None:
            if auth.is_auth_frame(payload) and payload[len(auth.MAGIC)] == auth.HELLO:
                self._answer(identity, auth.refuse_frame(auth.NO_SECRET))
                return
            self._dispatch(identity, payload)
            return
        opened, answer = self._server_auth.on_frame(identity, payload, peer_address(frame))
        if answer is not None:
            self._answer(identity, answer)
        if opened is not None:
            self._dispatch(identity, opened)

    def _answer(self, identity: bytes, frame: bytes) -> None:
        assert self._router is not None
        try:
            self._router.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.dropped += 1

    def _from_server(self, name: str, s: zmq.Socket, payload: bytes) -> None:
        """A frame at a DEALER: the challenge, a refusal, or (authenticated) a message."""
        refused = auth.parse_refuse(payload)
        session = self._client_auth.get(name)
        if session is None:
            if refused is not None:
                self._refused(name, refused[1])
            else:
                self._dispatch(name, payload)
            return
        if not session.session and session.on_challenge(payload):
            queued, session.queue = session.queue, []
            for p in queued:
                self._send(s, session.seal(p))
            return
        if refused is not None:
            if refused[0] == auth.UNKNOWN_SESSION:
                hello = session.restart()  # the server restarted: a new handshake
                if hello is not None:
                    self._send(s, hello)
            else:
                self._refused(name, refused[1])
            return
        opened = session.open(payload)
        if opened is not None:
            self._dispatch(name, opened)
        elif auth.is_auth_frame(payload) and payload[len(auth.MAGIC)] == auth.CHALLENGE:
            self._refused(name, "answered the challenge without the same control secret; hint: "
                                "give every prefill and decode process the same secret "
                                "(PDC_CONTROL_SECRET_FILE)")
        elif not auth.is_auth_frame(payload):
            self._refused(name, "answered without authentication (it runs without a control "
                                "secret, and this process has one); hint: give both sides the "
                                "same secret, or neither")

    def _refused(self, name: str, reason: str) -> None:
        if name in self._told or self.on_refused is None:
            return
        self._told.add(name)
        self._guard(self.on_refused, name, f"{self._peer_addr.get(name, name)} {reason}")

    def _run(self) -> None:
        limit = int(knobs.get("max_messages_per_tick"))
        while not self._stop.is_set():
            events = dict(self._poller.poll(20))
            if self._pull in events:
                for _ in range(limit):
                    try:
                        op, key, arg = self._pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if op == b"C":
                        self._open(key.decode(), arg.decode())
                    else:
                        self._deliver(key, arg)
            if self._router is not None and self._router in events:
                for _ in range(limit):
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(frames) == 2:
                        self._from_peer(frames[0].bytes, frames[1])
            for s, name in list(self._names.items()):
                if s in events:
                    for _ in range(limit):
                        try:
                            payload = s.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except zmq.ZMQError:
                            break
                        self._from_server(name, s, payload)
            if self.on_tick is not None:
                self._guard(self.on_tick)
        for s in list(self._dealers.values()):
            s.close(0)
        if self._router is not None:
            self._router.close(0)
        self._pull.close(0)

    def _dispatch(self, peer, payload: bytes) -> None:
        self._guard(self.handler, peer, payload)

    def _guard(self, fn, *args) -> None:
        # A handler bug must not kill the control thread: every request on this endpoint
        # would hang. Log and go on; the affected request fails by its own deadline.
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            import sys
            import traceback

            self.handler_errors += 1
            print(f"pdc: control handler error: {e!r}", file=sys.stderr)
            traceback.print_exc()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._push_lock:
            self._closed = True
            self._push.close(0)
