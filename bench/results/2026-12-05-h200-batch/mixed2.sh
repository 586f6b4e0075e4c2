#!/usr/bin/env bash
# The GPU layout cases one at a time, every thread's stack dumped after 35 s
set -u
B=$PWD/build/gpurun; T=$B/tree
export PYTHONUNBUFFERED=1 PDC_TEST_STACKS_AFTER_S=35 MC_LOG_LEVEL=INFO
mkdir -p /tmp/debs /tmp/site /tmp/shim/pdc
for f in "$B"/pkg/*.deb; do dpkg -x "$f" /tmp/debs; done
for f in "$B"/pkg/*.tgz; do tar xzf "$f" -C /tmp/site; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$B"/pkg/*.whl
cp -r "$T"/pdc/. /tmp/shim/pdc/
for s in runtime compiler generated integrations; do ln -sfn "$T/$s" /tmp/shim/pdc/$s; done
CUDART=$(python3 -c "import glob, os, site; print(':'.join(sorted({os.path.dirname(p) for d in site.getsitepackages() for p in glob.glob(d + '/nvidia/**/libcudart.so.13*', recursive=True)})))")
export LD_LIBRARY_PATH="/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="/tmp/shim:/tmp/site"
cd /tmp
for k in "nixl-cpu" "mooncake-cuda" "mooncake-cpu"; do
  timeout 70 python3 -m pytest -q -rA -s --tb=short --timeout 55 -p no:cacheprovider \
    --import-mode=append --rootdir "$T" -k "$k" "$T/tests/integrations/test_sglang_gpu.py" > "$OUT/$k.txt" 2>&1
  echo "$k exit $? $(date -u +%T)" | tee -a "$OUT/steps.txt"
  grep -E "^(PASSED|FAILED|ERROR)|bytes checked|passed|failed" "$OUT/$k.txt" | tail -5
done
