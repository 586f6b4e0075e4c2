#!/usr/bin/env bash
# One device call (issue 29 item 4): how a replayed graph reads its pinned input (Note [Pinned
# graph input]): copied by the graph's first node ("copy"), read across the bus by a first
# kernel ("kernel") or by the launches themselves ("mapped"). (a) the GPU tests of the pinned
# graphs (every knob value) and of the cuda_ipc engine; (b) bench/staging_host.py with the modes
# alternating per repetition, twice, the first with --profile, and bench/staging_python.py (the
# calls' Python alone on this host's CPU); (c) bench/endpoints_processes.py
# over cuda_ipc (direct 1K and 8K, staged TP2 -> TP1 8K), PDC_GRAPH_INPUT over MODES
# alternating twice. The first call (run1/) had the modes copy, mapped and off, and its tests
# did not start (pytest run from the repository root); run2/ is this script. Everything also lands in $OUT/results.tgz. Carried: .whl. From the
# repository root:
#   BUDGET=440 bash bench/results/2026-12-06-gpu-mapped/run.sh
BUDGET=${BUDGET:-440}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
MODES=${MODES:-copy kernel}
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 150 python3 -m pytest -q -rA --tb=short \
  -p no:cacheprovider --import-mode=append --rootdir "$T" -m gpu --timeout 100 \
  $T/tests/runtime/test_staging_graphs.py $T/tests/runtime/test_pinned_graph.py \
  $T/tests/runtime/engines/test_cuda_ipc.py) > $W/gpu-tests.txt 2>&1
pack gpu-tests $?; grep -E "^(FAILED|ERROR)|passed|failed" $W/gpu-tests.txt | tail -8
# the Python of a call alone on this host's CPU (no launches, CPU pools): the host's speed
PYTHONPATH="$AFTER:/tmp/site" timeout 60 python3 bench/staging_python.py --reps 300 \
  --json $W/python.json > $W/python.txt 2>&1
pack python $?; grep -E '^(gather|scatter) ' $W/python.txt
for round in 1 2; do
  PYTHONPATH="$AFTER:/tmp/site" timeout 60 python3 bench/staging_host.py --tokens 8192 --reps 30 \
    --modes copy,kernel,mapped,off --profile $((round == 1 ? 20 : 0)) --json $W/host-$round.json \
    > $W/host-$round.txt 2>&1
  pack "host-$round" $?; grep -E '^(copy|kernel|mapped|off) ' $W/host-$round.txt | sed "s/^/host-$round /"
done
for round in 1 2; do
  for mode in $MODES; do
    t=$(($(left) - 5)); [ $t -gt 90 ] && t=90
    [ $t -lt 30 ] && { echo "$mode-$round skipped"; continue; }
    PDC_GRAPH_INPUT=$mode PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoints_processes.py \
      --engines cuda_ipc --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192,tp2-tp1-staged:8192 \
      --reps 20 --json $W/$mode-$round.json > $W/$mode-$round.log 2>&1
    pack "$mode-$round" $?
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], r['case'][9:], 'ms %.2f p99 %.2f engine %.2f fixed %.2f ratio %s submit_us %.0f' % (r['ms'], r['p99_ms'], r['engine_only_ms'], r['fixed_ms'], '%.3f' % r['ratio_to_engine'], r['engine_submit_host_us'] or 0), 'checks', d['all_checks_passed']) for r in d['rows'] if 'ms' in r]" $W/$mode-$round.json $mode-$round 2>/dev/null
  done
done
cat $W/steps.txt
