"""Hosts on one machine: Linux network namespaces joined by a bridge, for `pdc demo --hosts
netns` and the multi-host tests.

Note [Namespace hosts]: each host is a network namespace with one interface (`pdc0`, one end of
a veth pair) and one private address (10.77.0.N/24, or fd00:77::N/64) that exists only inside
it. The other ends hang on a bridge in a namespace of its own (the switch), so the machine's
own namespace gets no interface, no address and no route. A process enters its host with
`enter()` before it opens any socket or starts any thread (setns(2) moves the calling thread;
threads started later inherit it): its loopback is then the namespace's own, so no loopback
shortcut between two hosts exists, and the bytes provably cross the veth pairs (their
counters, `counters()`). Needs root (CAP_SYS_ADMIN) and iproute2's `ip`.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC, MS_SLAVE = 0x4000, 1 << 19
MNT_DETACH = 2
DEVICE = "pdc0"


class NetnsError(RuntimeError):
    """Namespaces cannot be made or entered here; the message says why and what to do."""


def unavailable() -> str:
    """Why namespace hosts cannot be made on this machine ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN); run as root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is missing; install it (apt-get install iproute2)"
    return ""


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str  # its private address, without the prefix length
    device: str = DEVICE


def _ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r.stdout


class Hosts:
    """`count` namespace hosts on one bridge; a context manager that removes them all."""

    def __init__(self, count: int, ipv6: bool = False, tag: str = ""):
        why = unavailable()
        if why:
            raise NetnsError(why)
        self.tag = tag or f"pdc{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self._made: list[str] = []
        try:
            self._make(count, ipv6)
        except BaseException:
            self.close()
            raise

    def _make(self, count: int, ipv6: bool) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(count):
            ns = f"{self.tag}-h{i}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            port = f"h{i}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", DEVICE,
                "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            addr = f"fd00:77::{i + 1}" if ipv6 else f"10.77.0.{i + 1}"
            cidr = f"{addr}/64" if ipv6 else f"{addr}/24"
            extra = ["nodad"] if ipv6 else []  # usable at once, not after duplicate detection
            _ip("-n", ns, "addr", "add", cidr, "dev", DEVICE, *extra)
            _ip("-n", ns, "link", "set", DEVICE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts.append(Host(ns, addr))

    def counters(self) -> dict[str, tuple[int, int]]:
        """(tx bytes, rx bytes) of each host's interface, by namespace."""
        out = {}
        for h in self.hosts:
            link = json.loads(_ip("-n", h.namespace, "-j", "-s", "link", "show", h.device))[0]
            stats = link.get("stats64", link.get("stats", {}))
            out[h.namespace] = (int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
        return out

    def close(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def enter(namespace: str) -> None:
    """Move the calling thread (and the threads it starts later) into `namespace`. Call it
    first thing in a fresh process (Note [Namespace hosts]).

    Like `ip netns exec`, it also gives the process a mount namespace of its own with /sys
    mounted again: /sys/class/net lists the devices of the network namespace that mounted
    sysfs, and UCX picks its interfaces from there (without this it sees only the machine's
    devices and refuses UCX_NET_DEVICES=pdc0 as "not available")."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise NetnsError(f"{what} for {namespace} failed: {os.strerror(ctypes.get_errno())}")

    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # Private propagation first, so the new /sys stays inside this process.
    check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    libc.umount2(b"/sys", MNT_DETACH)  # may not be mounted at all
    check(libc.mount(namespace.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


def _start_zmq_at_home() -> None:
    """Note [ZMQ threads and namespaces]: a ZMQ context connects from its I/O thread, which
    the context starts with its first socket and which keeps the namespace of the thread that
    started it. Were the process's shared context (zmq.Context.instance(), what the Hubs use)
    first used inside `inside()`, every later connect of the process would leave from that
    namespace, long gone by then. So the shared context starts here, at home, first; a call
    that must connect from inside the namespace makes a context of its own there
    (runtime/control.py's bootstrap_call does)."""
    try:
        import zmq
    except ImportError:  # no ZMQ in this process: nothing to pin
        return
    zmq.Context.instance().socket(zmq.PAIR).close(0)


@contextmanager
def inside(namespace: str) -> Iterator[None]:
    """The calling thread's sockets (and those of threads it starts meanwhile) live in
    `namespace` until the block ends; then it returns to the namespace it came from. For a
    client that talks to servers on namespace hosts from a test or demo process, which has no
    interface on the hosts' bridge (Note [Namespace hosts]). Network namespace only: paths
    and /sys stay the process's own."""
    _start_zmq_at_home()
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    try:
        fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise NetnsError(f"setns for {namespace} failed: "
                                 f"{os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
        try:
            yield
        finally:
            libc.setns(home, CLONE_NEWNET)
    finally:
        os.close(home)
