#!/usr/bin/env bash
# Device call 2: bench/staging_host.py (graphs on/off), tests/integrations/test_sglang_gpu.py,
# then bench/endpoints_processes.py over cuda_ipc, 8K and 1K, staged and direct,
# before (main without Note [Staging graphs]) and after, alternating twice; then one traced
# run per tree (bench/endpoint_trace.py) for the host time of the gather and scatter calls.
# Carried: build/gpurun/{pkg,tree,before}.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "${BASH_SOURCE[0]}")/../2026-12-05-h200-batch/unpack.sh"
shim() { d=$(mktemp -d); mkdir -p "$d/pdc"; cp -r "$1"/pdc/. "$d/pdc/"
  for s in runtime compiler generated integrations; do ln -sfn "$1/$s" "$d/pdc/$s"; done; echo "$d"; }
AFTER=$(shim "$T"); BEFORE=$(shim "$B/before")
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime; } > "$OUT/env.txt" 2>&1
cd "$T"
PYTHONPATH="$AFTER:/tmp/site" timeout 120 python3 bench/staging_host.py --tokens 8192 --reps 20 \
  --json "$OUT/staging_host.json" > "$OUT/staging_host.txt" 2>&1
echo "staging_host exit $? $(date -u +%T)" | tee -a "$OUT/steps.txt"; cat "$OUT/staging_host.txt"
# SGLang's GPU layouts through the backend as it now binds them (default layout accepted)
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 150 python3 -m pytest -q -rA -s --tb=short --timeout 60 \
  -p no:cacheprovider --import-mode=append --rootdir "$T" "$T/tests/integrations/test_sglang_gpu.py") \
  > "$OUT/sglang_gpu.txt" 2>&1
echo "sglang_gpu exit $? $(date -u +%T)" | tee -a "$OUT/steps.txt"
grep -E "^(PASSED|FAILED|ERROR)|bytes checked|passed|failed" "$OUT/sglang_gpu.txt" | tail -12
for round in ${ROUNDS:-1 2}; do
  for tree in before after; do
    if [ $tree = before ]; then P=$BEFORE; else P=$AFTER; fi
    PYTHONPATH="$P:/tmp/site" timeout 150 python3 bench/endpoints_processes.py --engines cuda_ipc \
      --tokens-list 8192,1024 --reps "${REPS:-15}" --json "$OUT/$tree-$round.json" > "$OUT/$tree-$round.log" 2>&1
    echo "$tree $round exit $? $(date -u +%T)" | tee -a "$OUT/steps.txt"; uptime >> "$OUT/load.txt"
  done
done
for tree in ${TRACES:-before after}; do
  if [ $tree = before ]; then P=$BEFORE; else P=$AFTER; fi
  mkdir -p "$OUT/trace-$tree"
  PYTHONPATH="$P:/tmp/site" TRACE_OUT="$OUT/trace-$tree/t" TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine \
    timeout 90 python3 "$T/bench/endpoint_trace.py" python3 bench/endpoints_processes.py --engines cuda_ipc \
    --tokens-list 8192 --cases tp2-tp1-staged --reps 8 --json "$OUT/traced-$tree.json" > "$OUT/traced-$tree.log" 2>&1
  echo "trace $tree exit $? $(date -u +%T)" | tee -a "$OUT/steps.txt"
  PYTHONPATH="$P:/tmp/site" python3 "$T/bench/endpoint_trace.py" --show "$OUT/trace-$tree/t" --reps 8 --cases staged-8K > "$OUT/trace-$tree.txt" 2>&1
  cat "$OUT/trace-$tree.txt" | head -40
done
for f in "$OUT"/*-[12].log; do echo "== $f"; grep -E "staged|direct" "$f" | tail -6; done
