"""runtime/descriptor_copy.py on the CPU (the Triton interpreter): grids of descriptors, as
the cuda_ipc engine launches them, copy exactly their bytes. The GPU's graphs of the same
launches: tests/runtime/test_pinned_graph.py and engines/test_cuda_ipc.py."""

from __future__ import annotations

import numpy as np
import pytest
from pdc.runtime.engines.base import DescriptorGrid, check_grids

torch = pytest.importorskip("torch")


def _u(values) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


@pytest.mark.parametrize("run_bytes", [[32, 48, 16], [4, 12, 20], [3, 5, 7]])
def test_grids_of_rows_and_runs_copy_exactly_their_bytes(run_bytes):
    """Two grids, two rows and three runs, then one row: every descriptor (row + run) lands
    its bytes, nothing else is written, at lengths that allow 16-byte, 4-byte and only
    1-byte words."""
    from pdc.runtime import descriptor_copy

    src = torch.arange(1024, dtype=torch.int16).view(torch.uint8)
    dst = torch.zeros(2048, dtype=torch.uint8)
    s, d = src.data_ptr(), dst.data_ptr()
    grids = [DescriptorGrid(_u([s, s + 512]), _u([d, d + 1024]), _u([0, 128, 256]),
                            _u([64, 320, 704]), _u(run_bytes)),
             DescriptorGrid(_u([s]), _u([d + 1536]), _u([8]), _u([0]), _u([40]))]
    descriptor_copy.launch_grids(check_grids(grids), torch.device("cpu"))
    want = torch.zeros_like(dst)
    for g in grids:
        for s_row, d_row in zip(g.src_rows.tolist(), g.dst_rows.tolist(), strict=True):
            for s_off, d_off, n in zip(g.src_runs.tolist(), g.dst_runs.tolist(),
                                       g.run_bytes.tolist(), strict=True):
                at_s, at_d = s_row - s + s_off, d_row - d + d_off
                want[at_d:at_d + n] = src[at_s:at_s + n]
    assert torch.equal(dst, want)
