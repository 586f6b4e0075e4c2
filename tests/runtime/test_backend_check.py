"""A plan runs only over the engine it was lowered for (Note [Plan backend])."""

from __future__ import annotations

import pytest
from pdc.runtime.endpoints import DecodeEndpoint, PrefillEndpoint, check_backend
from pdc.runtime.engines.local import LocalEngine

from ..compiler.planning import ROOT, plan_for

LLAMA = ROOT / "specs" / "llama3-70b.yaml"


def refused_at_start(endpoint, layout, plan) -> str:
    """The ValueError's message of `endpoint` built over the local engine with no pools and no
    bootstrap server: the start-up checks come before anything is touched."""
    rank = plan.links[0].prefill if endpoint is PrefillEndpoint else plan.links[0].decode
    engine = LocalEngine()
    try:
        with pytest.raises(ValueError) as e:
            endpoint(layout, None, plan, rank, 0, engine, None, "tcp://127.0.0.1:9")
    finally:
        engine.close()
    return str(e.value)


@pytest.mark.parametrize("endpoint", [PrefillEndpoint, DecodeEndpoint])
def test_plan_for_another_backend_is_refused_before_registering(endpoint):
    layout, plan = plan_for(LLAMA, {"tp": 2}, {"tp": 1}, backend="mooncake")
    assert refused_at_start(endpoint, layout, plan) == (
        "the plan was lowered for backend 'mooncake' but this endpoint's engine is 'local'; "
        "hint: lower the plan for 'local' (its backend rules may refuse this topology) or run "
        "the 'mooncake' engine")


def test_the_plan_digest_covers_the_backend():
    _, over_mooncake = plan_for(LLAMA, {"tp": 2}, {"tp": 2}, backend="mooncake")
    _, over_nixl = plan_for(LLAMA, {"tp": 2}, {"tp": 2}, backend="nixl")
    assert over_mooncake.digest() != over_nixl.digest()


def test_cuda_ipc_runs_plans_lowered_for_local():
    from pdc.runtime.engines.cuda_ipc import CudaIpcEngine

    engine = CudaIpcEngine("cpu")
    try:
        assert (engine.name, engine.backend) == ("cuda_ipc", "local")
        _, over_local = plan_for(LLAMA, {"tp": 2}, {"tp": 1}, backend="local")
        check_backend(over_local, engine)
        _, over_mooncake = plan_for(LLAMA, {"tp": 2}, {"tp": 1}, backend="mooncake")
        with pytest.raises(ValueError) as e:
            check_backend(over_mooncake, engine)
    finally:
        engine.close()
    assert str(e.value) == (
        "the plan was lowered for backend 'mooncake' but this endpoint's engine is 'cuda_ipc' "
        "(plans for 'local'); hint: lower the plan for 'local' (its backend rules may refuse "
        "this topology) or run the 'mooncake' engine")
