"""The Mooncake write of one small SGLang request alone: 14 descriptors of 400 B between two
MooncakeEngines in one process over loopback TCP, submit -> wait, 50 timed after 10 warm-up.
BENCHMARKS.md (n), "SGLang at 1 in flight, 3 interleaved repetitions". Run: python <this file>."""

import statistics
import time

import numpy as np
from pdc.runtime.engines import make_engine

DESCRIPTORS, ITEM_BYTES, STRIDE = 14, 400, 4096

src_engine, dst_engine = make_engine("mooncake"), make_engine("mooncake")
src = np.ones(1 << 20, np.uint8)
dst = np.zeros(1 << 20, np.uint8)
src_engine.register(src.ctypes.data, src.nbytes)
dst_engine.register(dst.ctypes.data, dst.nbytes)
peer = src_engine.connect(dst_engine.agent_info())
offsets = np.arange(DESCRIPTORS, dtype=np.uint64) * STRIDE
nbytes = np.full(DESCRIPTORS, ITEM_BYTES, np.uint64)
latency_ms = []
for _ in range(60):
    t0 = time.perf_counter()
    batch = src_engine.submit_write(peer, offsets + src.ctypes.data, offsets + dst.ctypes.data,
                                    nbytes)
    src_engine.wait(batch, 10)
    latency_ms.append((time.perf_counter() - t0) * 1e3)
print(f"submit -> done ms: p50 {statistics.median(latency_ms[10:]):.3f}, "
      f"max {max(latency_ms[10:]):.3f}")
