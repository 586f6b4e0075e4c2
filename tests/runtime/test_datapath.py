"""Request-level data path without an engine: descriptors applied with memmove in-process.

Pools of every prefill and decode rank live in this process; each chunk's descriptors are
built by the runtime's own functions (component_pairs, build_descriptors) and executed with
ctypes.memmove, then every decode byte is compared with the aggregate labels. This proves
chunking, absolute page positions, decode prefix skipping and slot/ring/aux state together.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from pdc.runtime import datapath, indices, staging
from pdc.runtime.datapath import (
    DescriptorTemplate,
    LocalBuffer,
    RemoteBuffer,
    build_descriptors,
    component_pairs,
)
from pdc.runtime.indices import DecodeTarget, IndexError_, PrefillChunk
from pdc.runtime.labels import item_labels, project
from pdc.runtime.pools import Capacity, RankPools

from ..compiler.planning import ROOT, plan_for

SEED = 7


def _positions(comp, n_pages, ids):
    if comp.index == "page":
        return [(p, int(ids["pages"][p])) for p in range(n_pages)]
    if comp.index == "ring":
        return [(i, ids["ring"] * comp.ring_rows + i) for i in range(comp.ring_rows)]
    return [(0, ids["slot"] if comp.index == "slot" else ids["aux"])]


def _fill_or_check(layout, plan, side, rank, pools, room, tokens, ids, check, skip_pages=0):
    s = plan.topology.prefill if side == "prefill" else plan.topology.decode
    n_pages = -(-tokens // s.page_size)
    bad = []
    for comp in layout.components:
        for pos, (tensor, layer_id) in enumerate(plan.registration(side, rank).entries(comp.name)):
            for where, item in _positions(comp, n_pages, ids):
                full = item_labels(SEED, room, comp, tensor, layer_id, where)
                data = project(comp, full, s.tp, rank.tp)
                view = pools.view(comp.name, pos)
                if not check:
                    view[item] = data
                elif not (comp.index == "page" and where < skip_pages) and \
                        not np.array_equal(view[item], data):
                    bad.append((comp.name, tensor, layer_id, where))
    return bad


def _run(path, prefill, decode, tokens, chunk_pages, prefix_tokens, rng, staged=False,
         template=False):
    layout, plan = plan_for(path, prefill, decode)
    topo = plan.topology
    cap = Capacity(pages=16, slots=2, aux_rows=2, window_pages=16)
    pre = {r.rank: RankPools(layout, r, cap) for r in plan.prefill}
    dec = {r.rank: RankPools(layout, r, cap) for r in plan.decode}
    ps = topo.prefill.page_size
    n_pages = -(-tokens // ps)
    p_ids = {"pages": rng.permutation(16)[:n_pages], "slot": 1, "ring": 1, "aux": 0}
    d_ids = {"pages": rng.permutation(16)[:n_pages], "slot": 0, "ring": 0, "aux": 1}
    for rank, pools in pre.items():
        _fill_or_check(layout, plan, "prefill", rank, pools, 5, tokens, p_ids, check=False)
    for pools in dec.values():
        pools.arena[:] = 0xA5
    target = DecodeTarget(np.asarray(d_ids["pages"]), prefix_tokens, 0, 0, 1)
    items = staging.request_items(layout, target, ps)
    regions = {}  # link -> (prefill staging buffer, decode staging buffer, blocks)
    for link in plan.links:
        blocks, nbytes = staging.link_blocks(link, items)
        regions[link] = (np.zeros(nbytes + 1, np.uint8), np.zeros(nbytes + 1, np.uint8), blocks)
    for start in range(0, n_pages, chunk_pages):
        last = start + chunk_pages >= n_pages
        chunk = PrefillChunk(start, np.asarray(p_ids["pages"][start:start + chunk_pages]), last,
                             min(tokens, (start + chunk_pages) * ps),
                             1 if last else -1, 1 if last else -1, 0 if last else -1)
        for link in plan.links:
            src, dst = pre[link.prefill], dec[link.decode]
            local = {n: [LocalBuffer(src.address(n, i), b.item_bytes, b.capacity)
                         for i, b in enumerate(bs)] for n, bs in src.buffers.items()}
            remote = {n: [RemoteBuffer(b.layer_id, 0, dst.address(n, i), b.item_bytes,
                                       b.capacity) for i, b in enumerate(bs)]
                      for n, bs in dst.buffers.items()}
            pairs = component_pairs(layout, chunk, target, ps)
            if template:  # Note [Descriptor templates]
                d = DescriptorTemplate.of(link, local, remote, staged).build(pairs)
            else:
                d = build_descriptors(link, local, remote, pairs, whole_only=staged)
            moves = list(zip(d.src.tolist(), d.dst.tolist(), d.nbytes.tolist(), strict=True))
            if staged:
                mine, theirs, blocks = regions[link]
                positions = staging.chunk_positions(layout, chunk, target, ps)
                for b, ids, j0, n in staging.chunk_block_ranges(blocks, link, positions):
                    e = link.entries[b.entry]
                    tb = b.segment.total_bytes
                    at = b.offset + j0 * tb
                    staging.gather(src.view(e.component, e.src_pos), ids, b.segment,
                                   mine[at:at + n * tb])
                    moves.append((mine.ctypes.data + at, theirs.ctypes.data + at, n * tb))
            for s_addr, d_addr, n in moves:
                ctypes.memmove(d_addr, s_addr, n)
    if staged:
        ids = staging.target_ids(layout, target, ps)
        for link, (_, theirs, blocks) in regions.items():
            for b in blocks:
                e = link.entries[b.entry]
                tb = b.segment.total_bytes
                staging.scatter(dec[link.decode].view(e.component, e.dst_pos), ids[e.component],
                                b.segment, theirs[b.offset:b.offset + b.items * tb])
    bad = []
    for rank, pools in dec.items():
        bad += _fill_or_check(layout, plan, "decode", rank, pools, 5, tokens, d_ids, check=True,
                              skip_pages=prefix_tokens // ps)
    return bad


LLAMA = ROOT / "specs" / "llama3-70b.yaml"
QWEN = ROOT / "specs" / "qwen38.yaml"
GLM = ROOT / "specs" / "glm52.yaml"


@pytest.mark.parametrize("path,prefill,decode", [
    (LLAMA, {"tp": 2}, {"tp": 1}),
    (LLAMA, {"tp": 1}, {"tp": 2}),
    (LLAMA, {"tp": 2, "pp": 2}, {"tp": 1}),
    (GLM, {"tp": 2, "pp": 2}, {"tp": 1}),
    (QWEN, {"tp": 2}, {"tp": 1}),
])
@pytest.mark.parametrize("template", [False, True])
def test_chunked_request_lands_byte_exact(path, prefill, decode, template):
    rng = np.random.default_rng(0)
    ps = 16 if path == LLAMA else 64
    assert _run(path, prefill, decode, tokens=5 * ps + 3, chunk_pages=2, prefix_tokens=ps,
                rng=rng, template=template) == []


@pytest.mark.parametrize("path,prefill,decode", [
    (LLAMA, {"tp": 2}, {"tp": 1}),
    (LLAMA, {"tp": 1}, {"tp": 4}),
    (QWEN, {"tp": 2, "pp": 2}, {"tp": 1}),
    (QWEN, {"tp": 1}, {"tp": 2}),
])
@pytest.mark.parametrize("template", [False, True])
def test_staged_path_lands_byte_exact(path, prefill, decode, template):
    ps = 16 if path == LLAMA else 64
    assert _run(path, prefill, decode, tokens=5 * ps + 3, chunk_pages=2, prefix_tokens=ps,
                rng=np.random.default_rng(2), staged=True, template=template) == []


def _llama_buffers(bad_layer=False):
    local = {"kv": [LocalBuffer(4096 + i * (1 << 20), 32768, 16) for i in range(160)],
             "aux_first_token": [LocalBuffer(8192, 64, 2)]}
    remote = {"kv": [RemoteBuffer(i % 80, 0, (1 << 30) + i * (1 << 20), 32768, 16)
                     for i in range(160)],
              "aux_first_token": [RemoteBuffer(0xFFFFFFFF, 0, 1 << 31, 64, 2)]}
    if bad_layer:
        remote["kv"][7] = RemoteBuffer(70, 0, 1 << 29, 32768, 16)
    return local, remote


def test_template_gives_the_same_descriptors_in_the_same_order():
    # Note [Descriptor templates]: every chunk kind, equal to build_descriptors element by
    # element; a layer-limited chunk (streaming) takes build_descriptors itself.
    layout, plan = plan_for(LLAMA, {"tp": 1}, {"tp": 1})
    (link,) = plan.links
    local, remote = _llama_buffers()
    rng = np.random.default_rng(3)
    target = DecodeTarget(rng.permutation(16)[:9], 16, aux_row=1)
    for chunk in (PrefillChunk(0, rng.permutation(16)[:5], False, 80),
                  PrefillChunk(5, rng.permutation(16)[:4], True, 140, aux_row=0),
                  PrefillChunk(0, np.arange(9), True, 140, aux_row=1)):
        pairs = component_pairs(layout, chunk, target, 16)
        for layers in (None, {0, 5, 79}):
            want = build_descriptors(link, local, remote, pairs, layers)
            got = DescriptorTemplate.of(link, local, remote).build(pairs, layers)
            for w, g in ((want.src, got.src), (want.dst, got.dst), (want.nbytes, got.nbytes)):
                assert g.dtype == np.uint64 and w.tolist() == g.tolist()


def test_template_refuses_what_build_descriptors_refuses():
    layout, plan = plan_for(LLAMA, {"tp": 1}, {"tp": 1})
    (link,) = plan.links
    local, remote = _llama_buffers(bad_layer=True)
    pairs = component_pairs(layout, PrefillChunk(0, np.array([0, 1]), False, 32),
                            DecodeTarget(np.array([3, 4]), 0), 16)
    tmpl = DescriptorTemplate.of(link, local, remote)  # made without complaint: no ids yet
    for build in (lambda: build_descriptors(link, local, remote, pairs), lambda: tmpl.build(pairs)):
        with pytest.raises(IndexError_) as info:
            build()
        assert str(info.value) == ("peer entry 7 of 'kv' is layer 70 with 32768 B items; the "
                                   "plan expects layer 7 with 32768 B")
    local, remote = _llama_buffers()
    pairs = component_pairs(layout, PrefillChunk(0, np.array([0, 1]), False, 32),
                            DecodeTarget(np.array([3, 99]), 0), 16)
    with pytest.raises(IndexError_) as info:
        DescriptorTemplate.of(link, local, remote).build(pairs)
    assert str(info.value) == "decode 'kv' index 99 is outside the registered capacity 16"


def test_staging_merges_a_single_chunk_into_few_descriptors():
    layout, plan = plan_for(LLAMA, {"tp": 2}, {"tp": 1})
    link = plan.links[0]
    items = {"kv": 8, "aux_first_token": 1}
    blocks, nbytes = staging.link_blocks(link, items)
    assert len(blocks) == 160 and nbytes == 160 * 8 * 16 * 1024
    assert staging.partial_descriptors(link, items) == 160 * 8 * 16
    src = np.array([b.offset for b in blocks], np.int64) + 4096
    dst = src + (1 << 20)
    n = np.array([b.items * b.segment.total_bytes for b in blocks], np.int64)
    s, d, m = staging.merge_descriptors(src, dst, n)
    assert (s.tolist(), d.tolist(), m.tolist()) == ([4096], [4096 + (1 << 20)], [nbytes])


def test_arena_first_fit_and_merge():
    a = staging.Arena(1024)
    x, y = a.alloc(100), a.alloc(200)
    assert (x, y) == (0, 128)
    assert a.alloc(2000) is None
    a.release(x, 100)
    a.release(y, 200)
    assert a.free == [(0, 1024)]


def test_chunk_page_offsets_relative_instead_of_absolute_is_caught(monkeypatch):
    real = indices.chunk_page_pairs

    def relative(chunk, target, page_size, prefix_pages=None):
        moved = PrefillChunk(0, chunk.page_ids, chunk.last, chunk.seq_len)
        return real(moved, target, page_size, prefix_pages)

    monkeypatch.setattr(datapath, "chunk_page_pairs", relative)
    bad = _run(LLAMA, {"tp": 1}, {"tp": 1}, tokens=80, chunk_pages=2, prefix_tokens=0,
               rng=np.random.default_rng(1))
    assert any(name == "kv" for name, *_ in bad)


def test_out_of_range_decode_page_is_refused_before_any_descriptor():
    layout, plan = plan_for(LLAMA, {"tp": 1}, {"tp": 1})
    (link,) = plan.links
    local = {"kv": [LocalBuffer(4096, 32768, 16)] * 160, "aux_first_token": [
        LocalBuffer(8192, 64, 2)]}
    remote = {"kv": [RemoteBuffer(i, 0, 1 << 30, 32768, 16) for i in range(80)] * 2,
              "aux_first_token": [RemoteBuffer(0xFFFFFFFF, 0, 1 << 31, 64, 2)]}
    chunk = PrefillChunk(0, np.array([0, 1]), False, 32)
    target = DecodeTarget(np.array([3, 99]), 0)
    pairs = component_pairs(layout, chunk, target, 16)
    with pytest.raises(IndexError_) as info:
        build_descriptors(link, local, remote, pairs)
    assert str(info.value) == "decode 'kv' index 99 is outside the registered capacity 16"


def test_contiguous_runs():
    s, d, n = indices.contiguous_runs(np.array([4, 5, 6, 9, 10]), np.array([0, 1, 2, 3, 4]))
    assert s.tolist() == [4, 9] and d.tolist() == [0, 3] and n.tolist() == [3, 2]
