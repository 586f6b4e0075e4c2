#!/usr/bin/env bash
# Step 1 of run.sh alone (SGLang's default GPU layout and the memory-kind tests), each test
# file in its own pytest under its own limit, output kept under $OUT as it comes.
set -u
B=$PWD/build/gpurun; T=$B/tree
export PYTHONUNBUFFERED=1
mkdir -p /tmp/debs /tmp/site /tmp/shim/pdc
date -u > "$OUT/steps.txt"; nvidia-smi --query-gpu=name,driver_version --format=csv >> "$OUT/steps.txt" 2>&1
for f in "$B"/pkg/*.deb; do dpkg -x "$f" /tmp/debs; done
for f in "$B"/pkg/*.tgz; do tar xzf "$f" -C /tmp/site; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$B"/pkg/*.whl
cp -r "$T"/pdc/. /tmp/shim/pdc/
for s in runtime compiler generated integrations; do ln -sfn "$T/$s" /tmp/shim/pdc/$s; done
CUDART=$(python3 -c "import glob, os, site; print(':'.join(sorted({os.path.dirname(p) for d in site.getsitepackages() for p in glob.glob(d + '/nvidia/**/libcudart.so.13*', recursive=True)})))")
export LD_LIBRARY_PATH="/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
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
