"""A PD router for SGLang servers of the pdc backend that streams the first token from prefill.

Note [SGLang first token from prefill] (integrations/sglang/first_token.py) is the server
side. Like SGLang's own router, this one sends a `/generate` request to a prefill and a
decode server at once, both with the same bootstrap host, port and room; a streaming request
also asks prefill for its first token (`sampling_params.custom_params.pdc_first_token`). The
client gets whichever first token comes first, normally prefill's, right after prefill's
forward, then decode's stream from its second token on. Decode's first token must equal the
one the client got (it is prefill's, moved in the metadata row); a difference ends the stream
with an error naming both. A request that does not stream gets decode's answer, as from
SGLang's router. Prefill's stream is read to its end in the background so that prefill
finishes the request normally. Counts: `stats` (first tokens from prefill, from decode,
mismatches, errors).

    router = FirstTokenRouter([Prefill(url, "127.0.0.1", bootstrap_port)], [decode_url])
    router.start(); ...; router.stop()
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FLAG = "pdc_first_token"  # integrations/sglang/first_token.py reads it


@dataclass(frozen=True)
class Prefill:
    url: str
    bootstrap_host: str  # where decode reaches prefill's bootstrap server
    bootstrap_port: int


class FirstTokenRouter:
    def __init__(self, prefills: list[Prefill], decodes: list[str], host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 600.0):
        if not prefills or not decodes:
            raise ValueError("a router needs at least one prefill and one decode server")
        self.prefills, self.decodes, self.timeout_s = list(prefills), list(decodes), timeout_s
        self.stats = {"first_from_prefill": 0, "first_from_decode": 0, "mismatches": 0,
                      "errors": 0}
        self._lock = threading.Lock()
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
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.readers.shutdown(wait=False, cancel_futures=True)
        for u in self.upstreams.values():
            u.close()

    def count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def bodies(self, body: dict) -> tuple[Upstream, dict, Upstream, dict]:
        """(prefill, prefill's body, decode, decode's body) of one request."""
        p, d = random.choice(self.prefills), random.choice(self.decodes)
        boot = {"bootstrap_host": p.bootstrap_host, "bootstrap_port": p.bootstrap_port,
                "bootstrap_room": random.getrandbits(63)}
        to_prefill = {**body, **boot}
        if body.get("stream"):
            params = dict(body.get("sampling_params") or {})
            params["custom_params"] = {**(params.get("custom_params") or {}), FLAG: True}
            to_prefill["sampling_params"] = params
        return self.upstreams[p.url], to_prefill, self.upstreams[d], {**body, **boot}


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
        ok = self.path in ("/health", "/v1/models")
        self._reply(200 if ok else 404, {"ok": ok})

    def do_POST(self) -> None:
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
            self._stream(*self.owner.bodies(body))
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

    def _stream(self, prefill: Upstream, p_body: dict, decode: Upstream, d_body: dict) -> None:
        events: queue.Queue = queue.Queue()
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
                if side == "prefill":
                    if sent == 0 and ids:  # later prefill messages repeat it, then finish
                        self._send({**msg, "output_ids": ids[:1]})
                        sent, first = 1, ids[0]
                        self.owner.count("first_from_prefill")
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
                    sent = max(sent, len(ids))
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):  # the client hung up
            pass

    def _send(self, msg: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
        self.wfile.flush()


def _drain(prefill: Upstream, body: dict) -> None:
    """Read prefill's answer to its end (prefill finishes the request only then). Its
    failure reaches the client through decode's answer (no KV, no tokens)."""
    try:
        prefill.fetch(body)
    except (http.client.HTTPException, OSError):
        pass
