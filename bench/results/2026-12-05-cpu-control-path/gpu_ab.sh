#!/usr/bin/env bash
# The control path before and after on one H200: cuda_ipc, 1K direct, rounds alternating.
set -u
OUT=${1:?OUT}; ROUNDS=${2:-3}; REPS=${3:-100}
mkdir -p /tmp/site "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site build/whl/*.whl
mk() { d=$(mktemp -d); mkdir -p "$d/pdc"; cp -r "$1"/pdc/. "$d/pdc/"
  for s in runtime generated integrations; do ln -s "$(realpath "$1/$s")" "$d/pdc/$s"; done; echo "$d"; }
AFTER=$(mk .); BEFORE=$(mk build/before)
export PYTHONUNBUFFERED=1
{ date -u; nproc; nvidia-smi --query-gpu=name,driver_version --format=csv; uptime
  python3 -c "import torch, numpy, sys; print(sys.version.split()[0], torch.__version__, numpy.__version__)"; } > "$OUT/env.txt" 2>&1
for r in $(seq 1 "$ROUNDS"); do
  for tree in before after; do
    if [ "$tree" = before ]; then P=$BEFORE; else P=$AFTER; fi
    PYTHONPATH="$P:/tmp/site" timeout 170 python3 bench/endpoints_processes.py --engines cuda_ipc \
      --tokens-list 1024 --cases "${CASES:-tp1-tp1-direct}" --reps "$REPS" --json "$OUT/$tree-$r.json" > "$OUT/$tree-$r.log" 2>&1
    echo "$tree $r exit $? $(date -u +%T)"; uptime >> "$OUT/load.txt"
  done
done
python3 bench/control_path_summary.py "$OUT"
