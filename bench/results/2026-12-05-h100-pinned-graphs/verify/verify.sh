#!/usr/bin/env bash
# The check of the committed code of Note [Pinned graph input] (16:21 UTC, an H100): the GPU
# tests and bench/staging_host.py over main before the change and after it, once each.
# Carried: build/gpurun/{pkg,tree,before}, this file copied to build/gpurun/tree/verify.sh; run
# from the repository root: bash build/gpurun/tree/verify.sh
set -u
export PYTHONUNBUFFERED=1
W=/tmp/w; mkdir -p $W
source build/gpurun/tree/bench/results/2026-12-05-h200-batch/unpack.sh
shim() { d=$(mktemp -d); mkdir -p "$d/pdc"; cp -r "$1"/pdc/. "$d/pdc/"
  for s in runtime compiler generated integrations; do ln -sfn "$1/$s" "$d/pdc/$s"; done; echo "$d"; }
AFTER=$(shim "$T"); BEFORE=$(shim "$B/before")
cd "$T"
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 150 python3 -m pytest -q -rA --tb=short -p no:cacheprovider \
  --import-mode=append --rootdir "$T" -m gpu --timeout 100 $T/tests/runtime/test_staging_graphs.py \
  $T/tests/runtime/test_pinned_graph.py $T/tests/runtime/test_copy_kernels.py \
  $T/tests/runtime/test_staged.py $T/tests/runtime/engines/test_cuda_ipc.py) > $W/gpu_tests.txt 2>&1
echo "gpu tests rc $?"; grep -E "^(PASSED|FAILED|ERROR)| passed| failed" $W/gpu_tests.txt | tail -20
for tree in before after; do
  if [ $tree = before ]; then P=$BEFORE; prof=""; else P=$AFTER; prof="--profile 20"; fi
  PYTHONPATH="$P:/tmp/site" timeout 100 python3 bench/staging_host.py --tokens 8192 --reps 30 \
    $prof --json $W/host-$tree-3.json > $W/host-$tree-3.txt 2>&1
  echo "host-$tree rc $?"; grep -A4 "^graphs" $W/host-$tree-3.txt | tail -4
done
grep -A9 "copy inside" $W/host-after-3.txt
cp $W/* $OUT/ 2>/dev/null; ls $OUT
