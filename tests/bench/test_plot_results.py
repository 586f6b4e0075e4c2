"""bench/plot_results.py draws BENCHMARKS.md's plots from the JSON results under bench/results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("plot_results", ROOT / "bench" / "plot_results.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_every_plot_is_drawn_from_the_results_and_referenced(tmp_path, capsys):
    m = _module()
    assert m.main(["--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["control_cost.png", "endpoints.png", "hetero_tp.png", "kernels.png",
                     "p2p_request.png"]
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The checked-in plots are the ones BENCHMARKS.md shows, one per main table.
    bench = (ROOT / "BENCHMARKS.md").read_text()
    for name in names:
        assert f"](docs/plots/{name})" in bench, name
        assert (ROOT / "docs" / "plots" / name).exists(), name


def test_a_plot_reads_the_run_the_table_cites():
    m = _module()
    src = m.newest(ROOT / "bench" / "results", "kernels.json", "*h200*")
    assert src.parent.name == "2026-11-30-h200x2-run3"
    rows = json.loads(src.read_text())["rows"]
    assert any(r["tiling"] == "default" and r["op"] == "scatter" for r in rows)
