"""Note [Many engines] (integrations/vllm/links.py), unit level: a decode worker's endpoints
by prefill engine, opened at first use, closed when idle or when their prefill went silent,
never while a request uses them; the engine registers the cache once however many endpoints
register it; the settings that number the decode engines. Stand-in endpoints and engine here;
tests/vllm/test_vllm_many_engines.py runs two prefill and two decode vLLM engines."""

from __future__ import annotations

import threading

import pytest
from pdc.integrations.vllm.links import DecodeLinks, SharedRegistrations
from pdc.integrations.vllm.settings import SettingsError, parse_settings


class Endpoint:
    def __init__(self, bootstrap: str):
        self.bootstrap = bootstrap
        self.lock = threading.Lock()
        self.liveness = type("Liveness", (), {"dead": set()})()
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def links():
    opened = []

    def open_endpoint(bootstrap: str, prefill_tp: int):
        if bootstrap == "tcp://gone":
            raise ConnectionError("bootstrap did not answer")
        opened.append((bootstrap, prefill_tp))
        return Endpoint(bootstrap)

    clock = Clock()
    lk = DecodeLinks(open_endpoint, idle_s=60.0, clock=clock)
    lk.opened, lk.clock = opened, clock
    return lk


def test_one_endpoint_per_prefill_engine_opened_at_first_use(links):
    a = links.get("tcp://a", 1)
    b = links.get("tcp://b", 2)
    assert links.get("tcp://a", 1) is a and a is not b
    assert links.opened == [("tcp://a", 1), ("tcp://b", 2)]


def test_an_endpoint_that_cannot_open_is_not_kept(links):
    with pytest.raises(ConnectionError):
        links.get("tcp://gone", 1)
    assert links.endpoints == {}


def test_idle_endpoints_close_busy_ones_stay(links):
    a, b = links.get("tcp://a", 1), links.get("tcp://b", 1)
    links.clock.now += 59
    links.sweep(set())
    assert not a.closed and not b.closed
    links.clock.now += 2
    links.sweep({"tcp://a"})  # a request still loads from a: it stays, its idle time restarts
    assert not a.closed and b.closed
    assert links.closed == [("tcp://b", "no request for 60 s")]
    assert links.get("tcp://b", 1) is not b  # the next request opens a new one
    links.clock.now += 61
    links.sweep(set())
    assert a.closed


def test_a_silent_prefill_engines_endpoint_closes_once_no_request_uses_it(links):
    a = links.get("tcp://a", 1)
    a.liveness.dead.add("prefill.dp0.pp0.tp0")
    links.sweep({"tcp://a"})
    assert not a.closed  # its requests fail by themselves (peer_dead_after_s) first
    links.sweep(set())
    assert a.closed and links.closed == [("tcp://a", "its prefill engine went silent")]


def test_the_cache_is_registered_once_for_every_endpoint():
    calls = []

    class Engine:
        name = "mooncake"

        def register(self, addr, nbytes):
            calls.append(("register", addr, nbytes))

        def deregister(self, addr):
            calls.append(("deregister", addr))

    shared = SharedRegistrations(Engine())
    for _ in range(3):
        shared.register(0x1000, 4096)
        shared.register(0x9000, 512)  # an arena of one endpoint
        shared.deregister(0x9000)
    assert shared.name == "mooncake"
    assert calls == [("register", 0x1000, 4096)] + [("register", 0x9000, 512),
                                                    ("deregister", 0x9000)] * 3


def test_decode_engines_are_numbered_below_their_count():
    s = parse_settings("kv_consumer", {"family": "vllm-llama", "decode_engines": 2,
                                       "decode_index": 1})
    assert (s.decode_engines, s.decode_index) == (2, 1)
    with pytest.raises(SettingsError) as e:
        parse_settings("kv_consumer", {"family": "vllm-llama", "decode_engines": 2,
                                       "decode_index": 2})
    assert str(e.value) == (
        "kv_connector_extra_config['decode_index']: 2 is not below decode_engines 2\n  hint: "
        "number the decode engines 0 to decode_engines - 1 and give every engine, prefill "
        "too, the same decode_engines")
    with pytest.raises(SettingsError) as e:
        parse_settings("kv_producer", {"family": "vllm-llama", "decode_engines": 0})
    assert str(e.value) == "kv_connector_extra_config['decode_engines']: 0 is not an int >= 1"
