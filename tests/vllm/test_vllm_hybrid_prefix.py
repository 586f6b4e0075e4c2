"""A hybrid family with vLLM's prefix caching on both engines (mamba_cache_mode "align";
Note [Hybrid prefix caching] in integrations/vllm/scheduler.py): the tiny 3:1 Qwen3-Next
(specs/vllm-qwen3-next-3to1.yaml) through a prefill and a decode vLLM engine over Mooncake,
pdc's link digests on, one prompt at a time so that each finds the cache the earlier ones
left on both sides.

The prompts share long prefixes (320 and 160 tokens: two and one 160-token blocks), so
prefill computes only past its own hit, and decode loads only the pages past its own hit and
the state after the prompt's first N - 1 tokens (Note [Hybrid last token]); one prompt's hit
on decode covers every token prefill sends, so decode loads nothing and computes the last
token from its cached state. Every prompt is judged against one plain engine (no prefix
cache) by logprobs within TOL nats (Note [Logprob tolerance] in pdc/serving/drift.py; the
tolerance tests/vllm/test_vllm_hybrid_tp.py establishes for this model). The negative control
hands decode another prompt's transfer: the same 320-token prefix, which decode takes from its
own cache, but the third page and the states prefill computed for a different tail; the
digests match (the bytes moved as planned), the tokens fail the judge. `PDC_SLOW=1` adds the
same prompts from a TP-2 prefill engine to a TP-1 decode engine.
"""

from __future__ import annotations

import os
import random
import subprocess

import pytest

from pdc.serving.drift import compare
from pdc.serving.vllm_env import HINT, vllm_python
from pdc.serving.vllm_proxy import Engine, Flow, engine_env, run_pd, run_single

pytestmark = pytest.mark.engines

if vllm_python() is None:
    pytest.skip(f"no vLLM environment: {HINT}", allow_module_level=True)

FAMILY = "vllm-qwen3-next-3to1"
TOKENS = 8
TOP_K = 20
TOL = 0.25  # nats, as tests/vllm/test_vllm_hybrid_tp.py establishes for this model
PAGE_TOKENS, ATTN_PAGE, GDN_STATE = 160, 81920, 3072 + 65536  # float32 SSM state (TP 1)


def _prompts():
    rng = random.Random(31)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    shared = tokens(2 * PAGE_TOKENS)
    a = shared + tokens(1)  # decode loads 320 tokens: its state after them is cached
    b = shared + tokens(49)
    c = shared + tokens(1)  # A with another last token: decode's hit covers all it is sent
    d = shared[:PAGE_TOKENS] + tokens(140)
    e = b + tokens(150)
    f = e[:3 * PAGE_TOKENS] + tokens(1)
    g = e[:3 * PAGE_TOKENS] + tokens(100)
    wrong = shared + tokens(49)  # the negative control's prefill prompt
    return [a, b, c, d, e, f, g], wrong


PROMPTS, WRONG = _prompts()
RIGHT = PROMPTS[1]  # what decode is asked in the negative control, with WRONG's transfer
# Each prompt's prefix-cache hit in tokens, (prefill, decode), one prompt after another.
HITS = [(0, 0), (160, 320), (160, 320), (160, 0), (320, 320), (320, 320), (480, 480)]
WHOLE = 2  # the prompt whose decode hit holds all N - 1 tokens prefill computed


