"""Runs tests/integrations/inside/ (tests that import SGLang itself: its pool classes driven
through pdc's backend classes) under the SGLang environment's python, as one test of pdc's own
run; when this interpreter has SGLang, pytest collects them directly."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from pdc.serving import sglang_harness as H

INSIDE = Path(__file__).parent / "inside"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None,
                    reason="this interpreter has SGLang: tests/integrations/inside/ is "
                           "collected directly")
def test_the_sglang_side_tests_pass_in_the_sglang_environment():
    python = H.sglang_python()
    if python is None:
        pytest.skip("no SGLang environment: run scripts/install-sglang.sh (CI does)")
    r = subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", str(INSIDE)],
                       capture_output=True, text=True, timeout=540, cwd=INSIDE.parents[2])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 66 and "skipped" not in out, out
