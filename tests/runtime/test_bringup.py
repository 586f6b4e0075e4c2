"""Bring-up errors that name the cause (runtime/bringup.py): each message asserted exactly."""

from __future__ import annotations

import socket

import pytest
from pdc.runtime import bringup, knobs
from pdc.runtime.control import BootstrapServer, ControlError, HostSettings, Hub, bootstrap_call


@pytest.fixture(autouse=True)
def _clean_knobs():
    yield
    knobs.reset()


def test_a_bind_address_not_on_this_host():
    # 192.0.2.0/24 is TEST-NET-1: documentation only, on no interface of a test machine.
    # The address list depends on the machine, so it is checked against the function's own.
    knobs.override(control_auth="off")
    with pytest.raises(ControlError) as e:
        Hub(lambda *_: None, bind=True, hosts=HostSettings("192.0.2.77"))
    have = ", ".join(sorted(bringup.local_addresses()))
    assert str(e.value) == (
        f"bind_host 192.0.2.77 is not an address of this host (its addresses: {have}); hint: "
        "set PDC_BIND_HOST to one of them, or to 0.0.0.0 / :: with PDC_ADVERTISE_HOST set to "
        "the address the peers dial")
    assert "127.0.0.1" in have


def test_a_host_name_that_resolves_to_loopback(monkeypatch):
    # Debian maps the machine's own name to 127.0.1.1 in /etc/hosts.
    real = socket.getaddrinfo

    def fake(host, *a, **kw):
        if host == "node-a":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
        return real(host, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    with pytest.raises(ControlError) as e:
        HostSettings("node-a")
    assert str(e.value) == (
        "bind_host 'node-a' is a host name that resolves to 127.0.1.1 here, a loopback address "
        "no other host can reach; hint: give this host's IP on the network its peers share "
        "(PDC_BIND_HOST)")


def test_a_silent_loopback_server_says_it_is_loopback():
    with socket.socket() as s:  # a port nobody answers on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    knobs.override(bind_host="127.0.0.1")
    with pytest.raises(ControlError) as e:
        bootstrap_call(f"tcp://127.0.0.1:{port}", {"op": "get"}, 0.2999997)
    assert str(e.value) == (
        f"bootstrap server tcp://127.0.0.1:{port} did not answer within 0.3 s; hint: 127.0.0.1 "
        "is a loopback address, reachable only from its own host: a peer on another host needs "
        "the server's own address (PDC_BIND_HOST / PDC_ADVERTISE_HOST on the server's side)")


def test_a_silent_remote_server_names_what_to_check():
    assert bringup.silent("prefill.dp0.pp0.tp0 at tcp://10.77.0.9:4000", 29.999997124999936,
                          "10.77.0.2") == (
        "prefill.dp0.pp0.tp0 at tcp://10.77.0.9:4000 did not answer within 30 s; hint: check "
        "that the server runs, that this host can reach 10.77.0.9 (route, firewall), and that "
        "the port is the one it listens on")


def test_a_port_in_use_names_the_fix():
    first = BootstrapServer(1)
    port = int(first.address.rsplit(":", 1)[1])
    try:
        with pytest.raises(ControlError) as e:
            BootstrapServer(1, port=port)
        assert str(e.value) == (
            f"bootstrap server: cannot listen on 127.0.0.1:{port}: the port is in use (another "
            "process listens on it, e.g. an earlier server still running); hint: stop that "
            "process or choose another port")
    finally:
        first.close()


@pytest.mark.engines
def test_mooncake_refuses_ipv6_up_front():
    from pdc.runtime.engines import make_engine
    from pdc.runtime.engines.base import TransferError

    knobs.override(bind_host="::1")
    with pytest.raises(TransferError) as e:
        make_engine("mooncake")
    assert str(e.value) == (
        "mooncake: hostname '::1' is IPv6, and Mooncake (0.3.13) moves bytes over IPv4 only; "
        "hint: give this process an IPv4 address (PDC_BIND_HOST / PDC_ADVERTISE_HOST), or use "
        "the nixl engine for IPv6")


def test_ucx_device_follows_the_bind_host():
    from pdc.runtime.engines.base import TransferError
    from pdc.runtime.engines.nixl import net_device

    assert net_device() == "lo"
    addrs = bringup.local_addresses()
    other = next((a for a, dev in addrs.items() if dev != "lo" and "." in a), None)
    if other is not None:
        knobs.override(bind_host=other)
        assert net_device() == addrs[other]
    knobs.override(bind_host="0.0.0.0", advertise_host="192.0.2.77")
    with pytest.raises(TransferError) as e:
        net_device()
    assert str(e.value) == (
        "nixl: neither bind_host 0.0.0.0 nor advertise_host 192.0.2.77 is an address of this "
        "host, so UCX's interface cannot be derived; hint: set UCX_NET_DEVICES to the "
        "interface that reaches the peers (e.g. eth0), or PDC_BIND_HOST to this host's address")
