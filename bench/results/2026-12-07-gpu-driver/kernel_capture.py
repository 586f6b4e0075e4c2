"""Why a "kernel" graph-input capture fails (a scratch check for the device call beside it):
descriptor copies of one shape under graph_input copy, then kernel, then mapped, each capture
built directly (PinnedGraph) so that its traceback prints. Not a bench of the project's code."""

import sys
import traceback

import numpy as np
import torch
from pdc.runtime import descriptor_copy, knobs
from pdc.runtime.pinned_graph import PinnedGraph


def main() -> None:
    order = sys.argv[1].split(",")
    dev = torch.device("cuda:0")
    table = torch.zeros(4096, dtype=torch.int64, device=dev)
    out = torch.zeros(4096, dtype=torch.int64, device=dev)

    def build_run(values):
        return lambda: out.copy_(values, non_blocking=True)

    for mode in order:
        knobs.override(graph_input=mode)
        try:
            g = PinnedGraph(table, build_run, torch.cuda.current_stream(dev), dev)
            g.put([np.arange(4096, dtype=np.int64) + 7])
            torch.cuda.synchronize()
            print(mode, "captured", g.mode, "ok" if int(out[5]) == 12 else "WRONG")
        except Exception:  # noqa: BLE001 - the point is the traceback
            print(mode, "FAILED")
            traceback.print_exc()
        finally:
            knobs.reset()
    s = np.arange(8, dtype=np.uint64) * 4096
    src = torch.randint(0, 255, (8 * 4096,), dtype=torch.uint8, device=dev)
    dst = torch.zeros(16 * 4096, dtype=torch.uint8, device=dev)
    for mode in order:
        knobs.override(graph_input=mode)
        descriptor_copy._graphs.clear()
        descriptor_copy._seen.clear()
        for _ in range(3):
            descriptor_copy.launch(src.data_ptr() + s, dst.data_ptr() + s * 2,
                                   np.full(8, 4096, np.uint64), dev)
        torch.cuda.synchronize()
        print(mode, "descriptor_copy", dict(descriptor_copy.graph_stats))
        knobs.reset()


if __name__ == "__main__":
    main()
