"""Real bytes between real processes over loopback, for every transfer engine.

Each test spawns a receiver process (see _engine_peer.py), exchanges agent_info over a Pipe
and writes from this process into the receiver's registered buffer. Every exchange with the
receiver and every transfer wait has its own deadline, so a broken engine fails a test instead
of hanging the run.
"""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _engine_peer import (
    SLOT_NBYTES,
    make_plan,
    peer_main,
    source_pattern,
    unprivileged_writer_main,
)
from pdc.runtime.engines import (
    ENGINES,
    BatchState,
    DescriptorError,
    TransferError,
    make_engine,
)
from pdc.runtime.engines.base import DescriptorGrid, RegionTable, as_descriptors, check_grids

pytestmark = pytest.mark.engines

STEP_TIMEOUT_S = 30.0  # one request/answer with the receiver, incl. its start-up
WAIT_TIMEOUT_S = 20.0  # one transfer wait
DEAD_PEER_DEADLINE_S = 10.0  # a write to a killed peer must fail sooner than this
# 300 descriptors, then 2500: above Mooncake's 1024 per submit and the kernel's IOV_MAX.
BATCH_COUNTS = [300, 2500]

_LIBRARIES = {"mooncake": ["mooncake"], "nixl": ["nixl_cu12", "nixl_cu13", "nixl"], "local": []}


def _engine_params():
    params = []
    for name in ENGINES:
        if name == "cuda_ipc":
            continue  # device memory only: tests/runtime/engines/test_cuda_ipc.py
        libs = _LIBRARIES[name]
        missing = libs and not any(importlib.util.find_spec(lib) for lib in libs)
        marks = [pytest.mark.skip(reason=f"{name}: library not installed")] if missing else []
        params.append(pytest.param(name, marks=marks))
    return params


