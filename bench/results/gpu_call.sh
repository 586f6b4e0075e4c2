# Sourced by the device-call scripts under bench/results, run from the repository root with
# BUDGET (seconds) set. Gives: `left` (seconds of BUDGET left); W, a work folder, and `pack
# STEP RC`, which notes the step in $W/steps.txt and packs $W into $OUT/results.tgz (the
# device fetch brings back only a few files); the carried wheels (.whl) unpacked into
# /tmp/site; T, the repository root; `shim TREE`, an import root whose pdc package is TREE's
# (pdc/ copied, its stage folders linked); AFTER, the working tree's shim, and BEFORE,
# build/gpurun/before's where it was carried; $W/env.txt (machine, GPU, versions), printed.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=/tmp/w; mkdir -p $W
pack() { echo "$1 exit $2 $(date -u +%T) left $(left)s" >> $W/steps.txt
  tar czf "$OUT/results.tgz" -C $W . ; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T=$PWD
shim() { d=$(mktemp -d); mkdir -p "$d/pdc"; cp -r "$1"/pdc/. "$d/pdc/"
  for s in runtime compiler generated integrations; do ln -sfn "$1/$s" "$d/pdc/$s"; done; echo "$d"; }
AFTER=$(shim "$T")
BEFORE=""; [ -d "$T/build/gpurun/before" ] && BEFORE=$(shim "$T/build/gpurun/before")
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; nproc; uptime
  PYTHONPATH="$AFTER:/tmp/site" python3 -c "import sys, torch, triton, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"; } > $W/env.txt 2>&1
cat $W/env.txt
