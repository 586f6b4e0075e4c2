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
# ring TREE ROUND RESERVE_S: bench/arena_ring.py --cuda, 8K tokens through a 512 MiB arena
# with 64 MiB slots, over TREE (before: BEFORE's shim, else AFTER's), at most 70 s and skipped
# when fewer than RESERVE_S + 20 are left; its rows printed, its JSON and output packed.
ring() {
  local P=$AFTER; [ "$1" = before ] && P=$BEFORE
  local t=$(($(left) - $3)); [ $t -gt 70 ] && t=70
  [ $t -lt 20 ] && { echo "ring $1-$2 skipped"; return; }
  PYTHONPATH="$P:/tmp/site" timeout $t python3 bench/arena_ring.py --cuda --tokens 8192 --reps 3 \
    --no-direct --arena $((512 << 20)) --slot-bytes $((64 << 20)) --json $W/ring-$1-$2.json \
    > $W/ring-$1-$2.txt 2>&1
  pack "ring-$1-$2" $?; grep -E "arena|checks" $W/ring-$1-$2.txt | cut -c1-300 | sed "s/^/ring $1-$2 /"
}
# endpoint_rows LABEL LOG: the rows bench/endpoints_processes.py printed to LOG, one line each
endpoint_rows() {
  grep "^{'case'" "$2" | python3 -c "import ast,sys; [print('$1', d['case'][9:], 'ms %.2f fixed %.2f ratio %.3f submit_us %.0f' % (d['ms'], d['fixed_ms'], d['ratio_to_engine'], d.get('engine_submit_host_us') or 0)) for d in map(ast.literal_eval, sys.stdin) if 'ms' in d]"
}
# endpoints_ab ROUNDS RESERVE_S MOST_S: bench/endpoints_processes.py over cuda_ipc, direct 1K
# and 8K, 50 requests a case, the BEFORE and AFTER trees alternating ROUNDS times; a run gets
# at most MOST_S seconds and is skipped when fewer than RESERVE_S + 30 are left; each run's
# rows printed as it ends, its JSON and log packed.
endpoints_ab() {
  local rounds=$1 reserve=$2 most=$3 round tree P t
  for round in $(seq 1 "$rounds"); do
    for tree in before after; do
      if [ $tree = before ]; then P=$BEFORE; else P=$AFTER; fi
      t=$(($(left) - reserve)); [ $t -gt "$most" ] && t=$most
      [ $t -lt 30 ] && { echo "$tree-$round skipped"; continue; }
      PYTHONPATH="$P:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
        --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192 --reps 50 --json $W/$tree-$round.json > $W/$tree-$round.log 2>&1
      pack "$tree-$round" $?
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], r['case'][9:], 'ms %.2f p99 %.2f engine %.2f fixed %.2f i2s %.2f d2s %.2f submit_us %.0f' % (r['ms'], r['p99_ms'], r['engine_only_ms'], r['fixed_ms'], r['init_to_submit_ms'], r['done_to_success_ms'], r['engine_submit_host_us'] or 0), 'checks', d['all_checks_passed']) for r in d['rows'] if 'ms' in r]" $W/$tree-$round.json $tree-$round 2>/dev/null
    done
  done
}
# issue_table TREE ROUND RESERVE_S MOST_S: the issue's table (bench/endpoints_processes.py over
# cuda_ipc, direct 1K and 8K, staged 8K, 20 requests a case) over TREE: "issue0" runs the tree
# of the day before the issue (build/gpurun/issue0, ca0c239, with its own bench), else this
# one; at most MOST_S seconds, skipped when fewer than RESERVE_S + 40 are left; rows printed.
issue_table() {
  local t=$(($(left) - $3)); [ $t -gt "$4" ] && t=$4
  [ $t -lt 40 ] && { echo "table $1-$2 skipped"; return; }
  if [ "$1" = issue0 ]; then
    local I=$(shim "$T/build/gpurun/issue0")
    PYTHONPATH="$I:/tmp/site" timeout $t python3 $T/build/gpurun/issue0/bench/endpoints_processes.py \
      --engines cuda_ipc --cases tp1-tp1-direct,tp2-tp1-staged --tokens-list 1024,8192 --reps 20 \
      --json $W/table-$1-$2.json > $W/table-$1-$2.log 2>&1
  else
    PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
      --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192,tp2-tp1-staged:8192 --reps 20 \
      --json $W/table-$1-$2.json > $W/table-$1-$2.log 2>&1
  fi
  pack "table-$1-$2" $?
  endpoint_rows "$1-$2" $W/table-$1-$2.log
}
