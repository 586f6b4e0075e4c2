"""Note [Pinned graph input]: a replayed descriptor-copy launch reads its table from the
graph's own pinned buffer, copied by the graph's first node ("copy"), read across the bus by
a first kernel ("kernel") or by the launches themselves ("mapped"); launches of one shape queued back to back each copy their own descriptors. Needs a
CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("graph_input", ["copy", "kernel", "mapped"])
def test_descriptor_copies_of_one_shape_queued_back_to_back_each_land(graph_input):
    from pdc.runtime import descriptor_copy, knobs

    knobs.override(graph_input=graph_input)
    descriptor_copy._graphs.clear()
    descriptor_copy._seen.clear()
    try:
        _back_to_back(descriptor_copy, graph_input)
    finally:
        knobs.reset()
        descriptor_copy._graphs.clear()


def _back_to_back(descriptor_copy, graph_input):
    page, n, rounds = 4096, 64, 6
    src = torch.randint(0, 256, (n * page,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(rounds * 2 * n * page, dtype=torch.uint8, device="cuda:0")
    rng = np.random.default_rng(2)
    before = dict(descriptor_copy.graph_stats)
    targets = []
    s = src.data_ptr() + np.arange(n, dtype=np.uint64) * page
    for r in range(rounds):
        pages = rng.permutation(2 * n)[:n] + r * 2 * n
        targets.append(pages)
        d = dst.data_ptr() + pages.astype(np.uint64) * page
        descriptor_copy.launch(s, d, np.full(n, page, np.uint64), torch.device("cuda:0"))
    torch.cuda.synchronize()
    pages_of = dst.view(-1, page)
    for r, pages in enumerate(targets):
        assert torch.equal(pages_of[torch.from_numpy(pages).cuda()], src.view(-1, page)), r
    assert descriptor_copy.graph_stats["captured"] == before["captured"] + 1
    assert descriptor_copy.graph_stats["replayed"] == before["replayed"] + rounds - 2
    assert [g.mode for g in descriptor_copy._graphs.values()] == [graph_input]
