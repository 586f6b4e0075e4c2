"""The control hub's sends from the caller's thread (Note [Sends from the caller's thread] in
runtime/hub.py): a message leaves while the hub thread is busy, sends from many threads all
arrive authenticated and in each thread's order, a send after close() is counted, and
prefill's worker answers Success while prefill's hub thread is held."""

from __future__ import annotations

import threading

import pytest
from pdc.runtime import knobs
from pdc.runtime.endpoints import KVPoll
from pdc.runtime.hub import Hub

from .failure_tools import fill, send_all, values, wait_for

SECRET = "correct horse battery staple 0123"


@pytest.fixture(params=["secret", "no secret", "zeromq only"])
def secret(request):
    if request.param == "secret":
        knobs.override(control_secret=SECRET)
    if request.param == "zeromq only":  # without Note [Same-host lane], on by default
        knobs.override(control_lane=0)
    yield request.param
    knobs.reset()


def _handshake(client: Hub, server_got: list) -> None:
    """Until the client's session is set up (a message sent before it is queued, then sent):
    the server has heard the client."""
    client.send("p0", b"hello")
    wait_for(lambda: server_got, what="the server hearing the client")


def test_a_message_leaves_from_the_callers_thread_while_the_hub_thread_is_busy(secret):
    """Decode's request while its hub thread runs a timer, prefill's Success while its hub
    thread runs a handler: both reach the peer before either hub thread is free again."""
    release, release_server, busy = threading.Event(), threading.Event(), threading.Event()
    server_got: list[bytes] = []
    client_got: list[bytes] = []
    identity: list[bytes] = []
    blocked = {"client": False, "server": False}

    def server_handler(peer, payload):
        server_got.append(payload)
        identity.append(peer)
        if payload == b"block" and not blocked["server"]:
            blocked["server"] = True
            busy.set()
            release_server.wait(30)  # the prefill hub thread, stuck in a handler

    def client_tick():
        if blocked["client"]:
            busy.set()
            release.wait(30)  # the decode hub thread, stuck in a timer
            blocked["client"] = False

    server = Hub(server_handler, bind=True)
    client = Hub(lambda peer, p: client_got.append(p), bind=False, on_tick=client_tick)
    try:
        client.connect("p0", server.address)
        _handshake(client, server_got)
        client.send("p0", b"block")
        wait_for(busy.is_set, what="the server's hub thread in the handler")
        server.send(identity[-1], b"success from the worker")  # this thread: the worker
        wait_for(lambda: b"success from the worker" in client_got, what="the Success")
        assert blocked["server"] and not release_server.is_set()
        release_server.set()
        busy.clear()
        blocked["client"] = True
        wait_for(busy.is_set, what="the client's hub thread in its timer")
        client.send("p0", b"request from the caller")
        wait_for(lambda: b"request from the caller" in server_got, what="the request")
        assert blocked["client"] and not release.is_set()
    finally:
        release.set()
        release_server.set()
        client.close()
        server.close()
    assert (client.dropped, server.dropped, client.handler_errors, server.handler_errors) == \
        (0, 0, 0, 0)


def test_sends_from_many_threads_all_arrive_in_each_threads_order(secret):
    """Seal and send are one step under the hub's lock: with authentication the server takes
    a frame only if its sequence number is new, so any reordering would lose messages."""
    got: list[bytes] = []
    server = Hub(lambda peer, p: got.append(p), bind=True)
    client = Hub(lambda peer, p: None, bind=False)
    threads, per = 4, 300
    try:
        client.connect("p0", server.address)
        _handshake(client, got)
        got.clear()
        workers = [threading.Thread(target=lambda t=t: [client.send("p0", b"%d:%d" % (t, i))
                                                        for i in range(per)])
                   for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wait_for(lambda: len(got) >= threads * per, timeout=30, what="every message")
        assert len(got) == threads * per
        for t in range(threads):
            mine = [int(m.split(b":")[1]) for m in got if m.startswith(b"%d:" % t)]
            assert mine == list(range(per))
        assert (client.dropped, server.refused) == (0, 0)
    finally:
        client.close()
        server.close()


def test_a_send_after_close_is_dropped_and_counted():
    client = Hub(lambda peer, p: None, bind=False)
    client.connect("p0", "tcp://127.0.0.1:9")
    client.close()
    client.send("p0", b"late")
    client.connect("p1", "tcp://127.0.0.1:9")  # ignored: no socket opens after close
    client.send("p1", b"late")
    assert client.dropped == 2


def test_prefills_worker_sends_success_while_prefills_hub_thread_is_held(pair):
    """The worker seals and sends the Success itself: decode's request succeeds, every byte
    in place, while prefill's hub thread sits in its timer (with the outbox it waited there)."""
    knobs.override(peer_dead_after_s=60.0)  # the held hub thread sends no heartbeat meanwhile
    fill(pair.ppools, [1, 2], 1, 7)
    fill(pair.dpools, [1, 2], 1, 0)
    rv = pair.dec.receiver(5)
    rv.init([1, 2], 0, slot=1, aux_row=1)
    s = pair.pre.sender(5)
    wait_for(lambda: s.poll() == KVPoll.WaitingForInput, what="prefill holding the request")
    hub, tick = pair.pre.hub, pair.pre.hub.on_tick
    release, held = threading.Event(), threading.Event()
    hub.on_tick = lambda: (held.set(), release.wait(30))
    try:
        wait_for(held.is_set, what="prefill's hub thread in its timer")
        send_all(s, [1, 2], 1)
        wait_for(lambda: rv.poll() == KVPoll.Success, what="Success at decode")
        assert not release.is_set() and s.poll() == KVPoll.Success
        assert values(pair.dpools, [1, 2], 1) == {7}
    finally:
        release.set()
        hub.on_tick = tick
