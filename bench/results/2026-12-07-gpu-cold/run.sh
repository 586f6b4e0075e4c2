#!/usr/bin/env bash
# One device call (issue 29 item 4): is the control path's time cold code, or calls that cost
# this much anyway? (a) cold_calls.py beside this file: a graph replay, an event record and
# pure Python, back to back and after the thread slept or spun; (b) bench/endpoint_trace.py
# over bench/endpoints_processes.py, cuda_ipc, direct 1K and 8K, 30 requests a case, with the
# submit's torch calls and the messages' steps stamped one by one (TRACE_EXTRA); (c) the same
# cases untraced. Carried: .whl. From the repository root:
#   BUDGET=300 bash bench/results/2026-12-07-gpu-cold/run.sh
BUDGET=${BUDGET:-300}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
D=$(dirname "${BASH_SOURCE[0]}")
PYTHONPATH="$AFTER:/tmp/site" timeout 60 python3 $D/cold_calls.py > $W/cold.txt 2>&1
pack cold $?; cat $W/cold.txt
X=pdc.runtime.descriptor_copy:_run,pdc.runtime.descriptor_copy:on_device
X=$X,pdc.runtime.descriptor_copy:pow2_alignment,pdc.runtime.descriptor_copy:_shape
X=$X,pdc.runtime.pinned_graph:PinnedGraph.call,torch.cuda.graphs:CUDAGraph.replay
X=$X,torch.cuda:Event.record,torch.cuda:Event.synchronize,torch.cuda:Stream.wait_event
X=$X,torch.cuda:set_stream,torch.cuda:current_stream,torch.cuda:current_device
X=$X,pdc.runtime.knobs:get,pdc.runtime.family:Family.decode,pdc.runtime.family:Family.encode
X=$X,pdc.runtime.hub:Hub.send,pdc.runtime.engines.cuda_ipc:CudaIpcEngine.open_written_event
X=$X,pdc.runtime.engines.cuda_ipc:CudaIpcEngine.watch_written
X=$X,pdc.runtime.endpoints.prefill_control:PrefillControl._on_request
PAIRS=tp1-tp1-direct:1024,tp1-tp1-direct:8192
rm -rf /tmp/trace; mkdir -p /tmp/trace
t=$(($(left) - 100)); [ $t -gt 100 ] && t=100
TRACE_FINE=1 TRACE_EXTRA=$X TRACE_OUT=/tmp/trace/t TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine \
  PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoint_trace.py python3 \
  bench/endpoints_processes.py --engines cuda_ipc --pairs $PAIRS --reps 30 --json $W/traced.json \
  > $W/traced.log 2>&1
rc=$?
PYTHONPATH="$AFTER:/tmp/site" python3 bench/endpoint_trace.py --show /tmp/trace/t --reps 30 \
  --cases direct-1K,direct-8K > $W/trace.txt 2>&1
pack traced $rc; cat $W/trace.txt; endpoint_rows traced $W/traced.log
t=$(($(left) - 5)); [ $t -gt 80 ] && t=80
if [ $t -ge 30 ]; then
  PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
    --pairs $PAIRS --reps 30 --json $W/table.json > $W/table.log 2>&1
  pack table $?; endpoint_rows table $W/table.log
fi
cat $W/steps.txt
