#!/usr/bin/env bash
# The third device call: this tree's GPU tests (cuda_ipc engine, staging graphs, pinned graphs,
# copy kernels) and the staged path through the endpoints, now issued on the control thread
# (Note [Advance on the waking thread]): staged 1K and 8K TP2 -> TP1 and direct 8K, every byte
# checked. Carried: .whl. From the repository root:
#   BUDGET=330 bash bench/results/2026-12-06-h100-inline/run3.sh
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-330}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=$OUT; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T=$PWD; A=$(mktemp -d); mkdir -p "$A/pdc"; cp -r pdc/. "$A/pdc/"
for s in runtime compiler generated integrations; do ln -sfn "$T/$s" "$A/pdc/$s"; done
export PYTHONPATH="$A:/tmp/site"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; uptime; } > $W/env.txt 2>&1
(cd /tmp && timeout 150 python3 -m pytest -q -rA --tb=short -p no:cacheprovider --import-mode=append \
  --rootdir "$T" -m gpu --timeout 120 $T/tests/runtime/engines/test_cuda_ipc.py $T/tests/runtime/test_staging_graphs.py \
  $T/tests/runtime/test_pinned_graph.py $T/tests/runtime/test_copy_kernels.py) > $W/gpu_tests.txt 2>&1
echo "gpu_tests exit $? left $(left)s" | tee -a $W/steps.txt; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.txt | tail -20
timeout $(($(left) - 10)) python3 bench/endpoints_processes.py --engines cuda_ipc \
  --pairs tp2-tp1-staged:1024,tp2-tp1-staged:8192,tp1-tp1-direct:8192 --reps 10 --json $W/staged.json > $W/staged.log 2>&1
echo "staged exit $? left $(left)s" | tee -a $W/steps.txt
grep -E "^cuda_ipc|^case|checks" $W/staged.log | cut -c1-220
