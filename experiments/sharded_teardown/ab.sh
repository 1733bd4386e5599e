#!/usr/bin/env bash
# Alternate the old and the new ending N times each (default 100); one line per run:
# "<mode> <i> rc <exit code> <'terminate called' lines>". Run from the checkout.
set -u
N=${1:-100}
work=$(mktemp -d)
for i in $(seq 1 "$N"); do
  for mode in old new; do
    rm -rf "$work/ck"
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \
      experiments/sharded_teardown/teardown.py "$mode" "$work/ck" > "$work/out.txt" 2>&1
    rc=$?
    echo "$mode $i rc $rc $(grep -c 'terminate called' "$work/out.txt")"
  done
done
rm -rf "$work"
