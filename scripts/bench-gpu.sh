#!/usr/bin/env bash
# Issue 5's measurement on 2 GPUs, in one device call: the PyTorch anchor and
# `overlap bench` (NCCL and copy transport) on design §6's three workloads, the copy
# transport's levers, then the collective sweep.
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
B="$BIN launch --nproc-per-node 2 --master-port"
W="--layers 16 --grad-mib 64 --d 4096 --iters $ITERS --warmup 3 --json"
# The three workloads: the anchor, then overlap with NCCL collectives, then overlap
# with the copy transport (exchange on copy engines, combine on the compute stream one
# layer behind: the defaults of --combine-lag and --combine-stream).
step anchor_rs 110 python3 scratch/anchors/torch_reduce_overlap.py rs "$OUT/anchor_rs.json"
step bench_rs 90 $B 29621 -- bench --mesh 2x1 --gemms 3 $W
step bench_rs_copy 90 $B 29631 -- bench --mesh 2x1 --gemms 3 --transport copy $W
step anchor_ar 110 python3 scratch/anchors/torch_reduce_overlap.py ar "$OUT/anchor_ar.json"
step bench_ar 90 $B 29622 -- bench --mesh 1x2 --gemms 3 $W
step bench_ar_copy 90 $B 29632 -- bench --mesh 1x2 --gemms 3 --transport copy $W
step anchor_rs_mm1 110 env MM=1 python3 scratch/anchors/torch_reduce_overlap.py rs "$OUT/anchor_rs_mm1.json"
step bench_rs_mm1 90 $B 29623 -- bench --mesh 2x1 --gemms 1 $W
step bench_rs_mm1_copy 90 $B 29633 -- bench --mesh 2x1 --gemms 1 --transport copy $W
# Levers of the copy transport: where the combine runs and when.
step copy_rs_lag0_reduce 90 $B 29634 -- bench --mesh 2x1 --gemms 3 --transport copy --combine-lag 0 --combine-stream reduce $W
step copy_rs_lag2 90 $B 29636 -- bench --mesh 2x1 --gemms 3 --transport copy --combine-lag 2 $W
# NCCL CTA limits (ncclConfig_t maxCTAs): fewer SMs for NCCL beside the GEMMs.
step nccl_rs_cta8 90 $B 29641 -- bench --mesh 2x1 --gemms 3 --nccl-max-ctas 8 $W
step nccl_rs_cta16 90 $B 29642 -- bench --mesh 2x1 --gemms 3 --nccl-max-ctas 16 $W
step nccl_ar_cta16 90 $B 29643 -- bench --mesh 1x2 --gemms 3 --nccl-max-ctas 16 $W
step nccl_rs_mm1_cta8 90 $B 29644 -- bench --mesh 2x1 --gemms 1 --nccl-max-ctas 8 $W
# Raw collective efficiency: the executor's collective nodes against NCCL alone.
step coll_rs 90 $B 29624 -- bench-collectives --mesh 2x1 --iters 20 --warmup 3
step coll_ar 90 $B 29625 -- bench-collectives --mesh 1x2 --iters 20 --warmup 3
