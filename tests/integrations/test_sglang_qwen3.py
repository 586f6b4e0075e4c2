"""A family beyond Llama inside real SGLang 0.5.23 servers: a tiny dense Qwen3
(`Qwen3ForCausalLM`, head_dim from its config, q/k norms) served by pdc's backend through
specs/sglang-llama.yaml (bound to Qwen3's config), against a plain SGLang server. The pair's decode runs its radix
cache (`--disaggregation-decode-enable-radix-cache`): a repeated prompt is served from the
pages decode holds, and prefill sends only the rest (Note [SGLang decode prefix]).

Needs the SGLang environment of scripts/install-sglang.sh (CI builds it); skipped with that
reason when it is absent. Lean on purpose (CI budget): one plain server for the reference
(stopped before the pair starts) and one PD pair over Mooncake; the engines, faults, aborts
and metrics are covered with the Llama in test_sglang_servers.py.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest

from pdc.serving import sglang_harness as H

PYTHON = H.sglang_python()
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(PYTHON is None, reason="no SGLang environment: run "
                       "scripts/install-sglang.sh (CI does)"),
]

NEW_TOKENS = 16
PROMPTS = H.mixed_prompts(8, seed=2)  # 1 .. 300 tokens: up to 5 chunks of 64, 16-token pages
REPEATED = [(t + 1) % 509 + 3 for t in PROMPTS[1]]  # 300 tokens none of PROMPTS starts with


@pytest.fixture(scope="module")
def workdir():
    d = tempfile.mkdtemp(prefix="pdc-sglang-qwen3-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def model(workdir):
    return H.make_tiny_model(PYTHON, f"{workdir}/tiny-qwen3", "qwen3")


@pytest.fixture(scope="module")
def reference(model, workdir):
    plain = H.start_plain(PYTHON, model, workdir)
    try:
        results = H.run_prompts(plain.url, PROMPTS + [REPEATED], NEW_TOKENS, in_flight=4)
    finally:
        plain.stop()
    assert [r.error for r in results] == [""] * (len(PROMPTS) + 1)
    return [r.tokens for r in results]


@pytest.fixture(scope="module")
def pair(model, workdir, reference):
    p = H.PDPair.start(PYTHON, model, workdir, engine="mooncake",
                       decode_args=("--disaggregation-decode-enable-radix-cache",))
    yield p
    p.stop()


def test_qwen3_pd_pair_is_token_identical_to_a_plain_server(pair, reference):
    results = H.run_prompts(pair.router.url, PROMPTS, NEW_TOKENS, in_flight=4)
    assert [r.error for r in results] == [""] * len(PROMPTS)
    assert [i for i, (r, ref) in enumerate(zip(results, reference[:-1], strict=True))
            if r.tokens != ref] == []
    assert all(len(r.tokens) == NEW_TOKENS for r in results)


def test_both_servers_serve_qwen3_through_its_own_spec(pair, reference):
    # Note [Served family]: the architecture picks the candidates, SGLang's buffers the spec
    for server in (pair.prefill, pair.decode):
        with open(server.log, errors="replace") as f:
            log = f.read()
        assert "Qwen3ForCausalLM rank pp0.tp0, family sglang-llama " \
               "(specs/sglang-llama.yaml) bound to 2 layers" in log, server.tail()


PAGE_BYTES = 2 * 2 * 16 * 2 * 32 * 2  # K and V of 2 layers, 16 tokens x 2 heads x 32, bf16
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


def test_a_repeated_prompt_sends_only_what_decode_does_not_hold(pair, reference):
    # A fresh 300-token prompt (19 pages) moves every page; sent again, decode's radix cache
    # holds its first 18 pages (SGLang matches whole pages and keeps the last token to
    # compute), so prefill sends page 18 and the aux row only, and the tokens stay.
    first, first_bytes = _request_bytes(pair, REPEATED)
    again, again_bytes = _request_bytes(pair, REPEATED)
    assert [(first.error, first.tokens), (again.error, again.tokens)] == \
        [("", reference[-1])] * 2
    assert first_bytes == 19 * PAGE_BYTES + AUX_ROW_BYTES
    assert again_bytes == 1 * PAGE_BYTES + AUX_ROW_BYTES
    # and the prompts of the first test, in decode's cache now, are still served token for
    # token
    results = H.run_prompts(pair.router.url, PROMPTS, NEW_TOKENS, in_flight=4)
    assert [(r.error, r.tokens) for r in results] == [("", t) for t in reference[:-1]]
