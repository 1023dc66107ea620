#!/usr/bin/env bash
# Issue 5's measurement on 2 GPUs, in one device call: the PyTorch anchor and
# `overlap bench` on design §6's three workloads, then the collective sweep.
# Needs target/release/overlap (--features cuda) and the anchor script copied to
# scratch/anchors/ (git-ignored; `cp ../shared/anchors/torch_reduce_overlap.py scratch/anchors/`).
# Writes everything under ${OUT:-out}.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
BIN=./target/release/overlap
ITERS=${ITERS:-10}
step() { # name, timeout, command...
  local name=$1 t=$2; shift 2
  if [ "$SECONDS" -gt "${BUDGET_S:-520}" ]; then echo "== $name: skipped (budget)" | tee -a "$OUT/log.txt"; return; fi
  echo "== $name: $*" | tee -a "$OUT/log.txt"
  local s=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.out" 2>> "$OUT/stderr.txt"
  local rc=$?
  echo "   exit $rc ($((SECONDS - s)) s)" | tee -a "$OUT/log.txt"
  cat "$OUT/$name.out" >> "$OUT/log.txt"; tail -n 1 "$OUT/$name.out"; rm -f "$OUT/$name.out"
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$OUT/log.txt" 2>&1
step anchor_rs 110 python3 scratch/anchors/torch_reduce_overlap.py rs "$OUT/anchor_rs.json"
step bench_rs 90 $BIN launch --nproc-per-node 2 --master-port 29621 -- bench --mesh 2x1 --layers 16 --grad-mib 64 --gemms 3 --d 4096 --iters "$ITERS" --warmup 3 --json
step anchor_ar 110 python3 scratch/anchors/torch_reduce_overlap.py ar "$OUT/anchor_ar.json"
step bench_ar 90 $BIN launch --nproc-per-node 2 --master-port 29622 -- bench --mesh 1x2 --layers 16 --grad-mib 64 --gemms 3 --d 4096 --iters "$ITERS" --warmup 3 --json
step anchor_rs_mm1 110 env MM=1 python3 scratch/anchors/torch_reduce_overlap.py rs "$OUT/anchor_rs_mm1.json"
step bench_rs_mm1 90 $BIN launch --nproc-per-node 2 --master-port 29623 -- bench --mesh 2x1 --layers 16 --grad-mib 64 --gemms 1 --d 4096 --iters "$ITERS" --warmup 3 --json
step coll_rs 90 $BIN launch --nproc-per-node 2 --master-port 29624 -- bench-collectives --mesh 2x1 --iters 20 --warmup 3
step coll_ar 90 $BIN launch --nproc-per-node 2 --master-port 29625 -- bench-collectives --mesh 1x2 --iters 20 --warmup 3
step bench_rs_w2 90 $BIN launch --nproc-per-node 2 --master-port 29626 -- bench --mesh 2x1 --layers 16 --grad-mib 64 --gemms 3 --d 4096 --iters "$ITERS" --warmup 3 --window 2 --json
step bench_rs_w16 90 $BIN launch --nproc-per-node 2 --master-port 29627 -- bench --mesh 2x1 --layers 16 --grad-mib 64 --gemms 3 --d 4096 --iters "$ITERS" --warmup 3 --window 16 --json
# The same three workloads with buffer aliasing off (every pack, group-of-one and
# unpack copy runs), for the before/after of the aliasing lever in the same call.
step bench_rs_noalias 90 $BIN launch --nproc-per-node 2 --master-port 29628 -- bench --mesh 2x1 --layers 16 --grad-mib 64 --gemms 3 --d 4096 --iters "$ITERS" --warmup 3 --no-alias --json
step bench_ar_noalias 90 $BIN launch --nproc-per-node 2 --master-port 29629 -- bench --mesh 1x2 --layers 16 --grad-mib 64 --gemms 3 --d 4096 --iters "$ITERS" --warmup 3 --no-alias --json
step bench_rs_mm1_noalias 90 $BIN launch --nproc-per-node 2 --master-port 29630 -- bench --mesh 2x1 --layers 16 --grad-mib 64 --gemms 1 --d 4096 --iters "$ITERS" --warmup 3 --no-alias --json
