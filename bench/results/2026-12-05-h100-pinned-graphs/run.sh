#!/usr/bin/env bash
# One device call (issue 29 item 4): Note [Pinned graph input] before / after in one run. (a)
# bench/staging_host.py of the after tree over both trees' packages, alternating twice (host
# µs per replayed gather / scatter, and how much of it is the graph call); (b) the GPU tests of
# the graph caches, the copy kernels and the descriptor copies; (c) bench/endpoints_processes.py
# over cuda_ipc, staged 8K and direct 1K, before / after interleaved twice; (d) one traced run
# of the after tree, direct 1K and staged 8K.
# Carried: build/gpurun/{pkg,tree,before} (tree: the change, before: main before it); run from
# the repository root:
#   BUDGET=540 bash build/gpurun/tree/bench/results/2026-12-05-h100-pinned-graphs/run.sh
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s); BUDGET=${BUDGET:-560}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=/tmp/w; mkdir -p $W
pack() { echo "$1 exit $2 $(date -u +%T) left $(left)s" | tee -a $W/steps.txt
  tar czf "$OUT/results.tgz" -C $W . ; }
source "$(dirname "${BASH_SOURCE[0]}")/../2026-12-05-h200-batch/unpack.sh"
shim() { d=$(mktemp -d); mkdir -p "$d/pdc"; cp -r "$1"/pdc/. "$d/pdc/"
  for s in runtime compiler generated integrations; do ln -sfn "$1/$s" "$d/pdc/$s"; done; echo "$d"; }
AFTER=$(shim "$T"); BEFORE=$(shim "$B/before")
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime
  lscpu | grep -E "Model name|MHz" | head -3
  python3 -c "import sys, torch, triton, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"; } > $W/env.txt 2>&1
cat $W/env.txt
cd "$T"
# (a)
for round in 1 2; do
  for tree in before after; do
    if [ $tree = before ]; then P=$BEFORE; prof=""; else P=$AFTER; prof="--profile 20"; fi
    PYTHONPATH="$P:/tmp/site" timeout 100 python3 bench/staging_host.py --tokens 8192 --reps 30 \
      $prof --json $W/host-$tree-$round.json > $W/host-$tree-$round.txt 2>&1
    pack "host-$tree-$round" $?; grep -A4 "^graphs" $W/host-$tree-$round.txt
  done
done
grep -A9 "copy inside" $W/host-after-1.txt
# (b)
t=$(($(left) - 10)); [ $t -gt 150 ] && t=150
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 -m pytest -q -rA --tb=short -p no:cacheprovider \
  --import-mode=append --rootdir "$T" -m gpu --timeout 100 $T/tests/runtime/test_staging_graphs.py \
  $T/tests/runtime/test_pinned_graph.py $T/tests/runtime/test_copy_kernels.py \
  $T/tests/runtime/test_staged.py $T/tests/runtime/engines/test_cuda_ipc.py) > $W/gpu_tests.txt 2>&1
pack gpu_tests $?; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.txt | tail -30
# (c)
for round in 1 2; do
  for tree in before after; do
    if [ $tree = before ]; then P=$BEFORE; else P=$AFTER; fi
    t=$(($(left) - 5)); [ $t -gt 110 ] && t=110; [ $t -lt 40 ] && { pack "$tree-$round skipped" 0; continue; }
    PYTHONPATH="$P:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
      --pairs tp2-tp1-staged:8192,tp1-tp1-direct:1024 --reps 20 --json $W/$tree-$round.json \
      > $W/$tree-$round.log 2>&1
    rc=$?; uptime >> $W/load.txt; pack "$tree-$round" $rc
  done
done
# (d)
if [ "$(left)" -gt 90 ]; then
  mkdir -p $W/trace-after
  PYTHONPATH="$AFTER:/tmp/site" TRACE_OUT=$W/trace-after/t TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine \
    timeout $(($(left) - 20)) python3 bench/endpoint_trace.py python3 bench/endpoints_processes.py --engines cuda_ipc \
    --pairs tp1-tp1-direct:1024,tp2-tp1-staged:8192 --reps 8 --json $W/traced-after.json > $W/traced-after.log 2>&1
  rc=$?
  PYTHONPATH="$AFTER:/tmp/site" python3 bench/endpoint_trace.py --show $W/trace-after/t --reps 8 \
    --cases direct-1K,staged-8K > $W/trace-after.txt 2>&1
  pack trace $rc
fi
python3 - $W <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*-[12].json")):
    d = json.load(open(f))
    for r in d["rows"]:
        if "ms" in r:
            print(f"{os.path.basename(f):14} {r['case']:30} ms {r['ms']:6.2f} engine {r['engine_only_ms']:5.2f} "
                  f"ratio {r['ratio_to_engine']:.3f} fixed {r['fixed_ms']:5.2f} "
                  f"submit_us {r['engine_submit_host_us'] or 0:6.0f} checks {d['all_checks_passed']}")
        else:
            print(os.path.basename(f), r)
PY
cat $W/steps.txt
