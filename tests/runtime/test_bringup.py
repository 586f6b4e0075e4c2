"""Bring-up errors that name the cause (runtime/bringup.py): each message asserted exactly."""

from __future__ import annotations

import socket

import pytest
import zmq
from pdc.runtime import bringup, knobs
from pdc.runtime.control import BootstrapServer, ControlError, HostSettings, bootstrap_call
from pdc.runtime.hub import Hub


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


def test_a_loopback_decode_and_a_prefill_on_another_host():
    me = HostSettings("127.0.0.1")
    peers = {"prefill.dp0.pp0.tp0": "tcp://192.0.2.77:4000"}
    assert bringup.unreachable_pairing("decode rank dp0.pp0.tp0", me, peers,
                                       "tcp://192.0.2.77:5000") == (
        "decode rank dp0.pp0.tp0 advertises 127.0.0.1, a loopback address, and "
        "prefill.dp0.pp0.tp0 is on another host (192.0.2.77): it cannot send to this host's "
        "loopback; hint: set PDC_BIND_HOST (or PDC_ADVERTISE_HOST) of this process to its "
        "address on the network that 192.0.2.77 reaches")
    # a prefill that registered loopback in a table on another host
    assert bringup.unreachable_pairing(
        "decode rank dp0.pp0.tp0", HostSettings("0.0.0.0", "192.0.2.9"),
        {"prefill.dp0.pp0.tp0": "tcp://127.0.0.1:4000"}, "tcp://192.0.2.77:5000") == (
        "prefill.dp0.pp0.tp0 registered tcp://127.0.0.1:4000, a loopback address, in the "
        "bootstrap table of another host (192.0.2.77): decode rank dp0.pp0.tp0 cannot reach "
        "it; hint: set PDC_BIND_HOST (or PDC_ADVERTISE_HOST) of prefill.dp0.pp0.tp0 to its "
        "address on the network both hosts share")
    # one host: loopback on both sides, or a table on this host, is fine
    assert bringup.unreachable_pairing("d", me, {"p": "tcp://127.0.0.2:1"}, "tcp://127.0.0.1:2") \
        == ""
    assert bringup.unreachable_pairing("d", HostSettings("0.0.0.0", "192.0.2.9"),
                                       {"p": "tcp://127.0.0.1:1"}, "tcp://127.0.0.1:2") == ""


def _decode_against(table_endpoint: str):
    """A decode rank whose bootstrap table (on this host) names `table_endpoint`."""
    from pdc.runtime.endpoints import DecodeEndpoint
    from pdc.runtime.engines import make_engine
    from pdc.runtime.family import Family
    from pdc.runtime.plan_types import RankId
    from pdc.runtime.pools import Capacity, RankPools

    from ..compiler.planning import ROOT, plan_for

    layout, plan = plan_for(ROOT / "specs" / "llama3-70b.yaml", {"tp": 1}, {"tp": 1})
    boot = BootstrapServer(1)
    engine = make_engine("mooncake")
    bootstrap_call(boot.address, {"op": "put", "dp": 0, "pp": 0, "tp": 0,
                                  "endpoint": table_endpoint}, 5)
    pools = RankPools(layout, plan.registration("decode", RankId(0, 0)),
                      Capacity(pages=4, slots=1, aux_rows=1, window_pages=1))
    return boot, engine, lambda: DecodeEndpoint(layout, Family.load("llama3_70b"), plan,
                                                RankId(0, 0), 0, engine, pools, boot.address)


@pytest.mark.engines
def test_a_loopback_decode_is_refused_before_it_registers_with_a_remote_prefill():
    boot, engine, make = _decode_against("tcp://192.0.2.77:4000")
    try:
        with pytest.raises(ControlError) as e:
            make()
        assert str(e.value).startswith(
            "decode rank dp0.pp0.tp0 advertises 127.0.0.1, a loopback address, and "
            "prefill.dp0.pp0.tp0 is on another host (192.0.2.77)")
    finally:
        engine.close()
        boot.close()


@pytest.mark.engines
def test_a_silent_prefill_rank_is_named_with_its_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    boot, engine, make = _decode_against(f"tcp://127.0.0.1:{port}")
    try:
        ep = make()
        with pytest.raises(ControlError) as e:
            ep.wait_ready(0.5)
        ep.close()
        assert str(e.value) == (
            f"registration: prefill.dp0.pp0.tp0 at tcp://127.0.0.1:{port} did not answer within "
            "0.5 s; hint: 127.0.0.1 is a loopback address, reachable only from its own host: a "
            "peer on another host needs the server's own address (PDC_BIND_HOST / "
            "PDC_ADVERTISE_HOST on the server's side)")
    finally:
        engine.close()
        boot.close()


def test_a_peer_of_another_plan_or_pdc_version_is_refused_with_the_reason(pair, fam):
    """Registrations of a decode rank that lowered another plan, or that speaks another wire
    version (another pdc release), each answered with the reason."""
    from pdc.runtime import wire as W

    c = zmq.Context.instance().socket(zmq.DEALER)
    c.setsockopt(zmq.LINGER, 0)
    c.setsockopt(zmq.RCVTIMEO, 3000)
    c.connect(pair.pre.hub.address)
    try:
        reg = fam.wire.decode(pair.dec._reg_payload)
        fields = {f: getattr(reg, f) for f in reg.__dataclass_fields__}
        fields["plan_digest"] = b"\x11" * len(reg.plan_digest)
        c.send(fam.wire.encode(W.Register(**fields)))
        mine = pair.pre.digest.hex()[:12]
        assert fam.wire.decode(c.recv()).reason == (
            "plan digest differs: both sides must lower the same spec and topology (prefill "
            f"{mine}, decode {'11' * 6})")
        other = bytearray(pair.dec._reg_payload)
        other[4:6] = (W.WIRE_VERSION + 7).to_bytes(2, "little")
        c.send(bytes(other))
        assert fam.wire.decode(c.recv()).reason == (
            f"malformed message: header.version: peer speaks wire version {W.WIRE_VERSION + 7}, "
            f"this side speaks {W.WIRE_VERSION}: run the same pdc release on both sides")
    finally:
        c.close(0)
