"""The control hub: one endpoint's ZeroMQ sockets, its receiving thread and its timers.

Note [Sends from the caller's thread]: a control message leaves from the thread that sends it.
Before, every send from another thread went through an inproc outbox that the hub thread
polled: decode's request went caller -> hub thread -> ZeroMQ, prefill's Success went worker ->
hub thread -> ZeroMQ, each hand-off a thread wake-up and a wait for the GIL (the GPU trace of
a 1K request put 0.3-0.6 ms of its time in them each way, BENCHMARKS.md (p)). ZeroMQ sockets
are not thread-safe, but one may be used from several threads when a full memory barrier
separates the uses; so every socket operation, and the authentication state that sealing and
opening a frame change (its sequence numbers, Note [Control authentication]), runs under one
lock, `_io`, and the hub thread holds it only while it reads, never while it waits:
- The hub thread waits in the operating system's poll on each socket's notification file
  descriptor (zmq.FD) and a wake pipe, not in zmq_poll (which would touch the sockets). That
  descriptor is edge-triggered: any operation on the socket, a send from another thread too,
  may take the edge of a message that has already arrived. So after every send the sender
  asks the socket (zmq.EVENTS) whether a message waits and, if one does, writes the wake
  pipe; the hub thread reads a socket until zmq.EVENTS says it is empty (or its per-tick
  limit, after which it does not sleep). A message therefore never waits for a timer.
- Handlers, `on_tick` and `on_refused` run on the hub thread outside `_io`, as before, so a
  handler may send (it takes `_io` again) and the endpoints' own locks are always taken
  before `_io`, never after: no lock-order cycle.
- Order: the messages to one peer leave on one socket in the order their senders took `_io`;
  a thread's own sends keep its program order. `connect()` opens the socket at once, under
  `_io`, so a send right after it finds the socket (the outbox ordered the two before).
- The caller pays for its message: sealing and sending (tens of µs) run on its thread.
  Measured on a 2-core CPU box, two processes, 1K requests: the control path's p50 fell
  0.22-0.41 ms (-11 to -18 %, local and Mooncake engines; BENCHMARKS.md (r)).
- A send never blocks: a full queue (`control_queue_depth`) or a vanished peer drops the
  message and counts it in `dropped`; the request it belonged to fails by its deadline. A
  send after `close()` is dropped and counted.
"""

from __future__ import annotations

import os
import select
import threading
import uuid
from typing import cast

import zmq

from . import auth, knobs, lane
from .control import HostSettings, _bind_random, _key, enable_ipv6, peer_address

_POLL_MS = 20  # the hub's longest sleep: on_tick runs at least this often


def _events(s: zmq.Socket) -> int:
    """The socket's zmq.EVENTS bits (an int option; pyzmq types every option int | bytes)."""
    return cast(int, s.getsockopt(zmq.EVENTS))


def _fd(s: zmq.Socket) -> int:
    """The socket's notification file descriptor (zmq.FD)."""
    return cast(int, s.getsockopt(zmq.FD))


