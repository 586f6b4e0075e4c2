"""The authenticated control plane between processes: a prefill rank here with the secret, a
decode rank in a child process (tests/runtime/auth_peer.py) with the same secret (a verified
request), without one, or with another (refused at once, with the exact reason)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from pdc.runtime import knobs
from pdc.runtime.control import BootstrapServer
from pdc.runtime.endpoints import KVPoll, PrefillEndpoint
from pdc.runtime.engines import make_engine
from pdc.runtime.family import Family
from pdc.runtime.plan_types import RankId
from pdc.runtime.pools import Capacity, RankPools

from ..compiler.planning import ROOT, plan_for
from .failure_tools import wait_for

pytestmark = pytest.mark.engines

LLAMA = ROOT / "specs" / "llama3-70b.yaml"
SECRET = "the secret these ranks share, 32+"


def _decode_process(plan_file, bootstrap: str, secret: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDC_CONTROL_")}
    env.update(MC_LOG_LEVEL="ERROR", PDC_BOOTSTRAP_TIMEOUT_S="10")
    if secret is not None:
        env["PDC_CONTROL_SECRET"] = secret
    return subprocess.Popen([sys.executable, "-m", "tests.runtime.auth_peer", str(plan_file),
                             bootstrap], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


@pytest.fixture
def prefill(tmp_path):
    layout, plan = plan_for(LLAMA, {"tp": 1}, {"tp": 1}, backend="mooncake")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    knobs.override(control_secret=SECRET)
    r0 = RankId(0, 0)
    made = []
    try:
        boot = BootstrapServer(1)
        made.append(boot)
        engine = make_engine("mooncake")
        made.append(engine)
        pools = RankPools(layout, plan.registration("prefill", r0),
                          Capacity(pages=8, slots=2, aux_rows=2, window_pages=1))
        ep = PrefillEndpoint(layout, Family.load("llama3_70b"), plan, r0, 0, engine, pools,
                             boot.address)
        made.append(ep)
        yield plan_file, boot, ep, pools
    finally:
        knobs.reset()
        for obj in reversed(made):
            obj.close()


def test_a_decode_process_with_the_secret_gets_every_byte(prefill):
    plan_file, boot, ep, pools = prefill
    child = _decode_process(plan_file, boot.address, SECRET)
    try:
        assert json.loads(child.stdout.readline()) == {"ready": True}
        src = [1, 4, 6]
        for pos in range(len(pools.buffers["kv"])):
            pools.view("kv", pos)[src] = np.uint8(pos % 251 + 1)
        s = ep.sender(5)
        s.send(src, 0, True, 3 * 16, aux_row=1)
        wait_for(lambda: s.poll() in (KVPoll.Success, KVPoll.Failed), timeout=20,
                 what="the request")
        got = json.loads(child.stdout.readline())
        assert got["state"] == "Success", got["reason"]
        assert got["kv"] == [[pos % 251 + 1] for pos in range(len(pools.buffers["kv"]))]
        assert boot.refused == 0 and ep.hub.refused == 0
    finally:
        child.wait(30)


def test_a_decode_process_without_the_secret_is_refused_with_the_reason(prefill):
    plan_file, boot, ep, _ = prefill
    child = _decode_process(plan_file, boot.address, None)
    got = json.loads(child.stdout.readline())
    child.wait(30)
    assert got == {"error": f"bootstrap server {boot.address}: unauthenticated request refused "
                            "(no control secret, or a different one); hint: give every prefill "
                            "and decode process the same secret (PDC_CONTROL_SECRET_FILE)"}
    assert boot.refused == 1
    assert ep.counters["registrations"] == 0


def test_a_decode_process_with_another_secret_is_refused_with_the_reason(prefill):
    plan_file, boot, ep, _ = prefill
    child = _decode_process(plan_file, boot.address, SECRET[::-1])
    got = json.loads(child.stdout.readline())
    child.wait(30)
    assert got == {"error": f"bootstrap server {boot.address}: unauthenticated request refused "
                            "(no control secret, or a different one); hint: give every prefill "
                            "and decode process the same secret (PDC_CONTROL_SECRET_FILE)"}
    assert ep.counters["registrations"] == 0
