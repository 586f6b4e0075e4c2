#!/usr/bin/env bash
# GPU memory across processes: each engine through the endpoints, prefill and decode as two
# processes (bench/endpoints_processes.py), plus the GPU tests of the engines. One call:
#
#   bash bench/run_gpu_engines.sh OUT [PACKAGES]
#
# PACKAGES (default .whl) holds what the bare GPU image lacks: the Debian packages Mooncake's
# engine.so loads (libibverbs1, ibverbs-providers for libmlx5, libnl-3-200, libnl-route-3-200,
# libnuma1; unpacked into /tmp/debs, never into /) and the engines as .tgz trees of trimmed
# wheels (mooncake-transfer-engine-cuda13, nixl-cu13), unpacked into /tmp/site.
# Environment: DEVICES=prefill,decode (default cuda:0,cuda:0; two GPUs: cuda:0,cuda:1),
# ENGINES (default cuda_ipc,mooncake,nixl), TOKENS (default 8192,1024), REPS (default 5),
# PER_ENGINE_S (default 240), RUN_GPU_TESTS (default 1). Writes OUT/env.txt, OUT/log.txt,
# OUT/endpoints_processes_<engine>.json and OUT/gpu_tests.txt (TESTS_S bounds the tests,
# TESTS_K selects them as pytest -k does). BENCH_WRAP prefixes the bench's command, e.g. a
# sampling profiler: BENCH_WRAP="py-spy record --subprocesses --threads --format raw -o F --".
set -u
OUT=${1:?usage: run_gpu_engines.sh OUT [PACKAGES]}
PKG=${2:-.whl}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEVICES=${DEVICES:-cuda:0,cuda:0}
ENGINES=${ENGINES:-cuda_ipc,mooncake,nixl}
SHIM=$(mktemp -d)
mkdir -p "$SHIM/pdc" /tmp/debs /tmp/site
cp -r pdc/. "$SHIM/pdc/"  # the CLI modules and pdc.verify
for stage in runtime compiler generated integrations; do ln -s "$PWD/$stage" "$SHIM/pdc/$stage"; done
for f in "$PKG"/*.deb; do [ -e "$f" ] && dpkg -x "$f" /tmp/debs; done
for f in "$PKG"/*.tgz; do [ -e "$f" ] && tar xzf "$f" -C /tmp/site; done
for f in "$PKG"/*.whl; do
  [ -e "$f" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site "$f"
done
# libcudart.so.13 for the engines' native libraries: the one torch's CUDA runtime wheel ships
CUDART=$(python3 -c "import glob, os, site; print(':'.join(sorted({os.path.dirname(p) for d in site.getsitepackages() for p in glob.glob(d + '/nvidia/**/libcudart.so.13*', recursive=True)})))")
export LD_LIBRARY_PATH="/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$SHIM:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi
  nvidia-smi topo -m
  nproc
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, 'gpus', torch.cuda.device_count())"
  [ -e /tmp/site/mooncake/engine.so ] && ldd /tmp/site/mooncake/engine.so | grep -E "not found|cudart|ibverbs|mlx5|curl|numa"
  python3 -c "import mooncake.engine as m; print('mooncake', {k: getattr(m, k) for k in dir(m) if k.startswith('SUPPORT_')}); print([n for n in dir(m.TransferEngine) if not n.startswith('_')])"
  python3 -c "import nixl_cu13._api as n; print('nixl', n.__file__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# the GPU tests first: their failures explain a bench's
if [ "${RUN_GPU_TESTS:-1}" = 1 ]; then
  REPO=$PWD
  # from /tmp with --import-mode=append: the repository's own pdc/ folder has no runtime/ inside
  (cd /tmp && timeout "${TESTS_S:-200}" python3 -m pytest -q -rA --tb=short --timeout 90 -p no:cacheprovider --import-mode=append \
    --rootdir "$REPO" -m gpu -k "${TESTS_K:-}" "$REPO/tests/runtime/engines/test_cuda_ipc.py" \
    "$REPO/tests/runtime/engines/test_gpu_engines.py") > "$OUT/gpu_tests.txt" 2>&1
  echo "=== gpu tests exit $?"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|Error|error:|passed|failed" "$OUT/gpu_tests.txt" | tail -25
fi
PRE=${DEVICES%,*}
DEC=${DEVICES#*,}
for engine in ${ENGINES//,/ }; do
  echo "=== $engine $(date -u +%T)"
  timeout "${PER_ENGINE_S:-240}" ${BENCH_WRAP:-} python3 bench/endpoints_processes.py --engines "$engine" \
    --prefill-device "$PRE" --decode-device "$DEC" --tokens-list "${TOKENS:-8192,1024}" \
    --reps "${REPS:-5}" --json "$OUT/endpoints_processes_$engine.json"
  echo "=== $engine exit $? $(date -u +%T)"
done 2>&1 | tee "$OUT/log.txt"
