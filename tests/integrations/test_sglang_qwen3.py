"""A family beyond Llama inside real SGLang 0.5.23 servers: a tiny dense Qwen3
(`Qwen3ForCausalLM`, head_dim from its config, q/k norms) served by pdc's backend through
specs/sglang-tiny-qwen3.yaml, against a plain SGLang server.

Needs the SGLang environment of scripts/install-sglang.sh (CI builds it); skipped with that
reason when it is absent. Lean on purpose (CI budget): one plain server for the reference
(stopped before the pair starts) and one PD pair over Mooncake; the engines, faults, aborts
and metrics are covered with the Llama in test_sglang_servers.py.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest

from pdc import sglang_harness as H

PYTHON = H.sglang_python()
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(PYTHON is None, reason="no SGLang environment: run "
                       "scripts/install-sglang.sh (CI does)"),
]

NEW_TOKENS = 16
PROMPTS = H.mixed_prompts(8, seed=2)  # 1 .. 300 tokens: up to 5 chunks of 64, 16-token pages


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
        results = H.run_prompts(plain.url, PROMPTS, NEW_TOKENS, in_flight=4)
    finally:
        plain.stop()
    assert [r.error for r in results] == [""] * len(PROMPTS)
    return [r.tokens for r in results]


@pytest.fixture(scope="module")
def pair(model, workdir, reference):
    p = H.PDPair.start(PYTHON, model, workdir, engine="mooncake")
    yield p
    p.stop()


def test_qwen3_pd_pair_is_token_identical_to_a_plain_server(pair, reference):
    results = H.run_prompts(pair.router.url, PROMPTS, NEW_TOKENS, in_flight=4)
    assert [r.error for r in results] == [""] * len(PROMPTS)
    assert [i for i, (r, ref) in enumerate(zip(results, reference, strict=True))
            if r.tokens != ref] == []
    assert all(len(r.tokens) == NEW_TOKENS for r in results)


def test_both_servers_serve_qwen3_through_its_own_spec(pair, reference):
    # Note [Served family]: the architecture picks the candidates, SGLang's buffers the spec
    for server in (pair.prefill, pair.decode):
        with open(server.log, errors="replace") as f:
            log = f.read()
        assert "Qwen3ForCausalLM rank pp0.tp0, family sglang-tiny-qwen3 " \
               "(specs/sglang-tiny-qwen3.yaml)" in log, server.tail()

