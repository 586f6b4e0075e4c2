"""Note [Staging graphs]: the copy-kernel launches of one staged gather or scatter read their
item ids and staging offsets from one buffer and address the arena's base tensor, so a
request's region may lie anywhere in the arena; on a GPU a call shape seen before replays a
CUDA graph. The bytes are checked against the per-block reference copies (staging.gather and
staging.scatter) on the CPU (Triton's interpreter) and, with a GPU, through the graphs."""

from __future__ import annotations

import numpy as np
import pytest
from pdc.runtime import knobs, staging
from pdc.runtime.family import Family
from pdc.runtime.pools import Capacity, TensorPools

torch = pytest.importorskip("torch")

PAGES = 6


def _gpu(test):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(skip(test))


@pytest.fixture(params=["copy", "kernel", "mapped"])
def graph_input(request):
    """Each way a replayed graph reads its pinned buffer (Note [Pinned graph input])."""
    knobs.override(graph_input=request.param)
    yield request.param
    knobs.reset()


def _graphs_read(launches, mode):
    """Every kept graph reads its values the way the knob asked."""
    assert [g.pinned.mode for g in launches.graphs._graphs.values()] == [mode]


@pytest.fixture(scope="module")
def llama():
    family = Family.load("llama3_70b")
    return family.layout, family.plan_for("tp=2", "tp=1", "local")


def _pools(layout, plan, side, rank, device, seed):
    pools = TensorPools(layout, plan.registration(side, rank),
                        Capacity(pages=PAGES, slots=1, aux_rows=1, window_pages=1), device)
    g = torch.Generator(device=device).manual_seed(seed)
    pools.arena.random_(0, 256, generator=g)
    return pools


def _want_gather(link, blocks, pools, ids, nbytes):
    want = torch.zeros(nbytes, dtype=torch.uint8)
    for b in blocks:
        if link.entries[b.entry].component != "kv":
            continue
        pool = pools.view("kv", link.entries[b.entry].src_pos).cpu()
        tb = b.segment.total_bytes
        staging.gather(pool, np.asarray(ids), b.segment, want[b.offset:b.offset + len(ids) * tb])
    return want


def _gather_three(layout, plan, device):
    """Three requests of one shape gathered at three places of one arena; each region equals
    the reference and nothing outside it is written."""
    link = plan.links[1]
    pools = _pools(layout, plan, "prefill", link.prefill, device, 5)
    blocks, nbytes = staging.link_blocks(link, {"kv": 3, "aux_first_token": 1})
    launches = staging.Launches(staging.family_kernels(layout))
    arena = torch.zeros(4 * nbytes + 256, dtype=torch.uint8, device=device)
    for at, ids in ((0, [3, 1, 5]), (nbytes + 256, [0, 2, 4]), (2 * nbytes + 512, [5, 4, 3])):
        out = arena[at:at + nbytes]
        positions = {"kv": (np.array(ids), np.arange(3))}
        offs, lens = launches.gather_chunk(link, blocks, pools.view, positions, None, out)
        assert (offs.tolist(), lens.tolist()) == ([0], [nbytes])
        assert torch.equal(out.cpu(), _want_gather(link, blocks, pools, ids, nbytes))
    written = torch.zeros(len(arena), dtype=torch.bool)
    for at in (0, nbytes + 256, 2 * nbytes + 512):
        written[at:at + nbytes] = True
    assert not arena.cpu()[~written].any()
    return launches


