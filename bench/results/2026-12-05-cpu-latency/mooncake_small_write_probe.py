"""The Mooncake write of one small SGLang request alone: 14 descriptors of 400 B between two
MooncakeEngines in one process over loopback TCP, submit -> wait, 50 timed after 10 warm-up.
BENCHMARKS.md (n), "SGLang at 1 in flight, 3 repetitions". Run: python <this file>."""
import time, numpy as np, statistics as st
from pdc.runtime.engines import make_engine
from pdc.runtime.engines.base import BatchState
a, b = make_engine("mooncake"), make_engine("mooncake")
N = 1 << 20
src = np.ones(N, np.uint8); dst = np.zeros(N, np.uint8)
a.register(src.ctypes.data, N); b.register(dst.ctypes.data, N)
peer = a.connect(b.agent_info())
n=14; sz=400
s = np.arange(n, dtype=np.uint64)*4096 + src.ctypes.data
d = np.arange(n, dtype=np.uint64)*4096 + dst.ctypes.data
nb = np.full(n, sz, np.uint64)
lat=[]
for i in range(60):
    t=time.perf_counter(); bt=a.submit_write(peer, s, d, nb); a.wait(bt, 10); lat.append((time.perf_counter()-t)*1e3)
lat=lat[10:]
print("ms p50", round(st.median(lat),3), "max", round(max(lat),3))
