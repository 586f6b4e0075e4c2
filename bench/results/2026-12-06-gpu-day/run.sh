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
endpoints_ab 2 5 45
cat $W/steps.txt
