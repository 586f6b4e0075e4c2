"""Bytewise tests of the gather/scatter copy kernels against the torch references.

On CPU the kernels run in the Triton interpreter. The launcher picks the interpreter from the
tensors' device, so it does not depend on TRITON_INTERPRET; the variable is still set here (when
no GPU is present) for any other kernel module this test process imports.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import re  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pdc.runtime import copy_kernels as ck  # noqa: E402
from pdc.runtime.copy_kernels import (  # noqa: E402
    Entry,
    EntryTable,
    SegmentSpec,
    Tiling,
    gather,
    gather_reference,
    scatter,
    scatter_reference,
)

POISON = 0xAB
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int32,
          torch.uint8]


def random_pool(capacity: int, item_shape: tuple[int, ...], dtype: torch.dtype, gen,
                device="cpu") -> torch.Tensor:
    """A pool of random bytes (NaN bit patterns included) viewed as `dtype`."""
    esize = torch.empty((), dtype=dtype).element_size()
    nbytes = capacity * esize * int(torch.tensor(item_shape).prod())
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(capacity, *item_shape).to(device)


def poisoned(nbytes: int, device="cpu") -> torch.Tensor:
    return torch.full((nbytes,), POISON, dtype=torch.uint8, device=device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def check_gather(entries, indices, *, slack=24, **kw):
    """gather into a poisoned buffer == gather_reference into another; pools untouched."""
    table = EntryTable(entries)
    offsets = kw.get("staging_offsets")
    need = (table.staging_nbytes(indices.numel()) if offsets is None else
            max(o + indices.numel() * p for o, p in zip(offsets, table.packed_bytes,
                                                        strict=True)))
    device = indices.device
    before = [as_bytes(e.pool).clone() for e in entries]
    out = poisoned(need + slack, device)
    ref = out.clone()
    gather(entries, indices, out, **kw)
    gather_reference(entries, indices, ref, staging_offsets=offsets)
    assert torch.equal(out, ref)
    for e, b in zip(entries, before, strict=True):
        assert torch.equal(as_bytes(e.pool), b)
    return out


def check_scatter(entries, indices, staging, **kw):
    """scatter into poisoned pools == scatter_reference into poisoned copies; staging untouched."""
    for e in entries:
        as_bytes(e.pool).fill_(POISON)
    ref_entries = [Entry(e.pool.clone(), e.spec) for e in entries]
    before = staging.clone()
    scatter(entries, indices, staging, **kw)
    scatter_reference(ref_entries, indices, staging, staging_offsets=kw.get("staging_offsets"))
    for e, r in zip(entries, ref_entries, strict=True):
        assert torch.equal(as_bytes(e.pool), as_bytes(r.pool))
    assert torch.equal(staging, before)


def kv_geometry(page: int, heads: int, dim: int, esize: int, h0: int, h1: int) -> SegmentSpec:
    """Heads [h0, h1) of a [page, heads, dim] page."""
    return SegmentSpec(seg_offset=h0 * dim * esize, seg_bytes=(h1 - h0) * dim * esize,
                       repeat=page, seg_stride=heads * dim * esize,
                       item_bytes=page * heads * dim * esize)


# (name, item shape [page, heads, dim], head range or None for the whole item)
GEOMETRIES = [
    ("whole_page16", (16, 4, 8), None),
    ("heads_page16", (16, 4, 8), (1, 3)),
    ("heads_page1", (1, 4, 8), (2, 3)),
    ("heads_page64", (64, 2, 4), (1, 2)),
]


def geometry_spec(shape, heads, esize) -> SegmentSpec:
    page, nheads, dim = shape
    if heads is None:
        return SegmentSpec.whole(page * nheads * dim * esize)
    return kv_geometry(page, nheads, dim, esize, *heads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,shape,heads", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
def test_gather_then_scatter_dtypes(dtype, name, shape, heads):
    gen = torch.Generator().manual_seed(hash((str(dtype), name)) % 2**31)
    esize = torch.empty((), dtype=dtype).element_size()
    spec = geometry_spec(shape, heads, esize)
    entries = [Entry(random_pool(12, shape, dtype, gen), spec) for _ in range(3)]
    indices = torch.tensor([7, 0, 11, 3, 7], dtype=torch.int64)
    staging = check_gather(entries, indices)
    # Scatter the gathered bytes back into fresh pools, at other items (scatter needs uniques).
    dst = [Entry(torch.empty_like(e.pool), spec) for e in entries]
    check_scatter(dst, torch.tensor([1, 2, 3, 4, 5], dtype=torch.int64), staging)


def test_sub_block_segment_with_offset():
    # A GDN conv-state-like item [channels=3*16, kernel=3] in bf16: the middle sub-block (k part
    # of q|k|v), offset > 0, one contiguous piece per item.
    gen = torch.Generator().manual_seed(1)
    pool = random_pool(6, (48, 3), torch.bfloat16, gen)
    spec = SegmentSpec(seg_offset=16 * 3 * 2, seg_bytes=16 * 3 * 2, repeat=1, seg_stride=0,
                       item_bytes=48 * 3 * 2)
    check_gather([Entry(pool, spec)], torch.tensor([5, 2], dtype=torch.int64))


def test_mixed_entries_one_launch_round_trip_to_other_geometry():
    # Prefill TP1 pages hold 4 heads; decode TP2 rank 1 holds heads 2..3 as whole pages. The
    # packed stream is the same, so gather with head slices then scatter whole items must land
    # exactly the sliced heads. A state slot entry of another size rides in the same launch.
    gen = torch.Generator().manual_seed(2)
    page, heads, dim = 16, 4, 8
    src_k = random_pool(10, (page, heads, dim), torch.bfloat16, gen)
    src_v = random_pool(10, (page, heads, dim), torch.bfloat16, gen)
    src_state = random_pool(10, (3, 40), torch.float32, gen)
    slice_spec = kv_geometry(page, heads, dim, 2, 2, 4)
    entries = [Entry(src_k, slice_spec), Entry(src_v, slice_spec),
               Entry(src_state, SegmentSpec.whole(3 * 40 * 4))]
    src_idx = torch.tensor([4, 9, 0], dtype=torch.int64)
    staging = check_gather(entries, src_idx, slack=0)

    dst_k = torch.full((6, page, 2, dim), float("nan"), dtype=torch.bfloat16)
    dst_v = torch.full_like(dst_k, float("nan"))
    dst_state = torch.zeros(6, 3, 40)
    whole = SegmentSpec.whole(page * 2 * dim * 2)
    dst_entries = [Entry(dst_k, whole), Entry(dst_v, whole),
                   Entry(dst_state, SegmentSpec.whole(3 * 40 * 4))]
    dst_idx = torch.tensor([5, 1, 2], dtype=torch.int64)
    scatter(dst_entries, dst_idx, staging)
    assert torch.equal(as_bytes(dst_k[dst_idx]), as_bytes(src_k[src_idx][:, :, 2:4].contiguous()))
    assert torch.equal(as_bytes(dst_v[dst_idx]), as_bytes(src_v[src_idx][:, :, 2:4].contiguous()))
    assert torch.equal(as_bytes(dst_state[dst_idx]), as_bytes(src_state[src_idx]))
    assert torch.isnan(dst_k[[0, 3, 4]].float()).all()  # untouched items stay as they were


def test_empty_index_list_writes_nothing():
    gen = torch.Generator().manual_seed(3)
    entries = [Entry(random_pool(4, (16,), torch.uint8, gen), SegmentSpec.whole(16))]
    empty = torch.empty(0, dtype=torch.int64)
    out = poisoned(8)
    gather(entries, empty, out)
    scatter(entries, empty, out)
    assert bool((out == POISON).all())
    gather([], torch.tensor([0], dtype=torch.int64), out)  # no entries: nothing to do


@pytest.mark.parametrize("max_align", [1, 2, 4, 8, 16])
def test_every_word_size_path(max_align):
    gen = torch.Generator().manual_seed(4)
    spec = kv_geometry(16, 4, 16, 2, 1, 3)  # 64-byte pieces: every path is available
    entries = [Entry(random_pool(8, (16, 4, 16), torch.bfloat16, gen), spec) for _ in range(2)]
    indices = torch.tensor([3, 1, 6], dtype=torch.int64)
    staging = check_gather(entries, indices, max_align=max_align)
    check_scatter([Entry(torch.empty_like(e.pool), spec) for e in entries],
                  torch.tensor([0, 7, 2], dtype=torch.int64), staging, max_align=max_align)


def test_alignment_selection():
    pool = torch.zeros(4, 256, dtype=torch.uint8)
    table = EntryTable([Entry(pool, kv_geometry(4, 4, 8, 2, 1, 2))])  # 16-byte pieces
    staging = torch.zeros(512, dtype=torch.uint8)
    assert table.alignment == 16
    assert ck.launch_alignment(table, staging, None, 16) == 16
    assert ck.launch_alignment(table, staging, None, 4) == 4
    assert ck.launch_alignment(table, staging[1:], None, 16) == 1
    assert ck.launch_alignment(table, staging, [8], 16) == 8
    odd = EntryTable([Entry(pool, SegmentSpec(3, 6, 2, 10, 64))])
    assert odd.alignment == 1


def test_misaligned_staging_and_explicit_offsets():
    gen = torch.Generator().manual_seed(5)
    specs = [kv_geometry(16, 2, 8, 2, 0, 1), SegmentSpec(6, 10, 3, 20, 64)]
    entries = [Entry(random_pool(9, (16, 2, 8), torch.float16, gen), specs[0]),
               Entry(random_pool(9, (64,), torch.uint8, gen), specs[1])]
    indices = torch.tensor([8, 2, 2, 5], dtype=torch.int64)
    # Entry 1 first, a gap, then entry 0; the staging buffer itself starts at an odd address.
    buf = poisoned(1 + 4 * 30 + 13 + 4 * 256 + 5)
    out = buf[1:]
    ref = out.clone()
    offsets = [4 * 30 + 13, 0]
    gather(entries, indices, out, staging_offsets=offsets)
    gather_reference(entries, indices, ref, staging_offsets=offsets)
    assert torch.equal(out, ref) and buf[0] == POISON
    check_scatter(entries, torch.tensor([0, 8, 3, 1], dtype=torch.int64), out,
                  staging_offsets=offsets)


def test_tilings_split_rows_and_columns():
    gen = torch.Generator().manual_seed(6)
    specs = [kv_geometry(16, 4, 8, 4, 1, 4), SegmentSpec.whole(2048)]
    entries = [Entry(random_pool(5, (16, 4, 8), torch.float32, gen), specs[0]),
               Entry(random_pool(5, (2048,), torch.uint8, gen), specs[1])]
    indices = torch.tensor([4, 0, 3], dtype=torch.int64)
    for tiling in (Tiling(rows=4, block_bytes=64, iters=3), Tiling(rows=64, block_bytes=256,
                                                                       iters=1)):
        staging = check_gather(entries, indices, tiling=tiling)
        check_scatter(entries, torch.tensor([1, 2, 0], dtype=torch.int64), staging,
                      tiling=tiling)


def test_int64_addressing_past_2_gib():
    # A 4 GiB pool and a 2 GiB+ staging offset: untouched pages are never committed, so only
    # the items used cost memory. int32 offsets would wrap (or crash the interpreter).
    item = 4096
    capacity = (2**32) // item
    pool = torch.empty(capacity, item, dtype=torch.uint8)
    indices = torch.tensor([capacity - 1, 2**19 + 3, 1], dtype=torch.int64)
    gen = torch.Generator().manual_seed(7)
    for i in indices.tolist():
        pool[i] = torch.randint(0, 256, (item,), dtype=torch.uint8, generator=gen)
    spec = SegmentSpec(seg_offset=1024, seg_bytes=512, repeat=4, seg_stride=768,
                       item_bytes=item)
    entries = [Entry(pool, spec)]
    big = 2**31 + 64
    staging = torch.empty(big + 3 * spec.packed_bytes, dtype=torch.uint8)
    window = staging[big:]
    window.fill_(POISON)
    gather(entries, indices, staging, staging_offsets=[big])
    expect = pool[indices].view(3, item)[:, 1024:].unfold(1, 512, 768).reshape(3, -1)
    assert torch.equal(window.view(3, -1), expect)
    # ... and back, into other items past 2^31 bytes.
    dst = torch.tensor([capacity - 2, 2**19 + 9, 2**19 + 1], dtype=torch.int64)
    pool[dst] = POISON
    scatter(entries, dst, staging, staging_offsets=[big])
    got = pool[dst][:, 1024:].unfold(1, 512, 768).reshape(3, -1)
    assert torch.equal(got, expect)
    assert bool((pool[dst][:, :1024] == POISON).all())


def test_address_entries():
    gen = torch.Generator().manual_seed(8)
    pool = random_pool(6, (32,), torch.uint8, gen)
    spec = SegmentSpec(4, 8, 2, 16, 32)
    indices = torch.tensor([5, 0], dtype=torch.int64)
    out = poisoned(32)
    gather([Entry(pool.data_ptr(), spec, capacity=6)], indices, out)
    ref = poisoned(32)
    gather_reference([Entry(pool, spec)], indices, ref)
    assert torch.equal(out, ref)


@st.composite
def geometries(draw):
    unit = draw(st.sampled_from([1, 2, 4, 16]))
    seg = unit * draw(st.integers(1, 6))
    repeat = draw(st.integers(1, 4))
    stride = seg + unit * draw(st.integers(0, 3))
    offset = unit * draw(st.integers(0, 3))
    item = offset + (repeat - 1) * stride + seg + unit * draw(st.integers(0, 2))
    return SegmentSpec(offset, seg, repeat, stride, item)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    specs=st.lists(geometries(), min_size=1, max_size=3),
    capacity=st.integers(1, 9),
    data=st.data(),
)
def test_random_geometries(specs, capacity, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    entries = [Entry(random_pool(capacity, (s.item_bytes,), torch.uint8, gen), s) for s in specs]
    n = data.draw(st.integers(0, 6))
    src = torch.tensor(data.draw(st.lists(st.integers(0, capacity - 1), min_size=n,
                                          max_size=n)), dtype=torch.int64)
    tiling = data.draw(st.none() | st.builds(Tiling, rows=st.sampled_from([1, 2, 8]),
                                             block_bytes=st.sampled_from([4, 16, 64]),
                                             iters=st.integers(1, 3)))
    max_align = data.draw(st.sampled_from([1, 4, 16]))
    staging = check_gather(entries, src, tiling=tiling, max_align=max_align)
    dst = torch.randperm(capacity, generator=gen)[: min(n, capacity)]
    if dst.numel() == n:
        check_scatter(entries, dst, staging, tiling=tiling, max_align=max_align)


# ~~~ argument errors ~~~


def raises(msg: str):
    return pytest.raises(ValueError, match="^" + re.escape(msg) + "$")


def test_segment_spec_errors():
    with raises("SegmentSpec.item_bytes must be positive, got 0"):
        SegmentSpec(0, 1, 1, 1, 0)
    with raises("SegmentSpec.seg_bytes must be positive, got 0"):
        SegmentSpec(0, 0, 1, 1, 8)
    with raises("SegmentSpec.repeat must be >= 1, got 0"):
        SegmentSpec(0, 4, 0, 4, 8)
    with raises("SegmentSpec.seg_offset must be >= 0, got -1"):
        SegmentSpec(-1, 4, 1, 4, 8)
    with raises("SegmentSpec.seg_stride must be >= seg_bytes (4) when repeat > 1, got 3"):
        SegmentSpec(0, 4, 2, 3, 8)
    with raises("SegmentSpec.seg_stride must be >= 0, got -4"):
        SegmentSpec(0, 4, 1, -4, 8)
    with raises("SegmentSpec ends at byte 12 but item_bytes is 8"):
        SegmentSpec(4, 4, 2, 4, 8)
    with raises("SegmentSpec.repeat must be an int, got float"):
        SegmentSpec(0, 4, 1.0, 4, 8)
    with raises("SegmentSpec.seg_bytes must be an int, got bool"):
        SegmentSpec(0, True, 1, 4, 8)


def test_entry_and_table_errors():
    spec = SegmentSpec.whole(16)
    with raises("Entry.pool must be a contiguous tensor"):
        Entry(torch.zeros(4, 32, dtype=torch.uint8)[:, :16], spec)
    with raises("Entry.pool holds 40 bytes, not a positive multiple of item_bytes 16"):
        Entry(torch.zeros(40, dtype=torch.uint8), spec)
    with raises("Entry.capacity 3 items of 16 bytes exceed the pool's 32 bytes"):
        Entry(torch.zeros(32, dtype=torch.uint8), spec, capacity=3)
    with raises("Entry.capacity is required when Entry.pool is an address"):
        Entry(4096, spec)
    with raises("Entry.pool address must be positive, got 0"):
        Entry(0, spec, capacity=1)
    with raises("Entry.capacity must be >= 1, got 0"):
        Entry(4096, spec, capacity=0)
    with raises("Entry.pool must be a torch.Tensor or an int address, got str"):
        Entry("pool", spec)
    with raises("Entry.spec must be a SegmentSpec, got tuple"):
        Entry(4096, (0, 16, 1, 16, 16), capacity=1)
    with raises("entries[1] must be an Entry, got int"):
        EntryTable([Entry(4096, spec, capacity=1), 5])
    with raises("entries[1].pool is on meta, expected cpu"):
        EntryTable([Entry(torch.zeros(16, dtype=torch.uint8), spec),
                    Entry(torch.zeros(16, dtype=torch.uint8, device="meta"), spec)])
    with raises("Tiling.rows must be a power of two, got 3"):
        Tiling(rows=3, block_bytes=16, iters=1)
    with raises("Tiling.iters must be >= 1, got 0"):
        Tiling(rows=1, block_bytes=16, iters=0)
    with raises("Tiling tile of 1024 x 2048 bytes exceeds 2^20 bytes"):
        Tiling(rows=1024, block_bytes=2048, iters=1)


def test_launch_errors():
    pool = torch.zeros(4, 16, dtype=torch.uint8)
    entries = [Entry(pool, SegmentSpec.whole(16)), Entry(torch.zeros(8, 16, dtype=torch.uint8),
                                                         SegmentSpec(0, 8, 1, 8, 16))]
    idx = torch.tensor([1, 2], dtype=torch.int64)
    out = torch.zeros(64, dtype=torch.uint8)
    with raises("indices must be int64, got torch.int32"):
        gather(entries, idx.int(), out)
    with raises("indices must be 1-D, got shape (1, 2)"):
        gather(entries, idx[None], out)
    with raises("indices must be a torch.Tensor, got list"):
        gather(entries, [1, 2], out)
    with raises("indices[1] = 4 is out of range for entry 0 (capacity 4)"):
        gather(entries, torch.tensor([1, 4, 7], dtype=torch.int64), out)
    with raises("indices[1] = 5 is out of range for entry 1 (capacity 4)"):
        gather(entries[::-1], torch.tensor([1, 5, 0], dtype=torch.int64), out)
    with raises("indices[0] = -1 is out of range for entry 0 (capacity 4)"):
        gather(entries, torch.tensor([-1], dtype=torch.int64), out)
    with raises("scatter indices must be unique, but item 2 appears more than once"):
        scatter(entries, torch.tensor([2, 0, 2], dtype=torch.int64), out)
    with raises("staging holds 40 bytes but entry 1 needs bytes [32, 48)"):
        gather(entries, idx, out[:40])
    with raises("staging must be a contiguous tensor"):
        gather(entries, idx, out.view(8, 8)[:, :4])
    with raises("staging must be a torch.Tensor, got bytearray"):
        gather(entries, idx, bytearray(64))
    with raises("staging_offsets has 1 values for 2 entries"):
        gather(entries, idx, out, staging_offsets=[0])
    with raises("staging_offsets[1] must be >= 0, got -8"):
        gather(entries, idx, out, staging_offsets=[0, -8])
    with raises("staging regions of entries 0 and 1 overlap: [0, 32) and [16, 32)"):
        gather(entries, idx, out, staging_offsets=[0, 16])
    with raises("max_align must be one of 1, 2, 4, 8, 16, got 32"):
        gather(entries, idx, out, max_align=32)
    with raises("staging is on meta, but the entries' pools are on cpu"):
        gather(entries, idx, torch.zeros(64, dtype=torch.uint8, device="meta"))
    with raises("unsupported device meta: copies run on CUDA, or on CPU through the Triton "
                "interpreter"):
        gather([Entry(4096, SegmentSpec.whole(16), capacity=4)], idx.to("meta"),
               torch.zeros(64, dtype=torch.uint8, device="meta"))
    assert bool((out == 0).all())  # nothing ran
    scatter(entries, idx, out, staging_offsets=[0, 16])  # scatter may read shared bytes


# ~~~ CUDA ~~~


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("max_align", [1, 2, 4, 16])
def test_cuda_matches_reference(max_align):
    gen = torch.Generator().manual_seed(9)
    dev = "cuda"
    specs = [kv_geometry(16, 8, 128, 2, 2, 4), SegmentSpec.whole(16 * 8 * 128),
             SegmentSpec(6, 10, 3, 20, 64)]
    entries = [Entry(random_pool(40, (16, 8, 128), torch.bfloat16, gen, dev), specs[0]),
               Entry(random_pool(40, (16, 8, 128), torch.float8_e4m3fn, gen, dev), specs[1]),
               Entry(random_pool(40, (64,), torch.uint8, gen, dev), specs[2])]
    src = torch.randint(0, 40, (33,), generator=gen).to(dev)
    staging = check_gather(entries, src, max_align=max_align)
    dst = torch.randperm(40, generator=gen)[:33].to(dev)
    check_scatter(entries, dst, staging, max_align=max_align)
    torch.cuda.synchronize()
