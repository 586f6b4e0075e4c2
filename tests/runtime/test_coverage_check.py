"""Exact page coverage at the last chunk (Note [Exact page coverage])."""

from __future__ import annotations

import numpy as np
import pytest
from pdc.runtime.indices import DecodeTarget, IndexError_, PrefillChunk, check_page_coverage

PAGE = 4


def _chunk(start: int, n: int, seq_len: int, last: bool) -> PrefillChunk:
    return PrefillChunk(start, np.arange(100 + start, 100 + start + n, dtype=np.int64), last,
                        seq_len)


def _target(pages: int, prefix: int = 0) -> DecodeTarget:
    return DecodeTarget(np.arange(pages, dtype=np.int64), prefix)


def test_whole_prompt_in_chunks_passes():
    check_page_coverage([_chunk(0, 2, 8, False), _chunk(2, 3, 18, True)], _target(5), PAGE)


def test_prefix_pages_may_be_skipped():
    # 9 tokens held by decode: pages 0-1 full, page 2 partly; pages 2..4 must be sent.
    check_page_coverage([_chunk(2, 3, 18, True)], _target(5, prefix=9), PAGE)


def test_partial_prefix_page_must_still_be_sent():
    with pytest.raises(IndexError_) as e:
        check_page_coverage([_chunk(3, 2, 18, True)], _target(5, prefix=9), PAGE)
    assert str(e.value) == ("prefill sent 2 of the 3 pages decode needs (positions 2..4); missing 2")


def test_decode_allocated_more_pages_than_the_prompt_has():
    with pytest.raises(IndexError_) as e:
        check_page_coverage([_chunk(0, 5, 18, True)], _target(7), PAGE)
    assert str(e.value) == "the prompt has 5 pages (18 tokens) but decode allocated 7"


def test_decode_allocated_fewer_pages():
    with pytest.raises(IndexError_) as e:
        check_page_coverage([_chunk(0, 4, 18, True)], _target(4), PAGE)
    assert str(e.value) == "the prompt has 5 pages (18 tokens) but decode allocated 4"


def test_chunks_that_skip_the_first_pages():
    with pytest.raises(IndexError_) as e:
        check_page_coverage([_chunk(3, 2, 18, True)], _target(5), PAGE)
    assert str(e.value) == ("prefill sent 2 of the 5 pages decode needs (positions 0..4); missing 0-2")


def test_a_gap_between_chunks():
    with pytest.raises(IndexError_) as e:
        check_page_coverage([_chunk(0, 1, 4, False), _chunk(2, 1, 12, False),
                             _chunk(4, 1, 18, True)], _target(5), PAGE)
    assert str(e.value) == ("prefill sent 3 of the 5 pages decode needs (positions 0..4); missing 1, 3")


def test_prefix_longer_than_the_prompt():
    with pytest.raises(IndexError_) as e:
        check_page_coverage([_chunk(0, 5, 18, True)], _target(5, prefix=20), PAGE)
    assert str(e.value) == "decode holds a prefix of 20 tokens but the prompt has only 18"


def test_window_page_count_must_match_the_window():
    from pdc.runtime.indices import window_pairs

    # 18 tokens, window 8, page 4: pages 2..4 hold the last 8 tokens -> 3 window pages.
    chunk = PrefillChunk(0, np.arange(5, dtype=np.int64), True, 18,
                         window_page_ids=np.array([1, 2], np.int64))
    target = DecodeTarget(np.arange(5, dtype=np.int64), 0,
                          window_page_ids=np.array([5, 6, 7], np.int64))
    with pytest.raises(IndexError_) as e:
        window_pairs(chunk, target, 8, PAGE)
    assert str(e.value) == "window needs 3 pages, prefill sent 2, decode holds 3"


def test_ring_state_needs_a_ring_slot_on_both_sides():
    from pdc.runtime.datapath import component_pairs

    from ..compiler.planning import ROOT, spec_and_layout

    _, layout = spec_and_layout(str(ROOT / "specs" / "qwen38.yaml"))
    page = layout.default_page_size if hasattr(layout, "default_page_size") else 64
    chunk = PrefillChunk(0, np.arange(1, dtype=np.int64), True, 10, slot=0, ring_slot=-1,
                         aux_row=0)
    target = DecodeTarget(np.arange(1, dtype=np.int64), 0, slot=0, ring_slot=2, aux_row=0)
    with pytest.raises(IndexError_) as e:
        component_pairs(layout, chunk, target, page)
    assert str(e.value).startswith("component '")
    assert "needs a ring slot on both sides (prefill -1, decode 2)" in str(e.value)


def test_a_window_that_reaches_into_decodes_prefix_starts_after_it():
    # Note [Window pages]: 60 tokens, window 32, pages of 16: the window's pages are 1..3;
    # decode holds 2 pages (32 tokens), so with `on_prefix_hit: skip` the lists hold 2..3
    from pdc.runtime.indices import window_first_page, window_pairs

    assert (window_first_page(60, 32, 16), window_first_page(60, 32, 16, 2),
            window_first_page(60, 32, 16, 1), window_first_page(20, 32, 16)) == (1, 2, 1, 0)
    chunk = PrefillChunk(2, np.array([6, 7], np.int64), True, 60,
                         window_page_ids=np.array([1, 5], np.int64))
    target = DecodeTarget(np.array([0, 0, 3, 4], np.int64), 32,
                          window_page_ids=np.array([6, 2], np.int64))
    src, dst = window_pairs(chunk, target, 32, 16, prefix_pages=2)
    assert (src.tolist(), dst.tolist()) == ([1, 5], [6, 2])
    with pytest.raises(IndexError_) as e:  # sent whole, the window has 3 pages
        window_pairs(chunk, target, 32, 16)
    assert str(e.value) == "window needs 3 pages, prefill sent 2, decode holds 2"


def test_the_layout_says_whether_a_window_skips_decodes_prefix():
    # sglang-swa's window skips the prefix's pages (SGLang's SWA radix cache keeps them);
    # hf-mistral-sw's is sent whole, as every window was before `on_prefix_hit` applied to it
    from pdc.generated.hf_mistral_sw.layout import LAYOUT as HF
    from pdc.generated.sglang_swa.layout import LAYOUT as SWA
    from pdc.runtime.datapath import component_pairs

    assert (SWA.component("swa_kv").on_prefix_hit, HF.component("kv").on_prefix_hit) == \
        ("skip", "send")
    chunk = PrefillChunk(2, np.array([6, 7], np.int64), True, 60, aux_row=1,
                         window_page_ids=np.array([1, 5], np.int64))
    target = DecodeTarget(np.array([0, 0, 3, 4], np.int64), 32, aux_row=2,
                          window_page_ids=np.array([6, 2], np.int64))
    pairs = component_pairs(SWA, chunk, target, 16)
    assert [x.tolist() for x in pairs["swa_kv"]] == [[1, 5], [6, 2]]
    assert [x.tolist() for x in pairs["kv"]] == [[6, 7], [3, 4]]
    # 18 tokens, window 7, pages of 4: pages 2..4, whatever decode's prefix of 3 pages holds
    chunk = PrefillChunk(0, np.arange(5, dtype=np.int64), True, 18,
                         window_page_ids=np.array([1, 2, 3], np.int64))
    target = DecodeTarget(np.arange(5, dtype=np.int64), 12,
                          window_page_ids=np.array([5, 6, 7], np.int64))
    assert [x.tolist() for x in component_pairs(HF, chunk, target, 4)["kv"]] == \
        [[1, 2, 3], [5, 6, 7]]