class Hub:
    """One thread receiving on a ROUTER (server) or DEALERs (client side), plus timers.

    Server mode (`bind=True`): peers connect; incoming frames carry the peer identity, and
    `send(identity, payload)` answers a peer. Client mode: `connect(name, address)` opens one
    DEALER per peer (connecting a name again replaces its socket: a restarted peer);
    `send(name, payload)` writes to it. Any thread may send (Note [Sends from the caller's
    thread]). The hub handles at most `max_messages_per_tick` incoming messages per socket
    before it runs its timers again, so a flood from one peer cannot starve them.
    """

    def __init__(self, handler, bind: bool, on_tick=None, ctx: zmq.Context | None = None,
                 hosts: HostSettings | None = None, on_refused=None):
        self.ctx = ctx or zmq.Context.instance()
        self.handler = handler  # handler(peer_key: bytes|str, payload: bytes) on the hub thread
        self.on_tick = on_tick  # called on the hub thread at least every 20 ms
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
        self._io = threading.RLock()  # every socket operation and auth state change
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._dealers: dict[str, zmq.Socket] = {}
        self._retired: list[zmq.Socket] = []  # replaced dealers, closed by the hub thread
        self._changed = True  # the set of sockets changed: the hub thread re-registers
        # Note [Same-host lane] (runtime/lane.py): lanes read by the hub thread (server: by
        # connection, its peer's identity once its hello came; client: by peer name) and
        # those a send may use (a lane that could not carry a message sends no more)
        self._lane_on = self._key is None and bool(knobs.get("control_lane"))
        self._listener = None
        self._lanes_in: dict = {}  # server: connection -> identity (None before its hello)
        self._lanes_out: dict = {}  # client: name -> connection
        self._lane_send: dict = {}  # identity (server) or name (client) -> connection
        self._lanes_closed: list = []  # closed by the hub thread when it re-registers
        self._lane_buf: bytearray | None = None  # the hub thread's, once a lane opens
        self.address = ""
        self._router = None
        if bind:
            self._router = self.ctx.socket(zmq.ROUTER)
            self._configure(self._router)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.address = _bind_random(self._router, hosts)
            if self._key is not None:
                self._server_auth = auth.ServerSessions(self._key, self.address)
            if self._lane_on:
                self._listener = lane.listen(self.address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdc-hub", daemon=True)
        self._thread.start()

    def _configure(self, s: zmq.Socket) -> None:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, knobs.get("max_message_bytes"))
        s.setsockopt(zmq.SNDHWM, self._depth)
        s.setsockopt(zmq.RCVHWM, self._depth)

    def connect(self, name: str, address: str) -> None:
        with self._io:
            if self._closed:
                return
            self._open(name, address)
            self._wake()  # the hub thread watches the new socket from its next wait on

    def send(self, peer, payload: bytes) -> None:
        key = peer if isinstance(peer, bytes) else peer.encode()
        with self._io:
            if self._closed:
                self.dropped += 1  # a late sender (e.g. a reconnect thread) after close()
                return
            self._deliver(key, payload)

    def _wake(self) -> None:
        """Caller holds `_io` (close() closes the pipe under it)."""
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the hub will wake anyway) or closed (after close())

    def _after_send(self, s: zmq.Socket) -> None:
        """Note [Sends from the caller's thread]: the send may have taken the edge of a message
        that arrived meanwhile; if one waits, wake the hub thread. Caller holds `_io`."""
        try:
            if _events(s) & zmq.POLLIN:
                self._wake()  # from the hub thread too: it is about to sleep
        except zmq.ZMQError:
            pass

    def _open(self, name: str, address: str) -> None:
        old = self._dealers.pop(name, None)
        if old is not None:
            self._retired.append(old)
        s = self.ctx.socket(zmq.DEALER)
        self._configure(s)
        # A routing id of our own: the peer keeps knowing us across a TCP reconnect.
        routing_id = uuid.uuid4().bytes
        s.setsockopt(zmq.ROUTING_ID, routing_id)
        enable_ipv6(s, address)
        s.connect(address)
        self._dealers[name] = s
        old_lane = self._lanes_out.pop(name, None)
        self._lane_send.pop(name, None)
        if old_lane is not None:
            self._lanes_closed.append(old_lane)
        conn = lane.dial(address, routing_id) if self._lane_on else None
        if conn is not None:  # Note [Same-host lane]
            self._lanes_out[name] = self._lane_send[name] = conn
        self._changed = True
        self._peer_addr[name] = address
        self._told.discard(name)
        if self._key is not None:
            session = self._client_auth[name] = auth.ClientSession(self._key)
            self._send(s, session.hello())

    def _send(self, s: zmq.Socket, frame: bytes, *parts: bytes) -> None:
        try:
            if parts:
                s.send_multipart([frame, *parts], zmq.NOBLOCK)
            else:
                s.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.dropped += 1  # full queue or peer gone: its requests fail by deadline
        self._after_send(s)

    @property
    def refused(self) -> int:
        """Frames this hub's socket refused as unauthenticated."""
        return self._server_auth.refused.count if self._server_auth is not None else 0

    def _deliver(self, key: bytes, payload: bytes) -> None:
        """Seal and send one message (caller holds `_io`)."""
        if self._lane_send:
            name = key if self._router is not None else key.decode(errors="replace")
            conn = self._lane_send.get(name)
            if conn is not None:
                sent = lane.send(conn, payload)
                if sent is not None:
                    self.dropped += not sent
                    return
                del self._lane_send[name]  # from now on ZeroMQ (Note [Same-host lane])
        if self._router is not None:
            if self._server_auth is not None:
                sealed = self._server_auth.seal(key, payload)
                if sealed is None:  # never answer a peer that has not proven the key
                    self.dropped += 1
                    return
                payload = sealed
            self._send(self._router, key, payload)
            return
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
        self._send(s, payload)

    def _from_peer(self, identity: bytes, frame: zmq.Frame, out: list) -> None:
        """A frame at the ROUTER: authenticated (or not required), then to the handler."""
        payload = frame.bytes
        router = cast(zmq.Socket, self._router)  # frames at the ROUTER come from it
        if self._server_auth is None:
            if auth.is_auth_frame(payload) and payload[len(auth.MAGIC)] == auth.HELLO:
                self._send(router, identity, auth.refuse_frame(auth.NO_SECRET))
                return
            out.append((self.handler, identity, payload))
            return
        opened, answer = self._server_auth.on_frame(identity, payload, peer_address(frame))
        if answer is not None:
            self._send(router, identity, answer)
        if opened is not None:
            out.append((self.handler, identity, opened))

    def _from_server(self, name: str, s: zmq.Socket, payload: bytes, out: list) -> None:
        """A frame at a DEALER: the challenge, a refusal, or (authenticated) a message."""
        refused = auth.parse_refuse(payload)
        session = self._client_auth.get(name)
        if session is None:
            if refused is not None:
                self._refused(name, refused[1], out)
            else:
                out.append((self.handler, name, payload))
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
                self._refused(name, refused[1], out)
            return
        opened = session.open(payload)
        if opened is not None:
            out.append((self.handler, name, opened))
        elif auth.is_auth_frame(payload) and payload[len(auth.MAGIC)] == auth.CHALLENGE:
            self._refused(name, "answered the challenge without the same control secret; hint: "
                                "give every prefill and decode process the same secret "
                                "(PDC_CONTROL_SECRET_FILE)", out)
        elif not auth.is_auth_frame(payload):
            self._refused(name, "answered without authentication (it runs without a control "
                                "secret, and this process has one); hint: give both sides the "
                                "same secret, or neither", out)

    def _refused(self, name: str, reason: str, out: list) -> None:
        if name in self._told or self.on_refused is None:
            return
        self._told.add(name)
        out.append((self.on_refused, name, f"{self._peer_addr.get(name, name)} {reason}"))

    def _read(self, limit: int) -> tuple[list, bool]:
        """Everything waiting on the sockets, at most `limit` frames per socket (caller holds
        `_io`): the calls to make outside the lock, and whether a socket still holds more."""
        out: list = []
        more = self._read_lanes(limit, out)  # first: Note [Same-host lane]
        if self._router is not None:
            for _ in range(limit):
                if not _events(self._router) & zmq.POLLIN:
                    break
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.ZMQError:
                    break
                if len(frames) == 2:
                    self._from_peer(frames[0].bytes, frames[1], out)
            else:
                more = True
        for name, s in list(self._dealers.items()):
            for _ in range(limit):
                try:
                    if not _events(s) & zmq.POLLIN:
                        break
                    payload = s.recv(zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                self._from_server(name, s, payload, out)
            else:
                more = True
        return out, more

    def _read_lanes(self, limit: int, out: list) -> bool:
        """Note [Same-host lane]: new connections at the listener, then every lane's frames
        (caller holds `_io`); whether a lane still holds more."""
        more = False
        if self._listener is not None:
            for conn in lane.accept(self._listener):
                self._lanes_in[conn] = None
                self._changed = True
        lanes = [(conn, True) for conn in self._lanes_in] + \
            [(conn, False) for conn in self._lanes_out.values()]
        names = {conn: name for name, conn in self._lanes_out.items()}
        if lanes and self._lane_buf is None:
            self._lane_buf = lane.buffer()
        for conn, server in lanes:
            frames, full, closed = lane.read(conn, limit, cast(bytearray, self._lane_buf))
            more |= full
            for frame in frames:
                if not server:
                    out.append((self.handler, names[conn], frame))
                elif self._lanes_in[conn] is not None:
                    out.append((self.handler, self._lanes_in[conn], frame))
                elif frame.startswith(lane.HELLO):  # a lane's first frame names its DEALER
                    identity = frame[len(lane.HELLO):]
                    self._lanes_in[conn] = identity
                    self._lane_send[identity] = conn
                else:
                    closed = True  # not a lane of a pdc hub
                    break
            if closed:
                self._close_lane(conn)
        return more

    def _close_lane(self, conn) -> None:
        for lanes in (self._lanes_in, self._lanes_out, self._lane_send):
            for k in [k for k, v in lanes.items() if v is conn or k is conn]:
                del lanes[k]
        self._lanes_closed.append(conn)
        self._changed = True

    def _register(self) -> select.poll:
        """A poll set of the current sockets' descriptors and the wake pipe (caller holds
        `_io`); replaced dealers and closed lanes are closed here, once no poll watches them."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        socks = list(self._dealers.values())
        if self._router is not None:
            socks.append(self._router)
        for s in socks:
            poller.register(_fd(s), select.POLLIN)
        for conn in [*self._lanes_in, *self._lanes_out.values(),
                     *([self._listener] if self._listener is not None else [])]:
            poller.register(conn.fileno(), select.POLLIN)
        for s in self._retired:
            s.close(0)
        self._retired.clear()
        for conn in self._lanes_closed:
            conn.close()
        self._lanes_closed.clear()
        self._changed = False
        return poller

    def _run(self) -> None:
        limit = int(knobs.get("max_messages_per_tick"))
        poller = select.poll()
        more = False
        while not self._stop.is_set():
            with self._io:
                if self._changed:
                    poller = self._register()
            if not more:
                poller.poll(_POLL_MS)
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            with self._io:
                calls, more = self._read(limit)
            for fn, *args in calls:
                self._guard(fn, *args)
            if self.on_tick is not None:
                self._guard(self.on_tick)
        with self._io:
            self._closed = True
            for s in [*self._dealers.values(), *self._retired]:
                s.close(0)
            if self._router is not None:
                self._router.close(0)
            for conn in [*self._lanes_in, *self._lanes_out.values(), *self._lanes_closed,
                         *([self._listener] if self._listener is not None else [])]:
                conn.close()
        os.close(self._wake_r)

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
        with self._io:
            self._wake()
        self._thread.join(timeout=2)
        with self._io:
            if self._wake_w >= 0:
                self._closed = True
                os.close(self._wake_w)
                self._wake_w = -1
