"""A 14-descriptor Mooncake write (400 B each) between two engines of one process while another
thread of the process spins: none, a pure-Python loop ("py"), or a loop around non-blocking
ZeroMQ receives ("zmq"); optional second argument: the switch interval in seconds. Prints the
p50 of the write through pdc's engine (submit_write + wait) and of Mooncake's own
batch_transfer_sync_write. BENCHMARKS.md (n), "One engine alone, and two levers".

    python gil_probe.py none|py|zmq [switch_interval_s]
"""
import statistics, sys, threading, time
import numpy as np, zmq
from pdc.runtime.engines import make_engine
mode = sys.argv[1]
if len(sys.argv) > 2: sys.setswitchinterval(float(sys.argv[2]))
D, IB, ST = 14, 400, 4096
se, de = make_engine("mooncake"), make_engine("mooncake")
src = np.ones(1 << 20, np.uint8); dst = np.zeros(1 << 20, np.uint8)
se.register(src.ctypes.data, src.nbytes); de.register(dst.ctypes.data, dst.nbytes)
peer = se.connect(de.agent_info())
off = np.arange(D, dtype=np.uint64) * ST; nb = np.full(D, IB, np.uint64)
stop = False
def busy_py():
    x = 0
    while not stop: x += 1
def busy_zmq():
    ctx = zmq.Context(); s = ctx.socket(zmq.PULL); s.bind("tcp://127.0.0.1:*")
    while not stop:
        try: s.recv(zmq.NOBLOCK)
        except zmq.Again: pass
        x = sum(range(200))
if mode == "py": threading.Thread(target=busy_py, daemon=True).start()
if mode == "zmq": threading.Thread(target=busy_zmq, daemon=True).start()
raw = se._engine
lat, lat_sync = [], []
for i in range(60):
    t0 = time.perf_counter()
    b = se.submit_write(peer, off + src.ctypes.data, off + dst.ctypes.data, nb); se.wait(b, 10)
    lat.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    rc = raw.batch_transfer_sync_write(peer, (off + src.ctypes.data).tolist(), (off + dst.ctypes.data).tolist(), nb.tolist())
    lat_sync.append((time.perf_counter() - t0) * 1e3)
stop = True
print(mode, f"engine path p50 {statistics.median(lat[10:]):.2f} ms; sync call p50 {statistics.median(lat_sync[10:]):.2f} ms")
