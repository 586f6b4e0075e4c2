"""`pdc sglang-demo --family deepseek-mla --dp 2` for real: a plain server, a prefill and a
decode server, each with two attention-DP groups of one rank (`--tp 2 --dp 2
--enable-dp-attention`), behind SGLang's router; every token of 8 prompts identical to the
plain server's, and pdc's managers registered under both groups on both sides.

Slow (three SGLang servers of two scheduler processes each and the router; minutes on the
2-core box), outside the README's pytest: `PDC_SLOW=1 pytest
tests/integrations/test_sglang_demo_dp.py`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pdc.serving import sglang_harness as H

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(H.sglang_python() is None, reason="no SGLang environment: run "
                       "scripts/install-sglang.sh (CI does)"),
    pytest.mark.skipif(os.environ.get("PDC_SLOW") != "1",
                       reason="slow (three SGLang servers of two ranks each): PDC_SLOW=1 "
                              "pytest tests/integrations/test_sglang_demo_dp.py"),
]


def test_the_dp_2_demo_is_token_identical_to_a_plain_dp_2_server():
    done = subprocess.run([sys.executable, "-m", "pdc.cli", "sglang-demo", "--family",
                           "deepseek-mla", "--dp", "2", "--prompts", "8"],
                          capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = [line.split() for line in done.stdout.splitlines()
            if re.match(r"\s+pdc\s+mooncake\s", line)]
    assert [r[:4] for r in rows] == [["pdc", "mooncake", "8", "0"]], done.stdout
    assert ("pdc/mooncake: pdc's managers registered on prefill groups 0, 1 of 2 and decode "
            "groups 0, 1 of 2") in done.stderr, done.stderr[-4000:]
