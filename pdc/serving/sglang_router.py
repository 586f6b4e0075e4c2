"""A PD router for SGLang servers of the pdc backend that streams the first token from prefill.

Note [SGLang first token from prefill] (integrations/sglang/first_token.py) is the server
side. Like SGLang's own router, this one sends a `/generate` request to a prefill and a
decode server at once, both with the same bootstrap host, port and room; a streaming request
also asks prefill for its first token (`sampling_params.custom_params.pdc_first_token`). The
client gets whichever first token comes first, normally prefill's, right after prefill's
forward, then decode's stream from its second token on. The first token normally comes
straight from prefill's scheduler to a UDP socket of the router's own, one datagram, past
SGLang's detokenizer and HTTP server (Note [First token straight to the router] in
integrations/sglang/first_token.py; `token_address`, `--token-host`); a datagram that is
not a token for a waiting request is counted (`stray_datagrams`) and dropped. Decode's first
token must equal the one the client got (it is prefill's, moved in the metadata row); a difference ends the stream
with an error naming both. A request that does not stream gets decode's answer, as from
SGLang's router. Prefill's stream is read to its end in the background so that prefill
finishes the request normally. Counts: `stats` (first tokens from prefill's stream, straight
from prefill, from decode; mismatches, errors, stray datagrams; `GET /stats` answers them).

    router = FirstTokenRouter([Prefill(url, "127.0.0.1", bootstrap_port)], [decode_url])
    router.start(); ...; router.stop()

As a process of its own, the way a router is deployed (and the way the demos run it, so that
the client's threads do not share the router's interpreter lock):

    python -m pdc.serving.sglang_router --prefill URL BOOTSTRAP_HOST BOOTSTRAP_PORT \
        --decode URL [--host 127.0.0.1] [--port 0]

It prints `listening on http://HOST:PORT` once it answers, and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import http.client
import json
import queue
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from pdc.runtime import knobs
from pdc.runtime.metrics import mark

FLAG = "pdc_first_token"  # integrations/sglang/first_token.py reads it
FLAG_TO = "pdc_first_token_to"  # where prefill sends the token (Note [First token straight
# to the router] in integrations/sglang/first_token.py)
_WILDCARDS = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class Prefill:
    url: str
    bootstrap_host: str  # where decode reaches prefill's bootstrap server
    bootstrap_port: int


class FirstTokenRouter:
    def __init__(self, prefills: list[Prefill], decodes: list[str], host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 600.0, token_host: str | None = None):
        """`token_host`: where prefill servers reach this router's token socket (Note [First
        token straight to the router]); by default `host`, and none when that is a wildcard
        address (prefill then streams the token the usual way)."""
        if not prefills or not decodes:
            raise ValueError("a router needs at least one prefill and one decode server")
        self.prefills, self.decodes, self.timeout_s = list(prefills), list(decodes), timeout_s
        self.stats = {"first_from_prefill": 0, "first_direct": 0, "first_from_decode": 0,
                      "mismatches": 0, "errors": 0, "stray_datagrams": 0}
        self._lock = threading.Lock()
        token_host = token_host_for(host, token_host)
        self.waiting: dict[int, queue.Queue] = {}  # room -> its stream's events
        self._stopping = False
        self._tokens: socket.socket | None = None
        self.token_address: str | None = None
        if token_host is not None:
            self._tokens = socket.socket(socket.AF_INET6 if ":" in token_host
                                         else socket.AF_INET, socket.SOCK_DGRAM)
            self._tokens.bind((token_host, 0))
            self.token_address = (f"[{token_host}]" if ":" in token_host else token_host) + \
                f":{self._tokens.getsockname()[1]}"
        self._listener = threading.Thread(target=self._listen, name="pdc-sglang-router-tokens",
                                          daemon=True)
        # Note [Router connections]
        self.upstreams = {url: Upstream(url, timeout_s)
                          for url in [p.url for p in self.prefills] + self.decodes}
        self.readers = ThreadPoolExecutor(thread_name_prefix="pdc-sglang-router-read")
        router = self

        class Handler(_Handler):
            owner = router

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="pdc-sglang-router", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FirstTokenRouter:
        if self._tokens is not None:
            self._listener.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        if self._tokens is not None:
            try:  # wakes the listener, which then sees _stopping
                self._tokens.sendto(b"", self._tokens.getsockname()[:2])
            except OSError:
                pass
            if self._listener.is_alive():
                self._listener.join(5)
            self._tokens.close()
        self._server.shutdown()
        self._server.server_close()
        self.readers.shutdown(wait=False, cancel_futures=True)
        for u in self.upstreams.values():
            u.close()

    def count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _listen(self) -> None:
        """First tokens from prefill servers, one datagram each, to the waiting streams; a
        datagram that is not one, or names no waiting room, is counted and dropped."""
        assert self._tokens is not None  # started only with a token socket
        while True:
            try:
                data = self._tokens.recv(65536)
            except OSError:
                return
            if self._stopping:
                return
            msg = _token_message(data)
            with self._lock:
                events = None if msg is None else self.waiting.get(msg[0])
            if events is None:
                self.count("stray_datagrams")
                continue
            events.put(("direct", msg[1]))

    def bodies(self, body: dict) -> tuple[Upstream, dict, Upstream, dict]:
        """(prefill, prefill's body, decode, decode's body) of one request."""
        p, d = random.choice(self.prefills), random.choice(self.decodes)
        boot = {"bootstrap_host": p.bootstrap_host, "bootstrap_port": p.bootstrap_port,
                "bootstrap_room": random.getrandbits(63)}
        to_prefill = {**body, **boot}
        if body.get("stream"):
            params = dict(body.get("sampling_params") or {})
            ask = {FLAG: True, **({FLAG_TO: self.token_address} if self.token_address else {})}
            params["custom_params"] = {**(params.get("custom_params") or {}), **ask}
            to_prefill["sampling_params"] = params
        return self.upstreams[p.url], to_prefill, self.upstreams[d], {**body, **boot}


def token_host_for(host: str, token_host: str | None) -> str | None:
    """Where prefill servers reach the token socket: `token_host`, else the router's own
    `host` unless that is a wildcard address (then none: no address to name)."""
    return token_host or (None if host in _WILDCARDS else host)


def _token_message(data: bytes) -> tuple[int, dict] | None:
    """(room, the message for the client) of a prefill's datagram, or None when it is not
    one: a JSON object with an integer room and one token id, optionally a text and a
    meta_info object (nothing else is passed on)."""
    try:
        obj = json.loads(data)
        room, ids = obj["room"], obj["output_ids"]
        if not (isinstance(room, int) and isinstance(ids, list) and len(ids) == 1
                and isinstance(ids[0], int)):
            return None
    except (ValueError, KeyError, TypeError):
        return None
    msg: dict = {"output_ids": ids}
    if isinstance(obj.get("text"), str):
        msg["text"] = obj["text"]
    if isinstance(obj.get("meta_info"), dict):
        msg["meta_info"] = obj["meta_info"]
    return room, msg


class UpstreamError(Exception):
    """A server's answer with another status than 200."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"answered HTTP {status}: {body.decode(errors='replace')[:300]}")
        self.status, self.body = status, body


