"""The SGLang harness without SGLang: while a server does not answer, its wait reports every
`every_s` which ones it waits for, and past the deadline it fails naming them and their log;
one that answers is ready once its log says SGLang's own warm-up ended; the cores each kind of
server computes on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdc.serving.sglang_harness import HarnessError, Server, free_port, server_cores, wait_ready


def test_waiting_for_a_silent_server_reports_progress_then_fails_naming_it(tmp_path):
    log = tmp_path / "decode.log"
    log.write_text("loading the model\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    server = Server("decode", f"http://127.0.0.1:{free_port()}", proc, str(log))
    said: list[str] = []
    try:
        with pytest.raises(HarnessError) as e:
            wait_ready([server], timeout_s=2.0, progress=said.append, every_s=0.5)
    finally:
        server.stop()
    assert str(e.value) == f"decode not ready within 2 s; {log}:\nloading the model"
    assert said and said[0].startswith(
        "waiting for decode to answer /model_info and finish its warm-up (")
    assert said[0].endswith(" s of at most 2 s)")


def test_a_server_that_answers_is_ready_only_once_its_log_says_its_warm_up_ended(tmp_path):
    """SGLang answers /model_info before its own warm-up request and gc freeze are done; a
    request then met the freeze (Note [Warm servers])."""
    import threading

    from pdc.serving.sglang_harness import WARMED

    (tmp_path / "model_info").write_text("{}")
    log = tmp_path / "plain.log"
    log.write_text("Uvicorn running\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server("plain", f"http://127.0.0.1:{port}", proc, str(log))
    try:
        with pytest.raises(HarnessError, match="^plain not ready within 3 s; "):
            wait_ready([server], timeout_s=3.0)
        wait_ready([server], timeout_s=3.0, logged=None)  # it does answer
        later = threading.Timer(0.5, lambda: log.write_text(f"Uvicorn running\n{WARMED}\n"))
        later.start()
        wait_ready([server], timeout_s=30.0, every_s=0.1)
        assert WARMED in log.read_text()  # it returned after the line, not before
    finally:
        server.stop()


def test_prefill_servers_on_the_first_core_decode_and_lone_servers_on_the_last():
    # Note [Server cores]
    assert server_cores("prefill", 2) == {"OMP_PROC_BIND": "true", "OMP_PLACES": "{0}"}
    assert server_cores("decode", 2) == {"OMP_PROC_BIND": "true", "OMP_PLACES": "{1}"}
    assert server_cores("null", 4) == {"OMP_PROC_BIND": "true", "OMP_PLACES": "{3}"}


def test_harness_ports_are_below_the_ephemeral_range_and_never_handed_out_twice(monkeypatch):
    """Note [Harness ports]: a pair's two servers drew the same rendezvous port, and a
    server's HTTP port was taken by an ephemeral one before it listened; a bound port, and
    ports another server derives from its own, are passed over too."""
    import socket

    from pdc.serving import sglang_harness as H

    # The suite's servers draw from the same range in this process: the test gets a memory of
    # its own and a block of ports that nothing holds now (a CI run failed on a fixed block).
    monkeypatch.setattr(H, "_PORTS_GIVEN", set())
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    base = next(b for b in range(20000, low - 120, 200) if _all_free(range(b, b + 110)))
    with socket.socket() as held:
        held.bind(("0.0.0.0", base))
        ports = [H.harness_port(base, base + 9) for _ in range(9)]
        assert base not in ports
    assert len(set(ports)) == 9 and all(base < p <= base + 9 < low for p in ports)
    with pytest.raises(HarnessError) as e:
        H.harness_port(base + 1, base + 9)
    assert str(e.value) == (f"no free port in {base + 1}-{base + 9}: each of the 9 drawn is "
                            "bound or already handed to a server of this process")
    server = H.harness_port(base + 100, base + 100, beside=(5, 6))
    assert server == base + 100
    assert H.harness_port(base + 103, base + 106) in (base + 103, base + 104)


def _all_free(ports) -> bool:
    import socket

    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return False
    return True


def test_a_server_that_could_not_listen_fails_its_wait_at_once(tmp_path):
    from pdc.serving.sglang_harness import UNBOUND

    log = tmp_path / "decode.log"
    log.write_text(f"Application startup complete.\nERROR:    [Errno 98] {UNBOUND} "
                   "('127.0.0.1', 42177): address already in use\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    server = Server("decode", f"http://127.0.0.1:{free_port()}", proc, str(log))
    try:
        with pytest.raises(HarnessError) as e:
            wait_ready([server], timeout_s=600.0)
    finally:
        server.stop()
    assert str(e.value).startswith(f"decode could not listen on its port; {log}:\n")
