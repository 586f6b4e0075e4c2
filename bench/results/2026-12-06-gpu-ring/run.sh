#!/usr/bin/env bash
# One device call (issue 29 item 4, Note [Staging ring]): an 8K Llama-3-70B request, prefill
# TP2 -> decode TP1 on one GPU, through the default 512 MiB arena (each link's whole region is
# 1.34 GB, so both links move through rings) with slots of at most 8 MiB (the default), 32
# and 64 MiB, against an arena that holds both regions whole. Everything also lands in
# $OUT/results.tgz; first, what an interprocess event costs per request (ipc_events.py).
# Carried: .whl. From the repository root:
#   BUDGET=300 bash bench/results/2026-12-06-gpu-ring/run.sh
BUDGET=${BUDGET:-300}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
P="$AFTER:/tmp/site"
PYTHONPATH=$P timeout 60 python3 bench/results/2026-12-06-gpu-ring/ipc_events.py > $W/ipc_events.txt 2>&1
pack ipc_events $?; cat $W/ipc_events.txt
PYTHONPATH=$P timeout 240 python3 bench/arena_ring.py --cuda --tokens 8192 --reps 3 --no-direct \
  --arena $((512 << 20)) --slot-bytes $((8 << 20)),$((32 << 20)),$((64 << 20)) --json $W/ring-8k.json > $W/ring-8k.txt 2>&1
pack ring-8k $?; cat $W/ring-8k.txt
cat $W/steps.txt
