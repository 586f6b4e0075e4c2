#!/usr/bin/env bash
# Build (or reuse) the SGLang test environment: a venv OUTSIDE the clone, in a cache folder keyed
# by a hash of its requirements, with SGLang 0.5.23 usable on a CPU-only machine, and pdc (this
# clone, editable) installed into it. Prints the venv's path on its last line.
#
#   ${PDC_CACHE_DIR:-$HOME/.cache/pdc}/sglang-<hash>    the venv (~3.9 GB, ~5-20 min the first time)
#   ${PDC_CACHE_DIR:-$HOME/.cache/pdc}/sglang-current   a link to it, which tests and
#                                                       `pdc sglang-demo` look for
#
# sglang pins a CUDA torch, so it goes in --no-deps and its CPU-usable dependencies under a
# torch==2.13.0 constraint (tests/support/sglang/requirements-*.txt). On a CPU machine two test
# shims from tests/support/sglang/cpu_shims are installed too (sgl_kernel has no CPU build on the
# registry; torchvision's is CUDA-linked). On a GPU machine: pip install sglang==0.5.23 (stock, with
# its CUDA torch) plus pdc, and no shims; see README.md.
#
# PYTHON selects the base interpreter (python3.11 or newer). Safe to run again; concurrent runs wait.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SUPPORT="$REPO/tests/support/sglang"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
CACHE="${PDC_CACHE_DIR:-$HOME/.cache/pdc}"
mkdir -p "$CACHE"

HASH=$(cat "$SUPPORT/requirements-cpu.txt" "$SUPPORT/requirements-nodeps.txt" \
         "$SUPPORT/torch-constraint.txt" | sha256sum | cut -c1-16)
VENV="$CACHE/sglang-$HASH"

exec 9>"$CACHE/sglang.lock"
flock 9

if [ ! -f "$VENV/.pdc-complete" ]; then
  echo "install-sglang.sh: building $VENV (first time: ~5-20 min, ~3.9 GB)" >&2
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install --quiet -c "$SUPPORT/torch-constraint.txt")
  "${PIP[@]}" torch==2.13.0
  grep -v '^#' "$SUPPORT/requirements-nodeps.txt" | xargs "${PIP[@]}" --no-deps
  "${PIP[@]}" -r "$SUPPORT/requirements-cpu.txt"
  touch "$VENV/.pdc-complete"
fi

# Every run: this clone's pdc (editable, its own light dependencies) and the CPU shims, built from
# a copy so that the source folder stays clean.
PIP=("$VENV/bin/python" -m pip install --quiet -c "$SUPPORT/torch-constraint.txt")
"${PIP[@]}" -e "$REPO"
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  SHIMS=$(mktemp -d)
  cp -r "$SUPPORT/cpu_shims/." "$SHIMS/"
  "${PIP[@]}" --no-build-isolation --force-reinstall --no-deps "$SHIMS"
  rm -rf "$SHIMS"
fi
ln -sfn "$VENV" "$CACHE/sglang-current"
echo "$VENV"
