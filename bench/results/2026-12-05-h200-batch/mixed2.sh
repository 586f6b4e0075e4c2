#!/usr/bin/env bash
# The GPU layout cases one at a time, every thread's stack dumped after 35 s
set -u
export PYTHONUNBUFFERED=1 PDC_TEST_STACKS_AFTER_S=35 MC_LOG_LEVEL=INFO
mkdir -p /tmp/shim/pdc
source "$(dirname "${BASH_SOURCE[0]}")/unpack.sh"
cp -r "$T"/pdc/. /tmp/shim/pdc/
for s in runtime compiler generated integrations; do ln -sfn "$T/$s" /tmp/shim/pdc/$s; done
export PYTHONPATH="/tmp/shim:/tmp/site"
cd /tmp
for k in "nixl-cpu" "mooncake-cuda" "mooncake-cpu"; do
  timeout 70 python3 -m pytest -q -rA -s --tb=short --timeout 55 -p no:cacheprovider \
    --import-mode=append --rootdir "$T" -k "$k" "$T/tests/integrations/test_sglang_gpu.py" > "$OUT/$k.txt" 2>&1
  echo "$k exit $? $(date -u +%T)" | tee -a "$OUT/steps.txt"
  grep -E "^(PASSED|FAILED|ERROR)|bytes checked|passed|failed" "$OUT/$k.txt" | tail -5
done
