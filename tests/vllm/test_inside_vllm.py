"""Runs tests/vllm/inside/ (tests that import vLLM itself) under the vLLM environment's python,
as one test of pdc's own run; when this interpreter has vLLM, pytest collects them directly."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from pdc.serving.vllm_env import HINT, vllm_python

INSIDE = Path(__file__).parent / "inside"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="this interpreter has vLLM: tests/vllm/inside/ is collected directly")
def test_the_vllm_side_tests_pass_in_the_vllm_environment():
    python = vllm_python()
    if python is None:
        pytest.skip(f"no vLLM environment: {HINT}")
    r = subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", str(INSIDE)],
                       capture_output=True, text=True, timeout=540,
                       cwd=INSIDE.parents[2])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 11 and "skipped" not in out, out
