"""The copy kernels' data model (runtime/copy_specs.py): the one plan-segment conversion and the
one alignment rule the runtime's launchers share."""

from __future__ import annotations

import numpy as np
import pytest
from pdc.runtime.copy_specs import SegmentSpec, pow2_alignment
from pdc.runtime.plan_types import Segment


def test_a_plan_segment_becomes_the_spec_of_either_side():
    seg = Segment(src_offset=256, dst_offset=512, nbytes=128, repeat=4, src_stride=1024,
                  dst_stride=2048)
    assert SegmentSpec.of(seg, 4096, "src") == SegmentSpec(256, 128, 4, 1024, 4096)
    assert SegmentSpec.of(seg, 8192, "dst") == SegmentSpec(512, 128, 4, 2048, 8192)
    whole = Segment(0, 0, 64)
    assert SegmentSpec.of(whole, 64, "src").end == 64


def test_a_segment_side_is_src_or_dst():
    with pytest.raises(ValueError) as e:
        SegmentSpec.of(Segment(0, 0, 64), 64, "source")
    assert str(e.value) == "SegmentSpec.of: side is 'src' or 'dst', not 'source'"


@pytest.mark.parametrize("values,want", [
    ((0,), 16), ((0, 0), 16), ((48,), 16), ((6, 12), 2), ((1024, 2048, 3), 1),
    ((np.array([64, 128], np.uint64), 8), 8), ((np.array([], np.uint64),), 16),
    ((np.array([2**40, 2**41 + 4], np.uint64), np.array([32], np.int64)), 4),
])
def test_pow2_alignment_is_the_largest_shared_power_of_two_up_to_16(values, want):
    assert pow2_alignment(*values) == want


def test_pow2_alignment_takes_another_limit():
    assert pow2_alignment(64, 128, limit=32) == 32
    assert pow2_alignment(0, limit=4) == 4
