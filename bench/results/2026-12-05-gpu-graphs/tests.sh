#!/usr/bin/env bash
# Device call 1: the GPU tests of the staging graphs and the staged path (after tree), then
# SGLang's default GPU layout case by case, every thread's stack dumped after 35 s.
# Carried: build/gpurun/{pkg,tree} (tree: the working tree with Note [Staging graphs]).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "${BASH_SOURCE[0]}")/../2026-12-05-h200-batch/unpack.sh"
S=/tmp/shim; mkdir -p $S/pdc; cp -r "$T"/pdc/. $S/pdc/
for s in runtime compiler generated integrations; do ln -sfn "$T/$s" $S/pdc/$s; done
export PYTHONPATH="$S:/tmp/site"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime
  python3 -c "import sys, torch, triton, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
cd /tmp
pt() { python3 -m pytest -q -rA --tb=short -p no:cacheprovider --import-mode=append --rootdir "$T" "$@"; }
timeout 150 bash -c "$(declare -f pt); pt -m gpu --timeout 120 $T/tests/runtime/test_staging_graphs.py $T/tests/runtime/test_copy_kernels.py $T/tests/runtime/test_staged.py" > "$OUT/graph_tests.txt" 2>&1
echo "graph tests exit $? $(date -u +%T)" | tee -a "$OUT/steps.txt"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/graph_tests.txt" | tail -25
export PDC_TEST_STACKS_AFTER_S=35 MC_LOG_LEVEL=INFO
for k in "nixl-cpu" "mooncake-cpu" "nixl-cuda" "mooncake-cuda"; do
  timeout 60 bash -c "$(declare -f pt); pt -s --timeout 50 -k $k $T/tests/integrations/test_sglang_gpu.py" > "$OUT/$k.txt" 2>&1
  echo "$k exit $? $(date -u +%T)" | tee -a "$OUT/steps.txt"
  grep -E "^(PASSED|FAILED|ERROR)|bytes checked|passed|failed" "$OUT/$k.txt" | tail -5
done
# the traced staged 8K request, this tree only (host time of the gather and scatter calls)
cd "$T"; mkdir -p "$OUT/trace-after"
TRACE_OUT="$OUT/trace-after/t" TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine \
  timeout 100 python3 bench/endpoint_trace.py python3 bench/endpoints_processes.py --engines cuda_ipc \
  --tokens-list 8192 --cases tp2-tp1-staged --reps 8 --json "$OUT/traced-after.json" > "$OUT/traced-after.log" 2>&1
echo "trace exit $? $(date -u +%T)" | tee -a "$OUT/steps.txt"
python3 bench/endpoint_trace.py --show "$OUT/trace-after/t" --reps 8 --cases staged-8K > "$OUT/trace-after.txt" 2>&1
head -40 "$OUT/trace-after.txt"; tail -5 "$OUT/traced-after.log"
