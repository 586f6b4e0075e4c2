#!/usr/bin/env bash
# Install pdc with everything its demo and its tests need, into a virtual environment.
#
#   1. libibverbs1, the system library Mooncake's transfer engine links against, and
#      python3-venv when `python3 -m venv` cannot work (apt, only when missing and apt-get
#      exists; through sudo when not root);
#   2. the virtual environment: the one PYTHON names (PYTHON=/path/to/venv/bin/python), else
#      the active one ($VIRTUAL_ENV), else .venv/ in the repository, created when missing.
#      System Pythons of Debian 12 and Ubuntu 24.04 refuse `pip install` outside one (PEP 668);
#   3. pdc itself, editable, with the engines, kernels, hf and test extras. torch is pinned to
#      2.13.0 and triton only bounded (`triton>=3.7.1,<3.9`): on a GPU machine pip takes PyPI's
#      CUDA build of torch with the triton it pins (3.7.1); where the machine offers torch's
#      CPU build (a local wheel folder, PIP_FIND_LINKS), pip takes that one, without CUDA
#      libraries, and the newest triton;
#   4. NIXL (nixl-cu12), which is not installable as a normal dependency of pdc, so it is
#      installed on its own, without its dependencies.
#
# Then: `. .venv/bin/activate` (or the venv you chose) puts `pdc` and `pytest` on PATH.
# Safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install --no-install-recommends -y "$@"
}

have_ibverbs() {
  ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' \
    || dpkg-query -W -f='${Status}' libibverbs1 2>/dev/null | grep -q 'install ok installed'
}

if ! have_ibverbs; then
  apt_install libibverbs1 \
    || echo "install.sh: libibverbs1 is missing and there is no apt-get; install it by hand" >&2
fi

if [ -z "${PYTHON:-}" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    PYTHON="$VIRTUAL_ENV/bin/python"
  else
    if [ ! -x .venv/bin/python ]; then
      BASE="$(command -v python3 || command -v python)"
      rm -rf .venv  # a half-made one from a failed attempt
      if ! "$BASE" -m venv .venv; then
        rm -rf .venv
        # Debian and Ubuntu ship venv's pip bootstrap separately.
        apt_install python3-venv || { echo "install.sh: '$BASE -m venv' failed; install" \
          "python3-venv (or give PYTHON=/path/to/venv/bin/python)" >&2; exit 1; }
        "$BASE" -m venv .venv
      fi
      echo "install.sh: created the virtual environment .venv/ (activate: . .venv/bin/activate)"
    fi
    PYTHON="$PWD/.venv/bin/python"
  fi
fi

"$PYTHON" -m pip install -e '.[engines,kernels,hf,test]'
"$PYTHON" -m pip install --no-deps 'nixl-cu12==1.5.1'
