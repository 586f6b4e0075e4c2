"""CPU time a thread spends waiting for CUDA work, per way of waiting (a scratch check for the
device call beside it; not a bench of the project's code). A kernel that sleeps ~50 ms on the
GPU, then: event.synchronize() for events made with blocking / blocking + interprocess /
default flags (the waiting thread's CPU time against the wall time), and a host function
queued behind the kernel (cuLaunchHostFunc) while the thread waits on a threading.Event (the
whole process's CPU time)."""

import ctypes
import resource
import threading
import time

import torch

CYCLES = 100_000_000


def _proc_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    torch.cuda.init()
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    for name, kw in [("blocking", {"blocking": True}),
                     ("blocking+interprocess", {"blocking": True, "interprocess": True}),
                     ("default", {})]:
        for _ in range(2):
            ev = torch.cuda.Event(**kw)
            torch.cuda._sleep(CYCLES)
            ev.record()
            w, c, p = time.perf_counter(), time.thread_time(), _proc_cpu()
            ev.synchronize()
            print(f"{name:22s} synchronize: wall {1e3 * (time.perf_counter() - w):6.1f} ms, "
                  f"thread cpu {1e3 * (time.thread_time() - c):6.1f} ms, process cpu "
                  f"{1e3 * (_proc_cpu() - p):6.1f} ms", flush=True)
    cu = ctypes.CDLL("libcuda.so.1")
    fn_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    fired = threading.Event()
    fn = fn_t(lambda _: fired.set())
    cu.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, fn_t, ctypes.c_void_p]
    for _ in range(2):
        fired.clear()
        torch.cuda._sleep(CYCLES)
        w, p = time.perf_counter(), _proc_cpu()
        rc = cu.cuLaunchHostFunc(torch.cuda.current_stream().cuda_stream, fn, None)
        fired.wait(5)
        print(f"host function (rc {rc}): wall {1e3 * (time.perf_counter() - w):6.1f} ms, "
              f"process cpu {1e3 * (_proc_cpu() - p):6.1f} ms", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
