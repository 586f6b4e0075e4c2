"""Real vLLM engines with PdcConnector between them, in the vLLM environment
(Note [vLLM environment] in scripts/install-vllm.sh): `pdc vllm-demo` starts a reference
engine, a prefill engine and a decode engine as separate processes and compares every token.

Each run checks, per engine: every prompt token-identical to the single engine, bytes moved
for every prompt, repeated prompts served from decode's prefix cache (only the blocks decode
does not hold are sent), and no request left holding blocks on either engine afterwards.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pdc.serving.vllm_env import HINT, vllm_python

pytestmark = pytest.mark.engines

if vllm_python() is None:
    pytest.skip(f"no vLLM environment: {HINT}", allow_module_level=True)


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_pd_through_real_vllm_engines_is_token_identical(engine):
    r = subprocess.run([sys.executable, "-m", "pdc", "vllm-demo", "--prompts", "8",
                        "--tokens", "8", "--engine", engine],
                       capture_output=True, text=True, timeout=560)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    flat = " ".join(out.split())  # the summary line wraps at the terminal's width
    assert "prompts ok: 8/8, failed: 0" in flat, out
    assert "no request left on either engine" in flat, out
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+([\d,]+)\s+\d+\s+identical\s*$", out,
                      re.MULTILINE)
    assert len(rows) == 8, out
    # Prompt 3 repeats an earlier one: decode holds all but its last block and prefill
    # sends one block per layer (2 layers x 16 KiB).
    cached = [row for row in rows if row[2] not in ("0", "-")]
    assert cached, out
    for _, tokens, prefix, nbytes in cached:
        blocks_left = -(-int(tokens) // 32) - int(prefix) // 32
        assert int(nbytes.replace(",", "")) == blocks_left * 2 * 16384
