#!/usr/bin/env bash
# The second device call: (a) before (main at 2239de6, build/gpurun/before) and after (this
# tree) alternating three times, cuda_ipc direct 1K and 8K, 50 requests a case; (b) decode's
# caller sleeping up to 2 ms between polls (--decode-poll-us 2000, as SGLang's idle scheduler
# does), this tree with and without Note [Landed wake-up] (PDC_LANDED_WAKEUP=0/1), twice.
# Carried: .whl, build/gpurun/before. From the repository root:
#   BUDGET=500 bash bench/results/2026-12-06-gpu-room/run2.sh
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-500}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=$OUT; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T=$PWD
tree() { mkdir -p "$1/pdc"; cp -r "$2/pdc/." "$1/pdc/"
  for s in runtime compiler generated integrations; do ln -sfn "$2/$s" "$1/pdc/$s"; done; }
A=$(mktemp -d); B=$(mktemp -d); tree "$A" "$T"; tree "$B" "$T/build/gpurun/before"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; nproc; uptime; } 2>&1 | tee $W/env.txt
PAIRS=tp1-tp1-direct:1024,tp1-tp1-direct:8192
one() {  # name tree wake decode_poll_us
  s=$(($(left) - 20)); [ $s -gt 70 ] && s=70; [ $s -lt 25 ] && { echo "$1 skipped"; return; }
  PDC_LANDED_WAKEUP=$3 PYTHONPATH="$2:/tmp/site" timeout $s python3 bench/endpoints_processes.py \
    --engines cuda_ipc --pairs $PAIRS --reps 50 --decode-poll-us $4 --json $W/$1.json > $W/$1.log 2>&1
  echo "$1 exit $? left $(left)s"
}
for round in 1 2 3; do one before-$round $B 1 200; one after-$round $A 1 200; done
for round in 1 2; do one idle-nowake-$round $A 0 2000; one idle-wake-$round $A 1 2000; done
python3 - $W <<'PY' | tee $W/summary.txt
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    d = json.load(open(f))
    for r in d["rows"]:
        if "ms" in r:
            print(f"{os.path.basename(f)[:-5]:15} {r['case'][9:]:22} ms {r['ms']:5.2f} p99 {r['p99_ms']:5.2f} engine {r['engine_only_ms']:5.2f} "
                  f"fixed {r['fixed_ms']:5.2f} i2s {r['init_to_submit_ms']:5.2f} s2d {r['submit_to_done_ms']:5.2f} "
                  f"d2s {r['done_to_success_ms']:5.2f} submit_us {r['engine_submit_host_us']:5.0f} checks {d['all_checks_passed']}")
PY
