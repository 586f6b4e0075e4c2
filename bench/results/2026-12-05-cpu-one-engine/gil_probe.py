"""A 14-descriptor Mooncake write (400 B each) between two engines of one process while another
thread of the process spins: none, a pure-Python loop ("py"), or a loop around non-blocking
ZeroMQ receives ("zmq"); optional second argument: the switch interval in seconds. Prints the
p50 of the write through pdc's engine (submit_write + wait) and of Mooncake's own
batch_transfer_sync_write. BENCHMARKS.md (n), "One engine alone, and two levers".

    python gil_probe.py none|py|zmq [switch_interval_s]
"""

import statistics
import sys
import threading
import time

import numpy as np
import zmq
from pdc.runtime.engines import make_engine

DESCRIPTORS, ITEM_BYTES, STRIDE = 14, 400, 4096
mode = sys.argv[1]
if len(sys.argv) > 2:
    sys.setswitchinterval(float(sys.argv[2]))
src_engine, dst_engine = make_engine("mooncake"), make_engine("mooncake")
src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
src_engine.register(src.ctypes.data, src.nbytes)
dst_engine.register(dst.ctypes.data, dst.nbytes)
peer = src_engine.connect(dst_engine.agent_info())
offsets = np.arange(DESCRIPTORS, dtype=np.uint64) * STRIDE
nbytes = np.full(DESCRIPTORS, ITEM_BYTES, np.uint64)
stop = False


def busy_python() -> None:
    x = 0
    while not stop:
        x += 1


def busy_zmq() -> None:
    sock = zmq.Context().socket(zmq.PULL)
    sock.bind("tcp://127.0.0.1:*")
    while not stop:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass
        sum(range(200))


if mode in ("py", "zmq"):
    threading.Thread(target=busy_python if mode == "py" else busy_zmq, daemon=True).start()
raw = src_engine._engine
through_pdc, sync_call = [], []
for _ in range(60):
    t0 = time.perf_counter()
    batch = src_engine.submit_write(peer, offsets + src.ctypes.data, offsets + dst.ctypes.data,
                                    nbytes)
    src_engine.wait(batch, 10)
    through_pdc.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    raw.batch_transfer_sync_write(peer, (offsets + src.ctypes.data).tolist(),
                                  (offsets + dst.ctypes.data).tolist(), nbytes.tolist())
    sync_call.append((time.perf_counter() - t0) * 1e3)
stop = True
print(f"{mode}: engine path p50 {statistics.median(through_pdc[10:]):.2f} ms; "
      f"sync call p50 {statistics.median(sync_call[10:]):.2f} ms")
