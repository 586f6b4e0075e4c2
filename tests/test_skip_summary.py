"""The README's test command ends with why tests were skipped and how to run them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.skip_summary import summary_lines

REPO = Path(__file__).resolve().parents[1]


def test_reasons_are_counted_and_given_a_way_to_enable_them():
    assert summary_lines(["needs a CUDA device", "no vLLM environment: x",
                          "needs a CUDA device", "something else"]) == [
        "2 skipped: needs a CUDA device",
        "    to run them: run on a machine with CUDA GPUs (bench/run_gpu.sh, BENCHMARKS.md)",
        "1 skipped: no vLLM environment: x",
        "    to run them: build it with ./scripts/install-vllm.sh (~3-5 min, ~3.8 GB, once)",
        "1 skipped: something else",
    ]


def test_a_pytest_run_prints_the_summary(tmp_path):
    (tmp_path / "test_x.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.skipif(True, reason="needs a CUDA device")
        def test_gpu():
            pass

        def test_cpu():
            pass
    """))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.support.skip_summary",
                        "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path),
                        str(tmp_path / "test_x.py")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if "why tests were skipped" in line)
    assert lines[at + 1:at + 3] == [
        "1 skipped: needs a CUDA device",
        "    to run them: run on a machine with CUDA GPUs (bench/run_gpu.sh, BENCHMARKS.md)",
    ]