class Upstream:
    """Keep-alive connections to one server, reused request after request.

    Note [Router connections]: the router is on the path of every first token, so it keeps
    what a request costs it small: an idle connection to the server is taken instead of a new
    one (SGLang's HTTP server keeps a connection open after a streamed answer read to its end),
    and the two streams of a request are read on a pool's threads instead of new ones. A
    connection that fails or was left half read is closed. A request on a reused connection
    that the server closed while it was idle (the server hung up before reading it) is sent
    again, once, on a new connection; any other failure is the request's.
    """

    def __init__(self, url: str, timeout_s: float):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout_s = timeout_s
        self.idle: queue.LifoQueue = queue.LifoQueue()

    def post(self, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """POST /generate; returns the connection and its response (status 200), for
        `release` once read; raises UpstreamError for another status, or the network's
        error."""
        data = json.dumps(body).encode()
        for attempt in (0, 1):
            # the retry takes a new one: another idle one may be stale too (the server hung
            # up on all of them)
            conn = self._idle() if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                conn.request("POST", "/generate", data, {"content-type": "application/json"})
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                if reused and attempt == 0:
                    continue  # closed by the server while idle: once more, on a new one
                raise
            except (http.client.HTTPException, OSError):
                conn.close()
                raise
            if resp.status != 200:
                body = resp.read()
                self.release(conn, resp)
                raise UpstreamError(resp.status, body)
            return conn, resp
        raise AssertionError("unreachable")

    def _idle(self) -> http.client.HTTPConnection | None:
        try:
            return self.idle.get_nowait()
        except queue.Empty:
            return None

    def fetch(self, body: dict) -> tuple[int, bytes]:
        """POST /generate and read the whole answer, whatever its status; raises the
        network's error."""
        try:
            conn, resp = self.post(body)
        except UpstreamError as e:
            return e.status, e.body
        data = resp.read()
        self.release(conn, resp)
        return resp.status, data

    def release(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        if resp.isclosed() and not resp.will_close:
            self.idle.put(conn)
        else:
            conn.close()

    def close(self) -> None:
        while True:
            try:
                self.idle.get_nowait().close()
            except queue.Empty:
                return


def _read_stream(side: str, upstream: Upstream, body: dict, out: queue.Queue) -> None:
    """Every `data:` message of one server's stream into `out` as (side, message), then
    (side, None) at its end; an HTTP or network failure as (side, {"error": ...})."""
    try:
        conn, resp = upstream.post(body)
        try:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    out.put((side, json.loads(line[5:])))
            resp.read()  # the end of the answer: the connection is free again
        finally:
            upstream.release(conn, resp)
    except UpstreamError as e:
        out.put((side, {"error": {"message": f"{side} {e}"[:300]}}))
    except (http.client.HTTPException, OSError, ValueError) as e:
        out.put((side, {"error": {"message": f"{side}: {type(e).__name__}: {e}"[:300]}}))
    out.put((side, None))


class _Handler(BaseHTTPRequestHandler):
    owner: FirstTokenRouter

    def log_message(self, *args) -> None:  # the servers log requests; this stays quiet
        pass

    def do_GET(self) -> None:
        if self.path == "/stats":
            with self.owner._lock:
                self._reply(200, dict(self.owner.stats))
            return
        ok = self.path in ("/health", "/v1/models")
        self._reply(200 if ok else 404, {"ok": ok})

    def do_POST(self) -> None:
        t_in = time.monotonic()
        if self.path != "/generate":
            self._reply(404, {"error": {"message": f"no route {self.path}; use /generate"}})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as e:
            self._reply(400, {"error": {"message": f"bad request body: {e}"}})
            return
        if body.get("stream"):
            self._stream(*self.owner.bodies(body), t_in)
        else:
            self._whole(*self.owner.bodies(body))

    def _reply(self, status: int, msg: dict) -> None:
        self._reply_bytes(status, json.dumps(msg).encode())

    def _reply_bytes(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _whole(self, prefill: Upstream, p_body: dict, decode: Upstream, d_body: dict) -> None:
        self.owner.readers.submit(_drain, prefill, p_body)
        try:
            status, data = decode.fetch(d_body)  # decode's own answer, passed on as it is
        except (http.client.HTTPException, OSError) as e:
            self.owner.count("errors")
            self._reply(502, {"error": {"message": f"decode: {type(e).__name__}: {e}"}})
            return
        self._reply_bytes(status, data)

    def _stream(self, prefill: Upstream, p_body: dict, decode: Upstream, d_body: dict,
                t_in: float) -> None:
        events: queue.Queue = queue.Queue()
        room = int(p_body["bootstrap_room"])
        with self.owner._lock:
            self.owner.waiting[room] = events
        try:
            self._stream_events(events, prefill, p_body, decode, d_body, t_in)
        finally:
            with self.owner._lock:
                self.owner.waiting.pop(room, None)

    def _stream_events(self, events: queue.Queue, prefill: Upstream, p_body: dict,
                       decode: Upstream, d_body: dict, t_in: float) -> None:
        timeout = self.owner.timeout_s
        for side, upstream, body in (("prefill", prefill, p_body), ("decode", decode, d_body)):
            self.owner.readers.submit(_read_stream, side, upstream, body, events)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        sent, first = 0, None  # tokens the client has; the first of them
        try:
            while True:
                try:
                    side, msg = events.get(timeout=timeout)
                except queue.Empty:
                    self._send({"error": {"message": f"no answer from prefill or decode "
                                                     f"within {timeout:.0f} s"}})
                    self.owner.count("errors")
                    break
                if msg is None:
                    if side == "decode":
                        break
                    continue
                if "error" in msg:
                    if side == "decode" or sent == 0:
                        self._send(msg)
                        self.owner.count("errors")
                        break
                    continue  # prefill's late failure: decode's stream says what happened
                ids = list(msg.get("output_ids") or [])
                if side in ("prefill", "direct"):
                    if sent == 0 and ids:  # later prefill messages repeat it, then finish
                        self._send({**msg, "output_ids": ids[:1]})
                        sent, first = 1, ids[0]
                        self.owner.count("first_direct" if side == "direct" else
                                         "first_from_prefill")
                        _stamp(p_body, t_in)
                    continue
                if first is not None and ids and ids[0] != first:
                    self.owner.count("mismatches")
                    self._send({"error": {"message": f"decode's first token {ids[0]} is not "
                                                     f"prefill's {first}"}})
                    break
                finish = (msg.get("meta_info") or {}).get("finish_reason")
                if len(ids) > sent or finish:
                    if sent == 0 and ids:
                        first = ids[0]
                        self.owner.count("first_from_decode")
                    self._send(msg)
                    if sent == 0 and ids:
                        _stamp(p_body, t_in)
                    sent = max(sent, len(ids))
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):  # the client hung up
            pass

    def _send(self, msg: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
        self.wfile.flush()


def _stamp(p_body: dict, t_in: float) -> None:
    """The timeline's stamps of a request whose first token the client was just sent:
    `router_in` (its request reached the router) and `router_token` (Note [Timeline stamps];
    generation 0: the room is a fresh random id)."""
    if knobs.get("transfer_log"):
        room = int(p_body["bootstrap_room"])
        mark("router_in", "router", room, t=t_in)
        mark("router_token", "router", room)


def _drain(prefill: Upstream, body: dict) -> None:
    """Read prefill's answer to its end (prefill finishes the request only then). Its
    failure reaches the client through decode's answer (no KV, no tokens)."""
    try:
        prefill.fetch(body)
    except (http.client.HTTPException, OSError):
        pass


LISTENING = "listening on "  # the first line `main` prints; RouterProcess waits for it


class RouterProcess:
    """`python -m pdc.serving.sglang_router` as a child process: `url`, `stats` (its
    `/stats`), `stop()`. Its stderr goes to `log_path`."""

    def __init__(self, prefills: list[Prefill], decodes: list[str], log_path: str,
                 host: str = "127.0.0.1", python: str = sys.executable,
                 start_timeout_s: float = 60.0):
        argv = [python, "-m", "pdc.serving.sglang_router", "--host", host, "--port", "0"]
        for p in prefills:
            argv += ["--prefill", p.url, p.bootstrap_host, str(p.bootstrap_port)]
        for d in decodes:
            argv += ["--decode", d]
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log,
                                         stdin=subprocess.DEVNULL)
        self.url = self._wait_listening(start_timeout_s)

    def _wait_listening(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None  # a pipe, above
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline().decode(errors="replace").strip()
                if line.startswith(LISTENING):
                    return line[len(LISTENING):]
                if not line and self.proc.poll() is not None:
                    break
        self.stop()
        raise RuntimeError(f"pdc's SGLang router did not start (exit {self.proc.returncode}); "
                           f"its log: {self.log_path}")

    @property
    def stats(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.url + "/stats", timeout=5) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdc.serving.sglang_router",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", nargs=3, action="append", required=True,
                    metavar=("URL", "BOOTSTRAP_HOST", "BOOTSTRAP_PORT"),
                    help="a prefill server, and where decode reaches its bootstrap server")
    ap.add_argument("--decode", action="append", required=True, metavar="URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--token-host", default=None,
                    help="where prefill servers reach the router's token socket (default: "
                         "--host, none for a wildcard address)")
    args = ap.parse_args(argv)
    prefills = []
    for url, host, port in args.prefill:
        if not port.isdigit() or not 0 < int(port) < 65536:
            ap.error(f"--prefill {url} {host} {port}: the bootstrap port is not a port number")
        prefills.append(Prefill(url, host, int(port)))
    try:
        router = FirstTokenRouter(prefills, args.decode, args.host, args.port,
                                  token_host=args.token_host)
    except OSError as e:
        print(f"pdc sglang router: cannot listen on {args.host}:{args.port}: {e}",
              file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    router.start()
    print(LISTENING + router.url, flush=True)
    while not stop.wait(0.5):  # a timed wait: the signal's handler runs between them
        pass
    router.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
