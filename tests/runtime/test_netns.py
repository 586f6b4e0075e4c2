"""Hosts for real on one machine (Note [Namespace hosts], pdc/netns.py): prefill and decode
ranks in different network namespaces joined by a bridge, private addresses that exist only
there, the control plane authenticated, every byte verified by `pdc demo --hosts netns`."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from pdc.demo import run_demo
from pdc.netns import unavailable

from ..compiler.planning import ROOT

pytestmark = [pytest.mark.engines,
              pytest.mark.skipif(bool(unavailable()), reason=f"namespace hosts: {unavailable()}")]

LLAMA = str(ROOT / "specs" / "llama3-70b.yaml")


def _demo(engine: str, prefill: str, decode: str, requests: int = 6, hosts: str = "netns"
          ) -> tuple[int, dict, str]:
    summary: dict = {}
    out = io.StringIO()
    code = run_demo(LLAMA, prefill, decode, engine, requests, concurrency=3, out=out,
                    summary=summary, hosts=hosts, timeout_s=30)
    return code, summary, out.getvalue()


@pytest.mark.parametrize("engine,prefill,decode", [
    ("mooncake", "tp=2", "tp=1"),
    ("nixl", "tp=1,dp=2", "tp=1,dp=2"),
])
def test_demo_moves_every_byte_across_namespace_hosts(engine, prefill, decode):
    code, summary, text = _demo(engine, prefill, decode)
    assert code == 0, text + str(summary.get("errors"))
    assert summary["ok"] == 6 and summary["failed"] == 0
    assert summary["control_auth"] is True
    hosts = summary["hosts"]
    assert [h["ranks"] for h in hosts] == (
        ["prefill dp0", "decode dp0"] if "dp" not in prefill else
        ["prefill dp0", "prefill dp1", "decode dp0", "decode dp1"])
    assert all(h["address"].startswith("10.77.0.") for h in hosts)
    # The verified bytes crossed the veth pairs: prefill hosts sent them, decode hosts got them.
    sent = sum(h["sent_bytes"] for h in hosts if h["ranks"].startswith("prefill"))
    got = sum(h["received_bytes"] for h in hosts if h["ranks"].startswith("decode"))
    assert sent >= summary["bytes"] and got >= summary["bytes"]
    want = "tcp on 10.77.0." if engine == "mooncake" else "ucx(tls=tcp) on pdc0"
    assert all(want in t for t in summary["transports"]), summary["transports"]


def test_nixl_pinned_to_loopback_across_hosts_names_the_fix(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # by hand: not one pdc derived earlier
    monkeypatch.delenv("PDC_UCX_NET_DEVICES_DERIVED", raising=False)
    code, summary, _ = _demo("nixl", "tp=1", "tp=1", requests=1)
    assert code == 1
    why = summary["errors"][0]["message"]
    assert (
        "registration rejected by prefill.dp0.pp0.tp0: cannot connect the transfer engine: "
        "nixl: add_remote_agent: nixlBackendError('NIXL_ERR_BACKEND'); UCX cannot reach the "
        "peer's addresses from UCX_NET_DEVICES=lo (loopback: it reaches no other host); hint: "
        "set UCX_NET_DEVICES to the interface that reaches the peer's host, or unset it so pdc "
        "derives it from PDC_BIND_HOST (Note [UCX device], docs/deploy.md)") in why, why


def test_nixl_over_ipv6_namespace_hosts():
    code, summary, text = _demo("nixl", "tp=1", "tp=1", requests=3, hosts="netns6")
    assert code == 0, text + str(summary.get("errors"))
    assert summary["ok"] == 3
    assert [h["address"] for h in summary["hosts"]] == ["fd00:77::1", "fd00:77::2"]
    assert summary["hosts"][1]["received_bytes"] >= summary["bytes"]


def test_mooncake_on_ipv6_hosts_is_refused_up_front():
    code, summary, _ = _demo("mooncake", "tp=1", "tp=1", requests=1, hosts="netns6")
    assert code == 1
    # Both ranks refuse at start; whichever the demo heard of first is the first error.
    why = summary["errors"][0]["message"]
    assert re.match(
        r"(prefill|decode)-dp0-pp0-tp0 crashed: TransferError\(\"mooncake: hostname "
        r"'fd00:77::\d+' is IPv6, and Mooncake \(0\.3\.13\) moves bytes over IPv4 only; "
        r"hint: give this process an IPv4 address \(PDC_BIND_HOST / PDC_ADVERTISE_HOST\), "
        r"or use the nixl engine for IPv6\"\)", why), why


# Note [ZMQ threads and namespaces]: the process's first ZMQ call happens inside a namespace
# host, as in tests/integrations/test_sglang_netns.py; a fresh process, so nothing before it
# has started the shared context.
_FIRST_ZMQ_INSIDE = """
import sys, threading
from pdc.netns import Hosts, inside
from pdc.runtime import knobs
from pdc.runtime.control import BootstrapServer, HostSettings, bootstrap_call, fetch_table
from pdc.runtime.hub import Hub
knobs.override(control_secret="s" * 32)
with Hosts(1, tag=sys.argv[1]) as hosts:
    host = hosts.hosts[0]
    with inside(host.namespace):
        table = BootstrapServer(1, hosts=HostSettings(host.address))
        bootstrap_call(table.address, {"op": "put", "dp": 0, "pp": 0, "tp": 0,
                                       "endpoint": "tcp://x:1"}, 5)
        print("inside:", fetch_table(table.address, 5))
knobs.reset()
got, done = [], threading.Event()
server = Hub(lambda peer, p: server.send(peer, b"pong:" + p), bind=True)
client = Hub(lambda peer, p: (got.append(p), done.set()), bind=False)
client.connect("p0", server.address)
for _ in range(25):
    client.send("p0", b"ping")
    if done.wait(0.2):
        break
print("home:", got[:1])
"""


def test_a_first_zmq_call_inside_a_namespace_leaves_later_connects_at_home():
    r = subprocess.run([sys.executable, "-c", _FIRST_ZMQ_INSIDE, f"pdczq{os.getpid() % 10000}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["inside: {(0, 0, 0): 'tcp://x:1'}", "home: [b'pong:ping']"]
