#!/usr/bin/env bash
# one device call: unpack the engines, shim pdc from the carried tree, run the GPU tests of
# SGLang's buffers in both layouts (metadata on the host: SGLang's default; on the GPU)
set -u
B=$PWD/build/gpurun; T=$B/tree
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/debs /tmp/site /tmp/shim/pdc
for f in "$B"/pkg/*.deb; do dpkg -x "$f" /tmp/debs; done
for f in "$B"/pkg/*.tgz; do tar xzf "$f" -C /tmp/site; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$B"/pkg/*.whl
cp -r "$T"/pdc/. /tmp/shim/pdc/
for s in runtime compiler generated integrations; do ln -sfn "$T/$s" /tmp/shim/pdc/$s; done
CUDART=$(python3 -c "import glob, os, site; print(':'.join(sorted({os.path.dirname(p) for d in site.getsitepackages() for p in glob.glob(d + '/nvidia/**/libcudart.so.13*', recursive=True)})))")
export LD_LIBRARY_PATH="/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="/tmp/shim:/tmp/site"
{
  date -u; nvidia-smi; nproc
  python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'gpus', torch.cuda.device_count())"
  ldd /tmp/site/mooncake/engine.so | grep -E "not found|cudart|ibverbs|curl|numa"
  python3 -c "import mooncake.engine as m; print('mooncake', {k: getattr(m, k) for k in dir(m) if k.startswith('SUPPORT_')})"
  python3 -c "import nixl_cu13._api as n; print('nixl', n.__file__)"
  (cd /tmp && python3 -c "import pdc.integrations.sglang.family as f, pdc.runtime.engines.nixl as n; print(f.__file__, n.__file__)")
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
cd /tmp && timeout "${TESTS_S:-330}" python3 -m pytest -q -rA -s --tb=short --timeout 150 -p no:cacheprovider \
  --import-mode=append --rootdir "$T" -k "${TESTS_K:-}" "$T/tests/integrations/test_sglang_gpu.py" \
  "$T/tests/runtime/engines/test_memory_kinds.py" "$T/tests/runtime/engines/test_region_kinds.py" \
  "$T/tests/integrations/test_sglang_device.py" "$T/tests/runtime/engines/test_gpu_engines.py" \
  > "$OUT/gpu_tests.txt" 2>&1
echo "=== gpu tests exit $?"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|bytes checked|Error|error:|passed|failed" "$OUT/gpu_tests.txt" | tail -40
