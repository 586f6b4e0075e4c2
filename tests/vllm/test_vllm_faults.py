"""Real vLLM engines with PdcConnector between them, over Mooncake and NIXL: every token of
PD against one engine alone, then faults (aborts on either side while a transfer is open,
peer death). One prefill and one decode engine per transfer engine serve every test of this
module (engines take ~20 s each to start; the reference engine runs before them, alone); the
peer death test kills the prefill engine, so it runs last.

Leak checks read vLLM's own block pool and the connector's accounting (pdc.serving.vllm_engine's
`free_blocks` op): after each test every block is back in vLLM's free queue (all but its null
block), no request is left in either scheduler, and the connector holds nothing.
"""

from __future__ import annotations

import itertools
import random
import time

import pytest

from pdc.serving.vllm_env import HINT, vllm_python
from pdc.serving.vllm_proxy import Engine, Flow, make_prompts, run_pd, run_single

pytestmark = pytest.mark.engines

if vllm_python() is None:
    pytest.skip(f"no vLLM environment: {HINT}", allow_module_level=True)

PEER_DEAD_AFTER_S = 3.0
HEARTBEAT_S = 0.5
KNOBS = {"peer_dead_after_s": PEER_DEAD_AFTER_S, "heartbeat_interval_s": HEARTBEAT_S,
         "abort_ack_timeout_s": 5.0}
_ids = itertools.count()


PROMPTS = make_prompts(8, 0)  # `pdc vllm-demo --prompts 8`'s: lengths 17 to 300, a repeat
TOKENS = 8


@pytest.fixture(scope="module")
def reference(vllm_model, tmp_path_factory) -> list[list[int]]:
    """One engine alone's tokens for PROMPTS, before any pair starts (the pairs take both
    cores)."""
    eng = Engine(vllm_python(), tmp_path_factory.mktemp("vllm-ref"), "single", vllm_model, "",
                 "mooncake", core=1)
    try:
        eng.wait_up()
        return run_single(eng, PROMPTS, TOKENS)
    finally:
        eng.stop()


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def pair(request, vllm_model, reference, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"vllm-{request.param}")
    engines = []
    try:
        for role, core in (("prefill", 0), ("decode", 1)):
            # no family: the connector binds the spec that serves LlamaForCausalLM
            # (specs/vllm-llama.yaml) to this model at start, as tests/vllm/test_vllm_bound.py
            # does for other sizes
            eng = Engine(vllm_python(), work, role, vllm_model, "", request.param,
                         core=core, extra={"knobs": KNOBS})
            engines.append(eng)
            eng.wait_up()
        yield tuple(engines)
    finally:
        for eng in engines:
            eng.stop()


def prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(tokens)]


def generate(eng: Engine, prompt_ids: list[int], max_tokens: int, params=None,
             timeout_s: float = 120.0) -> dict:
    rid = f"t{next(_ids)}"
    eng.send({"op": "generate", "id": rid, "prompt": prompt_ids, "max_tokens": max_tokens,
              "kv_transfer_params": params})
    return wait_for(eng, rid, timeout_s)


