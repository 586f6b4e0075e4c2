"""Control plane on addresses other than 127.0.0.1: distinct loopback hosts and IPv6.

Prefill and decode on different nodes need sockets bound where the peer can reach them and
an advertised address it can dial (Note [Bind and advertise]); 127.0.0.2 and 127.0.0.3 stand
in for two hosts (Linux routes all of 127.0.0.0/8 over lo).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from pdc.runtime import knobs
from pdc.runtime.control import BootstrapServer, ControlError, HostSettings, fetch_table
from pdc.runtime.hub import Hub


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _round_trip(server_hosts: HostSettings, client_hosts: HostSettings) -> tuple[str, str]:
    """Bootstrap on the server host, a hub there, a client hub dialing it; returns addresses."""
    got: list[bytes] = []
    done = threading.Event()

    def on_server(peer, payload):
        server.send(peer, b"pong:" + payload)

    def on_client(peer, payload):
        got.append(payload)
        done.set()

    boot = BootstrapServer(1, hosts=server_hosts)
    server = Hub(on_server, bind=True, hosts=server_hosts)
    client = Hub(on_client, bind=False, hosts=client_hosts)
    try:
        from pdc.runtime.control import bootstrap_call

        bootstrap_call(boot.address, {"op": "put", "dp": 0, "pp": 0, "tp": 0,
                                      "endpoint": server.address}, 5)
        table = fetch_table(boot.address, 5)
        client.connect("p0", table[(0, 0, 0)])
        deadline = time.monotonic() + 5
        while not done.is_set() and time.monotonic() < deadline:
            client.send("p0", b"ping")
            done.wait(0.2)
        assert got and got[0] == b"pong:ping"
        return boot.address, server.address
    finally:
        client.close()
        server.close()
        boot.close()


def test_distinct_loopback_hosts():
    boot_addr, hub_addr = _round_trip(HostSettings("127.0.0.2"), HostSettings("127.0.0.3"))
    assert boot_addr.startswith("tcp://127.0.0.2:") and hub_addr.startswith("tcp://127.0.0.2:")


def test_wildcard_bind_advertises_the_given_address():
    # A wildcard listens beyond loopback: it needs the control secret (Note [Auth default]).
    knobs.override(control_secret="a secret of sixteen bytes or more")
    try:
        boot_addr, hub_addr = _round_trip(HostSettings("0.0.0.0", "127.0.0.2"),
                                          HostSettings("127.0.0.3"))
    finally:
        knobs.reset("control_secret")
    assert boot_addr.startswith("tcp://127.0.0.2:") and hub_addr.startswith("tcp://127.0.0.2:")


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_ipv6_loopback():
    boot_addr, hub_addr = _round_trip(HostSettings("::1"), HostSettings("::1"))
    assert boot_addr.startswith("tcp://[::1]:") and hub_addr.startswith("tcp://[::1]:")


def test_knobs_choose_the_hosts():
    knobs.override(bind_host="127.0.0.2")
    try:
        assert HostSettings.from_knobs() == HostSettings("127.0.0.2", "")
        assert HostSettings.from_knobs().advertise == "127.0.0.2"
    finally:
        knobs.reset("bind_host")


@pytest.mark.parametrize("hosts,message", [
    (("node-a.invalid", ""), "bind_host 'node-a.invalid' is not an IP address; hint: give an "
                             "IPv4 or IPv6 literal (PDC_BIND_HOST), not a host name: a name may "
                             "resolve differently on the peer"),
    (("127.0.0.1", "10.0.0"), "advertise_host '10.0.0' is not an IP address (it resolves to "
                              "10.0.0.0 here); hint: give an IPv4 or IPv6 literal "
                              "(PDC_ADVERTISE_HOST), not a host name: a name may resolve "
                              "differently on the peer"),
    (("0.0.0.0", ""), "bind_host '0.0.0.0' is a wildcard, so peers need an address to dial; "
                      "hint: set advertise_host (PDC_ADVERTISE_HOST) to this node's IP"),
])
def test_bad_hosts_are_refused_with_a_hint(hosts, message):
    with pytest.raises(ControlError) as exc:
        HostSettings(*hosts)
    assert str(exc.value) == message
