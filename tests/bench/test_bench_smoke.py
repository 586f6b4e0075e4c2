"""CI smoke test of bench/: every script runs with --small on CPU (Triton interpreter) and writes
its JSON; the correctness checks inside the scripts must pass. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON = {"bench", "meta", "args", "rows", "checks", "all_checks_passed", "goals", "notes"}
GOALS = {
    "kernels": {"a_ratio_target", "a_min_ratio_default_tiling", "a_met_all"},
    "p2p_request": {"b_ratio_target", "b_best_ratio", "b_met"},
    "hetero_tp": {"c_ratio_target", "TP2->TP1 merge", "TP1->TP2 split"},
    "control_cost": {"d_staged_target_us", "d_staged_8k_max_us", "d_staged_met",
                     "d_per_desc_target_speedup", "d_per_desc_met"},
    "streaming": {"e_target", "e_by_case", "e_met_by_best_path"},
    "endpoints": {"staged_faster_in_every_case"},
    "endpoints_device": {"best_case"},
    "endpoints_processes": {"endpoints_vs_engine_target", "fixed_ms_target", "fixed_ms"},
    "staging_host": set(),
    "control_hop": set(),
    "request_steps": set(),
}
ROW_KEYS = {
    "kernels": {"case", "ms", "gbps", "copy_gbps", "ratio_to_copy"},
    "p2p_request": {"case", "ms", "gbps"},
    "hetero_tp": {"case", "ms", "gbps"},
    "control_cost": {"tokens", "page", "layout", "system", "path", "us"},
    "streaming": {"case", "ms"},
    "endpoints": {"case", "path", "descriptors", "batches", "gbps"},
    "endpoints_device": {"case", "ms", "gbps", "staged_links"},
    "endpoints_processes": {"case", "engine", "ms", "gbps", "engine_only_gbps",
                            "ratio_to_engine", "fixed_ms", "init_to_submit_ms"},
    "staging_host": {"graphs", "gather host", "scatter host", "captured", "replayed"},
    "control_hop": {"transport", "rtt_p50_us", "rtt_p90_us", "reps"},
    "request_steps": {"step", "us"},
}


@pytest.mark.parametrize("name", sorted(GOALS))
def test_bench_small(name, tmp_path):
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env.pop("PDC_SGLANG_PYTHON", None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), "--small",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert COMMON <= set(got), set(got)
    assert got["bench"] == name
    assert got["checks"], "the script ran no correctness check"
    assert got["all_checks_passed"], [k for k, v in got["checks"].items() if not v]
    assert GOALS[name] <= set(got["goals"]), set(got["goals"])
    rows = [r for r in got["rows"] if "error" not in r]
    assert rows and not [r for r in got["rows"] if "error" in r]
    for r in rows:
        assert ROW_KEYS[name] <= set(r), (name, r)
