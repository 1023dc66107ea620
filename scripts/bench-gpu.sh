#!/usr/bin/env bash
# The two-GPU measurement of docs/performance.md, in one run: the PyTorch anchor and
# `overlap bench` (NCCL and copy transport) on the three workloads (16 layers, 64 MiB
# f32 gradient per layer, bf16 4096^3 GEMMs: rs 2x1 x3 GEMMs, ar 1x2 x3, rs_mm1 2x1 x1),
# the copy transport's levers, the collective sweep, then `overlap bench-interference`.
# Needs target/release/overlap (--features cuda) and, for the anchor, its script
# torch_reduce_overlap.py (not in this repository; docs/performance.md, "The anchor"):
#
#   ANCHOR=/path/to/torch_reduce_overlap.py OUT=out/bench BUDGET_S=280 timeout 320 bash scripts/bench-gpu.sh
#
# Without ANCHOR (or with a path that does not exist) the anchor runs are skipped.
# Writes everything under ${OUT:-out}: log.txt, and for the copy transport's default
# runs a timeline of the last timed step (timeline_copy_<workload>_r<round>.svg, .jsonl).
set -u
source "$(dirname "$0")/bench-common.sh"
B="$BIN launch --nproc-per-node 2 --master-port"
# The three workloads, each: the anchor, then overlap with NCCL collectives, then the
# copy transport (exchanges on the copy stream) with its defaults (combine on the
# high-priority reduce stream one layer behind, reading shard groups' exchanges in
# place), with the combine on the compute stream one layer behind, with it on the
# reduce stream right after its exchange, and with every exchange copying out of the
# ring (--no-in-place).
# ROUNDS=2 repeats everything.
for round in $(seq 1 "${ROUNDS:-1}"); do
  p=$((29600 + round * 20))
  for wl in "rs 2x1 3" "ar 1x2 3" "rs_mm1 2x1 1"; do
    set -- $wl
    name=$1 mesh=$2 mm=$3
    mode=${name%_mm1}
    if [ -f "${ANCHOR:-}" ]; then
      step "anchor_${name}_r$round" 110 env MM=$mm python3 "$ANCHOR" "$mode" "$OUT/anchor_${name}_r$round.json"
    else
      echo "== anchor_${name}_r$round: skipped (set ANCHOR to torch_reduce_overlap.py)" | tee -a "$OUT/log.txt"
    fi
    step "nccl_${name}_r$round" 90 $B $((p + 1)) -- bench --mesh "$mesh" --gemms "$mm" $W
    step "copy_${name}_r$round" 90 $B $((p + 2)) -- bench --mesh "$mesh" --gemms "$mm" --transport copy --timeline "$OUT/timeline_copy_${name}_r$round.svg" $W
    step "copy_${name}_compute_r$round" 90 $B $((p + 3)) -- bench --mesh "$mesh" --gemms "$mm" --transport copy --combine-stream compute $W
    step "copy_${name}_lag0_r$round" 90 $B $((p + 4)) -- bench --mesh "$mesh" --gemms "$mm" --transport copy --combine-lag 0 $W
    step "copy_${name}_copyout_r$round" 90 $B $((p + 5)) -- bench --mesh "$mesh" --gemms "$mm" --transport copy --no-in-place $W
    p=$((p + 6))
  done
done
# Raw collective efficiency: the executor's collective nodes against NCCL alone.
step coll_rs 90 $B 29691 -- bench-collectives --mesh 2x1 --iters 20 --warmup 3
step coll_ar 90 $B 29692 -- bench-collectives --mesh 1x2 --iters 20 --warmup 3
# What a combine costs the GEMMs beside it, on GPU 0 alone (docs/performance.md).
step interference_mm3 60 "$BIN" bench-interference --gemms 3 --iters 10 --warmup 2
step interference_mm1 60 "$BIN" bench-interference --gemms 1 --iters 10 --warmup 2
