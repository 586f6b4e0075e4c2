"""The authenticated control plane (Note [Control authentication] in runtime/auth.py): the
key and its default, the hub's challenge and sessions, the bootstrap table's nonces, and
what a peer without the secret gets: refused with an exact message, logged once."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq
from pdc.runtime import auth, knobs
from pdc.runtime.control import (
    BootstrapServer,
    ControlError,
    HostSettings,
    bootstrap_call,
    fetch_table,
)
from pdc.runtime.hub import Hub

SECRET = "correct horse battery staple 0123"


@pytest.fixture(autouse=True)
def _clean_knobs():
    yield
    knobs.reset()


def _with_secret(secret: str = SECRET) -> None:
    knobs.override(control_secret=secret)


# ~~~ the key ~~~


def test_no_secret_means_no_key_on_loopback_and_a_refusal_elsewhere():
    assert auth.control_key() is None
    assert auth.listening_key("127.0.0.1", "x") is None
    with pytest.raises(auth.AuthError) as e:
        auth.listening_key("10.1.2.3", "the bootstrap server")
    assert str(e.value) == (
        "the bootstrap server would listen on 10.1.2.3 without a control secret, so any host "
        "that reaches it could register, request, abort or read addresses; hint: write a "
        "secret of 16+ bytes to a file and set PDC_CONTROL_SECRET_FILE on every prefill and "
        "decode process (or PDC_CONTROL_AUTH=off on a network you trust)")
    knobs.override(control_auth="off")
    assert auth.listening_key("0.0.0.0", "x") is None


def test_secret_from_file_strips_whitespace_and_needs_16_bytes(tmp_path):
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    knobs.override(control_secret_file=str(f))
    from_file = auth.control_key()
    knobs.override(control_secret_file="", control_secret=SECRET)
    assert from_file == auth.control_key() and from_file is not None
    f.write_text("short\n")
    knobs.override(control_secret_file=str(f))
    with pytest.raises(auth.AuthError) as e:
        auth.control_key()
    assert str(e.value) == (
        f"control_secret_file {str(f)!r} holds 5 bytes; a control secret needs at least 16; "
        "hint: `head -c 32 /dev/urandom | base64 > FILE`")
    knobs.override(control_secret_file=str(tmp_path / "missing"))
    with pytest.raises(auth.AuthError) as e:
        auth.control_key()
    assert str(e.value) == (
        f"control_secret_file {str(tmp_path / 'missing')!r} cannot be read: No such file or "
        "directory; hint: PDC_CONTROL_SECRET_FILE names a file this process can read")


def test_control_auth_on_without_a_secret_is_refused():
    knobs.override(control_auth="on")
    with pytest.raises(auth.AuthError) as e:
        auth.control_key()
    assert str(e.value) == (
        "control_auth is on and no control secret is set; hint: write a secret to a file and "
        "set PDC_CONTROL_SECRET_FILE on every prefill and decode process")


def test_a_listening_socket_without_a_secret_on_a_non_loopback_host_does_not_start():
    # 0.0.0.0 binds locally, so the refusal is the policy, not a failed bind.
    with pytest.raises(ControlError) as e:
        BootstrapServer(1, hosts=HostSettings("0.0.0.0", "127.0.0.1"))
    assert str(e.value).startswith("the bootstrap server would listen on 0.0.0.0 without a "
                                   "control secret")


# ~~~ the protocol, frame by frame ~~~


def _handshake(key: bytes) -> tuple[auth.ClientSession, auth.ServerSessions]:
    client, server = auth.ClientSession(key), auth.ServerSessions(key, "tcp://s:1")
    payload, challenge = server.on_frame(b"id", client.hello(), "10.0.0.3")
    assert payload is None and challenge is not None
    assert client.on_challenge(challenge)
    return client, server


def test_data_round_trip_after_the_challenge():
    key = b"k" * 32
    client, server = _handshake(key)
    payload, answer = server.on_frame(b"id", client.seal(b"register"), "10.0.0.3")
    assert (payload, answer) == (b"register", None)
    reply = server.seal(b"id", b"status")
    assert reply is not None and client.open(reply) == b"status"


def test_replayed_reordered_and_forged_frames_are_refused():
    key = b"k" * 32
    client, server = _handshake(key)
    first = client.seal(b"one")
    assert server.on_frame(b"id", first, "10.0.0.3")[0] == b"one"
    assert server.on_frame(b"id", client.seal(b"two"), "10.0.0.3")[0] == b"two"
    # a replay of an earlier frame of the same session
    assert server.on_frame(b"id", first, "10.0.0.3")[0] is None
    # the same frame on another connection (another session key)
    assert server.on_frame(b"other", first, "10.0.0.4")[0] is None
    # one flipped bit of payload, MAC or sequence number
    good = bytearray(client.seal(b"three"))
    for i in (len(good) - 1, 20, 6):
        bad = bytearray(good)
        bad[i] ^= 1
        assert server.on_frame(b"id", bytes(bad), "10.0.0.3")[0] is None
    assert server.on_frame(b"id", bytes(good), "10.0.0.3")[0] == b"three"
    assert server.refused.count == 5
    # a replayed reply to the client
    reply = server.seal(b"id", b"status")
    assert client.open(reply) == b"status" and client.open(reply) is None


def test_a_client_without_the_key_cannot_finish_the_handshake():
    server = auth.ServerSessions(b"k" * 32, "tcp://s:1")
    wrong = auth.ClientSession(b"w" * 32)
    _, challenge = server.on_frame(b"id", wrong.hello(), "10.0.0.9")
    assert not wrong.on_challenge(challenge)  # the server's proof does not check out
    wrong.session = b"w" * 32  # pretend: any key the client makes up is refused
    payload, answer = server.on_frame(b"id", wrong.seal(b"register"), "10.0.0.9")
    assert payload is None
    assert auth.parse_refuse(answer) == (auth.NOT_AUTHENTICATED,
                                         auth.REFUSED_TEXT[auth.NOT_AUTHENTICATED])
    assert server.sessions == {}


def test_pending_challenges_and_sessions_are_capped():
    knobs.override(max_control_sessions=8)
    key = b"k" * 32
    server = auth.ServerSessions(key, "tcp://s:1")
    for i in range(50):
        server.on_frame(b"id%d" % i, auth.ClientSession(key).hello(), "10.0.0.3")
    assert len(server.pending) == 8
    for i in range(50):
        c = auth.ClientSession(key)
        _, ch = server.on_frame(b"s%d" % i, c.hello(), "10.0.0.3")
        c.on_challenge(ch)
        assert server.on_frame(b"s%d" % i, c.seal(b"x"), "10.0.0.3")[0] == b"x"
    assert len(server.sessions) == 8 and len(server.pending) <= 8


def test_refusals_are_logged_once_per_address(caplog):
    server = auth.ServerSessions(b"k" * 32, "tcp://10.0.0.2:5000")
    with caplog.at_level(logging.WARNING, logger="pdc.control"):
        for i in range(20):
            server.on_frame(b"id%d" % i, b"raw frame", "10.0.0.9")
        server.on_frame(b"x", b"raw frame", "10.0.0.8")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "pdc: tcp://10.0.0.2:5000 refused an unauthenticated control message from 10.0.0.9 "
        "(no control secret, or a different one); later ones from this address are counted, "
        "not logged",
        "pdc: tcp://10.0.0.2:5000 refused an unauthenticated control message from 10.0.0.8 "
        "(no control secret, or a different one); later ones from this address are counted, "
        "not logged"]
    assert server.refused.count == 21


# ~~~ real sockets ~~~


def _ping_pong(client: Hub, got: list, done: threading.Event, name: str = "p0",
               timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done.is_set() and time.monotonic() < deadline:
        client.send(name, b"ping")
        done.wait(0.2)


def test_hubs_with_the_same_secret_talk_and_a_raw_peer_is_refused_and_logged(caplog):
    _with_secret()
    got: list[bytes] = []
    done = threading.Event()
    server = Hub(lambda peer, p: server.send(peer, b"pong:" + p), bind=True)
    client = Hub(lambda peer, p: (got.append(p), done.set()), bind=False)
    try:
        client.connect("p0", server.address)
        _ping_pong(client, got, done)
        assert got and got[0] == b"pong:ping"
        # A peer with no secret: a plain DEALER sends a raw message and hears a REFUSE.
        with caplog.at_level(logging.WARNING, logger="pdc.control"):
            raw = zmq.Context.instance().socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.RCVTIMEO, 3000)
            raw.connect(server.address)
            for _ in range(3):
                raw.send(b"register me")
            answer = raw.recv()
            raw.close(0)
            deadline = time.monotonic() + 3
            while server.refused < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert auth.parse_refuse(answer) == (auth.NOT_AUTHENTICATED,
                                             auth.REFUSED_TEXT[auth.NOT_AUTHENTICATED])
        assert server.refused == 3
        logged = [r.getMessage() for r in caplog.records]
        assert logged == [f"pdc: {server.address} refused an unauthenticated control message "
                          "from 127.0.0.1 (no control secret, or a different one); later ones "
                          "from this address are counted, not logged"]
    finally:
        client.close()
        server.close()


def _refusal_of(server_secret: str | None, client_secret: str | None) -> str:
    """What a client hub's on_refused hears from a server hub, each with its own secret."""
    if server_secret:
        _with_secret(server_secret)
    server = Hub(lambda peer, p: server.send(peer, p), bind=True)
    knobs.reset()
    if client_secret:
        _with_secret(client_secret)
    heard: list[str] = []
    done = threading.Event()
    client = Hub(lambda peer, p: None, bind=False,
                 on_refused=lambda name, why: (heard.append(f"{name}: {why}"), done.set()))
    try:
        client.connect("p0", server.address)
        _ping_pong(client, [], done)
        assert heard, "no refusal heard"
        return heard[0].replace(server.address, "ADDR")
    finally:
        client.close()
        server.close()


