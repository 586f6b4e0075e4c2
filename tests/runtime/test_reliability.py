"""Reliability under faults and load, over real engines (short versions of bench/reliability.py).

Every run goes through pdc.verify.reliability: one process per rank, LIFO page reuse, per-byte
labels on every successful request, canaries on every page given back, quarantined pages
never handed out again (Note [What is checked] there). A run is clean when nothing was lost
or corrupted and every failure is explained (an abort, an injected fault or bad index).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from pdc.verify.reliability import run
from pdc.verify.reliability_types import Fault, RelConfig

pytestmark = pytest.mark.engines

TINY = str(Path(__file__).parent / "specs" / "tiny.yaml")
# Failure detection gets 2 s: on this 2-core box, with Mooncake's writers busy-spinning, a
# rank's control thread can go ~1 s without running (endpoint stats: max_stall_ms).
FAST = dict(heartbeat_interval_s=0.1, peer_dead_after_s=2.0, abort_ack_timeout_s=1.5,
            transfer_timeout_s=10.0, prefill_room_timeout_s=20.0, reconnect_interval_s=0.3)
# Eight rank processes on two cores: the soak is about load, not detection speed.
SOAK = dict(FAST, peer_dead_after_s=10.0, abort_ack_timeout_s=10.0, transfer_timeout_s=30.0,
            prefill_room_timeout_s=60.0)

ABORTED = "aborted by decode"
BAD_INDEX = re.compile(r"prefill\.dpN\.ppN\.tpN: bad index from decode ppN\.tpN: 'kv' page N "
                       r"is outside the registered capacity N")
FAULT_REASONS = re.compile(
    r"(decode peer decode\.dpN\.ppN\.tpN silent for N s"
    r"|prefill peer prefill\.dpN\.ppN\.tpN silent for N s"
    r"|transfer failed: descriptors \[N, N\) failed \(rc -N: peer died, rejected the write, or "
    r"MC_TRANSFER_TIMEOUT expired\)"
    r"|no terminal report: .* went down first"
    r"|decode rank decode\.dpN\.ppN\.tpN registered again \(restarted\); requests of its "
    r"previous incarnation fail)")


def assert_clean(r) -> None:
    detail = r.summary() + (f"\n  logs: {r.log_dir}" if r.log_dir else "") + "".join(
        f"\n--- {name} (end) ---\n{tail}" for name, tail in r.log_tails.items())
    assert r.lost == 0, detail
    assert r.corrupted == 0 and r.corrupted_bytes == 0, detail
    assert r.unexpected == [] and r.inconsistent == [], detail
    assert r.succeeded + r.failed == r.requests, detail
    for ranks in r.rank_stats.values():
        assert ranks.get("handler_errors", 0) == 0 and ranks.get("worker_errors", 0) == 0, detail


def test_abort_storm_reuses_pages_at_once_and_corrupts_nothing():
    r = run(RelConfig(spec=TINY, engine="mooncake", requests=1000, abort_rate=0.4,
                      retry_rate=0.5, concurrency=8, knobs=FAST), out=io.StringIO())
    assert_clean(r)
    assert r.requests == 1000 and r.aborts >= 300 and r.retries >= 60, r.summary()
    # Aborts land mid-transfer: prefill saw them with writes still in flight.
    assert r.totals["aborts_with_writes_in_flight"] >= 50, r.summary()
    assert set(r.reasons) == {ABORTED}, r.summary()
    assert r.succeeded >= 500 and r.quarantined == 0, r.summary()


def test_killed_ranks_fail_only_their_requests_and_come_back_after_restart():
    faults = [Fault(at=40, action="kill", side="decode", dp=2, restart_after_s=0.5),
              Fault(at=140, action="kill", side="prefill", dp=1, restart_after_s=0.5)]
    r = run(RelConfig(spec=TINY, prefill="tp=1,dp=2", decode="tp=1,dp=3", requests=420,
                      abort_rate=0.1, concurrency=4, faults=faults, knobs=FAST),
            out=io.StringIO())
    assert_clean(r)
    assert r.faults_injected == 2 and r.fault_requests >= 2, r.summary()
    # No hang: every request a fault hit ended within peer_dead_after_s + abort_ack_timeout_s
    # (+ slack for a 2-core box that is also starting the replacement process).
    assert r.fault_resolution_s < 2.0 + 1.5 + 3.0, r.summary()
    for reason in set(r.reasons) - {ABORTED}:
        assert FAULT_REASONS.fullmatch(reason), reason
    # Both restarted ranks registered again and served requests, verified.
    assert r.rank_stats["decode.dp2.pp0.tp0"]["succeeded"] > 0, r.summary()
    assert r.rank_stats["prefill.dp1.pp0.tp0"]["succeeded"] > 0, r.summary()
    assert r.rank_stats["prefill.dp0.pp0.tp0"]["reregistrations"] == 1
    assert r.rank_stats["decode.dp0.pp0.tp0"]["reconnects"] == 1


def test_frozen_ranks_fail_only_their_requests_and_wake_up_harmless():
    # Writes to a frozen rank busy-spin in Mooncake until its timeout: on a 2-core box that
    # starves everyone, so the silence verdict gets more room here.
    knobs = dict(FAST, peer_dead_after_s=2.5)
    # Each rank sleeps past peer_dead_after_s (+ abort_ack_timeout_s for the prefill rank).
    faults = [Fault(at=40, action="stop", side="decode", dp=2, resume_after_s=4.0),
              Fault(at=140, action="stop", side="prefill", dp=1, resume_after_s=5.0)]
    r = run(RelConfig(spec=TINY, prefill="tp=1,dp=2", decode="tp=1,dp=3", requests=420,
                      abort_rate=0.1, concurrency=4, faults=faults, knobs=knobs),
            out=io.StringIO())
    assert_clean(r)
    assert r.faults_injected == 2 and r.fault_requests >= 2, r.summary()
    # A write to a frozen decode rank ends at Mooncake's own timeout (5 s) at the latest;
    # requests to a frozen prefill rank at peer_dead_after_s + abort_ack_timeout_s.
    assert r.fault_resolution_s < 5.0 + 3.0, r.summary()
    for reason in set(r.reasons) - {ABORTED}:
        assert FAULT_REASONS.fullmatch(reason), reason
    # The frozen decode rank noticed the gap and quarantined what was in flight across it;
    # requests to the frozen prefill rank (asleep past peer_dead_after_s +
    # abort_ack_timeout_s) were quarantined by their decode ranks. When it woke up, its late
    # writes landed in quarantined pages only: nothing above counts a corrupted byte.
    assert r.rank_stats["decode.dp2.pp0.tp0"]["self_freezes"] == 1
    quarantined = sum(s.get("quarantined", 0) for n, s in r.rank_stats.items()
                      if n.startswith("decode.") and n != "decode.dp2.pp0.tp0")
    assert quarantined >= 1 and r.quarantined >= quarantined, r.summary()
    assert r.rank_stats["decode.dp2.pp0.tp0"]["succeeded"] > 0  # it serves again


def test_soak_across_four_rank_pairs():
    """Hetero TP (prefill tp=2 x dp=2 -> decode tp=1 x dp=4) through the staged path (every
    link of every request), chunked prefill, prefix hits, aborts and re-runs, bad page ids
    from decode, link checksums on."""
    r = run(RelConfig(spec=TINY, prefill="tp=2,dp=2", decode="tp=1,dp=4", requests=500,
                      abort_rate=0.1, bad_index_rate=0.02, concurrency=6,
                      knobs=dict(SOAK, staged_min_descriptors=0)),
            out=io.StringIO())
    assert_clean(r)
    assert r.requests == 500
    assert r.totals["staged_links"] >= 2 * 450, r.summary()  # two links per request
    for reason in set(r.reasons) - {ABORTED}:
        assert BAD_INDEX.fullmatch(reason), reason
    assert r.totals.get("checksum_mismatches", 0) == 0


@pytest.mark.parametrize("secret", ["", "a control secret of 16+ bytes"],
                         ids=["open", "authenticated"])
def test_fuzzed_control_plane_keeps_serving_verified_traffic(secret):
    """With a secret every rank authenticates (Note [Control authentication]) and the fuzzer
    is an insider whose hostile messages pass it, besides outsiders, forged MACs and replays
    that must die at the authentication."""
    knobs = dict(FAST, prefill_room_timeout_s=2.0, max_message_bytes=1 << 20,
                 max_registrations=16, max_pending_rooms_per_peer=64, max_finished_rooms=2000,
                 control_secret=secret)
    r = run(RelConfig(spec=TINY, decode="tp=1,dp=2", decode_groups=(0,), requests=300,
                      abort_rate=0.1, fuzz=True, knobs=knobs), out=io.StringIO())
    assert_clean(r)
    assert set(r.reasons) == {ABORTED}, r.summary()
    f = r.fuzz
    assert f["sent"] >= 500, f
    for kind in ("malformed message: header.checksum", "malformed message: header", "room ",
                 "abort refused", "unexpected message", "page size differs",
                 "plan digest differs", "decode dp group", "cannot connect", "too many"):
        assert f[f"rejected: {kind}"] > 0, (kind, f)
    st = r.rank_stats["prefill.dp0.pp0.tp0"]
    if secret:
        for kind in ("outsider", "forged", "replay"):
            assert f[f"sent_{kind}"] > 0, (kind, f)
        # Each outsider, forged or replayed frame was refused, and nothing else was.
        sent = sum(f[f"sent_{k}"] for k in ("outsider", "forged", "replay"))
        assert st["unauthenticated"] == sent, (st, f)
        assert f["refused by authentication: A"] > 0, f
    else:
        assert st["unauthenticated"] == 0
    # Everything keyed by peer input stayed under its cap.
    assert st["engine_peers"] <= 16 and st["rooms"] <= 64 + 8 and st["finished"] <= 2000, st


def test_the_checks_catch_a_prefill_that_acks_before_draining():
    """Sabotage: prefill acks an abort at once and goes on writing. The labels, canaries and
    checksums must see the bytes that land in reused pages."""
    r = run(RelConfig(spec=TINY, requests=150, abort_rate=0.5, sabotage="early_ack",
                      knobs=FAST), out=io.StringIO())
    assert r.corrupted > 0 and r.corrupted_bytes > 0, r.summary()


# Prefill may still be draining writes to the killed rank (up to Mooncake's timeout on a
# loaded box): then the run waits on prefill dp0 for those.
STALLED = re.compile(r"stalled: nothing finished for 6 s with \d+/200 finished; ranks not \(back\) "
                     r"up: none; down: \['decode\.dp0'\]; requests waiting on: (none \(none "
                     r"issued: no pages or no healthy group\)|prefill\.dp0\.pp0\.tp0 x\d+)")


def test_a_run_that_stops_making_progress_ends_and_says_what_it_waits_on():
    """The only decode group dies for good: nothing can be issued any more. The run ends
    after stall_s (not at its deadline), names what it waits on, and its report carries the
    ends of the rank logs, the stacks every live rank wrote on the way out included."""
    faults = [Fault(at=10, action="kill", side="decode", dp=0)]
    # Rooms the killed rank never announced end on prefill at prefill_room_timeout_s.
    r = run(RelConfig(spec=TINY, requests=200, abort_rate=0.0, faults=faults,
                      knobs=dict(FAST, prefill_room_timeout_s=2.0), stall_s=6.0),
            out=io.StringIO())
    assert r.wall_s < 60, r.summary()
    assert r.unexpected and STALLED.fullmatch(r.unexpected[0]), r.unexpected
    assert r.faults_injected == 1 and 10 <= r.succeeded < 200, r.summary()
    assert all(re.fullmatch(r"room \d+ gen 0: LOST, waiting for \[\('prefill', 0, 0, 0\)\]", u)
               for u in r.unexpected[1:]), r.unexpected
    assert "prefill-dp0-pp0-tp0.log" in r.log_tails, sorted(r.log_tails)
    assert "Thread 0x" in r.log_tails["prefill-dp0-pp0-tp0.log"], r.log_tails
    assert r.log_dir and Path(r.log_dir).is_dir()


SPENT = re.compile(r"decode\.dp0: \d+ pages, 0 slots free, \d+ pages quarantined")


def test_a_group_whose_slots_went_to_quarantine_ends_the_run_instead_of_hanging():
    """Note [Spent groups]: each freeze of prefill dp1 mid-transfer quarantines the decode
    slots of its requests in flight (no abort ack within abort_ack_timeout_s), and quarantined
    slots never come back. With 3 slots, decode runs out: the run ends there, clean, instead
    of waiting for slots that cannot come. A fault waits for a request in the middle of its
    chunks on dp1, and each freeze sends the requests to dp0 until dp1 is back (~300 requests
    over three freezes here): the run has requests to spare for a loaded box, where those
    moments are rarer, and ends at the spent group long before its last."""
    faults = [Fault(at=a, action="stop", side="prefill", dp=1, resume_after_s=5.0)
              for a in (5, 15, 25, 35)]
    r = run(RelConfig(spec=TINY, prefill="tp=1,dp=2", requests=2000, abort_rate=0.0, slots=3,
                      concurrency=3, faults=faults, knobs=dict(FAST, peer_dead_after_s=1.0)),
            out=io.StringIO())
    assert_clean(r)
    assert len(r.spent) == 1 and SPENT.fullmatch(r.spent[0]), r.summary()
    assert r.quarantined >= 3 and r.requests < 2000, r.summary()
