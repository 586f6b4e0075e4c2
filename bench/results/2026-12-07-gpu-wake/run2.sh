#!/usr/bin/env bash
# Follow-up: the two GPU tests that a wait for GPU work sleeps (cuda_ipc's completion thread
# after its wait moved into cuda_streams.sleep_until; cuda_streams.sleep_until_idle behind
# TensorPools.sync and EnginePools.sync: Note [Sleeping waits]). Never ran: too little device
# time was left to start a machine. Carried: .whl.
#   BUDGET=90 bash bench/results/2026-12-07-gpu-wake/run2.sh
BUDGET=${BUDGET:-90}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 70 python3 -m pytest -q -rA --tb=short \
  -p no:cacheprovider --import-mode=append --rootdir "$T" -m gpu --timeout 60 \
  "$T/tests/runtime/engines/test_cuda_ipc.py::test_gpu_the_completion_thread_sleeps_while_a_write_is_in_flight" \
  "$T/tests/runtime/test_engine_pools.py::test_gpu_pools_wait_for_their_stream_asleep") > $W/gpu-tests2.txt 2>&1
pack gpu-tests2 $?; grep -E "^(PASSED|FAILED|ERROR)|[0-9]+ passed|[0-9]+ failed|^E " $W/gpu-tests2.txt | cut -c1-300 | tail -12
