"""Note [Pinned graph input]: a replayed descriptor-copy launch reads its table from the
graph's own pinned buffer, copied by the graph's first node ("copy"), read across the bus by
a first kernel ("kernel") or by the launches themselves ("mapped"); launches of one shape
queued back to back each copy their own descriptors (needs a CUDA device). On the CPU, with a
counting stand-in for the graph: calls alternate the slots and fill each exactly."""

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
    assert descriptor_copy.graph_stats["captured"] == before["captured"] + 1, \
        descriptor_copy.graph_stats
    assert descriptor_copy.graph_stats["replayed"] == before["replayed"] + rounds - 2
    assert [g.mode for g in descriptor_copy._graphs.values()] == [graph_input]


class _FakeSlot:
    """A slot whose graph and event only count (unit test of PinnedGraph.call's buffer use)."""

    def __init__(self, n):
        self.host_np = np.zeros(n, np.int64)
        self.mode, self.copy_inside, self.replayed = "kernel", False, False
        self.replays = 0
        self.graph = self.read = self

    def replay(self):
        self.replays += 1

    def record(self, stream):
        pass

    def synchronize(self):
        pass


def _fake_graph(slots):
    import threading

    from pdc.runtime.pinned_graph import PinnedGraph

    graph = object.__new__(PinnedGraph)
    graph.slots, graph.mode, graph.stream, graph._next = slots, "kernel", None, 0
    graph._lock = threading.Lock()
    return graph


def test_calls_alternate_slots_and_write_the_parts_back_to_back():
    slots = [_FakeSlot(5), _FakeSlot(5)]
    graph = _fake_graph(slots)
    graph.put([np.array([1, 2]), np.array([3, 4, 5])])
    graph.put([np.array([6, 7, 8]), np.array([9, 10])])
    graph.call(lambda buf: buf.fill(11))
    assert slots[0].host_np.tolist() == [11] * 5
    assert slots[1].host_np.tolist() == [6, 7, 8, 9, 10]
    assert [s.replays for s in slots] == [2, 1]


def test_parts_that_do_not_fill_the_graph_input_are_refused():
    graph = _fake_graph([_FakeSlot(5)])
    with pytest.raises(ValueError) as info:
        graph.put([np.array([1, 2]), np.array([3])])
    assert str(info.value) == "3 values for a graph input of 5"


@pytest.mark.gpu
@needs_cuda
def test_captures_run_on_a_stream_of_their_own_while_another_thread_queues_on_the_pool():
    # Note [Own streams]: another thread keeps queueing copies on every stream of torch's
    # pool while this one captures graphs; a capture on a pool stream would sooner or later
    # take one of those streams and fail (cudaErrorStreamCaptureIsolation).
    import threading

    from pdc.runtime.cuda_streams import capture_stream
    from pdc.runtime.pinned_graph import PinnedGraph

    dev = torch.device("cuda:0")
    pool = [torch.cuda.Stream(dev) for _ in range(64)]  # every pool stream, twice
    assert capture_stream(dev).cuda_stream not in {s.cuda_stream for s in pool}
    others: list = []
    done = threading.Event()

    def queue_on_the_pool():
        a = torch.ones(1 << 16, device=dev)
        b = torch.empty_like(a)
        try:
            while not done.is_set():
                for s in pool:
                    with torch.cuda.stream(s):
                        b.copy_(a)
            others.append(capture_stream(dev).cuda_stream)
        except RuntimeError as exc:  # the test reports it
            others.append(exc)

    thread = threading.Thread(target=queue_on_the_pool)
    thread.start()
    try:
        values = torch.zeros(8, dtype=torch.int64, device=dev)
        outs = []
        for i in range(40):
            out = torch.zeros(8, dtype=torch.int64, device=dev)

            def build_run(v, out=out):
                return lambda: out.copy_(v + 1)

            graph = PinnedGraph(values, build_run, torch.cuda.current_stream(dev), dev, "copy")
            graph.put([np.arange(8, dtype=np.int64) + i])
            outs.append(out)
        torch.cuda.synchronize(dev)
        assert [o.tolist() for o in outs] == [list(range(i + 1, i + 9)) for i in range(40)]
    finally:
        done.set()
        thread.join()
    # the other thread's own capture stream is neither this thread's nor an error
    assert others and not isinstance(others[0], Exception), others
    assert others[0] != capture_stream(dev).cuda_stream
