#!/usr/bin/env bash
# One device call (issue 29 item 4): Note [Graph launch by the driver], knob
# graph_launch_by_driver off (0: CUDAGraph.replay()) and on (1) in one tree. (a) the GPU tests
# of the pinned graphs (both settings), the staging graphs and the cuda_ipc engine; (b)
# bench/staging_host.py, knob 0 / 1 alternating twice (host µs per replayed gather / scatter);
# (c) bench/endpoints_processes.py over cuda_ipc, direct 1K and 8K and staged 8K, knob 0 / 1
# alternating, each run's rows printed as it ends. Everything also lands in $OUT/results.tgz.
# Carried: .whl. From the repository root:
#   BUDGET=400 bash bench/results/2026-12-06-gpu-driver-launch/run.sh
BUDGET=${BUDGET:-400}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
export PYTHONPATH="$AFTER:/tmp/site"
python3 -c "import torch; print('raw exec', hasattr(torch.cuda.CUDAGraph, 'raw_cuda_graph_exec'))" | tee -a $W/env.txt
# (a)
(cd /tmp && timeout 110 python3 -m pytest -q -rA --tb=short -p no:cacheprovider --import-mode=append \
  --rootdir "$T" -m gpu --timeout 90 $T/tests/runtime/test_pinned_graph.py \
  $T/tests/runtime/test_staging_graphs.py $T/tests/runtime/engines/test_cuda_ipc.py) > $W/gpu_tests.txt 2>&1
pack gpu_tests $?; grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error" $W/gpu_tests.txt | sed "s#$T/##" | tail -16
# (b)
for round in 1 2; do
  for k in 0 1; do
    PDC_GRAPH_LAUNCH_BY_DRIVER=$k timeout 60 python3 bench/staging_host.py --tokens 8192 --reps 20 \
      --json $W/host-$k-$round.json > $W/host-$k-$round.txt 2>&1
    pack "host-$k-$round" $?; echo "host knob $k round $round: $(grep -E '^on ' $W/host-$k-$round.txt | tr -s ' ')"
  done
done
# (c)
for round in 1 2 3; do
  for k in 0 1; do
    t=$(($(left) - 10)); [ $t -gt 75 ] && t=75; [ $t -lt 35 ] && { echo "$k-$round skipped"; continue; }
    PDC_GRAPH_LAUNCH_BY_DRIVER=$k timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
      --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192,tp2-tp1-staged:8192 --reps 20 \
      --json $W/ep-$k-$round.json > $W/ep-$k-$round.log 2>&1
    pack "ep-$k-$round" $?
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], r['case'][9:], 'ms %.2f p99 %.2f engine %.2f ratio %.3f fixed %.2f i2s %.2f d2s %.2f' % (r['ms'], r['p99_ms'], r['engine_only_ms'], r['ratio_to_engine'], r['fixed_ms'], r['init_to_submit_ms'], r['done_to_success_ms']), 'checks', d['all_checks_passed']) for r in d['rows'] if 'ms' in r]" $W/ep-$k-$round.json knob$k-$round 2>/dev/null
  done
done
cat $W/steps.txt
