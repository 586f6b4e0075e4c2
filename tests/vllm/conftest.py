from __future__ import annotations

import subprocess

import pytest

from pdc.serving.vllm_env import vllm_python


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory):
    """The random-weight Llama of the vllm-llama family, made once by the vLLM environment."""
    from pdc.serving.vllm_proxy import engine_env

    path = tmp_path_factory.mktemp("vllm-model") / "model"
    r = subprocess.run([vllm_python(), "-m", "pdc.serving.vllm_engine", "--make-model", str(path),
                        "vllm-llama"], capture_output=True, text=True, env=engine_env(0),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return str(path)
