"""Note [Staging programs]: a link's staging blocks and copy-kernel programs are built once
per (link, item counts) and reused by every request, and a component whose blocks follow
each other in the region moves in the kernels' dense layout (no per-block offsets)."""

from __future__ import annotations

import numpy as np
import pytest
from pdc.runtime import staging
from pdc.runtime.family import Family
from pdc.runtime.indices import DecodeTarget, IndexError_
from pdc.runtime.pools import Capacity, TensorPools

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def llama():
    family = Family.load("llama3_70b")
    plan = family.plan_for("tp=2", "tp=1", "local")
    return family.layout, plan


def _pools(layout, plan, side, rank):
    return TensorPools(layout, plan.registration(side, rank), Capacity(pages=4, slots=1,
                       aux_rows=1, window_pages=1), "cpu")


def test_blocks_are_one_tuple_per_link_and_item_counts(llama):
    layout, plan = llama
    link = plan.links[0]
    items = staging.request_items(layout, DecodeTarget(np.arange(3), 0, aux_row=0), 16)
    first, nbytes = staging.link_blocks(link, items)
    again, _ = staging.link_blocks(link, dict(items))
    other, other_bytes = staging.link_blocks(link, {**items, "kv": 2})
    assert again is first
    assert other is not first and other_bytes == nbytes * 2 // 3
    assert len(first) == 160  # 80 layers, K and V: one block per partial entry segment


def test_llama_links_move_in_the_dense_layout_with_one_program_per_request_shape(llama):
    layout, plan = llama
    link = plan.links[1]
    pools = _pools(layout, plan, "prefill", link.prefill)
    items = {"kv": 3, "aux_first_token": 1}
    blocks, nbytes = staging.link_blocks(link, items)
    launches = staging.Launches()
    groups = launches._groups("src", link, blocks, pools.view, None)
    assert list(groups) == ["kv"]
    kv = groups["kv"]
    assert (kv.dense_at, kv.items, kv.unit_bytes * kv.items) == (0, 3, nbytes)
    assert launches._groups("src", link, blocks, pools.view, None) is groups
    one_layer = launches._groups("src", link, blocks, pools.view, {kv_layer(link)})
    assert len(one_layer["kv"].offsets) == 2 and len(launches.tables) == 2


def kv_layer(link) -> int:
    return next(e.layer_id for e in link.entries if e.component == "kv")


def test_a_run_past_the_items_decode_asked_for_is_refused(llama):
    layout, plan = llama
    link = plan.links[0]
    pools = _pools(layout, plan, "prefill", link.prefill)
    blocks, nbytes = staging.link_blocks(link, {"kv": 2, "aux_first_token": 1})
    out = torch.zeros(nbytes, dtype=torch.uint8)
    positions = {"kv": (np.array([0, 1, 2]), np.array([0, 1, 2]))}
    with pytest.raises(IndexError_) as e:
        staging.Launches().gather_chunk(link, blocks, pools.view, positions, None, out)
    assert str(e.value) == "'kv' staging item 2 is outside the 2 items decode asked for"


def test_device_pools_copy_through_the_familys_generated_kernels(llama):
    from pdc.runtime import knobs
    from pdc.runtime.endpoints.staged import _launches

    layout, plan = llama
    link = plan.links[0]
    pools = _pools(layout, plan, "prefill", link.prefill)
    pools.arena.random_(0, 256, generator=torch.Generator().manual_seed(3))
    knobs.override(staging_copies="kernels")
    try:
        launches = _launches(pools, layout)
    finally:
        knobs.reset()
    assert launches.kernels.__name__ == "pdc.generated.llama3_70b.kernels"
    blocks, nbytes = staging.link_blocks(link, {"kv": 2, "aux_first_token": 1})
    out = torch.zeros(nbytes, dtype=torch.uint8)
    positions = {"kv": (np.array([3, 1]), np.array([0, 1]))}
    offs, lens = launches.gather_chunk(link, blocks, pools.view, positions, None, out)
    assert (offs.tolist(), lens.tolist()) == ([0], [nbytes])
    want = torch.zeros(nbytes, dtype=torch.uint8)
    for b in blocks:
        pool = pools.view("kv", link.entries[b.entry].src_pos)
        tb = b.segment.total_bytes
        staging.gather(pool, np.array([3, 1]), b.segment, want[b.offset:b.offset + 2 * tb])
    assert torch.equal(out, want)


@pytest.mark.parametrize("j", [[0], [2], [0, 1, 2, 3], [0, 1, 3, 4, 5], [4, 2, 3, 0], [1, 3, 5]])
def test_item_runs_are_the_contiguous_runs_of_the_positions(j):
    from pdc.runtime.indices import contiguous_runs

    starts, _, counts = contiguous_runs(np.array(j), np.array(j))
    want = list(zip(starts.tolist(), counts.tolist(), strict=True))
    assert staging._item_runs(np.array(j)) == want


