#!/usr/bin/env bash
# One device call (issue 29 item 4): where a cuda_ipc grid submit's host time goes.
# bench/submit_host.py at 64 pages (a 1K Llama-70B direct request) and 512 (8K), each step
# alone and cProfile over the submits; then the cuda_ipc GPU tests. Carried: .whl.
# From the repository root: BUDGET=300 bash bench/results/2026-12-06-h200-submit/run.sh
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-300}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=$OUT; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T=$PWD; S=$(mktemp -d); mkdir -p "$S/pdc"; cp -r pdc/. "$S/pdc/"
for s in runtime compiler generated integrations; do ln -sfn "$T/$s" "$S/pdc/$s"; done
export PYTHONPATH="$S:/tmp/site"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; uptime
  lscpu | grep -E "Model name|MHz" | head -3
  python3 -c "import sys, torch, triton, numpy; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"; } > $W/env.txt 2>&1
cat $W/env.txt
for pages in 64 512; do
  timeout $(( $(left) - 20 )) python3 bench/submit_host.py --pages $pages --reps 200 --profile 200 \
    --json $W/s$pages.json > $W/s$pages.txt 2>&1; echo "s$pages exit $? left $(left)s" | tee -a $W/steps.txt
  grep -v "^ *[0-9]" $W/s$pages.txt | tail -25
done
head -60 $W/s64.txt