def _scatter_three(layout, plan, device):
    link = plan.links[1]
    pools = _pools(layout, plan, "decode", link.decode, device, 6)
    blocks, nbytes = staging.link_blocks(link, {"kv": 2, "aux_first_token": 1})
    launches = staging.Launches(staging.family_kernels(layout))
    arena = torch.randint(0, 256, (3 * nbytes,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(7)).to(device)
    for at, ids in ((0, [4, 1]), (nbytes, [2, 5]), (2 * nbytes, [1, 4])):
        before = pools.arena.cpu().clone()
        region = arena[at:at + nbytes]
        launches.scatter_link(link, blocks, pools.view, {"kv": np.array(ids),
                                                         "aux_first_token": np.array([0])},
                              region)
        want = before.clone()
        want_pools = _pools(layout, plan, "decode", link.decode, "cpu", 0)
        want_pools.arena.copy_(want)
        for b in blocks:
            comp = link.entries[b.entry].component
            pool = want_pools.view(comp, link.entries[b.entry].dst_pos)
            got_ids = np.array(ids) if comp == "kv" else np.array([0])
            tb = b.segment.total_bytes
            staging.scatter(pool, got_ids, b.segment,
                            region.cpu()[b.offset:b.offset + len(got_ids) * tb])
        assert torch.equal(pools.arena.cpu(), want_pools.arena)
    return launches


def test_regions_anywhere_in_the_arena_gather_the_reference_bytes_on_the_cpu(llama):
    launches = _gather_three(*llama, "cpu")
    assert launches.graphs.stats["launched"] == 3  # no graphs off CUDA


def test_scatters_from_regions_anywhere_in_the_arena_on_the_cpu(llama):
    launches = _scatter_three(*llama, "cpu")
    assert launches.graphs.stats["launched"] == 3


@_gpu
def test_a_gather_shape_seen_before_replays_its_graph(llama, graph_input):
    launches = _gather_three(*llama, "cuda:0")
    stats = launches.graphs.stats
    assert (stats["launched"], stats["captured"], stats["replayed"]) == (2, 1, 1), \
        (stats, launches.graphs.last_capture_error)
    _graphs_read(launches, graph_input)


@_gpu
def test_a_scatter_shape_seen_before_replays_its_graph(llama, graph_input):
    launches = _scatter_three(*llama, "cuda:0")
    stats = launches.graphs.stats
    assert (stats["launched"], stats["captured"], stats["replayed"]) == (2, 1, 1), \
        (stats, launches.graphs.last_capture_error)
    _graphs_read(launches, graph_input)


@_gpu
def test_with_the_knob_off_every_call_goes_through_triton(llama):
    knobs.override(staging_graphs=0)
    try:
        launches = _gather_three(*llama, "cuda:0")
    finally:
        knobs.reset()
    stats = launches.graphs.stats
    assert (stats["launched"], stats["captured"], stats["replayed"]) == (3, 0, 0), stats


@_gpu
def test_replays_queued_back_to_back_each_gather_their_own_items(llama, graph_input):
    # Note [Pinned graph input]: six gathers of one shape queued without a wait between them;
    # each replay's values sit in a pinned buffer of the graph until its copy node, its first
    # kernel or (mapped) its launches ran, so a call must not overwrite them early.
    layout, plan = llama
    link = plan.links[1]
    pools = _pools(layout, plan, "prefill", link.prefill, "cuda:0", 5)
    blocks, nbytes = staging.link_blocks(link, {"kv": 3, "aux_first_token": 1})
    launches = staging.Launches(staging.family_kernels(layout))
    stride = -(-nbytes // 256) * 256
    arena = torch.zeros(6 * stride, dtype=torch.uint8, device="cuda:0")
    rng = np.random.default_rng(3)
    ids = [rng.permutation(PAGES)[:3] for _ in range(6)]
    for i, got in enumerate(ids):
        launches.gather_chunk(link, blocks, pools.view, {"kv": (got, np.arange(3))}, None,
                              arena[i * stride:i * stride + nbytes])
    for i, got in enumerate(ids):
        region = arena[i * stride:i * stride + nbytes].cpu()
        assert torch.equal(region, _want_gather(link, blocks, pools, got, nbytes)), i
    stats = launches.graphs.stats
    assert (stats["launched"], stats["captured"], stats["replayed"]) == (2, 1, 4), \
        (stats, launches.graphs.last_capture_error)
    _graphs_read(launches, graph_input)
