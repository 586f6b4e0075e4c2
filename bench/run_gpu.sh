#!/usr/bin/env bash
# Runs every bench/ script on a machine with two GPUs and writes their JSON under OUT.
#
#   bash bench/run_gpu.sh OUT [script ...]      # default: all five; "none": no script
#   bash bench/run_gpu.sh OUT arena_ring        # staging rings (BENCHMARKS.md (t)); not run yet
#
# Works on a bare image without installing pdc: a pdc/ folder whose stage packages are links to
# the repository's folders goes first on PYTHONPATH (setup.py maps them the same way). Wheels in
# .whl/ (jsonschema and its needs, for the spec front end) are unpacked into /tmp/site first.
# Each script runs under its own time limit (PER_SCRIPT_S, default 150 s); a failure is logged
# and the next script runs. RUN_GPU_TESTS=1 also runs the GPU tests of the device engine.
set -u
OUT=${1:?usage: run_gpu.sh OUT [script ...]}
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SHIM=$(mktemp -d)
mkdir -p "$SHIM/pdc"
cp -r pdc/. "$SHIM/pdc/"  # the CLI modules and pdc.verify
for stage in runtime compiler generated integrations; do ln -s "$PWD/$stage" "$SHIM/pdc/$stage"; done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || echo "wheel install failed; the spec front end may be missing"
fi
export PYTHONPATH="$SHIM:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi
  nvidia-smi topo -m
  python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, 'gpus', torch.cuda.device_count(), 'p2p', torch.cuda.can_device_access_peer(0, 1) if torch.cuda.device_count() > 1 else None)"
  python3 -c "import jsonschema; print('jsonschema', jsonschema.__version__)"
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
SCRIPTS=("$@")
if [ ${#SCRIPTS[@]} -eq 0 ]; then
  SCRIPTS=(kernels p2p_request hetero_tp streaming control_cost)
elif [ "${SCRIPTS[0]}" = none ]; then
  SCRIPTS=()
fi
for name in "${SCRIPTS[@]+"${SCRIPTS[@]}"}"; do
  extra=()
  if [ "$name" = control_cost ]; then extra=(--real); fi
  # Note [Staging ring]: one 8K Llama-70B request through a 256 MiB arena (a link's region is
  # 1.3 GB) as a ring, against the direct fallback and a whole-region arena
  if [ "$name" = arena_ring ]; then extra=(--cuda --tokens 8192 --arena $((256 << 20)) --slot-bytes $((32 << 20))); fi
  echo "=== $name $(date -u +%T)"
  timeout "${PER_SCRIPT_S:-150}" python3 "bench/$name.py" --json "$OUT/$name.json" "${extra[@]}"
  echo "=== $name exit $? $(date -u +%T)"
done
if [ "${RUN_GPU_TESTS:-0}" = 1 ]; then
  echo "=== gpu tests $(date -u +%T)"
  # from /tmp and with --import-mode=append, so that the repository's own pdc/ folder (which
  # has no runtime/ inside) cannot shadow the shim's pdc package
  REPO=$PWD
  (cd /tmp && timeout 120 python3 -m pytest -q -p no:cacheprovider --import-mode=append \
    --rootdir "$REPO" -m gpu "$REPO/tests/bench/test_local_device_engine.py" \
    "$REPO/tests/runtime/test_copy_kernels.py" "$REPO/tests/runtime/test_staged.py" \
    "$REPO/tests/runtime/test_staged_ring.py" \
    "$REPO/tests/runtime/test_forward_events.py")
  echo "=== gpu tests exit $? $(date -u +%T)"
fi
