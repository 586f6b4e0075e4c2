#!/usr/bin/env bash
# Follow-up device call: kernel_capture.py beside this file (graph_input captures with their
# tracebacks) over the tree before (7f0c852) and this one, in two orders; then the failing GPU
# tests alone with -x. Carried: .whl, build/gpurun/before.
#   BUDGET=150 bash bench/results/2026-12-07-gpu-driver/run2.sh
BUDGET=${BUDGET:-150}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
D=$(dirname "${BASH_SOURCE[0]}")
for tree in before after; do
  P=$AFTER; [ $tree = before ] && P=$BEFORE
  for order in copy,kernel,mapped kernel,copy; do
    echo "== $tree $order"
    PYTHONPATH="$P:/tmp/site" PDC_DRIVER_CALLS=1 timeout 60 python3 $D/kernel_capture.py $order 2>&1 | tail -25
  done
done
