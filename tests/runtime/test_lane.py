"""Note [Same-host lane] (runtime/lane.py): hubs on loopback talk over an abstract Unix-domain
socket when the knob says so; the server sees the DEALER's identity either way, one sender's
messages keep their order when a message too large for the lane moves the rest to ZeroMQ,
and a control key, an address other than loopback or a stranger at the listener keeps or
leaves ZeroMQ."""

from __future__ import annotations

import socket

import pytest
import zmq
from pdc.runtime import knobs, lane
from pdc.runtime.hub import Hub

from .failure_tools import wait_for


@pytest.fixture
def lanes():
    knobs.override(control_lane=1)
    yield
    knobs.reset()


def _pair(got_server: list, got_client: list) -> tuple[Hub, Hub]:
    server = Hub(lambda peer, p: got_server.append((peer, p)), bind=True)
    client = Hub(lambda peer, p: got_client.append((peer, p)), bind=False)
    client.connect("p0", server.address)
    return server, client


def test_loopback_hubs_talk_over_the_lane_as_the_same_peer(lanes):
    got_s: list = []
    got_c: list = []
    server, client = _pair(got_s, got_c)
    try:
        client.send("p0", b"register")
        wait_for(lambda: got_s, what="the server hearing the client")
        identity = got_s[0][0]
        assert identity == client._dealers["p0"].getsockopt(zmq.ROUTING_ID)
        assert set(server._lane_send) == {identity} and set(client._lane_send) == {"p0"}
        server.send(identity, b"status")
        wait_for(lambda: got_c, what="the client hearing the server")
        assert got_c == [("p0", b"status")]
        assert (client.dropped, server.dropped) == (0, 0)
    finally:
        client.close()
        server.close()


def test_a_message_too_large_for_the_lane_moves_the_rest_to_zeromq_in_order(lanes):
    got_s: list = []
    server, client = _pair(got_s, [])
    big = b"B" * (16 << 20)  # above any lane buffer the kernel grants
    try:
        sent = [b"%d" % i for i in range(200)] + [big] + [b"after %d" % i for i in range(200)]
        for m in sent:
            client.send("p0", m)
        wait_for(lambda: len(got_s) >= len(sent), timeout=30, what="every message")
        assert [p for _, p in got_s] == sent
        assert client._lane_send == {} and "p0" in client._lanes_out  # still read, not sent on
        assert len({peer for peer, _ in got_s}) == 1
    finally:
        client.close()
        server.close()


def test_no_lane_without_the_knob_or_with_a_control_key():
    knobs.override(control_lane=0)
    server = Hub(lambda peer, p: None, bind=True)
    client = Hub(lambda peer, p: None, bind=False)
    client.connect("p0", server.address)
    assert (server._listener, client._lanes_out) == (None, {})
    client.close()
    server.close()
    knobs.reset()
    knobs.override(control_lane=1, control_secret="correct horse battery staple 0123")
    try:
        server = Hub(lambda peer, p: None, bind=True)
        client = Hub(lambda peer, p: None, bind=False)
        client.connect("p0", server.address)
        assert (server._listener, client._lanes_out) == (None, {})
        client.close()
        server.close()
    finally:
        knobs.reset()


def test_lane_names_only_for_loopback_addresses():
    assert lane.lane_name("tcp://127.0.0.1:5555") == b"\0pdc-lane/tcp://127.0.0.1:5555"
    assert lane.lane_name("tcp://[::1]:5555") == b"\0pdc-lane/tcp://[::1]:5555"
    assert lane.lane_name("tcp://10.77.0.1:5555") is None
    assert lane.lane_name("ipc:///tmp/x") is None


def test_a_stranger_at_the_listener_is_closed_and_the_hub_goes_on(lanes):
    got_s: list = []
    server, client = _pair(got_s, [])
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        stranger.connect(lane.lane_name(server.address))
        stranger.send(b"GET / HTTP/1.1")
        stranger.settimeout(10)
        assert stranger.recv(16) == b""  # closed by the server
        client.send("p0", b"still served")
        wait_for(lambda: got_s, what="the client's message")
        assert got_s[0][1] == b"still served"
    finally:
        stranger.close()
        client.close()
        server.close()


def test_a_closed_server_closes_the_clients_lane(lanes):
    server, client = _pair([], [])
    try:
        client.send("p0", b"hello")
        wait_for(lambda: server._lane_send, what="the lane's hello")
        server.close()
        wait_for(lambda: not client._lanes_out, what="the client seeing the lane closed")
        client.send("p0", b"to ZeroMQ now")  # no lane: queued on the DEALER, not dropped
        assert client.dropped == 0
    finally:
        client.close()
