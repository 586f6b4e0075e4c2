"""pdc's SGLang router (pdc/serving/sglang_router.py, Note [SGLang first token from prefill])
against stand-in servers that answer `/generate` as SGLang's do (a unit test: the real
servers' case is in test_sglang_servers.py), and the prefill hook's choice of requests
(integrations/sglang/first_token.py)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from pdc.integrations.sglang import first_token as FT
from pdc.runtime import knobs

from pdc.serving import sglang_harness as H
from pdc.serving.sglang_router import FirstTokenRouter, Prefill


class Fake:
    """A stand-in server: streams `chunks` (cumulative output_ids), `delay_s` before the
    first; records the bodies it got. `keep_alive`: HTTP/1.1, whole answers with a length,
    the connection left open (as SGLang's server does); `connections` counts them."""

    def __init__(self, chunks, delay_s=0.0, status=200, keep_alive=False, on_body=None):
        self.chunks, self.delay_s, self.status, self.bodies = chunks, delay_s, status, []
        self.on_body = on_body  # called with each body before the delay
        self.connections = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def setup(self):
                super().setup()
                fake.connections += 1

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.bodies.append(body)
                if fake.on_body is not None:
                    fake.on_body(body)
                time.sleep(fake.delay_s)
                if fake.status != 200:
                    self.send_response(fake.status)
                    self.send_header("content-length", "10")
                    self.end_headers()
                    self.wfile.write(b"overloaded")
                    return
                if keep_alive:
                    answer = b"".join(b"data: " + json.dumps(
                        {"output_ids": ids, "meta_info": {"finish_reason": None}}).encode()
                        + b"\n\n" for ids in fake.chunks) + b"data: [DONE]\n\n"
                    self.send_response(200)
                    self.send_header("content-length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                    return
                self.send_response(200)
                self.end_headers()
                if not body.get("stream"):
                    self.wfile.write(json.dumps({"output_ids": fake.chunks[-1]}).encode())
                    return
                for i, ids in enumerate(fake.chunks):
                    done = {"type": "length"} if i == len(fake.chunks) - 1 else None
                    msg = {"output_ids": ids, "meta_info": {"finish_reason": done}}
                    self.wfile.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pair(request):
    prefill_chunks, decode_chunks, decode_delay = request.param
    p, d = Fake(prefill_chunks), Fake(decode_chunks, delay_s=decode_delay)
    router = FirstTokenRouter([Prefill(p.url, "10.1.2.3", 8998)], [d.url]).start()
    yield router, p, d
    router.stop()
    p.close()
    d.close()


@pytest.mark.parametrize("pair", [([[7], [7]], [[7], [7, 8], [7, 8, 9]], 0.3)], indirect=True)
def test_the_client_gets_prefills_first_token_then_decodes_rest(pair):
    router, p, d = pair
    res = H.generate(router.url, [1, 2, 3], 3)
    assert (res.error, res.tokens) == ("", [7, 8, 9])
    assert res.ttft_s < 0.25  # prefill's token, before decode's first chunk (0.3 s)
    assert router.stats == {"first_from_prefill": 1, "first_direct": 0, "first_from_decode": 0,
                            "mismatches": 0, "errors": 0, "stray_datagrams": 0}
    (pb,), (db,) = p.bodies, d.bodies
    assert pb["sampling_params"]["custom_params"] == {
        "pdc_first_token": True, "pdc_first_token_to": router.token_address}
    assert router.token_address.startswith("127.0.0.1:")
    assert "custom_params" not in db["sampling_params"]
    boot = {k: pb[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
    assert boot == {k: db[k] for k in boot} and boot["bootstrap_host"] == "10.1.2.3"


@pytest.mark.parametrize("pair", [([[7], [7]], [[7], [7, 8]], 0.1)], indirect=True)
def test_with_the_transfer_log_on_the_router_and_the_hook_stamp_the_first_tokens_way(
        pair, caplog):
    # Note [Timeline stamps]: the router's request in and first token out, prefill's token out
    router, p, _ = pair
    knobs.override(transfer_log=1)
    try:
        with caplog.at_level("INFO", logger="pdc.transfer"):
            res = H.generate(router.url, [1, 2, 3], 2)
            streamed = []
            sched = SimpleNamespace(transfer_backend=SimpleNamespace(value="pdc"),
                                    output_streamer=SimpleNamespace(
                                        stream_output=lambda reqs, lp: streamed.append(reqs)))
            req = _req({"pdc_first_token": True})
            req.bootstrap_room = 77
            FT.before_send_kv_chunk(sched, req, True)
    finally:
        knobs.reset()
    assert (res.error, res.tokens) == ("", [7, 8]) and streamed == [[req]]
    marks = [json.loads(r.message) for r in caplog.records if '"kv_mark"' in r.message]
    room = p.bodies[0]["bootstrap_room"]
    assert [(m["mark"], m["side"], m["room"]) for m in marks] == [
        ("router_in", "router", room), ("router_token", "router", room),
        ("token_out", "prefill", 77)]
    assert marks[0]["t"] <= marks[1]["t"] <= marks[2]["t"]


@pytest.mark.parametrize("pair", [([[7], [7]], [[5], [5, 8]], 0.1)], indirect=True)
def test_a_decode_first_token_unlike_prefills_ends_the_stream_with_an_error(pair):
    router, _, _ = pair
    res = H.generate(router.url, [1, 2, 3], 2)
    assert res.error == "{'message': \"decode's first token 5 is not prefill's 7\"}"
    assert router.stats["mismatches"] == 1


@pytest.mark.parametrize("pair", [([[7]], [[7], [7, 8]], 0.0)], indirect=True)
def test_a_request_that_does_not_stream_gets_decodes_answer(pair):
    router, p, _ = pair
    import urllib.request

    req = urllib.request.Request(router.url + "/generate", json.dumps(
        {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read()) == {"output_ids": [7, 8]}
    time.sleep(0.2)
    assert "custom_params" not in p.bodies[0]["sampling_params"]


def test_a_failing_decode_is_the_clients_error():
    p, d = Fake([[7], [7]]), Fake([], delay_s=0.3, status=503)  # after prefill's token
    router = FirstTokenRouter([Prefill(p.url, "127.0.0.1", 1)], [d.url]).start()
    try:
        res = H.generate(router.url, [1], 2)
    finally:
        router.stop()
        p.close()
        d.close()
    assert res.tokens == [7]
    assert res.error == "{'message': 'decode answered HTTP 503: overloaded'}"
    assert router.stats["errors"] == 1


def test_the_router_reuses_its_connections_and_sends_again_after_an_idle_close():
    p = Fake([[7], [7]], keep_alive=True)
    d = Fake([[7], [7, 8]], keep_alive=True)
    router = FirstTokenRouter([Prefill(p.url, "127.0.0.1", 1)], [d.url]).start()
    try:
        results = [H.generate(router.url, [1], 2) for _ in range(3)]
        # prefill's answer may end after the client's: a request then found its connection
        # still busy and opened another. Wait until every connection is idle again.
        upstreams = [(router.upstreams[p.url], p), (router.upstreams[d.url], d)]
        deadline = time.monotonic() + 10
        while any(u.idle.qsize() < f.connections for u, f in upstreams):
            assert time.monotonic() < deadline, [(u.idle.qsize(), f.connections)
                                                 for u, f in upstreams]
            time.sleep(0.01)
        opened = (p.connections, d.connections)
        assert opened[0] <= 3 and opened[1] == 1  # reused: decode's ends the client's answer
        for u, _ in upstreams:  # the servers hang up on all the idle connections
            for conn in list(u.idle.queue):
                conn.sock.shutdown(2)
        results.append(H.generate(router.url, [1], 2))
    finally:
        router.stop()
        p.close()
        d.close()
    assert [(r.error, r.tokens) for r in results] == [("", [7, 8])] * 4
    # one new connection each after the hang-up, not a second stale one tried
    assert (p.connections, d.connections) == (opened[0] + 1, opened[1] + 1)
    assert (len(p.bodies), len(d.bodies)) == (4, 4)  # no request was sent twice


def test_after_a_hang_up_on_every_idle_connection_the_request_goes_on_a_new_one():
    from concurrent.futures import ThreadPoolExecutor

    from pdc.serving.sglang_router import Upstream

    server = Fake([[7]], delay_s=0.2, keep_alive=True)
    upstream = Upstream(server.url, timeout_s=10)
    try:
        with ThreadPoolExecutor(2) as pool:  # two at once: two connections, both left idle
            first = list(pool.map(upstream.fetch, [{"n": 1}, {"n": 2}]))
        assert (server.connections, upstream.idle.qsize()) == (2, 2)
        for conn in list(upstream.idle.queue):
            conn.sock.shutdown(2)
        again = upstream.fetch({"n": 3})
    finally:
        upstream.close()
        server.close()
    assert [status for status, _ in first + [again]] == [200, 200, 200]
    assert server.connections == 3 and [b["n"] for b in server.bodies][2:] == [3]


def _req(params, stream=True, logprob=False, out=(7,), finished=False):
    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=params), stream=stream,
                           return_logprob=logprob, output_ids=list(out), send_token_offset=0,
                           finished=lambda: finished)


def test_the_hook_streams_only_requests_that_asked_and_can():
    ask = {"pdc_first_token": True}
    assert FT.wants_first_token(_req(ask))
    assert not FT.wants_first_token(_req(None))
    assert not FT.wants_first_token(_req(ask, stream=False))
    assert not FT.wants_first_token(_req(ask, logprob=True))
    assert not FT.wants_first_token(_req(ask, out=()))  # an earlier chunk: no token yet
    assert not FT.wants_first_token(_req(ask, finished=True))
    streamed = []
    sched = SimpleNamespace(transfer_backend=SimpleNamespace(value="pdc"),
                            output_streamer=SimpleNamespace(
                                stream_output=lambda reqs, lp: streamed.append(reqs)))
    batch = SimpleNamespace(reqs=[_req(ask), _req(None)])
    assert FT.after_prefill_result(None, sched, batch, None) is None
    assert streamed == [[batch.reqs[0]]]
    sched.transfer_backend = SimpleNamespace(value="mooncake")
    FT.after_prefill_result(None, sched, batch, None)
    assert len(streamed) == 1  # another backend's prefill is left alone


def test_the_first_token_leaves_before_the_last_chunk_and_only_once():
    ask = {"pdc_first_token": True}
    streamed = []

    def stream_output(reqs, logprob):  # as SGLang's: the streamed tokens are the client's
        streamed.append(list(reqs))
        for r in reqs:
            r.send_token_offset = len(r.output_ids)

    sched = SimpleNamespace(transfer_backend=SimpleNamespace(value="pdc"),
                            output_streamer=SimpleNamespace(stream_output=stream_output))
    sent, pending = _req(ask), _req(ask)  # pending: decode had not asked (optimistic prefill)
    assert FT.before_send_kv_chunk(sched, sent, last_chunk=False) is None  # an earlier chunk
    assert streamed == []
    assert FT.before_send_kv_chunk(sched, sent, True) is None
    assert streamed == [[sent]]
    FT.after_prefill_result(None, sched, SimpleNamespace(reqs=[sent, pending]), None)
    assert streamed == [[sent], [pending]]
    sched.transfer_backend = SimpleNamespace(value="mooncake")
    FT.before_send_kv_chunk(sched, _req(ask), True)
    assert len(streamed) == 2  # another backend's prefill is left alone


def test_the_router_as_a_process_of_its_own_serves_and_counts(tmp_path):
    from pdc.serving.sglang_router import RouterProcess

    p, d = Fake([[7], [7]]), Fake([[7], [7, 8]], delay_s=0.1)
    log = str(tmp_path / "router.log")
    router = RouterProcess([Prefill(p.url, "10.1.2.3", 8998)], [d.url], log)
    try:
        res = H.generate(router.url, [1, 2, 3], 2)
        stats = router.stats
    finally:
        router.stop()
        p.close()
        d.close()
    assert (res.error, res.tokens) == ("", [7, 8])
    assert stats == {"first_from_prefill": 1, "first_direct": 0, "first_from_decode": 0,
                     "mismatches": 0, "errors": 0, "stray_datagrams": 0}
    assert p.bodies[0]["bootstrap_host"] == "10.1.2.3"
    assert router.proc.returncode == 0  # SIGTERM ends it cleanly


def test_the_router_process_names_a_bad_bootstrap_port(capsys):
    from pdc.serving.sglang_router import main

    with pytest.raises(SystemExit) as e:
        main(["--prefill", "http://127.0.0.1:1", "127.0.0.1", "x1", "--decode",
              "http://127.0.0.1:2"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m pdc.serving.sglang_router: error: --prefill http://127.0.0.1:1 127.0.0.1 "
        "x1: the bootstrap port is not a port number")


def _send_token(body, token, **extra):
    """What the prefill hook sends (Note [First token straight to the router])."""
    import socket

    host, port = body["sampling_params"]["custom_params"]["pdc_first_token_to"].rsplit(":", 1)
    msg = {"room": body["bootstrap_room"], "output_ids": [token], **extra}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(json.dumps(msg).encode(), (host, int(port)))


def test_a_first_token_sent_straight_to_the_router_reaches_the_client_before_any_stream():
    # Prefill's stream and decode's both wait 0.5 s; the datagram is the first token.
    p = Fake([[7], [7]], delay_s=0.5,
             on_body=lambda b: _send_token(b, 7, text="Hi", meta_info={"id": "r1"}, error="x"))
    d = Fake([[7], [7, 8]], delay_s=0.5)
    router = FirstTokenRouter([Prefill(p.url, "10.1.2.3", 8998)], [d.url]).start()
    try:
        res = H.generate(router.url, [1, 2, 3], 2)
        stats = dict(router.stats)
        waiting = dict(router.waiting)
    finally:
        router.stop()
        p.close()
        d.close()
    assert (res.error, res.tokens) == ("", [7, 8])
    assert res.ttft_s < 0.4
    assert stats["first_direct"] == 1 and stats["first_from_prefill"] == 0
    assert stats["mismatches"] == stats["errors"] == stats["stray_datagrams"] == 0
    assert waiting == {}  # the ended stream's room is no longer waited for


def test_stray_datagrams_are_counted_and_dropped_and_a_wrong_token_is_caught():
    import socket

    def stray_then_wrong(body):
        host, port = body["sampling_params"]["custom_params"]["pdc_first_token_to"].rsplit(
            ":", 1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for junk in (b"not json", b'{"room": "1", "output_ids": [7]}',
                         json.dumps({"room": body["bootstrap_room"], "output_ids": [1, 2]}).encode(),
                         json.dumps({"room": body["bootstrap_room"] ^ 1, "output_ids": [7]}).encode()):
                sock.sendto(junk, (host, int(port)))
        _send_token(body, 5)  # not the token decode will have

    p = Fake([[7], [7]], delay_s=0.5, on_body=stray_then_wrong)
    d = Fake([[7], [7, 8]], delay_s=0.3)
    router = FirstTokenRouter([Prefill(p.url, "10.1.2.3", 8998)], [d.url]).start()
    try:
        res = H.generate(router.url, [1, 2, 3], 2)
        stats = dict(router.stats)
    finally:
        router.stop()
        p.close()
        d.close()
    assert res.error == "{'message': \"decode's first token 7 is not prefill's 5\"}"
    assert (stats["stray_datagrams"], stats["first_direct"], stats["mismatches"]) == (4, 1, 1)


def test_a_router_on_a_wildcard_address_names_no_token_socket_unless_told_one():
    from pdc.serving.sglang_router import token_host_for

    assert [token_host_for(h, t) for h, t in (("0.0.0.0", None), ("::", None), ("", None),
                                              ("0.0.0.0", "10.0.0.5"), ("127.0.0.1", None))] \
        == [None, None, None, "10.0.0.5", "127.0.0.1"]
    p, d = Fake([[7], [7]]), Fake([[7], [7, 8]])
    router = FirstTokenRouter([Prefill(p.url, "10.1.2.3", 8998)], [d.url])
    try:
        router.token_address = None  # as on a wildcard address
        _, to_prefill, _, _ = router.bodies({"stream": True, "sampling_params": {}})
        assert to_prefill["sampling_params"]["custom_params"] == {"pdc_first_token": True}
    finally:
        router.start().stop()
        p.close()
        d.close()


class _Tokenizer:
    """Decodes token t as chr(ord('a') + t), SGLang-style keywords accepted."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        return "".join(chr(ord("a") + t) for t in ids)


def _direct_req(to, room=41):
    req = _req({"pdc_first_token": True, "pdc_first_token_to": to}, out=(3,))
    req.bootstrap_room, req.rid = room, "rid-1"
    req.origin_input_ids = req.origin_input_ids_unpadded = [0, 1, 2, 4, 5, 6, 7]
    req.sampling_params.skip_special_tokens = True
    return req


def test_the_hook_sends_the_first_token_straight_to_the_router_and_not_again():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(5)
        streamed = []
        sched = SimpleNamespace(transfer_backend=SimpleNamespace(value="pdc"),
                                tokenizer=_Tokenizer(),
                                output_streamer=SimpleNamespace(
                                    stream_output=lambda reqs, lp: streamed.append(reqs)))
        req = _direct_req(f"127.0.0.1:{sock.getsockname()[1]}")
        assert FT.before_send_kv_chunk(sched, req, True) is None
        got = json.loads(sock.recv(65536))
        FT.after_prefill_result(None, sched, SimpleNamespace(reqs=[req]), None)
    assert streamed == []  # sent once, straight: never through SGLang's streamer
    assert got == {"room": 41, "output_ids": [3], "text": "d",
                   "meta_info": {"id": "rid-1", "finish_reason": None, "prompt_tokens": 7,
                                 "completion_tokens": 1}}
    assert FT.first_text(None, req) is None  # a server without a tokenizer: ids only


def test_the_hook_streams_the_usual_way_with_the_knob_off_or_a_bad_address():
    streamed = []
    sched = SimpleNamespace(transfer_backend=SimpleNamespace(value="pdc"), tokenizer=None,
                            output_streamer=SimpleNamespace(
                                stream_output=lambda reqs, lp: streamed.append(reqs)))
    bad = _direct_req("no-port-here")
    FT.before_send_kv_chunk(sched, bad, True)
    assert streamed == [[bad]]
    knobs.override(sglang_first_token_direct=0)
    try:
        off = _direct_req("127.0.0.1:9")
        FT.before_send_kv_chunk(sched, off, True)
    finally:
        knobs.reset()
    assert streamed == [[bad], [off]]

    class Failing:
        def decode(self, ids, **kw):
            raise IndexError("token id out of range")

    sched.tokenizer = Failing()  # a tokenizer's failure never reaches SGLang's scheduler
    failed = _direct_req("127.0.0.1:9")
    FT.before_send_kv_chunk(sched, failed, True)
    assert streamed == [[bad], [off], [failed]]
