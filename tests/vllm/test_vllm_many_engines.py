"""Many engines (xPyD, Note [Many engines] in integrations/vllm/links.py): two prefill and two
decode vLLM engines with PdcConnector, `pdc vllm-demo --prefill-engines 2 --decode-engines 2`.
The proxy spreads the prompts so that every prefill engine hands over to every decode engine;
the last prefill engine is killed once some prompts finished. Its prompts may fail (those it
had not handed over, or whose transfer it had not finished); every other prompt must be
token-identical to one engine alone, and no surviving engine may hold a request afterwards.
One run covers both (the four engines take minutes to start on the 2-core box)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pdc.serving.vllm_env import HINT, vllm_python

pytestmark = pytest.mark.engines

if vllm_python() is None:
    pytest.skip(f"no vLLM environment: {HINT}", allow_module_level=True)

PROMPTS = 12
KILL_AFTER = 5


def test_two_prefill_and_two_decode_engines_with_a_prefill_engine_killed():
    r = subprocess.run([sys.executable, "-m", "pdc", "vllm-demo", "--prefill-engines", "2",
                        "--decode-engines", "2", "--prompts", str(PROMPTS), "--tokens", "4",
                        "--kill-prefill-after", str(KILL_AFTER)],
                       capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    rows = re.findall(r"^\s*(\d+)\s+\d+\s+\S+\s+[\d,]+\s+\d+\s+(prefill\d) > (decode\d)\s+(.+?)"
                      r"\s*$", out, re.MULTILINE)
    assert len(rows) == PROMPTS, out
    pairs = {(p, d) for _, p, d, verdict in rows if verdict == "identical"}
    # every prefill engine handed over to every decode engine before the kill
    assert pairs == {(p, d) for p in ("prefill0", "prefill1") for d in ("decode0", "decode1")}
    failed = [(i, p, verdict) for i, p, _, verdict in rows if verdict != "identical"]
    assert all(p == "prefill1" for _, p, _ in failed), out
    flat = " ".join(out.split())
    ok = PROMPTS - len(failed)
    assert (f"prompts ok: {ok}/{PROMPTS}, failed: {len(failed)} ({len(failed)} of them on "
            f"prefill1, killed after {KILL_AFTER} prompts)") in flat, out
    assert "no request left on any of the 3 engines" in flat, out
