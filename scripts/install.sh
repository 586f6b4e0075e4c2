#!/usr/bin/env bash
# Install pdc with everything its demo and its tests need, on a clean Debian-like machine.
#
#   1. libibverbs1, the system library Mooncake's transfer engine links against (apt, only
#      when it is missing and apt-get exists; through sudo when not root);
#   2. pdc itself, editable, with the engines, kernels, hf and test extras (torch is pinned
#      to 2.13.0 in pyproject.toml: the CPU build; any other version downloads GBs);
#   3. NIXL (nixl-cu12), which is not installable as a normal dependency of pdc, so it is
#      installed on its own, without its dependencies.
#
# PYTHON selects the interpreter (default: python3, else python). Safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"

have_ibverbs() {
  ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' \
    || dpkg-query -W -f='${Status}' libibverbs1 2>/dev/null | grep -q 'install ok installed'
}

if ! have_ibverbs; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install --no-install-recommends -y libibverbs1
  else
    echo "install.sh: libibverbs1 is missing and there is no apt-get; install it by hand" >&2
  fi
fi

"$PYTHON" -m pip install -e '.[engines,kernels,hf,test]'
"$PYTHON" -m pip install --no-deps 'nixl-cu12==1.5.1'