def test_a_client_without_the_secret_hears_why():
    assert _refusal_of(SECRET, None) == (
        "p0: ADDR refused an unauthenticated control message (no control secret, or a "
        "different one); hint: give every prefill and decode process the same secret "
        "(PDC_CONTROL_SECRET_FILE)")


def test_a_client_with_another_secret_hears_why():
    assert _refusal_of(SECRET, SECRET[::-1]) == (
        "p0: ADDR answered the challenge without the same control secret; hint: give every "
        "prefill and decode process the same secret (PDC_CONTROL_SECRET_FILE)")


def test_a_client_with_a_secret_and_a_server_without_hears_why():
    assert _refusal_of(None, SECRET) == (
        "p0: ADDR runs without a control secret, and this process has one; hint: give both "
        "sides the same secret, or neither")


def test_bootstrap_table_needs_the_secret_to_put_or_get():
    _with_secret()
    boot = BootstrapServer(1)
    try:
        bootstrap_call(boot.address, {"op": "put", "dp": 0, "pp": 0, "tp": 0,
                                      "endpoint": "tcp://127.0.0.1:1"}, 5)
        assert fetch_table(boot.address, 5) == {(0, 0, 0): "tcp://127.0.0.1:1"}
        knobs.reset()
        with pytest.raises(ControlError) as e:
            bootstrap_call(boot.address, {"op": "get"}, 5)
        assert str(e.value) == (
            f"bootstrap server {boot.address}: unauthenticated request refused (no control "
            "secret, or a different one); hint: give every prefill and decode process the same "
            "secret (PDC_CONTROL_SECRET_FILE)")
        _with_secret(SECRET[::-1])
        with pytest.raises(ControlError) as e:
            bootstrap_call(boot.address, {"op": "get"}, 5)
        assert str(e.value) == (
            f"bootstrap server {boot.address}: unauthenticated request refused (no control "
            "secret, or a different one); hint: give every prefill and decode process the same "
            "secret (PDC_CONTROL_SECRET_FILE)")
        assert boot.refused == 2
    finally:
        boot.close()


