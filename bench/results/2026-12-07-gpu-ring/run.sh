#!/usr/bin/env bash
# One device call (issue 29 item 4): (a) GPU tests of the pinned graphs (graph_input copy,
# kernel, mapped), the staging graphs, the cuda_ipc engine and the staged rings (two-GPU ones
# skip on one GPU); (b) bench/staging_python.py (the calls' Python alone on this host's CPU)
# and bench/staging_host.py with the modes copy, kernel, mapped, off alternating; (c)
# bench/arena_ring.py --cuda, 8K tokens through a 512 MiB arena with 64 MiB slots, the tree
# before (ring pieces by torch ops per block) and after (ring pieces by the copy kernels),
# alternating; (d) bench/endpoints_processes.py, direct 1K and 8K over cuda_ipc,
# PDC_GRAPH_INPUT copy / kernel; (e) the issue's table, the tree of 2026-12-03 against this
# one. Carried: .whl, build/gpurun/before (git archive of main before the ring change, 313b1ed)
# and build/gpurun/issue0 (git archive of ca0c239). Outputs also in $OUT/results.tgz. From
# the repository root:
#   BUDGET=560 bash bench/results/2026-12-07-gpu-ring/run.sh
BUDGET=${BUDGET:-360}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
# QUICK=1 (little device time left): only (c), (b)'s staging_host.py and (e), one round each.
QUICK=${QUICK:-0}
if [ "$QUICK" != 1 ]; then
  (cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 80 python3 -m pytest -q -rA --tb=short \
    -p no:cacheprovider --import-mode=append --rootdir "$T" -m gpu --timeout 70 \
    $T/tests/runtime/test_staging_graphs.py $T/tests/runtime/test_pinned_graph.py \
    $T/tests/runtime/engines/test_cuda_ipc.py $T/tests/runtime/test_staged_ring.py) > $W/gpu-tests.txt 2>&1
  pack gpu-tests $?; grep -E "^(FAILED|ERROR)|passed|failed" $W/gpu-tests.txt | tail -8
fi
ring before 1 $((QUICK == 1 ? 45 : 140)); ring after 1 $((QUICK == 1 ? 45 : 140))
if [ "$QUICK" != 1 ]; then
  PYTHONPATH="$AFTER:/tmp/site" timeout 30 python3 bench/staging_python.py --reps 300 \
    --json $W/python.json > $W/python.txt 2>&1
  pack python $?; grep -E '^(gather|scatter) ' $W/python.txt
fi
PYTHONPATH="$AFTER:/tmp/site" timeout 40 python3 bench/staging_host.py --tokens 8192 --reps 30 \
  --modes copy,kernel,mapped,off --profile $((QUICK == 1 ? 0 : 10)) --json $W/host.json > $W/host.txt 2>&1
pack host $?; grep -E '^(copy|kernel|mapped|off) ' $W/host.txt
for mode in $([ "$QUICK" = 1 ] || echo copy kernel); do
  t=$(($(left) - 10)); [ $t -gt 45 ] && t=45
  [ $t -lt 20 ] && { echo "$mode skipped"; continue; }
  PDC_GRAPH_INPUT=$mode PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoints_processes.py \
    --engines cuda_ipc --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192 --reps 30 \
    --json $W/$mode.json > $W/$mode.log 2>&1
  pack "$mode" $?
  grep "^{'case'" $W/$mode.log | python3 -c "import ast,sys; [print('$mode', d['case'][9:], 'fixed %.2f ms %.2f submit_us %.0f' % (d['fixed_ms'], d['ms'], d['engine_submit_host_us'] or 0)) for d in map(ast.literal_eval, sys.stdin)]"
done
# (e) The issue's table: endpoints over cuda_ipc, direct 1K and 8K and staged 8K, the tree of
# the day the issue was filed (build/gpurun/issue0, ca0c239, with its own bench) and this one,
# alternating; each run prints its rows as it ends.
if [ -d "$T/build/gpurun/issue0" ]; then issue_table issue0 1 5 110; issue_table after 1 5 110; fi
[ "$QUICK" = 1 ] && { cat $W/steps.txt; exit 0; }
ring before 2 5; ring after 2 5
cat $W/steps.txt
