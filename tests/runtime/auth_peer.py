"""A decode rank in its own process, for tests/runtime/test_auth_processes.py.

    python -m tests.runtime.auth_peer PLAN_JSON_FILE BOOTSTRAP_ADDRESS

It registers with the prefill ranks the bootstrap table names (with whatever control secret
its environment gives it), prints one JSON line ({"ready": true} or {"error": "..."}), then
receives room 5 into pages [7, 0, 3] and prints {"state": ..., "kv": [labels per entry]}."""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    import numpy as np
    from pdc.runtime.control import ControlError
    from pdc.runtime.endpoints import DecodeEndpoint, KVPoll
    from pdc.runtime.engines import make_engine
    from pdc.runtime.family import Family
    from pdc.runtime.plan_types import Plan, RankId
    from pdc.runtime.pools import Capacity, RankPools

    plan = Plan.from_json(open(sys.argv[1]).read())
    wire = Family.load("llama3_70b")
    layout = wire.layout
    r0 = RankId(0, 0)
    pools = RankPools(layout, plan.registration("decode", r0),
                      Capacity(pages=8, slots=2, aux_rows=2, window_pages=1))
    engine = make_engine(plan.topology.backend)
    try:
        ep = DecodeEndpoint(layout, wire, plan, r0, 0, engine, pools, sys.argv[2])
        ep.wait_ready(10)
    except ControlError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        engine.close()
        return 0
    print(json.dumps({"ready": True}), flush=True)
    rv = ep.receiver(5, 0)
    rv.init([7, 0, 3], 0, aux_row=1)
    deadline = time.monotonic() + 20
    while rv.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
        time.sleep(0.01)
    kv = [sorted(np.unique(pools.view("kv", pos)[[7, 0, 3]]).tolist())
          for pos in range(len(pools.buffers["kv"]))]
    print(json.dumps({"state": rv.poll().name, "reason": rv.reason, "kv": kv}), flush=True)
    ep.close()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
