#!/usr/bin/env bash
# One device call (issue 29 item 4): Note [Same-host lane]. (a) bench/control_hop.py on the GPU
# host (a control message's round trip by transport); (b) bench/endpoints_processes.py over
# cuda_ipc, direct 1K and 8K, 50 requests a case, this tree with the lane off and on
# (PDC_CONTROL_LANE=0/1) alternating, each run's rows printed as it ends; (c) the hub's tests
# over the lane. Carried: .whl.
# From the repository root:
#   BUDGET=400 bash bench/results/2026-12-06-gpu-lane/run.sh
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-400}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=$OUT; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T=$PWD; A=$(mktemp -d); mkdir -p "$A/pdc"; cp -r pdc/. "$A/pdc/"
for s in runtime compiler generated integrations; do ln -sfn "$T/$s" "$A/pdc/$s"; done
export PYTHONPATH="$A:/tmp/site"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; nproc; uptime; } 2>&1 | tee $W/env.txt
python3 bench/control_hop.py --json $W/hop.json 2>&1 | grep -v "^$" | tee $W/hop.txt
PAIRS=tp1-tp1-direct:1024,tp1-tp1-direct:8192
for round in 1 2 3; do
  for t in off on; do
    [ $t = on ] && E=1 || E=0
    s=$(($(left) - 40)); [ $s -gt 70 ] && s=70; [ $s -lt 25 ] && { echo "$t-$round skipped"; continue; }
    PDC_CONTROL_LANE=$E timeout $s python3 bench/endpoints_processes.py --engines cuda_ipc --pairs $PAIRS \
      --reps 50 --json $W/$t-$round.json > $W/$t-$round.log 2>&1
    echo "$t-$round exit $? left $(left)s"
    # each run's rows printed at once: the fetch brings back only the first few files
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], r['case'][9:], 'fixed %.2f ms %.2f i2s %.2f d2s %.2f' % (r['fixed_ms'], r['ms'], r['init_to_submit_ms'], r['done_to_success_ms'])) for r in d['rows'] if 'ms' in r]" $W/$t-$round.json $t-$round 2>/dev/null
  done
done
(cd /tmp && timeout 60 python3 -m pytest -q -p no:cacheprovider --import-mode=append --rootdir "$T" \
  $T/tests/runtime/test_lane.py $T/tests/runtime/test_hub.py 2>&1 | tail -2)
python3 - $W <<'PY' | tee $W/summary.txt
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*-[123].json")):
    d = json.load(open(f))
    for r in d["rows"]:
        if "ms" in r:
            print(f"{os.path.basename(f)[:-5]:7} {r['case'][9:]:22} ms {r['ms']:5.2f} p99 {r['p99_ms']:5.2f} engine {r['engine_only_ms']:5.2f} "
                  f"fixed {r['fixed_ms']:5.2f} i2s {r['init_to_submit_ms']:5.2f} s2d {r['submit_to_done_ms']:5.2f} "
                  f"d2s {r['done_to_success_ms']:5.2f} submit_us {r['engine_submit_host_us']:5.0f} checks {d['all_checks_passed']}")
PY
