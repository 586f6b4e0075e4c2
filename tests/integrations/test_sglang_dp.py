"""DP attention inside real SGLang 0.5.23 servers on a CPU: the tiny DeepSeek-V3-shaped MLA
model (the GLM-5.2 seed's layout: MLA latent with DP attention) served with `--tp 2 --dp 2
--enable-dp-attention` by a plain server and by a PD pair whose prefill and decode both run two
attention-DP groups, pdc's backend moving each request's latent pages from the prefill group
that computed them to the decode group that serves it (Note [SGLang DP attention] in
integrations/sglang/family.py).

- 8 prompts of 1-300 tokens through the router, 4 in flight: token-identical to the plain
  server (the router's random rooms put requests on both groups, room % 2);
- the router's prefill_dp_rank honoured: requests sent to prefill and decode directly (as the
  router does), with a room whose room % 2 names the *other* group, prefill routed to group g
  (`routed_dp_rank`) and decode told so (`disagg_prefill_dp_rank`): identical tokens for
  both groups, so pdc reads where SGLang says the KV is, not where the room points;
- the negative control: decode not told (it then follows the room, to the other group) fails
  the request with pdc's reason instead of reading anything, and the next request succeeds.

Slow (three SGLang servers of two scheduler processes each, ~10 min on the 2-core box), outside
the README's pytest: `PDC_SLOW=1 pytest tests/integrations/test_sglang_dp.py`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import pytest

from pdc.serving import sglang_harness as H

PYTHON = H.sglang_python()
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(2400),
    pytest.mark.skipif(PYTHON is None, reason="no SGLang environment: run "
                       "scripts/install-sglang.sh (CI does)"),
    pytest.mark.skipif(os.environ.get("PDC_SLOW") != "1",
                       reason="slow (three SGLang servers of two ranks each): PDC_SLOW=1 "
                              "pytest tests/integrations/test_sglang_dp.py"),
]

FAMILY = "deepseek-mla"
# SGLang turns on the TP LM-head all-to-all for a decode server of pure DP attention
# (arg_groups/overrides.py `_tp_lm_head_all_to_all_default`); its collective has no CPU kernel
# (`sglang::reg_all_to_all_single`, registered for CUDA only, utils/common.py:2941)
DP_ARGS = H.SERVER_ARGS[FAMILY] + ("--dp", "2", "--enable-dp-attention",
                                   "--no-enable-tp-lm-head-all-to-all")
NEW_TOKENS = 16
PROMPTS = H.mixed_prompts(8, seed=3)
# pdc fails a request whose prefill ranks never report after this long (knob
# transfer_timeout_s on decode) and forgets a room nobody asked for (prefill_room_timeout_s)
DECODE_ENV = {"PDC_TRANSFER_TIMEOUT_S": "20"}
PREFILL_ENV = {"PDC_PREFILL_ROOM_TIMEOUT_S": "40"}


@pytest.fixture(scope="module")
def workdir(request):
    d = tempfile.mkdtemp(prefix="pdc-sglang-dp-")
    yield d
    if request.session.testsfailed:
        print(f"\nthe servers' logs are kept in {d}")
    else:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def model(workdir):
    return H.make_tiny_model(PYTHON, f"{workdir}/tiny-{FAMILY}", FAMILY)


@pytest.fixture(scope="module")
def plain(model, workdir):
    server = H.start_plain(PYTHON, model, workdir, extra_args=DP_ARGS, tp=2)
    try:
        results = H.run_prompts(server.url, PROMPTS, NEW_TOKENS, in_flight=4)
    finally:
        server.stop()
    assert [r.error for r in results] == [""] * len(PROMPTS)
    return [r.tokens for r in results]


@pytest.fixture(scope="module")
def pair(model, workdir, plain):
    p = H.PDPair.start(PYTHON, model, workdir, server_args=DP_ARGS, prefill_tp=2,
                       decode_tp=2, prefill_env=PREFILL_ENV, decode_env=DECODE_ENV)
    yield p
    p.stop()


def test_a_dp_attention_pair_is_token_identical_to_a_plain_server(pair, plain):
    results = H.run_prompts(pair.router.url, PROMPTS, NEW_TOKENS, in_flight=4)
    assert [r.error for r in results] == [""] * len(PROMPTS)
    assert [i for i, (r, ref) in enumerate(zip(results, plain, strict=True))
            if r.tokens != ref] == []
    for server in (pair.prefill, pair.decode):
        with open(server.log, errors="replace") as f:
            log = f.read()
        for group in (0, 1):
            assert f"engine mooncake, attention-DP group {group} of 2" in log, server.tail()


def _direct(pair: H.PDPair, prompt: list[int], room: int, prefill: dict, decode: dict):
    """One request sent to prefill and decode directly, as the router does, with our room and
    each side's own routing fields."""
    base = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.bootstrap_port,
            "bootstrap_room": room}
    out = {}

    def post(name, url, extra):
        out[name] = H.generate(url, prompt, NEW_TOKENS, extra={**base, **extra},
                               timeout_s=180.0)

    threads = [threading.Thread(target=post, args=a)
               for a in (("prefill", pair.prefill.url, prefill),
                         ("decode", pair.decode.url, decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("group", [0, 1])
def test_the_routers_prefill_dp_rank_is_honoured(pair, plain, group):
    # room % 2 names the other group: only the router's choice finds the KV
    room = 8_100_000 + (1 - group)
    out = _direct(pair, PROMPTS[1], room, {"routed_dp_rank": group},
                  {"routed_dp_rank": group, "disagg_prefill_dp_rank": group})
    assert (out["decode"].error, out["decode"].tokens) == ("", plain[1])


def test_a_decode_looking_in_the_other_group_fails_the_request_not_the_next(pair, plain):
    room = 8_200_000  # room % 2 == 0: decode, not told, looks in group 0
    out = _direct(pair, PROMPTS[0], room, {"routed_dp_rank": 1}, {"routed_dp_rank": 1})
    assert out["decode"].tokens == []
    assert "pdc: room 8200000" in out["decode"].error, out["decode"].error
    again = _direct(pair, PROMPTS[0], room + 2, {"routed_dp_rank": 0}, {"routed_dp_rank": 0})
    assert (again["decode"].error, again["decode"].tokens) == ("", plain[0])
