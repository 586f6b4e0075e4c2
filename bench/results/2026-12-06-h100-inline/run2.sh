#!/usr/bin/env bash
# The second device call: the direct 1K request alone, 100 requests a run, three trees
# alternating twice: "before" (main at 3417673, build/gpurun/before), "after" (this tree) and
# "spin" (this tree with PDC_COMPLETION_SPIN_US=500); then each of before and after traced.
# Carried: .whl, build/gpurun/before. From the repository root:
#   BUDGET=480 bash bench/results/2026-12-06-h100-inline/run2.sh
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-480}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=$OUT; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T=$PWD
tree() { mkdir -p "$1/pdc"; cp -r "$2/pdc/." "$1/pdc/"
  for s in runtime compiler generated integrations; do ln -sfn "$2/$s" "$1/pdc/$s"; done; }
A=$(mktemp -d); B=$(mktemp -d); tree "$A" "$T"; tree "$B" "$T/build/gpurun/before"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; uptime; } > $W/env.txt 2>&1
for round in 1 2; do
  for t in before after spin; do
    [ $t = before ] && P=$B || P=$A; [ $t = spin ] && SPIN=500 || SPIN=0
    s=$(($(left) - 100)); [ $s -gt 60 ] && s=60; [ $s -lt 25 ] && { echo "$t-$round skipped" >> $W/steps.txt; continue; }
    PDC_COMPLETION_SPIN_US=$SPIN PYTHONPATH="$P:/tmp/site" timeout $s python3 bench/endpoints_processes.py \
      --engines cuda_ipc --pairs tp1-tp1-direct:1024 --reps 100 --json $W/$t-$round.json > $W/$t-$round.log 2>&1
    echo "$t-$round exit $? left $(left)s" | tee -a $W/steps.txt; uptime >> $W/load.txt
  done
done
for t in after before; do
  [ $t = before ] && P=$B || P=$A
  [ "$(left)" -lt 35 ] && break
  mkdir -p /tmp/trace-$t
  PYTHONPATH="$P:/tmp/site" TRACE_OUT=/tmp/trace-$t/t TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine \
    timeout $(( $(left) > 60 ? 45 : $(left) - 10 )) python3 bench/endpoint_trace.py python3 bench/endpoints_processes.py \
    --engines cuda_ipc --pairs tp1-tp1-direct:1024 --reps 20 > $W/traced-$t.log 2>&1
  echo "trace-$t exit $? left $(left)s" | tee -a $W/steps.txt
  PYTHONPATH="$P:/tmp/site" python3 bench/endpoint_trace.py --show /tmp/trace-$t/t --reps 20 --cases direct-1K > $W/trace-$t.txt 2>&1
  cat $W/trace-$t.txt
done
python3 - $W <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*-[12].json")):
    for r in json.load(open(f))["rows"]:
        if "ms" in r:
            print(f"{os.path.basename(f):13} ms {r['ms']:5.2f} p99 {r['p99_ms']:5.2f} engine {r['engine_only_ms']:5.2f} "
                  f"fixed {r['fixed_ms']:5.2f} i2s {r['init_to_submit_ms']:5.2f} s2d {r['submit_to_done_ms']:5.2f} "
                  f"d2s {r['done_to_success_ms']:5.2f} ctl {r['control_ms']:5.2f} submit_us {r['engine_submit_host_us']:5.0f}")
PY
