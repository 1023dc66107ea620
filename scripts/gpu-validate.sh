#!/usr/bin/env bash
# The GPU validation of docs/gpu-validation.md, on one machine with 2 GPUs.
#
#   cargo build --release --features cuda --bin overlap
#   scripts/gpu-validate.sh [BINARY] [OUTDIR (default /tmp/overlap-gpu-validation)] [BUDGET_SECONDS]
#
# Runs, each under `overlap launch --nproc-per-node 2` (one process per GPU):
#   1. cuda-smoke: libraries, every collective in f32/bf16 with sum/avg, the kernels
#      against the reference math, all-reduce bandwidth;
#   2. verify on meshes 2x1 and 1x2, four gate patterns, f32 and bf16, 3 steps, with
#      NCCL collectives; then the copy transport on both meshes and on three configs
#      whose combines read the copy rings in place (2x1, 1x2, 2x1 with rings of three
#      slots), f32 and bf16, two gate patterns;
#   3. one `overlap run` for the per-step figures (transport `auto`: copy on one node).
# Everything it prints also goes to OUTDIR/log.txt. Stops starting new runs after
# BUDGET_SECONDS (default 420).
set -u
BIN=${1:-target/release/overlap}
OUT=${2:-${TMPDIR:-/tmp}/overlap-gpu-validation}
BUDGET=${3:-420}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
port=29600
failures=0
step() {
  port=$((port + 1))
  if [ "$SECONDS" -gt "$BUDGET" ]; then
    echo "skipped (time budget): $*"
    return
  fi
  echo "\$ overlap launch --nproc-per-node 2 --master-port $port -- $*"
  local t0=$SECONDS
  timeout 90 "$BIN" launch --nproc-per-node 2 --master-port "$port" -- "$@"
  local rc=$?
  echo "exit $rc ($((SECONDS - t0)) s)"
  [ "$rc" -eq 0 ] || failures=$((failures + 1))
}
{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  step cuda-smoke --mib 1,16,64,256 --iters 20
  # NCCL_VERIFY=0 skips the NCCL runs (when only the copy transport changed).
  for mesh in $([ "${NCCL_VERIFY:-1}" = 0 ] || echo 2x1 1x2); do
    for dtype in f32 bf16; do
      for gates in off,on off,off,on on,on no_sync,off,on; do
        step verify --config "examples/gpu/gpu_$mesh.toml" --backend cuda --transport nccl --gates "$gates" --dtype "$dtype" --steps 3 --json
      done
    done
  done
  # The copy transport (exchange on copy engines, combine kernel): every route's
  # reduce-scatter, reduce and all-reduce through CUDA IPC.
  # gpu_2x1_in_place and gpu_1x2_in_place have one bucket per layer, so their combines
  # read the exchanged chunks in place in the copy rings (the all-reduce's gathers on
  # the rings' second lane); gpu_2x1_depth3 does so two layers behind, with rings of
  # three slots per peer.
  for mesh in 2x1 1x2 2x1_in_place 1x2_in_place 2x1_depth3; do
    for dtype in f32 bf16; do
      for gates in off,on no_sync,off,on; do
        step verify --config "examples/gpu/gpu_$mesh.toml" --backend cuda --transport copy --gates "$gates" --dtype "$dtype" --steps 3 --json
      done
    done
  done
  step run --config examples/gpu/gpu_2x1.toml --backend cuda --steps 4 --trace "$OUT/trace-2x1.json"
  echo "failures: $failures"
} 2>&1 | tee "$OUT/log.txt"
