#!/usr/bin/env bash
# One device call (issue 29 item 4): the day's changes together, main in the morning (6dbab44,
# "before") against main at the end of the day (this tree), in one run: (a) bench/staging_host.py
# over both trees (host µs per replayed gather / scatter); (b) bench/endpoints_processes.py over
# cuda_ipc, direct 1K and 8K, 50 requests a case, before / after alternating twice, each run's
# rows printed as it ends. Everything also lands in $OUT/results.tgz. Carried: .whl,
# build/gpurun/before (git archive of 6dbab44). From the repository root:
#   BUDGET=230 bash bench/results/2026-12-06-gpu-day/run.sh
BUDGET=${BUDGET:-230}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
for tree in before after; do
  if [ $tree = before ]; then P=$BEFORE; else P=$AFTER; fi
  PYTHONPATH="$P:/tmp/site" timeout 40 python3 bench/staging_host.py --tokens 8192 --reps 20 \
    --json $W/host-$tree.json > $W/host-$tree.txt 2>&1
  pack "host-$tree" $?; echo "host $tree: $(grep -E '^on ' $W/host-$tree.txt | tr -s ' ')"
done
for round in 1 2; do
  for tree in before after; do
    if [ $tree = before ]; then P=$BEFORE; else P=$AFTER; fi
    t=$(($(left) - 5)); [ $t -gt 45 ] && t=45; [ $t -lt 30 ] && { echo "$tree-$round skipped"; continue; }
    PYTHONPATH="$P:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
      --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192 --reps 50 --json $W/$tree-$round.json > $W/$tree-$round.log 2>&1
    pack "$tree-$round" $?
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], r['case'][9:], 'ms %.2f p99 %.2f engine %.2f fixed %.2f i2s %.2f d2s %.2f submit_us %.0f' % (r['ms'], r['p99_ms'], r['engine_only_ms'], r['fixed_ms'], r['init_to_submit_ms'], r['done_to_success_ms'], r['engine_submit_host_us'] or 0), 'checks', d['all_checks_passed']) for r in d['rows'] if 'ms' in r]" $W/$tree-$round.json $tree-$round 2>/dev/null
  done
done
cat $W/steps.txt
