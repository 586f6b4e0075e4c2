"""The CUDA IPC engine (runtime/engines/cuda_ipc.py).

On the CPU the engine runs with a driver of the test's own: allocations are memfd-backed host
memory, "exporting" names the memfd and "opening" maps it a second time at another address, as
cuIpcOpenMemHandle maps a peer's allocation. The peer engine lives in this process, its
agent_info carrying the pid of a child process, so the writer takes the cross-process path
(handles, translation into the second mapping, liveness checks) and the bytes it moves are
real. The GPU tests at the end run two real processes on one CUDA device.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import subprocess
import threading
import time

import torch

# Only where no GPU is: set in a GPU run, it would turn every Triton kernel that a later test
# module imports into the interpreter's (which copies its tensors to the host).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
from pdc.runtime.engines import BatchState, DescriptorError, TransferError, make_engine
from pdc.runtime.engines.base import DescriptorGrid
from pdc.runtime.engines.cuda_ipc import MAPPINGS, CudaIpcEngine
from pdc.runtime.engines.local import _start_time_ticks

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_RW, MAP_SHARED = 0x1 | 0x2, 0x01


class MemfdDriver:
    """Allocations in memfds; open() maps one again elsewhere, close() unmaps it."""

    def __init__(self):
        self.blocks: dict[int, tuple[int, int]] = {}  # base -> (fd, size)
        self.maps: dict[int, int] = {}  # mapped address -> size
        self.keep = []

    def alloc(self, size: int) -> torch.Tensor:
        fd = os.memfd_create("pdc-test")
        os.ftruncate(fd, size)
        base = _libc.mmap(None, size, PROT_RW, MAP_SHARED, fd, 0)
        self.blocks[base] = (fd, size)
        t = torch.frombuffer((ctypes.c_char * size).from_address(base), dtype=torch.uint8)
        self.keep.append(t)
        return t

    def ensure_context(self, device_index):
        pass

    def allocation(self, ptr):
        for base, (_, size) in self.blocks.items():
            if base <= ptr < base + size:
                return base, size
        raise TransferError("fake driver: not an allocation")

    def export(self, base):
        return base.to_bytes(8, "little") + bytes(56)

    def open(self, handle):
        fd, size = self.blocks[int.from_bytes(handle[:8], "little")]
        addr = _libc.mmap(None, size, PROT_RW, MAP_SHARED, fd, 0)
        self.maps[addr] = size
        return addr

    def close(self, ptr):
        _libc.munmap(ptr, self.maps.pop(ptr))


@pytest.fixture
def child():
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def _as_other_process(info: bytes, proc) -> bytes:
    d = json.loads(info)
    d["pid"], d["start_ticks"] = proc.pid, _start_time_ticks(proc.pid)
    return json.dumps(d).encode()


def _setup(child, n=3, size=1 << 16, seed=0, writer_class=CudaIpcEngine):
    drv = MemfdDriver()
    writer = writer_class("cpu", driver=drv, copy_engine_bytes=8192)
    peer = CudaIpcEngine("cpu", driver=drv)
    g = torch.Generator().manual_seed(seed)
    src = drv.alloc(size)
    src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
    writer.register_tensor(src)
    dst = []
    for _ in range(n):
        t = drv.alloc(size)
        t.fill_(0xA5)
        peer.register_tensor(t)
        dst.append(t)
    name = writer.connect(_as_other_process(peer.agent_info(), child))
    return drv, writer, peer, name, src, dst


def _grid(rows_s, rows_d, runs_s, runs_d, run_bytes):
    u = lambda v: np.asarray(v, np.uint64)  # noqa: E731
    return DescriptorGrid(u(rows_s), u(rows_d), u(runs_s), u(runs_d), u(run_bytes))


def test_made_by_name_and_same_process_peers_keep_the_local_path():
    a = make_engine("cuda_ipc", device="cpu")
    b = make_engine("cuda_ipc", device="cpu")
    x, y = torch.arange(256, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    a.register_tensor(x)
    b.register_tensor(y)
    peer = a.connect(b.agent_info())
    assert peer.startswith("device:")
    a.wait(a.submit_write(peer, [x.data_ptr()], [y.data_ptr()], [256]), 10)
    assert torch.equal(x, y)
    # grids to such a peer go expanded through submit_write (TransferEngine.submit_grids)
    xs, ys = x.data_ptr(), y.data_ptr()
    y.zero_()
    a.wait(a.submit_grids(peer, [_grid([xs, xs + 128], [ys + 128, ys], [0, 64], [0, 64],
                                       [32, 64])]), 10)
    want = torch.zeros(256, dtype=torch.uint8)
    want[128:160], want[192:256] = x[0:32], x[64:128]
    want[0:32], want[64:128] = x[128:160], x[192:256]
    assert torch.equal(y, want)
    a.close()
    b.close()


def test_writes_small_and_large_descriptors_through_the_mapping(child):
    drv, writer, peer, name, src, dst = _setup(child)
    assert name.startswith(f"ipc:{child.pid}:")
    s0 = src.data_ptr()
    # two small pieces (kernel) and one 16 KiB piece (copy engine, threshold 8 KiB)
    s = [s0 + 100, s0 + 4096, s0 + 20000]
    d = [dst[0].data_ptr() + 7, dst[2].data_ptr() + 512, dst[1].data_ptr()]
    n = [1000, 2048, 16384]
    b = writer.submit_write(name, s, d, n)
    assert writer.poll(b) is BatchState.DONE
    expect = [t.clone().fill_(0xA5) for t in dst]
    expect[0][7:1007] = src[100:1100]
    expect[2][512:2560] = src[4096:6144]
    expect[1][:16384] = src[20000:36384]
    for got, want in zip(dst, expect, strict=True):
        assert torch.equal(got, want)
    # the bytes went through the second mapping, not the peer's own addresses
    assert len(drv.maps) == 3
    writer.close()
    peer.close()


def test_handles_opened_once_shared_and_closed_on_deregistration(child):
    drv, writer, peer, name, src, dst = _setup(child)
    opens, live = MAPPINGS.opens, MAPPINGS.live()
    other = CudaIpcEngine("cpu", driver=drv)
    other.register_tensor(drv.alloc(4096))
    info = _as_other_process(peer.agent_info(), child)
    other.connect(info)  # a second engine of this process: shares the three mappings
    writer.connect(info)  # refreshing the same peer opens nothing new
    assert (MAPPINGS.opens, MAPPINGS.live()) == (opens, live)
    peer.deregister(dst[1].data_ptr())
    info = _as_other_process(peer.agent_info(), child)
    writer.connect(info)
    other.connect(info)
    assert MAPPINGS.live() == live - 1 and len(drv.maps) == 2
    with pytest.raises(DescriptorError, match="is not inside memory ipc:"):
        writer.submit_write(name, [src.data_ptr()], [dst[1].data_ptr()], [16])
    other.close()
    writer.close()
    assert len(drv.maps) == 0
    peer.close()


def test_peer_death_fails_the_batch_and_closes_its_mappings(child):
    drv, writer, peer, name, src, dst = _setup(child)
    child.kill()
    child.wait()
    b = writer.submit_write(name, [src.data_ptr()], [dst[0].data_ptr()], [64])
    assert (b.state, b.reason) == (BatchState.FAILED, "peer process has exited")
    assert len(drv.maps) == 0
    assert torch.all(dst[0] == 0xA5)
    with pytest.raises(TransferError, match="unknown peer"):
        writer.submit_write(name, [src.data_ptr()], [dst[0].data_ptr()], [64])
    writer.close()
    peer.close()


def test_refusals(child):
    drv, writer, peer, name, src, dst = _setup(child)
    with pytest.raises(DescriptorError, match=r"^cuda_ipc: destination descriptor 0 "):
        writer.submit_write(name, [src.data_ptr()], [dst[0].data_ptr() + (1 << 16) - 8], [16])
    with pytest.raises(DescriptorError, match=r"^cuda_ipc: source descriptor 0 "):
        writer.submit_write(name, [src.data_ptr() - 4096], [dst[0].data_ptr()], [16])
    with pytest.raises(DescriptorError, match="agent_info is not a device-mode blob"):
        writer.connect(b"{}")
    info = json.loads(_as_other_process(peer.agent_info(), child))
    bad = dict(info, ipc={})
    with pytest.raises(DescriptorError, match="carries no valid IPC handle"):
        writer.connect(json.dumps(bad).encode())
    with pytest.raises(DescriptorError, match="another host"):
        writer.connect(json.dumps(dict(info, boot_id="elsewhere")).encode())
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = dict(info, pid=gone.pid)
    with pytest.raises(TransferError, match=f"cuda_ipc: peer pid {gone.pid} has exited"):
        writer.connect(json.dumps(dead).encode())
    assert torch.all(dst[0] == 0xA5)
    writer.close()
    peer.close()


def test_interior_region_is_translated_by_its_allocation_offset(child):
    drv = MemfdDriver()
    writer = CudaIpcEngine("cpu", driver=drv)
    peer = CudaIpcEngine("cpu", driver=drv)
    src = drv.alloc(4096)
    src.copy_(torch.arange(4096) % 251)
    writer.register_tensor(src)
    block = drv.alloc(1 << 16)
    block.zero_()
    inner = block[8192:12288]
    peer.register(inner.data_ptr(), 4096)
    name = writer.connect(_as_other_process(peer.agent_info(), child))
    writer.wait(writer.submit_write(name, [src.data_ptr()], [inner.data_ptr() + 16], [512]), 10)
    assert torch.equal(block[8192 + 16:8192 + 528], src[:512])
    assert int(block[:8192 + 16].sum()) == 0
    writer.close()
    peer.close()


def test_grids_write_the_descriptors_they_stand_for(child):
    # Note [Descriptor grids]: two grids (three rows over three peer buffers, one row of
    # another length) land exactly where their expanded flat list would.
    drv, writer, peer, name, src, dst = _setup(child)
    s0, d = src.data_ptr(), [t.data_ptr() for t in dst]
    grids = [_grid([s0, s0 + 8192, s0 + 16384], d, [0, 1024, 4096], [2048, 0, 8192],
                   [512, 1024, 256]),
             _grid([s0 + 40000], [d[2] + 30000], [0], [64], [3000])]
    b = writer.submit_grids(name, grids)
    assert writer.poll(b) is BatchState.DONE
    assert (b.descriptors, b.nbytes) == (10, 3 * 1792 + 3000)
    expect = [t.clone().fill_(0xA5) for t in dst]
    for g in grids:
        for s, t, n in zip(*g.expand(), strict=True):
            k = next(i for i, x in enumerate(d) if x <= int(t) < x + (1 << 16))
            at, frm = int(t) - d[k], int(s) - s0
            expect[k][at:at + int(n)] = src[frm:frm + int(n)]
    for got, want in zip(dst, expect, strict=True):
        assert torch.equal(got, want)
    writer.close()
    peer.close()


def test_grid_refusals_name_the_grid_and_row(child):
    drv, writer, peer, name, src, dst = _setup(child)
    s0, d0 = src.data_ptr(), dst[0].data_ptr()
    with pytest.raises(DescriptorError) as e:
        writer.submit_grids(name, [_grid([s0], [d0], [0], [0], [16]),
                                   _grid([s0, s0], [d0, d0 + 65500], [0, 64], [0, 64], [8, 8])])
    assert str(e.value) == (f"cuda_ipc: grid 1, destination row 1 [{d0 + 65500:#x}, +72) is not "
                            f"inside memory {name} registered (1 such); nothing was written")
    with pytest.raises(DescriptorError) as e:
        writer.submit_grids(name, [_grid([s0 - 64], [d0], [0], [0], [16])])
    assert str(e.value) == (f"cuda_ipc: grid 0, source row 0 [{s0 - 64:#x}, +16) is not inside "
                            "memory this engine registered (1 such); nothing was written")
    with pytest.raises(DescriptorError) as e:
        writer.submit_grids(name, [_grid([s0], [d0], [0, 8], [0, 8], [16, 0])])
    assert str(e.value) == "grid 0: run_bytes[1] is 0; every run must move at least 1 byte"
    with pytest.raises(DescriptorError) as e:
        writer.submit_grids(name, [_grid([s0], [d0, d0], [0], [0], [16])])
    assert str(e.value) == "grid 0: rows (1, 2) or runs (1, 1, 1) differ in length"
    with pytest.raises(DescriptorError, match="^empty write request: no descriptors$"):
        writer.submit_grids(name, [_grid([], [], [0], [0], [16])])
    assert torch.all(dst[0] == 0xA5)
    writer.close()
    peer.close()


def test_grids_of_repeated_rows_are_checked_against_the_registrations_of_the_time(child):
    # Note [Row room]: rows seen before check by their kept room; a request beyond it, or a
    # table changed since, gets the full check and its refusal.
    drv, writer, peer, name, src, dst = _setup(child)
    s0, d0 = src.data_ptr(), dst[0].data_ptr()
    rows = ([s0, s0 + 1024], [d0, d0 + 2048])
    for run in (0, 4096, 60000):
        b = writer.submit_grids(name, [_grid(*rows, [run], [run], [512])])
        assert writer.poll(b) is BatchState.DONE
        assert torch.equal(dst[0][2048 + run:2048 + run + 512], src[1024 + run:1024 + run + 512])
    with pytest.raises(DescriptorError) as e:
        writer.submit_grids(name, [_grid(*rows, [0], [63000], [512])])
    assert str(e.value) == (f"cuda_ipc: grid 0, destination row 1 [{d0 + 2048 + 63000:#x}, "
                            f"+512) is not inside memory {name} registered (1 such); nothing "
                            "was written")
    writer.deregister(s0)
    with pytest.raises(DescriptorError) as e:
        writer.submit_grids(name, [_grid(*rows, [0], [0], [512])])
    assert str(e.value) == (f"cuda_ipc: grid 0, source row 0 [{s0:#x}, +512) is not inside "
                            "memory this engine registered (2 such); nothing was written")
    writer.close()
    peer.close()


# ~~~ GPU: two real processes on one device ~~~

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_peer(conn, size):
    eng = CudaIpcEngine("cuda:0")
    dst = torch.full((size,), 0xA5, dtype=torch.uint8, device="cuda:0")
    eng.register_tensor(dst)
    conn.send((eng.agent_info(), dst.data_ptr()))
    conn.recv()
    conn.send(dst.cpu().numpy().tobytes())
    conn.recv()
    eng.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_two_processes_every_byte():
    size = 64 << 20
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_gpu_peer, args=(b, size))
    p.start()
    try:
        assert a.poll(120)
        info, base = a.recv()
        eng = CudaIpcEngine("cuda:0")
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0")
        eng.register_tensor(src)
        name = eng.connect(info)
        rng = np.random.default_rng(0)
        pages = rng.permutation(size // 32768)
        s = src.data_ptr() + np.arange(len(pages), dtype=np.uint64) * 32768
        d = base + pages.astype(np.uint64) * 32768
        half = len(pages) // 2  # first half page by page (kernel), then one bulk copy
        eng.wait(eng.submit_write(name, s[:half], d[:half], np.full(half, 32768)), 60)
        rest = np.arange(half, len(pages))
        eng.wait(eng.submit_write(name, s[rest], d[rest], np.full(len(rest), 32768)), 60)
        a.send("read")
        assert a.poll(120)
        got = torch.frombuffer(bytearray(a.recv()), dtype=torch.uint8).view(-1, 32768)
        want = src.cpu().view(-1, 32768)
        assert torch.equal(got[torch.from_numpy(pages)], want)
        eng.close()
        assert MAPPINGS.live() == 0
    finally:
        a.send("stop")
        p.join(60)


def _gpu_reader(conn, size):
    """Like _gpu_peer, but answers every "read" with its bytes until "stop"."""
    eng = CudaIpcEngine("cuda:0")
    dst = torch.full((size,), 0xA5, dtype=torch.uint8, device="cuda:0")
    eng.register_tensor(dst)
    conn.send((eng.agent_info(), dst.data_ptr()))
    while conn.recv() == "read":
        conn.send(dst.cpu().numpy().tobytes())
    eng.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_the_completion_thread_sleeps_while_a_write_is_in_flight():
    # Note [Completion wake-up]: the write waits behind ~50 ms of GPU work on the caller's
    # stream; the completion thread must wait for it asleep (synchronising the batch's own
    # event would spin a core: the process's CPU time would be the whole wait).
    import resource

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    a, b = CudaIpcEngine("cuda:0"), CudaIpcEngine("cuda:0")
    woken = threading.Event()
    assert a.on_completion(woken.set)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    a.register_tensor(src)
    b.register_tensor(dst)
    name = a.connect(b.agent_info())
    torch.cuda._sleep(100_000_000)
    batch = a.submit_write(name, np.array([src.data_ptr()]), np.array([dst.data_ptr()]),
                           np.array([1 << 20]))
    wall, cpu = time.monotonic(), cpu_s()
    assert woken.wait(30)
    wall, cpu = time.monotonic() - wall, cpu_s() - cpu
    assert a.poll(batch) == BatchState.DONE
    assert torch.equal(src, dst)
    assert wall > 0.01, f"the write did not wait for the GPU work ({wall * 1e3:.1f} ms)"
    assert cpu < 0.5 * wall, f"{cpu * 1e3:.1f} ms of CPU in a {wall * 1e3:.1f} ms wait"
    a.close()
    b.close()


@pytest.mark.gpu
@needs_cuda
def test_gpu_repeated_shape_replays_a_graph_and_wakes_the_waiter():
    # Note [Descriptor-copy graphs] and Note [Completion wake-up]: the same shape four times
    # with fresh bytes and fresh pages each time; the second is captured, the third and fourth
    # replay its graph, and every byte of each write lands.
    from pdc.runtime import descriptor_copy

    size = 16 << 20
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_gpu_reader, args=(b, size))
    p.start()
    try:
        assert a.poll(120)
        info, base = a.recv()
        eng = CudaIpcEngine("cuda:0")
        woken = []
        assert eng.on_completion(lambda: woken.append(1))
        src = torch.empty(size, dtype=torch.uint8, device="cuda:0")
        eng.register_tensor(src)
        name = eng.connect(info)
        rng = np.random.default_rng(1)
        n = size // 32768 // 2
        before = dict(descriptor_copy.graph_stats)
        s = src.data_ptr() + np.arange(n, dtype=np.uint64) * 32768
        for _ in range(4):
            src.random_(0, 256)
            pages = rng.permutation(size // 32768)[:n]
            d = base + pages.astype(np.uint64) * 32768
            eng.wait(eng.submit_write(name, s, d, np.full(n, 32768)), 60)
            a.send("read")
            assert a.poll(120)
            got = torch.frombuffer(bytearray(a.recv()), dtype=torch.uint8).view(-1, 32768)
            assert torch.equal(got[torch.from_numpy(pages)], src[:n * 32768].cpu().view(-1, 32768))
        assert descriptor_copy.graph_stats["captured"] == before["captured"] + 1
        assert descriptor_copy.graph_stats["replayed"] == before["replayed"] + 2
        deadline = time.monotonic() + 10
        while len(woken) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(woken) == 4
        eng.close()
    finally:
        a.send("stop")
        p.join(60)


@pytest.mark.gpu
@needs_cuda
def test_gpu_grids_of_one_shape_land_every_byte_and_replay_a_graph():
    # Note [Descriptor grids]: 160 rows (a layer's K or V each) x the pages of a request, four
    # requests of one shape with fresh pages and bytes, and a fifth with fewer runs (padded
    # into the same graph); every byte read back from the peer process.
    from pdc.runtime import descriptor_copy

    rows, page, pages = 160, 4096, 48
    size = rows * 2 * pages * page
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_gpu_reader, args=(b, size))
    p.start()
    try:
        assert a.poll(120)
        info, base = a.recv()
        eng = CudaIpcEngine("cuda:0")
        src = torch.empty(size // 2, dtype=torch.uint8, device="cuda:0")
        eng.register_tensor(src)
        name = eng.connect(info)
        rng = np.random.default_rng(2)
        s_rows = src.data_ptr() + np.arange(rows, dtype=np.uint64) * np.uint64(pages * page)
        d_rows = base + np.arange(rows, dtype=np.uint64) * np.uint64(2 * pages * page)
        before = dict(descriptor_copy.graph_stats)
        for n in (40, 40, 40, 40, 33):
            src.random_(0, 256)
            s_ids = rng.permutation(pages)[:n].astype(np.uint64)
            d_ids = rng.permutation(2 * pages)[:n].astype(np.uint64)
            grid = DescriptorGrid(s_rows, d_rows, s_ids * page, d_ids * page,
                                  np.full(n, page, np.uint64))
            eng.wait(eng.submit_grids(name, [grid]), 60)
            a.send("read")
            assert a.poll(120)
            got = torch.frombuffer(bytearray(a.recv()), dtype=torch.uint8)
            got = got.view(rows, 2 * pages, page)[:, torch.from_numpy(d_ids.astype(np.int64))]
            want = src.cpu().view(rows, pages, page)[:, torch.from_numpy(s_ids.astype(np.int64))]
            assert torch.equal(got, want)
        assert descriptor_copy.graph_stats["captured"] == before["captured"] + 1
        assert descriptor_copy.graph_stats["replayed"] == before["replayed"] + 3
        eng.close()
    finally:
        a.send("stop")
        p.join(60)


def test_completion_thread_wakes_after_each_batch_event(monkeypatch):
    # Note [Completion wake-up] without a GPU: the engine's completion thread waits on each
    # pending batch's events, in order, and then calls every callback.
    from pdc.runtime.engines.base import Batch

    eng = CudaIpcEngine("cpu")
    monkeypatch.setattr(eng, "_cuda", True)
    # the wait itself (a blocking-sync event behind each one) is the GPU test's
    from pdc.runtime.engines import cuda_ipc

    monkeypatch.setattr(cuda_ipc, "sleep_until", lambda ev, device: ev.synchronize())
    woken = []
    assert eng.on_completion(lambda: woken.append("a"))
    assert eng.on_completion(lambda: woken.append("b"))
    gate = threading.Event()
    synced = []

    class Ev:
        def __init__(self, tag):
            self.tag = tag

        def synchronize(self):
            if self.tag == 1:
                gate.wait(10)  # the first batch ends only when the test says so
            synced.append(self.tag)

    first = Batch(peer="p", handles=[Ev(1)], nbytes=1, descriptors=1)
    eng._watch(first)
    eng._watch(Batch(peer="p", handles=[Ev(2)], nbytes=1, descriptors=1))
    done = Batch(peer="p", handles=[], nbytes=1, descriptors=1)
    done.state = BatchState.DONE
    eng._watch(done)  # an ended batch is not waited for
    time.sleep(0.05)
    assert synced == [] and woken == []
    gate.set()
    deadline = time.monotonic() + 10
    while len(woken) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert synced == [1, 2] and woken == ["a", "b", "a", "b"]
    monkeypatch.setattr(eng, "_cuda", False)
    eng.close()
    assert eng._waiter is None


def test_cpu_engine_reports_no_completion_thread():
    eng = CudaIpcEngine("cpu")
    assert eng.on_completion(lambda: None) is False  # batches end inside submit_write
    eng.close()


def test_handle_bytes_survive_nul_bytes():
    # A c_char array reads back cut at its first NUL; handles are mostly NULs (seen on an H200).
    import ctypes as ct

    from pdc.runtime.engines.cuda_ipc import _IpcHandle

    raw = bytes([0, 1, 0, 0, 9] + [0] * 58 + [7])
    h = _IpcHandle()
    ct.memmove(ct.addressof(h), raw, len(raw))
    assert bytes(bytearray(h.reserved)) == raw


def _gpu_event_reader(conn, size, watched=False):
    """The decode side of Note [Success by event]: opens the writer's event handle, waits by
    asking it (never on the writer's stream), or, `watched`, for the engine's call back
    (Note [Landed wake-up]), then answers with its bytes."""
    import threading

    eng = CudaIpcEngine("cuda:0")
    dst = torch.full((size,), 0xA5, dtype=torch.uint8, device="cuda:0")
    eng.register_tensor(dst)
    conn.send((eng.agent_info(), dst.data_ptr()))
    ev = eng.open_written_event(conn.recv())
    asked, at_call = 1, None
    if watched:
        called = threading.Event()
        at_call = eng.watch_written(ev, "writer", called.set) and called.wait(60) and \
            ev.query()  # complete when the call came
    while not ev.query():
        asked += 1
    conn.send((asked, at_call, dst.cpu().numpy().tobytes()))
    conn.recv()
    eng.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("watched", [False, True], ids=["asked", "watched"])
def test_gpu_a_written_event_opened_in_the_peer_completes_after_every_byte_landed(watched):
    size = 256 << 20
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_gpu_event_reader, args=(b, size, watched))
    p.start()
    try:
        assert a.poll(120)
        info, base = a.recv()
        eng = CudaIpcEngine("cuda:0")
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0")
        eng.register_tensor(src)
        name = eng.connect(info)
        pages = np.random.default_rng(1).permutation(size // 32768)
        s = src.data_ptr() + np.arange(len(pages), dtype=np.uint64) * 32768
        d = base + pages.astype(np.uint64) * 32768
        half = len(pages) // 2  # two batches: the second's event covers the first's writes
        eng.submit_write(name, s[:half], d[:half], np.full(half, 32768))
        last = eng.submit_write(name, s[half:], d[half:], np.full(len(pages) - half, 32768))
        handle = eng.written_event(last)
        assert len(handle) == 64
        a.send(handle)
        assert a.poll(120)
        asked, at_call, raw = a.recv()
        got = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, 32768)
        assert torch.equal(got[torch.from_numpy(pages)], src.cpu().view(-1, 32768))
        assert at_call is (True if watched else None)
        print(f"the peer asked the event {asked} times")
        eng.wait(last, 60)
        assert eng.written_event(last) == b""  # an ended batch has no event to hand out
        eng.close()
    finally:
        a.send("stop")
        p.join(60)
