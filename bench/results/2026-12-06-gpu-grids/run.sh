#!/usr/bin/env bash
# One device call (issue 29 item 4): Note [Descriptor grids] on / off in one run. (a) the GPU
# tests of the cuda_ipc engine (the grid test among them) and of the copy kernels; (b)
# bench/endpoints_processes.py over cuda_ipc, direct 1K and 8K and staged 8K, with
# PDC_DESCRIPTOR_GRIDS=0 and =1 interleaved twice (both processes of a run read the knob); (c) one
# traced run with grids, direct 1K and 8K. Carried: .whl (pyzmq, jsonschema and its needs).
# From the repository root: BUDGET=540 bash bench/results/2026-12-06-gpu-grids/run.sh
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s); BUDGET=${BUDGET:-540}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=/tmp/w; mkdir -p $W
pack() { echo "$1 exit $2 $(date -u +%T) left $(left)s" | tee -a $W/steps.txt
  tar czf "$OUT/results.tgz" -C $W . ; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T=$PWD; S=$(mktemp -d); mkdir -p "$S/pdc"; cp -r pdc/. "$S/pdc/"
for s in runtime compiler generated integrations; do ln -sfn "$T/$s" "$S/pdc/$s"; done
export PYTHONPATH="$S:/tmp/site"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime
  lscpu | grep -E "Model name|MHz" | head -3
  python3 -c "import sys, torch, triton, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"; } > $W/env.txt 2>&1
cat $W/env.txt
# (a)
(cd /tmp && timeout 150 python3 -m pytest -q -rA --tb=short -p no:cacheprovider \
  --import-mode=append --rootdir "$T" -m gpu --timeout 100 $T/tests/runtime/engines/test_cuda_ipc.py \
  $T/tests/runtime/test_copy_kernels.py $T/tests/runtime/test_pinned_graph.py) > $W/gpu_tests.txt 2>&1
pack gpu_tests $?; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.txt | tail -20
# (b)
for round in 1 2; do
  for grids in 0 1; do
    t=$(($(left) - 5)); [ $t -gt 120 ] && t=120; [ $t -lt 40 ] && { pack "grids$grids-$round skipped" 0; continue; }
    PDC_DESCRIPTOR_GRIDS=$grids timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
      --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192,tp2-tp1-staged:8192 --reps 20 \
      --json $W/grids$grids-$round.json > $W/grids$grids-$round.log 2>&1
    rc=$?; uptime >> $W/load.txt; pack "grids$grids-$round" $rc
  done
done
# (c)
if [ "$(left)" -gt 70 ]; then
  mkdir -p $W/trace
  TRACE_OUT=$W/trace/t TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine \
    timeout $(($(left) - 15)) python3 bench/endpoint_trace.py python3 bench/endpoints_processes.py \
    --engines cuda_ipc --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192 --reps 8 \
    --json $W/traced.json > $W/traced.log 2>&1
  rc=$?
  python3 bench/endpoint_trace.py --show $W/trace/t --reps 8 --cases direct-1K,direct-8K \
    > $W/trace.txt 2>&1
  pack trace $rc; cat $W/trace.txt | head -40
fi
python3 - $W <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/grids*-[12].json")):
    d = json.load(open(f))
    for r in d["rows"]:
        if "ms" in r:
            print(f"{os.path.basename(f):13} {r['case']:30} ms {r['ms']:6.2f} p99 {r['p99_ms']:6.2f} "
                  f"engine {r['engine_only_ms']:5.2f} ({r.get('engine_form')}) fixed {r['fixed_ms']:5.2f} "
                  f"ctl {r['control_ms']:5.2f} submit_us {r['engine_submit_host_us'] or 0:6.0f} "
                  f"checks {d['all_checks_passed']}")
        else:
            print(os.path.basename(f), r)
PY
cat $W/steps.txt
