"""A control lane between the hubs of one host that does without ZeroMQ's I/O threads.

Note [Same-host lane]: a ZeroMQ message wakes the sender's I/O thread, the receiver's I/O
thread and then the receiving hub thread; on a GPU host with idle cores each wake-up costs
tens of µs, and a control hop took 0.18-0.25 ms in the traces of BENCHMARKS.md (x).
`bench/control_hop.py` puts a round trip over ZeroMQ on loopback at 6-7x one over a
Unix-domain SOCK_SEQPACKET socket that the threads write and read themselves. With the knob
`control_lane` a hub that listens on a loopback address also listens on an abstract
Unix-domain socket named after that address (abstract names live in the network namespace,
as loopback does, so a client that can dial the address reaches this hub's lane and no
other), and a client hub dialling a loopback address opens the lane beside its DEALER and
introduces itself with the DEALER's routing id, so the server's handler sees the same peer
either way.
- Every message to a peer takes the lane while it is open, so the order of one sender's
  messages is the lane's. A message the lane refuses (above the socket's buffer: a large
  Register) or a lane error retires the lane for that peer for good, and everything after
  goes through ZeroMQ. The readers read lanes before ZeroMQ sockets: a lane message is in the
  receiver's queue when `send` returns, before a later ZeroMQ message has left the sender, so
  retiring keeps the order too.
- A full lane drops the message and counts it, as a full ZeroMQ queue does.
- Never with a control key (Note [Control authentication]: the lane carries no sessions), nor
  to an address other than loopback: those keep ZeroMQ.
- On by default since its GPU A/B (BENCHMARKS.md (x), an H100, direct requests between two
  processes, lane off and on alternating three times): fixed cost 1K 0.91 / 1.00 / 0.84 ->
  0.85 / 0.84 / 0.82 ms, 8K 1.08 / 1.16 / 1.31 -> 1.11 / 0.87 / 1.07 ms. `control_lane=0`
  gives ZeroMQ only.
"""

from __future__ import annotations

import errno
import ipaddress
import socket

HELLO = b"pdc-lane/1:"  # + the DEALER's routing id, the lane's first frame
_BUF_BYTES = 4 << 20  # asked for; the kernel caps it at net.core.wmem_max / rmem_max


def lane_name(address: str) -> bytes | None:
    """The abstract socket name of a hub listening on `address` (tcp://host:port), or None
    when its host is not a loopback address."""
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    try:
        if not ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        return None
    return b"\0pdc-lane/" + address.encode()


def _socket() -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK |
                      socket.SOCK_CLOEXEC)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, _BUF_BYTES)
        except OSError:
            pass
    return s


def send(sock: socket.socket, payload: bytes) -> bool | None:
    """True: sent; False: the lane is full (dropped, as ZeroMQ's high-water mark drops);
    None: the lane cannot carry it (too large, or broken): retire it, use ZeroMQ."""
    try:
        sock.send(payload)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno == errno.EAGAIN:
            return False
        return None


def buffer() -> bytearray:
    """A reader's buffer: as large as the largest frame a lane can carry (its send buffer's
    size, at most _BUF_BYTES), so one `recv_into` takes any frame whole."""
    return bytearray(_BUF_BYTES)


def read(sock: socket.socket, limit: int, buf: bytearray) -> tuple[list[bytes], bool, bool]:
    """Up to `limit` frames waiting on `sock`, each read into `buf` and copied out at its own
    length (a recv of the largest size would allocate that much per call): (frames, more
    waiting, closed). A frame larger than `buf` closes the lane."""
    frames: list[bytes] = []
    view = memoryview(buf)
    for _ in range(limit):
        try:
            n = sock.recv_into(view, len(buf), socket.MSG_TRUNC)
        except BlockingIOError:
            return frames, False, False
        except OSError:
            return frames, False, True
        if n == 0 or n > len(buf):  # the peer closed, or a frame cut short
            return frames, False, True
        frames.append(bytes(view[:n]))
    return frames, True, False


def listen(address: str) -> socket.socket | None:
    """The server's lane listener for `address`, or None (not loopback, or the name taken)."""
    name = lane_name(address)
    if name is None:
        return None
    s = _socket()
    try:
        s.bind(name)
        s.listen(64)
    except OSError:
        s.close()
        return None
    return s


def dial(address: str, routing_id: bytes) -> socket.socket | None:
    """A client's lane to the hub listening on `address`, introduced by `routing_id`; None
    when there is none to dial."""
    name = lane_name(address)
    if name is None:
        return None
    s = _socket()
    try:
        s.connect(name)
        s.send(HELLO + routing_id)
    except OSError:
        s.close()
        return None
    return s


def accept(listener: socket.socket) -> list[socket.socket]:
    """Every connection waiting at the listener (their hello not read yet)."""
    out: list[socket.socket] = []
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return out
        conn.setblocking(False)
        out.append(conn)
