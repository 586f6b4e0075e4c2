"""Note [Logprob tolerance] (pdc/serving/drift.py) on hand-made top-k lists: rounding-sized
differences and a near tie that flips a token pass; a larger difference, a flip that is no
tie, or a missing token fail with what differed."""

from __future__ import annotations

from pdc.serving.drift import compare


def top(*pairs):
    return [[t, lp] for t, lp in pairs]


REF = [5, 9, 4]
REF_TOP = [top((5, -0.50), (6, -2.0)), top((9, -1.00), (8, -1.01)), top((4, -0.2), (3, -3.0))]


def test_rounding_sized_differences_pass():
    got = [top((5, -0.51), (6, -2.0)), top((9, -1.02), (8, -1.00)), top((4, -0.21), (3, -3))]
    d = compare(REF, REF_TOP, REF, got, 0.05)
    assert d.ok and d.same_tokens == 3 and abs(d.max_diff_nats - 0.02) < 1e-9


def test_a_near_tie_that_flips_ends_the_comparison():
    got = [top((5, -0.51), (6, -2.0)), top((8, -1.00), (9, -1.02)), top((7, -0.1))]
    d = compare(REF, REF_TOP, [5, 8, 7], got, 0.05)
    assert (d.ok, d.same_tokens) == (True, 1) and abs(d.max_diff_nats - 0.01) < 1e-9
    assert abs(d.tie_nats - 0.02) < 1e-9  # PD's side: -1.00 against -1.02


def test_a_logprob_beyond_the_tolerance_fails():
    got = [top((5, -0.80), (6, -2.0))] + REF_TOP[1:]
    assert compare(REF, REF_TOP, REF, got, 0.05).error == (
        "token 0 (5): logprob -0.8000, the reference -0.5000, more than 0.05 apart")


def test_a_flip_that_is_no_tie_fails():
    got = [top((6, -0.1), (5, -2.5))] + REF_TOP[1:]
    assert compare(REF, REF_TOP, [6, 9, 4], got, 0.05).error == (
        "token 0: 6 where the reference chose 5, not a near tie (gaps reference, PD: 1.5000, "
        "2.4000; tolerance 0.05)")
    got = [top((7, -0.1))] + REF_TOP[1:]
    assert compare(REF, REF_TOP, [7, 9, 4], got, 0.05).error == (
        "token 0: 7 where the reference chose 5, not a near tie (gaps reference, PD: not in "
        "the top-k, not in the top-k; tolerance 0.05)")


def test_a_different_length_fails():
    assert compare(REF, REF_TOP, REF[:2], REF_TOP[:2], 0.05).error == \
        "2 tokens generated, the reference 3"