class _Receiver:
    """A spawned receiver process holding one registered buffer of dst_nbytes."""

    def __init__(self, engine_name: str, dst_nbytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=peer_main, args=(engine_name, child_conn, dst_nbytes), daemon=True
        )
        self.process.start()
        child_conn.close()
        self.agent_info, self.base_addr = self.recv()

    def recv(self):
        if not self.conn.poll(STEP_TIMEOUT_S):
            raise AssertionError(f"receiver silent for {STEP_TIMEOUT_S} s")
        return self.conn.recv()

    def verify(self, plan, batches_written) -> None:
        self.conn.send(("verify", plan, batches_written))
        tag, wrong, first_wrong = self.recv()
        assert tag == "verified"
        assert wrong == 0, f"{wrong} destination bytes differ, first at offsets {first_wrong}"

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(STEP_TIMEOUT_S)

    def pause(self) -> None:
        """SIGSTOP, and wait until every thread is stopped: the signal is delivered
        asynchronously, and a transport thread still running could complete the next write."""
        pid = self.process.pid
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline:
            states = []
            for task in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{task}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except OSError:
                    continue  # the thread exited meanwhile
            if states and all(st in "tT" for st in states):
                return
            time.sleep(0.001)
        raise AssertionError(f"receiver {pid} did not stop within {STEP_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGCONT)
            try:
                self.conn.send(("stop",))
                self.recv()
            except (OSError, EOFError, AssertionError):
                pass
            self.process.join(STEP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(STEP_TIMEOUT_S)
        self.conn.close()

    def __enter__(self) -> _Receiver:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.mark.parametrize("engine_name", _engine_params())
def test_scattered_write_reaches_every_byte(engine_name):
    plan = make_plan(BATCH_COUNTS, seed=1234)
    with _Receiver(engine_name, plan["dst_nbytes"]) as receiver:
        engine = make_engine(engine_name)
        try:
            src = source_pattern(plan["src_nbytes"], plan["seed"])
            engine.register(src.ctypes.data, src.nbytes)
            peer = engine.connect(receiver.agent_info)
            batches = [
                engine.submit_write(
                    peer,
                    src.ctypes.data + src_off,
                    receiver.base_addr + dst_off,
                    nbytes,
                )
                for src_off, dst_off, nbytes in plan["batches"]
            ]
            for batch, (_, _, nbytes) in zip(batches, plan["batches"], strict=True):
                engine.wait(batch, WAIT_TIMEOUT_S)
                assert engine.poll(batch) is BatchState.DONE
                assert batch.descriptors == nbytes.size
                assert batch.nbytes == int(nbytes.sum())
            receiver.verify(plan, batches_written=[0, 1])
        finally:
            engine.close()


def _nice(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of proc(5)


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None or
                    not sys.platform.startswith("linux"), reason="mooncake: library not "
                    "installed, or not Linux")
def test_mooncake_status_spin_runs_at_the_knobs_nice_value_and_only_it():
    """Note [Status spin priority]: the peer worker that spins in Mooncake's status call runs
    at mooncake_status_nice; every other thread of the process, Mooncake's transport threads
    among them, keeps its priority, and the bytes arrive."""
    import threading

    from pdc.runtime import knobs

    plan = make_plan([300], seed=7)
    src_off, dst_off, nbytes = plan["batches"][0]
    knobs.override(mooncake_status_nice=19)
    try:
        with _Receiver("mooncake", plan["dst_nbytes"]) as receiver:
            before = {int(t): _nice(int(t)) for t in os.listdir("/proc/self/task")}
            engine = make_engine("mooncake")
            try:
                src = source_pattern(plan["src_nbytes"], plan["seed"])
                engine.register(src.ctypes.data, src.nbytes)
                peer = engine.connect(receiver.agent_info)
                batch = engine.submit_write(peer, src.ctypes.data + src_off,
                                            receiver.base_addr + dst_off, nbytes)
                engine.wait(batch, WAIT_TIMEOUT_S)
                assert engine.poll(batch) is BatchState.DONE
                spinners = {t.native_id for t in threading.enumerate()
                            if t.name.startswith("pdc-mooncake-")}
                assert len(spinners) == 1
                nices = {int(t): _nice(int(t)) for t in os.listdir("/proc/self/task")}
                assert [nices[t] for t in spinners] == [19]
                others = {t: n for t, n in nices.items() if t not in spinners}
                assert len(others) > len(before)  # Mooncake started its own threads
                assert set(others.values()) == {before[threading.main_thread().native_id]}
                receiver.verify(plan, batches_written=[0])
            finally:
                engine.close()
    finally:
        knobs.reset("mooncake_status_nice")


@pytest.mark.parametrize("engine_name", _engine_params())
def test_write_to_killed_peer_fails_without_hanging(engine_name):
    plan = make_plan([64], seed=99)
    src_off, dst_off, nbytes = plan["batches"][0]
    with _Receiver(engine_name, plan["dst_nbytes"]) as receiver:
        engine = make_engine(engine_name)
        try:
            src = source_pattern(plan["src_nbytes"], plan["seed"])
            engine.register(src.ctypes.data, src.nbytes)
            peer = engine.connect(receiver.agent_info)
            src_addr, dst_addr = src.ctypes.data + src_off, receiver.base_addr + dst_off
            # A first write succeeds, so the failure below is the peer's death, not set-up.
            engine.wait(engine.submit_write(peer, src_addr, dst_addr, nbytes), WAIT_TIMEOUT_S)
            receiver.kill()
            start = time.monotonic()
            with pytest.raises(TransferError) as failure:
                batch = engine.submit_write(peer, src_addr, dst_addr, nbytes)
                engine.wait(batch, DEAD_PEER_DEADLINE_S)
            elapsed_s = time.monotonic() - start
            assert "timed out" not in str(failure.value), "the engine did not notice the death"
            assert elapsed_s < DEAD_PEER_DEADLINE_S
        finally:
            engine.close()


# A stopped peer never answers: Mooncake ends the batch at MC_TRANSFER_TIMEOUT (5 s at least),
# NIXL would wait forever, so the engine's own per-batch deadline must end it.
_STOPPED_PEER_TIMEOUT_S = {"mooncake": 5, "nixl": 1}
_STOPPED_PEER_REASON = {"mooncake": "MC_TRANSFER_TIMEOUT", "nixl": "no completion within 1.0 s"}


@pytest.mark.parametrize(
    "engine_name", [p for p in _engine_params() if p.values[0] in _STOPPED_PEER_TIMEOUT_S]
)
def test_write_to_stopped_peer_fails_at_the_transfer_timeout(engine_name):
    timeout_s = _STOPPED_PEER_TIMEOUT_S[engine_name]
    plan = make_plan([16], seed=5)
    src_off, dst_off, nbytes = plan["batches"][0]
    with _Receiver(engine_name, plan["dst_nbytes"]) as receiver:
        engine = make_engine(engine_name, transfer_timeout_s=timeout_s)
        try:
            src = source_pattern(plan["src_nbytes"], plan["seed"])
            engine.register(src.ctypes.data, src.nbytes)
            peer = engine.connect(receiver.agent_info)
            src_addr, dst_addr = src.ctypes.data + src_off, receiver.base_addr + dst_off
            engine.wait(engine.submit_write(peer, src_addr, dst_addr, nbytes), WAIT_TIMEOUT_S)
            receiver.pause()
            start = time.monotonic()
            batch = engine.submit_write(peer, src_addr, dst_addr, nbytes)
            with pytest.raises(TransferError, match=_STOPPED_PEER_REASON[engine_name]):
                engine.wait(batch, timeout_s + 10.0)
            elapsed_s = time.monotonic() - start
            assert timeout_s * 0.9 < elapsed_s < timeout_s + 5.0
            assert engine.poll(batch) is BatchState.FAILED
        finally:
            engine.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a writer as another user")
def test_local_without_ptrace_permission_raises_clear_error():
    with _Receiver("local", SLOT_NBYTES) as receiver:
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        writer = ctx.Process(
            target=unprivileged_writer_main,
            args=(child_conn, receiver.agent_info, receiver.base_addr),
            daemon=True,
        )
        writer.start()
        try:
            assert conn.poll(STEP_TIMEOUT_S), "unprivileged writer silent"
            outcome = conn.recv()
        finally:
            writer.join(STEP_TIMEOUT_S)
            if writer.is_alive():
                writer.kill()
        assert outcome[:2] == ("error", "TransferError"), outcome
        assert "not permitted (EPERM)" in outcome[2]
        receiver.verify(
            {"seed": 0, "src_nbytes": 0, "dst_nbytes": SLOT_NBYTES, "batches": []},
            batches_written=[],
        )


def test_local_refuses_destination_outside_registered_range():
    plan = make_plan([100], seed=7)
    src_off, dst_off, nbytes = plan["batches"][0]
    with _Receiver("local", plan["dst_nbytes"]) as receiver:
        engine = make_engine("local")
        try:
            src = source_pattern(plan["src_nbytes"], plan["seed"])
            engine.register(src.ctypes.data, src.nbytes)
            peer = engine.connect(receiver.agent_info)
            dst = receiver.base_addr + dst_off
            end = receiver.base_addr + plan["dst_nbytes"]
            straddling, before = dst.copy(), dst.copy()
            straddling[-1] = end - int(nbytes[-1]) + 1  # last byte lands one past the end
            before[-1] = receiver.base_addr - int(nbytes[-1])  # wholly below the start
            for bad_dst in (straddling, before):
                with pytest.raises(DescriptorError, match="not inside memory"):
                    engine.submit_write(peer, src.ctypes.data + src_off, bad_dst, nbytes)
            # The 99 valid descriptors of each refused batch must not have been written either.
            receiver.verify(plan, batches_written=[])
        finally:
            engine.close()


@pytest.mark.parametrize("engine_name", _engine_params())
def test_bad_requests_are_refused_with_clear_errors(engine_name):
    engine = make_engine(engine_name)
    try:
        buf = np.zeros(8 * SLOT_NBYTES, np.uint8)
        addr = buf.ctypes.data
        engine.register(addr, buf.nbytes)
        with pytest.raises(DescriptorError, match="overlaps"):
            engine.register(addr + SLOT_NBYTES, SLOT_NBYTES)
        with pytest.raises(DescriptorError, match="nbytes"):
            engine.register(addr + buf.nbytes + SLOT_NBYTES, 0)
        src = np.array([addr, addr + 64], np.uint64)
        cases = [
            ((src, src, np.array([8], np.uint64)), "equal lengths"),
            ((src, src, np.array([8, 0], np.uint64)), "nbytes\\[1\\] is 0"),
            ((src.astype(np.float64), src, np.array([8, 8])), "integers"),
            ((src, src, np.array([8, -1])), "negative"),
            ((src.reshape(1, 2), src, np.array([8, 8])), "1-D"),
            ((src[:0], src[:0], src[:0]), "empty"),
        ]
        for (s, d, n), message in cases:
            with pytest.raises(DescriptorError, match=message):
                engine.submit_write("nobody", s, d, n)
        with pytest.raises(TransferError, match="unknown peer"):
            engine.submit_write("nobody", src, src, np.array([8, 8]))
        with pytest.raises(TransferError):
            engine.connect(b"\xff not agent info")
    finally:
        engine.close()
    engine.close()  # idempotent


@pytest.mark.parametrize("engine_name", _engine_params())
def test_peer_reregistering_over_its_old_region_is_writable_after_connect_again(engine_name):
    # A peer deregisters a region and registers a wider one over it (the next request's
    # buffers allocated where the last one's were), then sends its new agent_info: a write
    # past the old region's end must land (Note [Fresh peer metadata] in nixl.py).
    writer, reader = make_engine(engine_name), make_engine(engine_name)
    try:
        src = source_pattern(4 * SLOT_NBYTES, seed=7)
        writer.register(src.ctypes.data, src.nbytes)
        dst = np.zeros(64 * SLOT_NBYTES, np.uint8)
        base = dst.ctypes.data
        reader.register(base + SLOT_NBYTES, 8 * SLOT_NBYTES)
        writer.connect(reader.agent_info())
        reader.deregister(base + SLOT_NBYTES)
        reader.register(base, 32 * SLOT_NBYTES)
        peer = writer.connect(reader.agent_info())
        # One write each: a batch whose first descriptor lies in the new region alone was
        # let through where a single one past the old end was refused.
        for i, slot in enumerate([20, 31, 0, 2]):
            batch = writer.submit_write(peer, [src.ctypes.data + i * SLOT_NBYTES],
                                        [base + slot * SLOT_NBYTES], [SLOT_NBYTES])
            writer.wait(batch, WAIT_TIMEOUT_S)
            assert writer.poll(batch) is BatchState.DONE, batch.reason
            got = dst[slot * SLOT_NBYTES:(slot + 1) * SLOT_NBYTES]
            assert (got == src[i * SLOT_NBYTES:(i + 1) * SLOT_NBYTES]).all()
    finally:
        writer.close()
        reader.close()


def test_region_table_containment():
    table = RegionTable([(0x1000, 0x1000), (0x2000, 0x1000), (0x8000, 0x100)])
    addr = np.array([0x1000, 0x1FFF, 0x1F00, 0x2F00, 0x8000, 0x7FFF, 0x0], np.uint64)
    nbytes = np.array([0x1000, 1, 0x200, 0x100, 0x101, 1, 1], np.uint64)
    # inside, inside, straddles two adjacent regions, inside, past the end, gap, below all
    assert table.outside(addr, nbytes).tolist() == [2, 4, 5, 6]
    assert RegionTable().outside(addr, nbytes).tolist() == list(range(7))
    with pytest.raises(DescriptorError, match="wraps around"):
        as_descriptors([2**64 - 8], [0x1000], [16])


def test_region_table_containment_of_large_writes():
    # Over 64 descriptors a write inside one registration is decided by its bounds at once;
    # anything else still gets the per-descriptor answer.
    table = RegionTable([(0x10000, 0x10000), (0x20000, 0x10000)])
    addr = 0x10000 + np.arange(100, dtype=np.uint64) * 0x100
    nbytes = np.full(100, 0x100, np.uint64)
    assert table.outside(addr, nbytes).tolist() == []
    for i, (a, n) in {7: (0x1FF80, 0x100), 50: (0x30000, 1), 99: (0xFFFF, 1)}.items():
        bad_a, bad_n = addr.copy(), nbytes.copy()
        bad_a[i], bad_n[i] = a, n  # straddles two regions, past the last, below the first
        assert table.outside(bad_a, bad_n).tolist() == [i]


def test_region_table_room_of_rows_follows_the_table():
    # Note [Row room]: the least bytes from a row to the end of its range, 0 when a row lies
    # in no range; an answer kept per rows is dropped when the table changes.
    table = RegionTable([(0x1000, 0x1000), (0x4000, 0x100)])
    rows = np.array([0x1000, 0x1800, 0x4080], np.uint64)
    assert table.room(rows) == 0x80
    assert table.room(rows[:2]) == 0x800
    assert table.room(np.array([0x1000, 0x2000], np.uint64)) == 0  # 0x2000 is past the end
    assert table.room(np.array([0x0FFF], np.uint64)) == 0
    assert table.room(np.zeros(0, np.uint64)) == 0
    table.remove(0x4000)
    assert table.room(rows) == 0
    table.add(0x4000, 0x1000)
    assert table.room(rows) == 0x800
    assert RegionTable().room(rows) == 0


def test_package_import_loads_no_engine_library():
    code = (
        "import sys, pdc.runtime.engines as e; "
        "print(sorted(e.ENGINES)); "
        "print([m for m in ('mooncake', 'nixl_cu12', 'nixl_cu13', 'nixl') if m in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=STEP_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["['cuda_ipc', 'local', 'mooncake', 'nixl']", "[]"]
    with pytest.raises(ValueError, match="known engines: cuda_ipc, local, mooncake, nixl"):
        make_engine("carrier-pigeon")


def test_grid_checks_name_the_grid_and_the_problem():
    """check_grids, the entry of a grid submit: a grid near the top of the address space
    passes while no descriptor wraps; one that wraps, a 0-byte run, a negative or ragged
    array are refused by name; grids as the descriptor template makes them (uint64) are
    kept as they are, others converted."""
    u = functools.partial(np.array, dtype=np.uint64)
    top = 2**64
    near = DescriptorGrid(u([top - 0x3000]), u([0x1000]), u([0, 0x1000]), u([0, 0x1000]),
                          u([0x1000, 0x1000]))
    kept = check_grids([near])[0]
    assert kept.src_rows is near.src_rows and kept.run_bytes is near.run_bytes
    converted = check_grids([DescriptorGrid(np.array([0x1000]), np.array([0x2000]),
                                            np.array([0]), np.array([8]), np.array([8]))])[0]
    assert converted.src_rows.dtype == np.uint64 and converted.dst_runs.tolist() == [8]
    cases = [
        (DescriptorGrid(u([top - 0x1000]), u([0]), u([0x800]), u([0]), u([0x800])),
         "grid 0: a descriptor wraps around the 64-bit address space"),
        (DescriptorGrid(u([0]), u([top - 0x100]), u([0]), u([0x80]), u([0x80])),
         "grid 0: a descriptor wraps around the 64-bit address space"),
        (DescriptorGrid(u([0]), u([0]), u([0, 8]), u([0, 8]), u([8, 0])),
         "grid 0: run_bytes[1] is 0; every run must move at least 1 byte"),
        (DescriptorGrid(np.array([-1]), u([0]), u([0]), u([0]), u([8])),
         "grid 0: src_rows has a negative entry (-1)"),
        (DescriptorGrid(u([0]), u([0]), u([0, 8]), u([0]), u([8])),
         "grid 0: rows (1, 1) or runs (2, 1, 1) differ in length"),
    ]
    for grid, why in cases:
        with pytest.raises(DescriptorError) as e:
            check_grids([grid])
        assert str(e.value) == why
