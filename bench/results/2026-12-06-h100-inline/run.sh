#!/usr/bin/env bash
# One device call (issue 29 item 4): Note [Advance on the waking thread] and the leaner cuda_ipc
# submit, before / after in one run. (a) the GPU tests of the cuda_ipc engine; (b)
# bench/endpoints_processes.py over cuda_ipc, direct 1K and 8K and staged 8K, the trees
# alternating before, after, before, after ("before" = main at 3417673, carried in
# build/gpurun/before; the bench file is this tree's in both); (c) the after tree traced, direct
# 1K and 8K; (d) bench/submit_host.py at 64 pages. Carried: .whl, build/gpurun/before.
# From the repository root: BUDGET=540 bash bench/results/2026-12-06-h100-inline/run.sh
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-540}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=$OUT; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T=$PWD
tree() {  # tree() DIR ROOT: DIR/pdc importable as pdc, its parts from ROOT
  mkdir -p "$1/pdc"; cp -r "$2/pdc/." "$1/pdc/"
  for s in runtime compiler generated integrations; do ln -sfn "$2/$s" "$1/pdc/$s"; done; }
A=$(mktemp -d); B=$(mktemp -d); tree "$A" "$T"; tree "$B" "$T/build/gpurun/before"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime
  lscpu | grep -E "Model name|MHz" | head -3
  python3 -c "import sys, torch, triton, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"; } > $W/env.txt 2>&1
cat $W/env.txt
(cd /tmp && PYTHONPATH="$A:/tmp/site" timeout 120 python3 -m pytest -q -rA --tb=short -p no:cacheprovider \
  --import-mode=append --rootdir "$T" -m gpu --timeout 100 $T/tests/runtime/engines/test_cuda_ipc.py) > $W/gpu_tests.txt 2>&1
echo "gpu_tests exit $? left $(left)s" | tee -a $W/steps.txt; grep -E "passed|failed" $W/gpu_tests.txt | tail -3
for round in 1 2; do
  for t in before after; do
    [ $t = before ] && P=$B || P=$A
    s=$(($(left) - 5)); [ $s -gt 110 ] && s=110; [ $s -lt 40 ] && { echo "$t-$round skipped" >> $W/steps.txt; continue; }
    PYTHONPATH="$P:/tmp/site" timeout $s python3 bench/endpoints_processes.py --engines cuda_ipc \
      --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192,tp2-tp1-staged:8192 --reps 20 \
      --json $W/$t-$round.json > $W/$t-$round.log 2>&1
    echo "$t-$round exit $? left $(left)s" | tee -a $W/steps.txt; uptime >> $W/load.txt
  done
done
if [ "$(left)" -gt 60 ]; then
  mkdir -p /tmp/trace
  PYTHONPATH="$A:/tmp/site" TRACE_OUT=/tmp/trace/t TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine \
    timeout $(($(left) - 30)) python3 bench/endpoint_trace.py python3 bench/endpoints_processes.py \
    --engines cuda_ipc --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192 --reps 8 \
    --json $W/traced.json > $W/traced.log 2>&1
  echo "trace exit $? left $(left)s" | tee -a $W/steps.txt
  PYTHONPATH="$A:/tmp/site" python3 bench/endpoint_trace.py --show /tmp/trace/t --reps 8 --cases direct-1K,direct-8K > $W/trace.txt 2>&1
  cat $W/trace.txt
fi
if [ "$(left)" -gt 40 ]; then
  PYTHONPATH="$A:/tmp/site" timeout $(($(left) - 10)) python3 bench/submit_host.py --pages 64 --reps 200 --profile 0 \
    --json $W/s64.json > $W/s64.txt 2>&1; echo "s64 exit $? left $(left)s" | tee -a $W/steps.txt
  grep "'what'" $W/s64.txt | head -4
fi
PYTHONPATH="$A:/tmp/site" python3 - $W <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*-[12].json")):
    d = json.load(open(f))
    for r in d["rows"]:
        if "ms" in r:
            print(f"{os.path.basename(f):13} {r['case']:30} ms {r['ms']:6.2f} p99 {r['p99_ms']:6.2f} "
                  f"engine {r['engine_only_ms']:5.2f} fixed {r['fixed_ms']:5.2f} "
                  f"ctl {r['control_ms']:5.2f} i2s {r['init_to_submit_ms']:5.2f} d2s {r['done_to_success_ms']:5.2f} "
                  f"submit_us {r['engine_submit_host_us'] or 0:6.0f} checks {d['all_checks_passed']}")
PY
cat $W/steps.txt