def test_bootstrap_nonces_are_single_use():
    key = b"k" * 32
    nonces = auth.BootstrapNonces(key, "tcp://s:1")
    import json

    snonce = bytes.fromhex(json.loads(nonces.issue())["nonce"])
    frame, cnonce = auth.seal_boot_request(key, snonce, b'{"op": "get"}')
    assert nonces.open(frame) == (snonce, cnonce, b'{"op": "get"}')
    assert nonces.open(frame) is None  # replayed
    reply = nonces.seal_reply(snonce, cnonce, b"{}")
    assert auth.open_boot_reply(key, snonce, cnonce, reply) == b"{}"
    assert auth.open_boot_reply(b"w" * 32, snonce, cnonce, reply) is None


def test_a_client_with_a_secret_and_a_bootstrap_server_without():
    boot = BootstrapServer(1)
    try:
        _with_secret()
        with pytest.raises(ControlError) as e:
            bootstrap_call(boot.address, {"op": "get"}, 5)
        assert str(e.value) == (
            f"bootstrap server {boot.address}: this bootstrap server runs without a control "
            "secret, and the client has one; hint: give both sides the same secret, or neither")
    finally:
        boot.close()


# ~~~ the fuzzer over authenticated frames (bench/fuzz_wire.py is the long run) ~~~


def test_fuzzed_authenticated_frames_are_accepted_only_when_intact_and_fresh():
    from .test_wire import FAMILIES, fuzz

    res = fuzz.run_auth_fuzz(20_000, seed=20261203, families=list(FAMILIES.values()))
    assert res.ok, "\n".join(res.failures)
    assert res.accepted_forgeries == res.lost_intact == res.other_exceptions == 0
    assert res.accepted_intact > 1000 and res.refused > 10_000
    assert res.accepted_intact + res.refused == res.iterations
    assert set(res.by_mutation) == {"intact", *fuzz.AUTH_MUTATIONS}