def test_a_chunk_of_two_runs_gathers_each_run_at_its_items(llama):
    """Positions 0 and 2-3 of four: two launches' offsets in one buffer, the bytes of
    per-block reference copies, and the two stretches of the region named."""
    layout, plan = llama
    link = plan.links[0]
    pools = _pools(layout, plan, "prefill", link.prefill)
    pools.arena.random_(0, 256, generator=torch.Generator().manual_seed(4))
    blocks, nbytes = staging.link_blocks(link, {"kv": 4, "aux_first_token": 1})
    out = torch.zeros(nbytes, dtype=torch.uint8)
    ids, j = np.array([3, 0, 2]), np.array([0, 2, 3])
    offs, lens = staging.Launches().gather_chunk(link, blocks, pools.view, {"kv": (ids, j)},
                                                 None, out)
    want = torch.zeros(nbytes, dtype=torch.uint8)
    for b, got_ids, j0, n in staging.chunk_block_ranges(blocks, link, {"kv": (ids, j)}):
        pool = pools.view("kv", link.entries[b.entry].src_pos)
        at = b.offset + j0 * b.segment.total_bytes
        staging.gather(pool, got_ids, b.segment, want[at:at + n * b.segment.total_bytes])
    assert torch.equal(out, want)
    kv = [b for b in blocks if link.entries[b.entry].component == "kv"]
    tb = [b.segment.total_bytes for b in kv]
    assert offs.tolist() == [b.offset for b in kv] + [b.offset + 2 * b.segment.total_bytes for b in kv]
    assert lens.tolist() == tb + [2 * t for t in tb]


def test_a_kept_call_shape_moves_each_calls_own_items_and_keys_the_regions_place(llama):
    """Note [Staging call shapes]: gathers of one shape (same runs, same place in the arena)
    share one kept shape yet each moves its own ids; a region elsewhere in the arena or
    other runs make shapes of their own; a kept shape's region offsets equal a fresh one's.
    Scatters back give every gathered byte to the decode pools."""
    layout, plan = llama
    link = plan.links[0]
    src = _pools(layout, plan, "prefill", link.prefill)
    src.arena.random_(0, 256, generator=torch.Generator().manual_seed(7))
    dst = _pools(layout, plan, "decode", link.decode)
    blocks, nbytes = staging.link_blocks(link, {"kv": 2, "aux_first_token": 1})
    arena = torch.zeros(3 * nbytes, dtype=torch.uint8)
    launches = staging.Launches()

    def reference(ids, j, out):
        want = torch.zeros_like(out)
        for b, got, j0, n in staging.chunk_block_ranges(blocks, link, {"kv": (ids, j)}):
            pool = src.view("kv", link.entries[b.entry].src_pos)
            at = b.offset + j0 * b.segment.total_bytes
            staging.gather(pool, got, b.segment, want[at:at + n * b.segment.total_bytes])
        return want

    whole = np.arange(2)
    got = []
    for ids, at in (([3, 1], 0), ([0, 2], 0), ([2, 3], nbytes), ([1, 0], 0)):
        out = arena[at:at + nbytes]
        ids = np.array(ids)
        got.append(launches.gather_chunk(link, blocks, src.view, {"kv": (ids, whole)}, None, out))
        assert torch.equal(out, reference(ids, whole, out)), (ids, at)
    assert len(launches.calls) == 2  # one shape per place of the region
    launches.gather_chunk(link, blocks, src.view, {"kv": (np.array([1]), np.array([1]))}, None,
                          arena[:nbytes])
    assert len(launches.calls) == 3  # another run of items
    fresh = staging.Launches().gather_chunk(link, blocks, src.view,
                                            {"kv": (np.array([0, 1]), whole)}, None,
                                            arena[:nbytes])
    for offs, lens in got:
        assert (offs.tolist(), lens.tolist()) == (fresh[0].tolist(), fresh[1].tolist())
    region = arena[:nbytes]
    launches.gather_chunk(link, blocks, src.view, {"kv": (np.array([2, 0]), whole)}, None, region)
    for _ in range(2):  # the second scatter takes the kept shape
        launches.scatter_link(link, blocks, dst.view, {"kv": np.array([1, 3])}, region)
    for e in (e for e in link.entries if e.component == "kv"):
        sent = src.view("kv", e.src_pos)[[2, 0]]
        landed = dst.view("kv", e.dst_pos)[[1, 3]]
        seg = next(b.segment for b in blocks if b.entry == link.entries.index(e))
        assert torch.equal(staging_slice(landed, seg, "dst"), staging_slice(sent, seg, "src"))


def staging_slice(rows, seg, side):
    """The bytes of `seg` of each item row (the part of the item a staged link moves)."""
    parts = []
    for k in range(seg.repeat):
        off = (seg.src_offset + k * seg.src_stride) if side == "src" else \
            (seg.dst_offset + k * seg.dst_stride)
        parts.append(rows[:, off:off + seg.nbytes])
    return torch.cat(parts, dim=1)
