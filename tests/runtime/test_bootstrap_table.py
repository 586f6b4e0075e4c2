"""The bootstrap table a serving engine starts before it knows its ranks, on a fixed port."""

from __future__ import annotations

import socket

import pytest
from pdc.runtime.control import BootstrapServer, ControlError, bootstrap_call, fetch_table


def test_a_table_without_expected_learns_it_from_the_first_put():
    boot = BootstrapServer(None)
    try:
        assert bootstrap_call(boot.address, {"op": "get"}, 5) == {"ready": False, "table": {}}
        with pytest.raises(ControlError, match="put needs 'expected'"):
            bootstrap_call(boot.address, {"op": "put", "dp": 0, "pp": 0, "tp": 0,
                                          "endpoint": "tcp://127.0.0.1:1"}, 5)
        put = {"op": "put", "dp": 0, "pp": 0, "tp": 0, "endpoint": "tcp://127.0.0.1:1",
               "expected": 1}
        bootstrap_call(boot.address, put, 5)
        assert fetch_table(boot.address, 5) == {(0, 0, 0): "tcp://127.0.0.1:1"}
        with pytest.raises(ControlError, match="put says 2 prefill ranks, the table holds 1"):
            bootstrap_call(boot.address, dict(put, expected=2), 5)
    finally:
        boot.close()


def test_a_table_on_a_fixed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    boot = BootstrapServer(1, port=port)
    try:
        assert boot.address == f"tcp://127.0.0.1:{port}"
        with pytest.raises(ControlError) as e:
            BootstrapServer(1, port=port)
        assert str(e.value) == (
            f"bootstrap server: cannot listen on 127.0.0.1:{port}: the port is in use (another "
            "process listens on it, e.g. an earlier server still running); hint: stop that "
            "process or choose another port")
    finally:
        boot.close()
