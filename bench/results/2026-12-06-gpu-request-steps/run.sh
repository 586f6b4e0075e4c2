#!/usr/bin/env bash
# One device call (issue 29 item 4): the direct path's per-request Python cut (the grids'
# rows made once per template, one alignment reduction per launch, the grid checks' bound
# first, a TransferRequest's and a Status's scalars by one pack), before / after in one run.
# (a) bench/request_steps.py on this host's CPU over both trees, alternating twice; (b) the
# cuda_ipc engine's and the pinned graphs' GPU tests; (c) bench/endpoints_processes.py over
# cuda_ipc, direct 1K and 8K, 50 requests a case, before / after alternating three times, each
# run's rows printed as it ends. Everything also lands in $OUT/results.tgz. Carried: .whl,
# build/gpurun/before (git archive of the tree before the change). From the repository root:
#   BUDGET=420 bash bench/results/2026-12-06-gpu-request-steps/run.sh
BUDGET=${BUDGET:-420}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
# (a)
for round in 1 2; do
  for tree in before after; do
    if [ $tree = before ]; then P=$BEFORE; else P=$AFTER; fi
    PYTHONPATH="$P:/tmp/site" timeout 60 python3 bench/request_steps.py --tokens 8192 \
      --json $W/steps-$tree-$round.json > $W/steps-$tree-$round.txt 2>&1
    pack "steps-$tree-$round" $?
  done
done
python3 - $W <<'PY'
import json, sys
runs = [(f"{t}-{r}", json.load(open(f"{sys.argv[1]}/steps-{t}-{r}.json"))) for r in (1, 2) for t in ("before", "after")]
print(f"{'step':26}" + "".join(f"{n:>10}" for n, _ in runs))
for i, row in enumerate(runs[0][1]["rows"]):
    print(f"{row['step']:26}" + "".join(f"{d['rows'][i]['us']:10.1f}" for _, d in runs))
print("checks", [d["all_checks_passed"] for _, d in runs])
PY
# (b)
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 100 python3 -m pytest -q -rA --tb=short -p no:cacheprovider \
  --import-mode=append --rootdir "$T" -m gpu --timeout 90 $T/tests/runtime/engines/test_cuda_ipc.py \
  $T/tests/runtime/test_pinned_graph.py $T/tests/runtime/test_descriptor_copy.py) > $W/gpu_tests.txt 2>&1
pack gpu_tests $?; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.txt | sed "s#$T/##" | tail -14
# (c)
endpoints_ab 3 10 70
cat $W/steps.txt