def moved(prompt_tokens: int, decode_prefix: int) -> int:
    """Bytes of one prompt: the pages of its first N - 1 tokens past decode's own hit, in
    both attention layers, and the conv and SSM state of all 6 GDN layers."""
    pages = -(-(prompt_tokens - 1) // PAGE_TOKENS) - decode_prefix // PAGE_TOKENS
    return pages * 2 * ATTN_PAGE + 6 * GDN_STATE


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-3to1-prefix") / "model"
    r = subprocess.run([vllm_python(), "-m", "pdc.serving.vllm_engine", "--make-model", str(path),
                        FAMILY], capture_output=True, text=True, env=engine_env(0), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return str(path)


@pytest.fixture(scope="module")
def ref(model, tmp_path_factory):
    """One plain engine's tokens and top logprobs for every prompt (no prefix cache)."""
    eng = Engine(vllm_python(), tmp_path_factory.mktemp("ref"), "single", model, FAMILY,
                 "mooncake", core=1)
    try:
        eng.wait_up(600)
        replies: dict = {}
        tokens = run_single(eng, PROMPTS, TOKENS, logprobs=TOP_K, replies=replies)
    finally:
        eng.stop()
    return tokens, [replies[i]["logprobs"] for i in range(len(PROMPTS))]


def engines(model: str, work, prefill_tp: int = 1) -> tuple[Engine, Engine]:
    """A prefill engine at `prefill_tp` (TP 2 on both cores) and a decode engine at TP 1,
    both with prefix caching."""
    extra = {"knobs": {"checksum": 1}}
    pre = Engine(vllm_python(), work, "prefill", model, FAMILY, "mooncake",
                 core="0|1" if prefill_tp == 2 else 0, tp=prefill_tp,
                 extra={"peer_tp": 1, **extra}, prefix_caching="on")
    dec = Engine(vllm_python(), work, "decode", model, FAMILY, "mooncake", core=1,
                 extra=extra, prefix_caching="on")
    return pre, dec


@pytest.fixture(scope="module")
def pair(model, tmp_path_factory):
    """A prefill and a decode engine, both with prefix caching, kept for the module."""
    pre, dec = engines(model, tmp_path_factory.mktemp("pd"))
    try:
        pre.wait_up(600)
        dec.wait_up(600)
        yield pre, dec
    finally:
        pre.stop()
        dec.stop()


def assert_nothing_left(pre: Engine, dec: Engine) -> None:
    for f in pre.call({"op": "free_blocks"}), dec.call({"op": "free_blocks"}):
        assert f["requests"] == 0 and f["held"] == [] and f["free"] == f["total"] - 1, f


def through_pd(pre: Engine, dec: Engine, ref, prefill_notes: bool = True) -> None:
    """PROMPTS one after another: each within TOL of the reference, with the hits of HITS,
    the bytes past decode's hit, and nothing left on either engine. `prefill_notes`: also
    check what prefill's worker noted (a TP-1 engine's worker runs in the engine's process,
    a TP-2 engine's do not)."""
    replies: dict = {}
    tokens, transfers, _, errors, _ = run_pd(pre, dec, PROMPTS, TOKENS, concurrency=1,
                                             logprobs=TOP_K, replies=replies)
    assert errors == [""] * len(PROMPTS), errors
    hits = [(replies["prefill", i]["kv_transfer_params"].get("remote_prefill_cached_tokens"),
             t["prefix_tokens"]) for i, t in enumerate(transfers)]
    got = [compare(r, rt, g, replies["decode", i]["logprobs"], TOL)
           for i, (r, rt, g) in enumerate(zip(ref[0], ref[1], tokens, strict=True))]
    print("prefill, decode hits:", hits)
    print("verdicts:", got)
    assert all(v.ok for v in got), got
    assert hits == HITS
    for i, (p, t, (_, hit)) in enumerate(zip(PROMPTS, transfers, HITS, strict=True)):
        assert t["ok"] and t["bytes"] == (0 if i == WHOLE else moved(len(p), hit)), t
    assert transfers[WHOLE].get("cached") and len(PROMPTS[WHOLE]) - 1 == HITS[WHOLE][1]
    if prefill_notes:  # prefill freed the prompt decode did not load when decode cancelled it
        sent = pre.call({"op": "transfers"})  # by vLLM's request id: "p2-<suffix>"
        (cancelled,) = [t for rid, t in sent.items() if rid.split("-")[0] == f"p{WHOLE}"]
        assert cancelled["reason"] == "aborted by decode" and cancelled["bytes"] == 0, sent
    assert_nothing_left(pre, dec)


def test_prefix_hits_on_both_sides_match_one_engine(pair, ref):
    through_pd(*pair, ref)


def test_another_prompts_page_and_state_fail_the_check(pair, ref):
    """The negative control: decode asked for RIGHT loads what prefill computed for WRONG
    (the same 320-token prefix, from decode's own cache, then another tail)."""
    pre, dec = pair
    p = pre.call({"op": "generate", "id": "pw", "prompt": WRONG, "max_tokens": 1,
                  "kv_transfer_params": {"do_remote_decode": True}}, 120)
    d = dec.call({"op": "generate", "id": "dw", "prompt": RIGHT, "max_tokens": TOKENS,
                  "kv_transfer_params": p["kv_transfer_params"], "logprobs": TOP_K}, 120)
    assert d["pdc"]["ok"] and d["pdc"]["prefix_tokens"] == 2 * PAGE_TOKENS, d["pdc"]
    verdict = compare(ref[0][1], ref[1][1], d["tokens"], d["logprobs"], TOL)
    print("negative control:", verdict)
    assert not verdict.ok, verdict
    assert_nothing_left(pre, dec)


def test_the_first_token_from_prefill_matches_one_engine(pair, ref):
    """Note [First token from prefill]: prefill computes all N tokens past its hit and sends
    the state after them; decode gets the prompt and prefill's token, loads past its own hit
    and computes that token's step: prefill's token is the reference's first, decode's tokens
    its second to last within TOL."""
    pre, dec = pair
    replies: dict = {}
    tokens, transfers, _, errors, _ = run_pd(pre, dec, PROMPTS, TOKENS, concurrency=1,
                                             logprobs=TOP_K, replies=replies,
                                             flow=Flow(first_token=True))
    assert errors == [""] * len(PROMPTS), errors
    assert [t[0] for t in tokens] == [r[0] for r in ref[0]]
    got = [compare(r[1:], rt[1:], g[1:], replies["decode", i]["logprobs"], TOL)
           for i, (r, rt, g) in enumerate(zip(ref[0], ref[1], tokens, strict=True))]
    assert all(v.ok for v in got), got
    assert all(t["ok"] for t in transfers), transfers
    assert_nothing_left(pre, dec)


@pytest.mark.skipif(os.environ.get("PDC_SLOW") != "1",
                    reason="slow (a TP-2 prefill engine): PDC_SLOW=1 pytest "
                           "tests/vllm/test_vllm_hybrid_prefix.py")
def test_prefill_tp2_to_decode_tp1_with_prefix_hits_matches_one_engine(model, ref, tmp_path):
    pre, dec = engines(model, tmp_path, prefill_tp=2)
    try:
        pre.wait_up(600)
        dec.wait_up(600)
        through_pd(pre, dec, ref, prefill_notes=False)
    finally:
        pre.stop()
        dec.stop()
