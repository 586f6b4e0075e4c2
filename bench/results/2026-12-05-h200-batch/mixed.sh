#!/usr/bin/env bash
# Step 1 of run.sh alone (SGLang's default GPU layout and the memory-kind tests), each test
# file in its own pytest under its own limit, output kept under $OUT as it comes.
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/shim/pdc
date -u > "$OUT/steps.txt"; nvidia-smi --query-gpu=name,driver_version --format=csv >> "$OUT/steps.txt" 2>&1
source "$(dirname "${BASH_SOURCE[0]}")/unpack.sh"
cp -r "$T"/pdc/. /tmp/shim/pdc/
for s in runtime compiler generated integrations; do ln -sfn "$T/$s" /tmp/shim/pdc/$s; done
export PYTHONPATH="/tmp/shim:/tmp/site"
echo "unpacked $(date -u +%T)" >> "$OUT/steps.txt"
cd /tmp
for t in tests/integrations/test_sglang_device.py tests/runtime/engines/test_memory_kinds.py \
         tests/runtime/engines/test_region_kinds.py tests/integrations/test_sglang_gpu.py; do
  n=$(basename "$t" .py)
  timeout "${PER_FILE_S:-100}" python3 -m pytest -q -rA -s --tb=short --timeout 60 -p no:cacheprovider \
    --import-mode=append --rootdir "$T" "$T/$t" > "$OUT/$n.txt" 2>&1
  echo "$n exit $? $(date -u +%T)" | tee -a "$OUT/steps.txt"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/$n.txt" | tail -12
done
