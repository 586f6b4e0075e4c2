#!/usr/bin/env bash
# One device call (issue 29 item 4): Note [Process watch], Note [Row room] and Note [Landed
# wake-up], in one run. (a) the cuda_ipc GPU tests (the watched written event among them);
# (b) bench/endpoints_processes.py over cuda_ipc, direct 1K and 8K, 50 requests a case, three
# settings alternating twice: "before" (main at 2239de6, build/gpurun/before), "nowake" (this
# tree with PDC_LANDED_WAKEUP=0: the process watch and the row room only) and "after" (this
# tree); (c) "after" traced with the submit's steps (TRACE_FINE=1). Carried: .whl,
# build/gpurun/before. From the repository root:
#   BUDGET=480 bash bench/results/2026-12-06-gpu-room/run.sh
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-480}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=$OUT; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T=$PWD
tree() { mkdir -p "$1/pdc"; cp -r "$2/pdc/." "$1/pdc/"
  for s in runtime compiler generated integrations; do ln -sfn "$2/$s" "$1/pdc/$s"; done; }
A=$(mktemp -d); B=$(mktemp -d); tree "$A" "$T"; tree "$B" "$T/build/gpurun/before"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; nproc; uptime; } > $W/env.txt 2>&1
cat $W/env.txt
(cd /tmp && PYTHONPATH="$A:/tmp/site" timeout 150 python3 -m pytest -q -rA -s --tb=short -p no:cacheprovider \
  --import-mode=append --rootdir "$T" -m gpu --timeout 120 $T/tests/runtime/engines/test_cuda_ipc.py) > $W/gpu_tests.txt 2>&1
echo "gpu_tests exit $? left $(left)s"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed|asked|Error|error" $W/gpu_tests.txt | tail -12
PAIRS=tp1-tp1-direct:1024,tp1-tp1-direct:8192
for round in 1 2; do
  for t in before nowake after; do
    [ $t = before ] && P=$B || P=$A; [ $t = nowake ] && E=0 || E=1
    s=$(($(left) - 75)); [ $s -gt 70 ] && s=70; [ $s -lt 25 ] && { echo "$t-$round skipped"; continue; }
    PDC_LANDED_WAKEUP=$E PYTHONPATH="$P:/tmp/site" timeout $s python3 bench/endpoints_processes.py \
      --engines cuda_ipc --pairs $PAIRS --reps 50 --json $W/$t-$round.json > $W/$t-$round.log 2>&1
    echo "$t-$round exit $? left $(left)s"
  done
done
if [ "$(left)" -gt 45 ]; then
  mkdir -p /tmp/trace
  TRACE_FINE=1 PYTHONPATH="$A:/tmp/site" TRACE_OUT=/tmp/trace/t TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine \
    timeout $(( $(left) - 12 )) python3 bench/endpoint_trace.py python3 bench/endpoints_processes.py \
    --engines cuda_ipc --pairs $PAIRS --reps 20 > $W/traced.log 2>&1
  echo "trace exit $? left $(left)s"
  PYTHONPATH="$A:/tmp/site" python3 bench/endpoint_trace.py --show /tmp/trace/t --reps 20 --cases direct-1K,direct-8K > $W/trace.txt 2>&1
  cat $W/trace.txt
fi
python3 - $W <<'PY' | tee $W/summary.txt
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*-[12].json")):
    d = json.load(open(f))
    for r in d["rows"]:
        if "ms" in r:
            print(f"{os.path.basename(f):14} {r['case'][9:]:22} ms {r['ms']:5.2f} p99 {r['p99_ms']:5.2f} engine {r['engine_only_ms']:5.2f} "
                  f"fixed {r['fixed_ms']:5.2f} i2s {r['init_to_submit_ms']:5.2f} s2d {r['submit_to_done_ms']:5.2f} "
                  f"d2s {r['done_to_success_ms']:5.2f} submit_us {r['engine_submit_host_us']:5.0f} checks {d['all_checks_passed']}")
PY
