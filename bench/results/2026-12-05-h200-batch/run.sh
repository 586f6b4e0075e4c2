#!/usr/bin/env bash
# One device call, most needed first; each step bounded and written under $OUT as it ends:
#  1. SGLang's default GPU layout (KV on the GPU, metadata on the host) over Mooncake and NIXL,
#     with the other GPU tests of the memory kinds (the 2026-12-04 mixed run, which got no result);
#  2. the endpoints over cuda_ipc, 8K and 1K, staged and direct: before (the tree before
#     Note [Sends from the caller's thread]) and after (this tree), alternating;
#  3. bench/arena_ring.py on one GPU, 8K, a 256 MiB arena.
# Carried: build/gpurun/{pkg,tree,before} (pkg: trimmed engines, debs, pyzmq and jsonschema
# wheels; tree: git archive of the commit; before: git archive of ac06c12^).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "${BASH_SOURCE[0]}")/unpack.sh"
shim() { d=$(mktemp -d); mkdir -p "$d/pdc"; cp -r "$1"/pdc/. "$d/pdc/"
  for s in runtime compiler generated integrations; do ln -sfn "$1/$s" "$d/pdc/$s"; done; echo "$d"; }
AFTER=$(shim "$T"); BEFORE=$(shim "$B/before")
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime
  PYTHONPATH="$AFTER:/tmp/site" python3 -c "import sys, torch, triton, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, 'gpus', torch.cuda.device_count())"
  PYTHONPATH="/tmp/site" python3 -c "import mooncake.engine as m; print('mooncake ok')"
  PYTHONPATH="/tmp/site" python3 -c "import nixl_cu13._api as n; print('nixl ok')"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
step() { echo "=== $1 $(date -u +%T)" | tee -a "$OUT/steps.txt"; }
step "1 mixed layout tests"
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout "${TESTS_S:-200}" python3 -m pytest -q -rA -s --tb=short \
  --timeout 80 -p no:cacheprovider --import-mode=append --rootdir "$T" \
  "$T/tests/integrations/test_sglang_gpu.py" "$T/tests/runtime/engines/test_memory_kinds.py" \
  "$T/tests/runtime/engines/test_region_kinds.py" "$T/tests/integrations/test_sglang_device.py") \
  > "$OUT/gpu_tests.txt" 2>&1
echo "exit $?" | tee -a "$OUT/steps.txt"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests.txt" | tail -30
cd "$T"
for tree in before after; do
  if [ $tree = before ]; then P=$BEFORE; else P=$AFTER; fi
  step "2 endpoints cuda_ipc $tree"
  PYTHONPATH="$P:/tmp/site" timeout 130 python3 bench/endpoints_processes.py --engines cuda_ipc \
    --tokens-list 8192,1024 --reps "${REPS:-15}" --json "$OUT/$tree-1.json" > "$OUT/$tree-1.log" 2>&1
  echo "exit $?" | tee -a "$OUT/steps.txt"; uptime >> "$OUT/load.txt"
done
PYTHONPATH="$AFTER:/tmp/site" python3 bench/control_path_summary.py "$OUT" > "$OUT/summary.md" 2>&1; cat "$OUT/summary.md"
step "3 arena ring"
PYTHONPATH="$AFTER:/tmp/site" timeout 150 python3 bench/arena_ring.py --cuda --tokens 8192 \
  --arena $((256 << 20)) --slot-bytes $((32 << 20)) --json "$OUT/arena_ring.json" > "$OUT/arena_ring.txt" 2>&1
echo "exit $?" | tee -a "$OUT/steps.txt"; tail -15 "$OUT/arena_ring.txt"
step done
