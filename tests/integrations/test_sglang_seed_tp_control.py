"""The negative control of the hybrid's TP pairs in tests/integrations/test_sglang_seed_families.py:
prefill TP 2 -> decode TP 1 with a spec that shards the GDN conv state as one contiguous half
per rank instead of each rank's q, k and v sub-blocks (specs/sglang-qwen3-next.yaml's
`groups`). Both servers bind that spec (found on PDC_SPEC_PATH by the architecture it serves),
so the plan, the registration check and every byte count agree and the transfer succeeds; only
the channels land wrong (a rank's k heads in decode's q channels, ...), and the tokens must
differ from the plain TP-1 server's. Without this, the TP pairs' identity could not show that
the sub-block slicing is what made them right.

Slow (a plain server and a TP 2 -> 1 pair, about 4 min on the 2-core box): `PDC_SLOW=1 pytest
tests/integrations/test_sglang_seed_tp_control.py`. Needs the SGLang environment of
scripts/install-sglang.sh.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from pdc.serving import sglang_harness as H

PYTHON = H.sglang_python()
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(PYTHON is None, reason="no SGLang environment: run "
                       "scripts/install-sglang.sh (CI does)"),
    pytest.mark.skipif(os.environ.get("PDC_SLOW") != "1",
                       reason="slow (a plain server and a TP 2 -> 1 pair): PDC_SLOW=1 pytest "
                              "tests/integrations/test_sglang_seed_tp_control.py"),
]

FAMILY = "qwen3-next"
SPEC = Path(__file__).parents[2] / "specs" / "sglang-qwen3-next.yaml"
GROUPED = ("tp: {shard: conv_dim, groups: [key_dim, key_dim, value_dim], unit: [head_k_dim, "
           "head_k_dim, head_v_dim]}")
PROMPTS = H.mixed_prompts(8, seed=3)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def workdir():
    d = tempfile.mkdtemp(prefix="pdc-sglang-tp-control-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_conv_state_sliced_as_one_half_per_rank_changes_the_tokens(workdir):
    specs = Path(workdir) / "specs"
    specs.mkdir()
    text = SPEC.read_text()
    assert GROUPED in text
    text = text.replace("family: sglang-qwen3-next", "family: qwen3-next-halves")
    (specs / "qwen3-next-halves.yaml").write_text(text.replace(GROUPED, "tp: {shard: conv_dim}"))
    model = H.make_tiny_model(PYTHON, f"{workdir}/tiny-{FAMILY}", FAMILY)
    plain = H.start_plain(PYTHON, model, workdir, extra_args=H.SERVER_ARGS[FAMILY])
    try:
        ref = H.run_prompts(plain.url, PROMPTS, NEW_TOKENS, in_flight=4)
    finally:
        plain.stop()
    env = {"PDC_SPEC_PATH": str(specs), "PDC_PEER_DEAD_AFTER_S": "60"}
    pair = H.PDPair.start(PYTHON, model, workdir, prefill_tp=2, decode_tp=1,
                          server_args=H.SERVER_ARGS[FAMILY], prefill_env=env,
                          decode_env=dict(env))
    try:
        got = H.run_prompts(pair.router.url, PROMPTS, NEW_TOKENS, in_flight=4)
    finally:
        pair.stop()
    assert [r.error for r in ref + got] == [""] * (2 * len(PROMPTS))  # every transfer went
    with open(pair.prefill.log, errors="replace") as f:
        assert "rank pp0.tp1, family qwen3-next-halves" in f.read()
    differ = [i for i, (r, g) in enumerate(zip(ref, got, strict=True)) if r.tokens != g.tokens]
    assert len(differ) >= len(PROMPTS) // 2, differ
