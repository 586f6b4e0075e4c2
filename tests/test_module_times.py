"""The README's test command ends with the test files that took longest (CI's time budget)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from tests.support.module_times import file_seconds, summary_lines

REPO = Path(__file__).resolve().parents[1]


def test_every_phase_of_a_file_is_summed_and_the_rest_folded_into_one_line():
    reports = [SimpleNamespace(nodeid="tests/a.py::t1", duration=2.0),   # setup
               SimpleNamespace(nodeid="tests/a.py::t1", duration=0.5),   # call
               SimpleNamespace(nodeid="tests/b.py::t[x]", duration=4.0),
               SimpleNamespace(nodeid="tests/c.py::t", duration=0.25),
               SimpleNamespace(nodeid="", duration=9.0),                 # a collection report
               SimpleNamespace(nodeid="tests/d.py::t")]                  # no duration
    seconds = file_seconds(reports)
    assert seconds == {"tests/a.py": 2.5, "tests/b.py": 4.0, "tests/c.py": 0.25}
    assert summary_lines(seconds, shown=2) == ["     4.0s  tests/b.py", "     2.5s  tests/a.py",
                                               "     0.2s  the other 1 files"]


def test_a_pytest_run_prints_the_summary(tmp_path):
    (tmp_path / "test_slow.py").write_text(textwrap.dedent("""
        import time

        import pytest

        @pytest.fixture(scope="module")
        def server():
            time.sleep(0.3)

        def test_one(server):
            pass
    """))
    (tmp_path / "test_fast.py").write_text("def test_two():\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.support.module_times",
                        "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path),
                        str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if "slowest 2 test files" in line)
    assert [line.split()[-1] for line in lines[at + 1:at + 3]] == ["test_slow.py",
                                                                   "test_fast.py"]
    assert float(lines[at + 1].split()[0].rstrip("s")) >= 0.3
