"""SharedRegistrations (runtime/engines/base.py): endpoints of one server that register the
same regions share one engine registration, dropped when the last of them lets go."""

from __future__ import annotations

from pdc.runtime.engines.base import SharedRegistrations


class Engine:
    name = "mooncake"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def register(self, addr, nbytes):
        self.calls.append(("register", addr, nbytes))

    def deregister(self, addr):
        self.calls.append(("deregister", addr))


def test_a_region_stays_registered_until_its_last_endpoint_lets_go():
    engine = Engine()
    shared = SharedRegistrations(engine)
    shared.register(0x1000, 4096)  # the KV pool, by the first prefill server's endpoint
    shared.register(0x1000, 4096)  # and by the second's
    shared.deregister(0x1000)  # the first endpoint closes
    assert engine.calls == [("register", 0x1000, 4096)]
    shared.deregister(0x1000)
    assert engine.calls == [("register", 0x1000, 4096), ("deregister", 0x1000)]
    shared.register(0x1000, 4096)  # a later endpoint registers it anew
    assert engine.calls[-1] == ("register", 0x1000, 4096)
    assert shared.name == "mooncake"


def test_an_unknown_range_reaches_the_engine():
    engine = Engine()
    SharedRegistrations(engine).deregister(0x9000)
    assert engine.calls == [("deregister", 0x9000)]
