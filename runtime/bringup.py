"""Bring-up diagnostics: what a failure to reach a peer or to listen most likely means, said
with the address, the side and the fix (docs/deploy.md)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a wildcard or a name


def host_of(address: str) -> str:
    """The host of 'tcp://HOST:PORT' (IPv6 brackets removed)."""
    rest = address.rsplit("tcp://", 1)[-1]
    return rest.rsplit(":", 1)[0].strip("[]")


def silent(what: str, timeout_s: float, advertise: str) -> str:
    """'<what> did not answer within N s', with the hint that fits its address; `what` ends
    with the peer's tcp:// address, `advertise` is this process's own."""
    msg = f"{what} did not answer within {timeout_s:.3g} s"
    host = host_of(what)
    if is_loopback(host):
        return (msg + f"; hint: {host} is a loopback address, reachable only from its own "
                "host: a peer on another host needs the server's own address (PDC_BIND_HOST / "
                "PDC_ADVERTISE_HOST on the server's side)" + (
                    "" if is_loopback(advertise) else f"; this process advertises {advertise}"))
    return msg + ("; hint: check that the server runs, that this host can reach "
                  f"{host} (route, firewall), and that the port is the one it listens on")


def local_addresses() -> dict[str, str]:
    """Every address of this host's interfaces (this network namespace's), address ->
    interface name: IPv4 through SIOCGIFADDR (the primary address of each interface), IPv6
    from /proc/net/if_inet6."""
    import fcntl
    import socket
    import struct

    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            out[socket.inet_ntoa(got[20:24])] = name
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    addr = ipaddress.IPv6Address(bytes.fromhex(parts[0]))
                    out[str(addr)] = parts[5]
    except OSError:
        pass
    return out


def interface_of(host: str) -> str | None:
    """The interface that holds `host` on this host, None when none does."""
    try:
        want = ipaddress.ip_address(host)
    except ValueError:
        return None
    for addr, name in local_addresses().items():
        if ipaddress.ip_address(addr) == want:
            return name
    return None


def not_local(host: str, knob: str) -> str:
    """The message for a bind host that is no address of this host."""
    have = ", ".join(sorted(local_addresses())) or "none"
    return (f"{knob} {host} is not an address of this host (its addresses: {have}); hint: set "
            f"PDC_{knob.upper()} to one of them, or to 0.0.0.0 / :: with PDC_ADVERTISE_HOST "
            "set to the address the peers dial")


def not_an_address(knob: str, host: str) -> str:
    """The message for a host knob given a name instead of an IP literal; a name that resolves
    to loopback (many distributions map the machine's own name to 127.0.1.1) says so."""
    import socket

    try:
        resolved = sorted({str(a[4][0]) for a in socket.getaddrinfo(
            host, None, proto=socket.IPPROTO_TCP)})
    except (OSError, UnicodeError):
        resolved = []
    env = f"PDC_{knob.upper()}"
    if resolved and all(is_loopback(a) for a in resolved):
        return (f"{knob} {host!r} is a host name that resolves to {', '.join(resolved)} here, a "
                "loopback address no other host can reach; hint: give this host's IP on the "
                f"network its peers share ({env})")
    seen = f" (it resolves to {', '.join(resolved)} here)" if resolved else ""
    return (f"{knob} {host!r} is not an IP address{seen}; hint: give an IPv4 or IPv6 literal "
            f"({env}), not a host name: a name may resolve differently on the peer")


def unreachable_pairing(me: str, hosts, peers: dict[str, str], bootstrap: str) -> str:
    """Why `me` (advertising hosts.advertise) and a peer of `peers` (name -> tcp:// address,
    from the bootstrap table at `bootstrap`) cannot reach each other, or "": a loopback
    address on one side and another host's address on the other. Caught at registration,
    before any transfer fails as 'peer unreachable'."""
    mine = hosts.advertise
    local = set(local_addresses())
    remote_table = not is_loopback(host_of(bootstrap)) and host_of(bootstrap) not in local
    for name, address in sorted(peers.items()):
        host = host_of(address)
        if is_loopback(mine) and not is_loopback(host) and host not in local:
            return (f"{me} advertises {mine}, a loopback address, and {name} is on another host "
                    f"({host}): it cannot send to this host's loopback; hint: set PDC_BIND_HOST "
                    "(or PDC_ADVERTISE_HOST) of this process to its address on the network "
                    f"that {host} reaches")
        if is_loopback(host) and not is_loopback(mine) and remote_table:
            return (f"{name} registered {address}, a loopback address, in the bootstrap table "
                    f"of another host ({host_of(bootstrap)}): {me} cannot reach it; hint: set "
                    f"PDC_BIND_HOST (or PDC_ADVERTISE_HOST) of {name} to its address on the "
                    "network both hosts share")
    return ""
