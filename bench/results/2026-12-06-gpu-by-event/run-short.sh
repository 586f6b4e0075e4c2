#!/usr/bin/env bash
# A shorter second call of run.sh's comparison: "before" (main at 3417673) and "event" (this
# tree), direct 1K and 8K, 50 requests a case, before, event, before, event. Carried: .whl,
# build/gpurun/before. From the repository root:
#   BUDGET=250 bash bench/results/2026-12-06-gpu-by-event/run-short.sh
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-250}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=$OUT; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T=$PWD
tree() { mkdir -p "$1/pdc"; cp -r "$2/pdc/." "$1/pdc/"
  for s in runtime compiler generated integrations; do ln -sfn "$2/$s" "$1/pdc/$s"; done; }
A=$(mktemp -d); B=$(mktemp -d); tree "$A" "$T"; tree "$B" "$T/build/gpurun/before"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; uptime; } > $W/env.txt 2>&1
cat $W/env.txt
for round in 1 2; do
  for t in before event; do
    [ $t = before ] && P=$B || P=$A
    s=$(($(left) - 15)); [ $s -gt 55 ] && s=55; [ $s -lt 25 ] && continue
    PYTHONPATH="$P:/tmp/site" timeout $s python3 bench/endpoints_processes.py \
      --engines cuda_ipc --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192 --reps 50 --json $W/$t-$round.json > $W/$t-$round.log 2>&1
    echo "$t-$round exit $? left $(left)s"
  done
done
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
