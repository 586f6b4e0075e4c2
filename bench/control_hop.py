"""One control message's round trip between two processes of one host, by transport.

The GPU traces of BENCHMARKS.md (x) put 0.18-0.25 ms between decode's request leaving and
prefill's handler starting, each way. This bench asks how much of a hop the transport itself
is: a 300-byte message (a 1K request's size) echoed by a second process, the sender waiting
the way the hub does (poll(2) on the socket's descriptor), with a pause between messages so
that both sides sleep between them as the endpoints do. Transports: ZeroMQ DEALER/ROUTER over
TCP on loopback (the hub's), over ipc://, and a Unix-domain SOCK_SEQPACKET socket written and
read by the threads themselves (no I/O thread on either side). Median and p90 of `--reps`
round trips; each echo is checked byte for byte.

    python3 bench/control_hop.py --json out.json
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import socket
import sys
import tempfile
import time

import _common as C
import zmq

MESSAGE = bytes(range(256)) + bytes(44)  # 300 bytes


def _zmq_echo(address: str, ready) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(address)
    ready.set()
    while True:
        frames = s.recv_multipart()
        if frames[1] == b"stop":
            break
        s.send_multipart(frames)
    s.close(0)
    ctx.term()


def _uds_echo(path: str, ready) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    s.listen(1)
    ready.set()
    conn, _ = s.accept()
    while True:
        m = conn.recv(4096)
        if not m or m == b"stop":
            break
        conn.send(m)
    conn.close()
    s.close()


def _zmq_rtts(address: str, reps: int, pause_s: float) -> tuple[list[float], bool]:
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.connect(address)
    poller = select.poll()
    poller.register(d.getsockopt(zmq.FD), select.POLLIN)
    took, same = [], True
    for _ in range(reps + 1):
        t = time.perf_counter()
        d.send(MESSAGE)
        while not d.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[operator]
            poller.poll(100)
        same &= d.recv() == MESSAGE
        took.append(time.perf_counter() - t)
        time.sleep(pause_s)
    d.send(b"stop")
    d.close(linger=1000)
    ctx.term()
    return took[1:], same


def _uds_rtts(path: str, reps: int, pause_s: float) -> tuple[list[float], bool]:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.connect(path)
    poller = select.poll()
    poller.register(c.fileno(), select.POLLIN)
    took, same = [], True
    for _ in range(reps + 1):
        t = time.perf_counter()
        c.send(MESSAGE)
        poller.poll(100)
        same &= c.recv(4096) == MESSAGE
        took.append(time.perf_counter() - t)
        time.sleep(pause_s)
    c.send(b"stop")
    c.close()
    return took[1:], same


def main() -> int:
    ap = C.parser(__doc__)
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--pause-us", type=int, default=500)
    args = ap.parse_args()
    if args.small:
        args.reps = 50
    ctx = mp.get_context("spawn")
    rows, checks = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("zmq tcp", _zmq_echo, "tcp://127.0.0.1:0", _zmq_rtts),
                 ("zmq ipc", _zmq_echo, f"ipc://{tmp}/hop.ipc", _zmq_rtts),
                 ("uds seqpacket", _uds_echo, f"{tmp}/hop.sock", _uds_rtts)]
        for name, echo, address, rtts in cases:
            if address.endswith(":0"):  # a free port of this host
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", 0))
                    address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
            ready = ctx.Event()
            p = ctx.Process(target=echo, args=(address, ready), daemon=True)
            p.start()
            if not ready.wait(30):
                p.kill()
                checks[f"{name}: echo process ready"] = False
                continue
            took, same = rtts(address, args.reps, args.pause_us * 1e-6)
            p.join(10)
            took.sort()
            rows.append({"transport": name, "rtt_p50_us": took[len(took) // 2] * 1e6,
                         "rtt_p90_us": took[int(len(took) * 0.9)] * 1e6, "reps": len(took)})
            checks[f"{name}: every echo equal"] = same
    C.table(rows, [("transport", "transport", ""), ("rtt_p50_us", "RTT p50 us", ".1f"),
                   ("rtt_p90_us", "RTT p90 us", ".1f"), ("reps", "reps", "")])
    load = os.getloadavg()
    return C.finish("control_hop", args, rows, checks,
                    notes=[f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"])


if __name__ == "__main__":
    sys.exit(main())