def wait_for(eng: Engine, rid: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        r = eng.recv(max(deadline - time.monotonic(), 0.1))
        if r.get("id") == rid:
            return r


def pd(pre: Engine, dec: Engine, prompt_ids: list[int], max_tokens: int = 4) -> dict:
    """One request through prefill then decode (the demo's proxy, Note [PD request flow])."""
    first = generate(pre, prompt_ids, 1, {"do_remote_decode": True})
    assert first["kv_transfer_params"], first
    return generate(dec, prompt_ids, max_tokens, first["kv_transfer_params"]) | {
        "params": first["kv_transfer_params"]}


def nothing_held(eng: Engine, timeout_s: float = 15.0) -> dict:
    """Wait until the engine holds no request, then check every block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = eng.call({"op": "free_blocks"})
        if (not state["requests"] and not state["held"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert state["requests"] == 0 and state["held"] == [], (eng.role, state)
    assert state["free"] == state["total"] - 1, (eng.role, state)
    return state


def wait_held(eng: Engine, count: int, timeout_s: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = eng.call({"op": "free_blocks"})["held"]
        if len(held) >= count:
            return held
        time.sleep(0.1)
    raise AssertionError(f"the {eng.role} engine never held {count} transfer(s)")


def pending_params(first_params: dict, room: int) -> dict:
    """Decode's params for a prefill request that has not produced its KV yet: decode's
    receiver registers the room with prefill and waits (WAITING_FOR_REMOTE_KVS)."""
    return {**first_params, "pdc_room": room, "remote_request_id": f"pending-{room}"}


def test_pd_is_token_identical_to_one_engine(pair, reference):
    """Every prompt token-identical to the engine alone, bytes moved for every prompt: the
    prompt's blocks x 2 layers x 16 KiB, a repeated prompt only the blocks decode's prefix
    cache does not hold (its last one), and nothing held afterwards on either engine."""
    pre, dec = pair
    tokens, transfers, _, errors, _ = run_pd(pre, dec, PROMPTS, TOKENS)
    assert errors == [""] * len(PROMPTS) and tokens == reference, (errors, tokens)
    repeats = 0
    for p, t in zip(PROMPTS, transfers, strict=True):
        assert t["ok"] and t["prefix_tokens"] % 32 == 0, t
        repeats += t["prefix_tokens"] > 0
        assert t["bytes"] == (-(-len(p) // 32) - t["prefix_tokens"] // 32) * 2 * 16384, t
    assert repeats == 2, transfers  # prompts 3 and 7 repeat prompt 2 (150 tokens: 4 of 5)
    nothing_held(pre)
    nothing_held(dec)


def test_the_first_token_from_prefill_is_token_identical_to_one_engine(pair, reference):
    """Note [First token from prefill]: the client's first token is prefill's, decode gets the
    prompt and that token and loads the prompt's blocks past its own prefix cache (which
    holds the earlier test's prompts: a prompt a whole number of blocks long is all cached,
    its load cancelled and prefill's blocks freed at once)."""
    pre, dec = pair
    tokens, transfers, _, errors, _ = run_pd(pre, dec, PROMPTS, TOKENS,
                                             flow=Flow(first_token=True))
    assert errors == [""] * len(PROMPTS) and tokens == reference, (errors, tokens)
    for p, t in zip(PROMPTS, transfers, strict=True):
        assert t["ok"] and t["prefix_tokens"] % 32 == 0, t
        assert t["bytes"] == (-(-len(p) // 32) - t["prefix_tokens"] // 32) * 2 * 16384, t
    assert any(t.get("cached") for t in transfers), transfers
    nothing_held(pre, timeout_s=5.0)
    nothing_held(dec)


def test_prefill_abort_while_its_transfer_is_open_frees_its_blocks(pair):
    """The prompt is computed and its blocks are queued for a decode that has not asked yet;
    the client goes away: pdc drains the room, vLLM frees the blocks once."""
    pre, dec = pair
    rid = f"t{next(_ids)}"
    pre.send({"op": "generate", "id": rid, "prompt": prompt(200, 2), "max_tokens": 600,
              "kv_transfer_params": {"do_remote_decode": True}})
    wait_held(pre, 1)  # the worker opened the room and queued the blocks
    busy = pre.call({"op": "free_blocks"})
    assert busy["free"] <= busy["total"] - 1 - 7  # 200 tokens: 7 blocks
    pre.send({"op": "abort", "id": rid})
    assert wait_for(pre, rid, 30)["aborted"]
    nothing_held(pre)
    r = pd(pre, dec, prompt(64, 3))  # the next request succeeds
    assert r["pdc"]["ok"], r
    nothing_held(pre)
    nothing_held(dec)


def test_decode_abort_while_it_waits_for_the_kv_frees_its_blocks(pair):
    """Decode's receiver registered the request with prefill, whose KV is not there yet; the
    client goes away: decode aborts, prefill acks (nothing in flight), the blocks are freed
    once; a later request for the same room on prefill fails instead of writing them."""
    pre, dec = pair
    params = pd(pre, dec, prompt(40, 4))["params"]
    rid = f"t{next(_ids)}"
    dec.send({"op": "generate", "id": rid, "prompt": prompt(150, 5), "max_tokens": 4,
              "kv_transfer_params": pending_params(params, 424242 + next(_ids))})
    wait_held(dec, 1)
    busy = dec.call({"op": "free_blocks"})
    assert busy["free"] <= busy["total"] - 1 - 5  # 150 tokens: 5 blocks
    dec.send({"op": "abort", "id": rid})
    assert wait_for(dec, rid, 30)["aborted"]
    nothing_held(dec)
    r = pd(pre, dec, prompt(150, 5))
    assert r["pdc"]["ok"], r
    nothing_held(pre)
    nothing_held(dec)


def test_decode_abort_during_a_live_transfer_leaks_nothing(pair):
    """Decode aborted right after its request arrived: the abort meets the load wherever it
    is (not started, in flight, or done); either way nothing is held afterwards on either
    side and the next request succeeds."""
    pre, dec = pair
    for n, tokens in enumerate((900, 500, 300)):
        first = generate(pre, prompt(tokens, 10 + n), 1, {"do_remote_decode": True})
        rid = f"t{next(_ids)}"
        dec.send({"op": "generate", "id": rid, "prompt": prompt(tokens, 10 + n),
                  "max_tokens": 4, "kv_transfer_params": first["kv_transfer_params"]})
        time.sleep(0.01 * n)
        dec.send({"op": "abort", "id": rid})
        wait_for(dec, rid, 30)
        nothing_held(dec)
        nothing_held(pre)
    r = pd(pre, dec, prompt(100, 20))
    assert r["pdc"]["ok"], r


def test_prefill_death_fails_the_waiting_request_and_decode_keeps_serving(pair):
    """Runs last: kills this module's prefill engine. Decode's request waits on prefill when
    prefill dies; pdc's heartbeats declare it dead after peer_dead_after_s and the load fails
    through vLLM's load-error hook (kv_load_failure_policy=fail: the request ends with an
    error, never decoded from its unwritten blocks); decode serves on."""
    pre, dec = pair
    params = pd(pre, dec, prompt(40, 30))["params"]
    pre.send({"op": "generate", "id": "long", "prompt": prompt(200, 31), "max_tokens": 600,
              "kv_transfer_params": {"do_remote_decode": True}})
    wait_held(pre, 1)
    rid = f"t{next(_ids)}"
    dec.send({"op": "generate", "id": rid, "prompt": prompt(120, 32), "max_tokens": 4,
              "kv_transfer_params": pending_params(params, 434343)})
    wait_held(dec, 1)
    pre.proc.kill()
    pre.proc.wait(10)
    killed = time.monotonic()
    r = wait_for(dec, rid, 60)
    waited_s = time.monotonic() - killed
    assert r["finish_reason"] == "error" and r["tokens"] == [], r
    assert not r["pdc"]["ok"] and "silent" in r["pdc"]["reason"], r
    # Declared dead after peer_dead_after_s of silence (the last heartbeat may be up to one
    # interval old when prefill dies), plus one engine step or two.
    assert waited_s < PEER_DEAD_AFTER_S + 2 * HEARTBEAT_S + 5.0, waited_s
    local = generate(dec, prompt(80, 33), 4)
    assert len(local["tokens"]) == 4 and local["finish_reason"] == "length", local
    nothing_held(dec)
