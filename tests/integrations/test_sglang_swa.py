"""A hybrid sliding-window model inside real SGLang 0.5.23 servers: a tiny GPT-OSS
(`GptOssForCausalLM`: sliding layers 0 and 2 with a 32-token window, full layers 1 and 3,
attention sinks, MoE) served by pdc's backend through specs/sglang-swa.yaml, against a plain
SGLang server. SGLang keeps the sliding layers in their own pool (SWAKVPool): the full
layers' pages move by the request's page list, the sliding layers' window by SGLang's second
list (Note [SGLang SWA pools] in pdc/integrations/sglang/swa.py); prompts of 1 to 300 tokens
put the window inside one page, across two and far past the first chunk.

Slow (a plain server and a PD pair on the CPU shim's intel_amx ops, which run GPT-OSS's
sliding windows and sinks in torch): `PDC_SLOW=1 pytest tests/integrations/test_sglang_swa.py`.
Needs the SGLang environment of scripts/install-sglang.sh.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import pytest

from pdc.serving import sglang_harness as H

PYTHON = H.sglang_python()
FAMILY = "gpt-oss"
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(PYTHON is None, reason="no SGLang environment: run "
                       "scripts/install-sglang.sh (CI does)"),
    pytest.mark.skipif(os.environ.get("PDC_SLOW") != "1", reason="slow (a plain server and a "
                       "PD pair of GPT-OSS): PDC_SLOW=1 pytest tests/integrations/"
                       "test_sglang_swa.py"),
]

NEW_TOKENS = 16
PROMPTS = H.mixed_prompts(6, seed=4)
# The negative control: a 20-token prompt no other request sends, so its window (32 tokens) is
# all of its sliding layers' context, 2 SWA pages; faults.py's `wrong_window_page` reads the
# first from the SWA page before it, which never holds a stale copy of this prompt's own KV
# (the served-right check sends another fresh prompt of the same length)
CONTROL = [3 + (7 * i + 5) % 509 for i in range(20)]
RIGHT = [3 + (11 * i + 2) % 509 for i in range(20)]
REPEATED = [3 + (13 * i + 1) % 509 for i in range(300)]  # 300 tokens no other prompt starts with
WRONG_ROOM = 7_100_011
EXTRA = [CONTROL, RIGHT, REPEATED]


@pytest.fixture(scope="module")
def workdir():
    d = tempfile.mkdtemp(prefix="pdc-sglang-swa-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def model(workdir):
    return H.make_tiny_model(PYTHON, f"{workdir}/tiny-gpt-oss", FAMILY)


@pytest.fixture(scope="module")
def reference(model, workdir):
    plain = H.start_plain(PYTHON, model, workdir, extra_args=H.SERVER_ARGS[FAMILY])
    try:
        results = H.run_prompts(plain.url, PROMPTS + EXTRA, NEW_TOKENS, in_flight=2)
    finally:
        plain.stop()
    assert [r.error for r in results] == [""] * (len(PROMPTS) + len(EXTRA))
    return [r.tokens for r in results]


@pytest.fixture(scope="module")
def pair(model, workdir, reference):
    p = H.PDPair.start(PYTHON, model, workdir, engine="mooncake",
                       server_args=H.SERVER_ARGS[FAMILY],
                       prefill_env={"PDC_SGLANG_FAULTS": f"wrong_window_page@{WRONG_ROOM}"})
    yield p
    p.stop()


def test_gpt_oss_pd_pair_is_token_identical_to_a_plain_server(pair, reference):
    results = H.run_prompts(pair.router.url, PROMPTS, NEW_TOKENS, in_flight=2)
    assert [r.error for r in results] == [""] * len(PROMPTS)
    assert [i for i, (r, ref) in enumerate(zip(results, reference[:len(PROMPTS)], strict=True))
            if r.tokens != ref] == []
    assert all(len(r.tokens) == NEW_TOKENS for r in results)


def test_both_servers_serve_gpt_oss_through_the_swa_spec(pair, reference):
    for server in (pair.prefill, pair.decode):
        with open(server.log, errors="replace") as f:
            log = f.read()
        assert "GptOssForCausalLM rank pp0.tp0, family sglang-swa " \
               "(specs/sglang-swa.yaml) bound to 4 layers" in log, server.tail()


def _direct(pair: H.PDPair, prompt: list[int], room: int):
    """One request sent to prefill and decode directly (as the router does), with our room."""
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.bootstrap_port,
             "bootstrap_room": room}
    out = {}

    def post(name, url):
        out[name] = H.generate(url, prompt, NEW_TOKENS, extra=extra)

    threads = [threading.Thread(target=post, args=a)
               for a in (("prefill", pair.prefill.url), ("decode", pair.decode.url))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out["decode"]


def test_a_wrong_swa_page_changes_the_tokens(pair, reference):
    # the negative control of the identity above: the window's first SWA page read from the
    # one before it (a well-formed transfer pdc's checks cannot see) must show in the tokens;
    # the same prompt in another room is served right
    wrong = _direct(pair, CONTROL, WRONG_ROOM)
    assert wrong.error == ""
    assert wrong.tokens != reference[len(PROMPTS)]
    right = _direct(pair, RIGHT, WRONG_ROOM + 1)
    assert (right.error, right.tokens) == ("", reference[len(PROMPTS) + 1])


PAGE_BYTES = 2 * 2 * 16 * 2 * 16 * 2  # K and V of 2 layers, 16 tokens x 2 heads x 16, bf16
AUX_ROW_BYTES = 3 * 64 + 2 * 64 + 512 + 512 + 128 + 64 + 64


def _request_bytes(pair, prompt):
    """One request through the router and the bytes pdc wrote for it, from prefill's
    sglang:kv_transfer_total_mb (observed once prefill sees the transfer done)."""
    def sample(name):
        return H.metric_sum(H.metrics(pair.prefill.url), name)

    count, mb = sample("sglang:kv_transfer_total_mb_count"), \
        sample("sglang:kv_transfer_total_mb_sum")
    result = H.generate(pair.router.url, prompt, NEW_TOKENS)
    deadline = time.monotonic() + 10
    while sample("sglang:kv_transfer_total_mb_count") == count and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    return result, round((sample("sglang:kv_transfer_total_mb_sum") - mb) * 1024 * 1024)


def test_the_window_moves_only_its_own_pages(pair, reference):
    # A fresh 300-token prompt: its 19 full-layer pages and the window's 3 SWA pages only
    # (tokens 268..299, pages 16..18), and the aux row
    result, nbytes = _request_bytes(pair, REPEATED)
    assert (result.error, result.tokens) == ("", reference[-1])
    assert nbytes == (19 + 3) * PAGE_BYTES + AUX_ROW_BYTES
