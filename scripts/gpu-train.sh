#!/usr/bin/env bash
# examples/train.rs on one GPU, and `verify` of a forward plan on CUDA (issue: the
# forward half and device-resident gradients).
#
#   bash scripts/gpu-train.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds `overlap` (cargo build --release --features cuda --bin overlap) and
# `train` (cargo build --release --features cuda --example train). Each rank of the
# trainer is started by `overlap launch`; it runs its model on the GPU (cuBLAS + NVRTC
# kernels), hands its gradients in on the device, reads the gathered parameters where
# the plan left them, and compares its loss curve, gradient norms and parameters with
# the CPU backend's run of the same example (exit 0 when within 1e-4 relative).
set -u
BIN=${1:?BIN_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
run() {
  echo "== $*"
  timeout 300 "$@"
  local rc=$?
  echo "exit $rc"
  [ $rc -eq 0 ] || status=1
}
# The documented run: 50 steps, mesh 1x1, 4 micro-batches of 16 samples.
run "$BIN/overlap" launch --nproc-per-node 1 -- "$BIN/train" --backend cuda --mesh 1x1 --steps 50
run "$BIN/overlap" launch --nproc-per-node 1 -- "$BIN/train" --backend cuda --mesh 1x1 --steps 50 --json
# Another shape: larger batches, 2 micro-batches, another seed, more steps.
run "$BIN/overlap" launch --nproc-per-node 1 -- "$BIN/train" --backend cuda --mesh 1x1 --steps 80 \
  --batch 64 --micro-batches 2 --seed 7 --json
# verify of a forward plan on the GPU: forward_rel_err against the CPU backend.
cfg="$OUT/forward_1x1.toml"
for p in 0 1; do for r in true false; do
  { sed 's/^shard = 2/shard = 1/' examples/gpu/gpu_2x1.toml
    printf '\n[forward]\nprefetch = %s\nreshard_after_forward = %s\n' $p $r; } > "$cfg"
  run "$BIN/overlap" launch --nproc-per-node 1 -- verify --config "$cfg" --backend cuda --steps 3
done; done
exit $status
