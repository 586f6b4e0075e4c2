"""bench/reliability.py over NIXL: its soak pairs equal TP there (the test spec forbids
heterogeneous attention TP on NIXL) and its report names the engine it ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.engines
def test_reliability_soak_over_nixl(tmp_path):
    out = tmp_path / "rel.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "reliability.py"), "--engine",
                           "nixl", "--storm", "0", "--faults", "0", "--soak", "40", "--fuzz",
                           "0", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert ", NIXL " in got["machine"] and "Mooncake" not in got["machine"], got["machine"]
    soak = got["results"]["soak"]
    assert soak["clean"] and soak["lost"] == 0 and soak["corrupted"] == 0
    assert soak["succeeded"] > 0 and soak["requests"] == 40
    assert "== soak: 40 requests, prefill tp=2,dp=2, decode tp=2,dp=2, nixl" in proc.stdout
