#!/usr/bin/env bash
# One device call (issue 29 item 4): Note [Staging call shapes] before / after in one run, and
# where the direct path's time goes by function. (a) bench/staging_host.py of this tree over
# both trees' packages, alternating twice (host µs per replayed gather / scatter); (b) the GPU
# tests of the staging graphs, the staged path and the cuda_ipc engine; (c) a traced run of this
# tree, direct 1K and 8K, with each thread's outermost step under cProfile (TRACE_PROFILE=1);
# (d) bench/endpoints_processes.py, staged 8K and direct 8K, before / after.
# Everything lands in $OUT/results.tgz (the fetch brings back only a few files), and each
# step's rows are printed as it ends. Carried: .whl, build/gpurun/before (git archive of the
# tree before the change). From the repository root:
#   BUDGET=420 bash bench/results/2026-12-06-gpu-call-shapes/run.sh
BUDGET=${BUDGET:-420}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
# (a)
for round in 1 2; do
  for tree in before after; do
    if [ $tree = before ]; then P=$BEFORE; else P=$AFTER; fi
    PYTHONPATH="$P:/tmp/site" timeout 90 python3 bench/staging_host.py --tokens 8192 --reps 30 \
      --json $W/host-$tree-$round.json > $W/host-$tree-$round.txt 2>&1
    pack "host-$tree-$round" $?; grep -A4 "^graphs" $W/host-$tree-$round.txt
  done
done
# (b)
t=$(($(left) - 200)); [ $t -gt 120 ] && t=120
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 -m pytest -q -rA --tb=short -p no:cacheprovider \
  --import-mode=append --rootdir "$T" -m gpu --timeout 100 $T/tests/runtime/test_staging_graphs.py \
  $T/tests/runtime/test_staged.py $T/tests/runtime/engines/test_cuda_ipc.py) > $W/gpu_tests.txt 2>&1
pack gpu_tests $?; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.txt | tail -20
# (c)
mkdir -p $W/trace
PYTHONPATH="$AFTER:/tmp/site" TRACE_PROFILE=1 TRACE_PROFILE_SORT=cumulative TRACE_PROFILE_LINES=60 \
  TRACE_OUT=$W/trace/t TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine TRACE_FINE=1 \
  timeout 100 python3 bench/endpoint_trace.py python3 bench/endpoints_processes.py --engines cuda_ipc \
  --pairs tp1-tp1-direct:8192 --reps 30 --json $W/traced.json > $W/traced.log 2>&1
rc=$?
PYTHONPATH="$AFTER:/tmp/site" python3 bench/endpoint_trace.py --show $W/trace/t --reps 30 \
  --cases direct-8K > $W/trace.txt 2>&1
pack trace $rc; cat $W/trace.txt
for f in $W/trace/*.prof.txt; do echo "== $f"; grep -v "site-packages\|{built-in\|<listcomp>\|<genexpr>" $f | head -50 | cut -c1-130 | sed "s#$T/##; s#/tmp/[^ ]*/pdc/##"; done
# (d)
for tree in before after before after; do
  if [ $tree = before ]; then P=$BEFORE; else P=$AFTER; fi
  t=$(($(left) - 10)); [ $t -gt 80 ] && t=80; [ $t -lt 40 ] && { pack "$tree skipped" 0; continue; }
  n=$(ls $W/$tree-*.json 2>/dev/null | wc -l); n=$((n + 1))
  PYTHONPATH="$P:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
    --pairs tp2-tp1-staged:8192,tp1-tp1-direct:8192 --reps 20 --json $W/$tree-$n.json > $W/$tree-$n.log 2>&1
  pack "$tree-$n" $?
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], r['case'][9:], 'ms %.2f engine %.2f ratio %.3f fixed %.2f submit_us %.0f' % (r['ms'], r['engine_only_ms'], r['ratio_to_engine'], r['fixed_ms'], r['engine_submit_host_us'] or 0), 'checks', d['all_checks_passed']) for r in d['rows'] if 'ms' in r]" $W/$tree-$n.json $tree-$n 2>/dev/null
done
cat $W/steps.txt
