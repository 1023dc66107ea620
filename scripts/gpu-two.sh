#!/usr/bin/env bash
# Everything that waits for a machine with two GPUs (docs/gpu-validation.md), in order of
# priority, each command under a timeout with its own log:
#
#   cargo build --release --features cuda --bin overlap --example train
#   mkdir -p bin && cp target/release/overlap target/release/examples/train bin/
#   [PARTS="tail train forward faults calibrate confirm validate"] bash scripts/gpu-two.sh bin OUT
#
# PARTS (default: all, in this order; each takes about 1 to 5 minutes):
#   tail       the optimizer tail across owners: examples/gpu/gpt2_muon_2x1.toml (every
#              block matrix on Muon, each owned by one GPU) run with every step timed, so
#              each rank's device span and optimizer time can be read beside the one-GPU
#              figure of `bench-optimizer`;
#   train      examples/train.rs --backend cuda on meshes 2x1 and 1x2 (one process per GPU
#              under `overlap launch`): each rank's loss curve, norms and parameters
#              against the CPU backend within 1e-4; the multi-GPU gathers of [forward]
#              (all-gathers on 2x1, broadcasts from the owner on 1x2);
#   forward    `verify --backend cuda` of gpu_2x1.toml with [forward] (prefetch 0/1,
#              reshard true/false): forward_rel_err against the CPU backend;
#   faults     the failure and hang commands of "Failures and timeouts on GPUs" (an
#              injected failure and hang on rank 1, under `overlap launch`): every rank must
#              exit non-zero within seconds of the failure, or after the 5 s step timeout;
#   calibrate  `overlap calibrate` on two GPUs (NCCL, peer copies and their slowdowns
#              measured; only copy_engine.concurrency and [network] from the base), then
#              the bench workloads simulated on it;
#   confirm    `overlap tune --confirm 2` on gpu_2x1.toml (prediction against measurement
#              on two GPUs);
#   validate   scripts/gpu-validate.sh (the full verify matrix, both transports).
#
# OUT/log.txt lists every command with its exit status and wall time.
set -u
BIN=${1:?BIN_DIR holding overlap and train}
OUT=${2:?OUT_DIR}
PARTS=${PARTS:-tail train forward faults calibrate confirm validate}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
B=$BIN/overlap
LOG=$OUT/log.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"

# step NAME LIMIT_S COMMAND...: runs the command, its output to OUT/NAME.log.
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s: $*" | tee -a "$LOG"
  tail -n 3 "$OUT/$name.log" | cut -c1-400 | sed 's/^/  | /'
}
want() { [[ " $PARTS " == *" $1 "* ]]; }

if want tail; then
  step tail-2x1 300 "$B" launch --nproc-per-node 2 -- run --config examples/gpu/gpt2_muon_2x1.toml --timing-every 1
fi
if want train; then
  for mesh in 2x1 1x2; do
    step "train-$mesh" 300 "$B" launch --nproc-per-node 2 -- "$BIN/train" --backend cuda --mesh "$mesh" --steps 50 --json
  done
fi
if want forward; then
  for p in 0 1; do for r in true false; do
    cfg="$OUT/fwd-$p-$r.toml"
    { cat examples/gpu/gpu_2x1.toml; printf '\n[forward]\nprefetch = %s\nreshard_after_forward = %s\n' "$p" "$r"; } >"$cfg"
    step "forward-$p-$r" 300 "$B" launch --nproc-per-node 2 -- verify --config "$cfg" --backend cuda --steps 3 --json
  done; done
fi
if want faults; then
  cfg="$OUT/faults.toml"
  sed 's/^steps = 3$/steps = 3\nstep_timeout = 5/' examples/gpu/gpu_2x1.toml >"$cfg"
  OVERLAP_FAULT=rank=1,kind=stage1,step=2,mode=fail step faults-fail 120 "$B" launch --nproc-per-node 2 -- run --config "$cfg" --backend cuda
  OVERLAP_FAULT=rank=1,kind=stage1,step=2,mode=hang step faults-hang 120 "$B" launch --nproc-per-node 2 -- run --config "$cfg" --backend cuda
  nvidia-smi --query-compute-apps=pid,name --format=csv,noheader | sed 's/^/  left running: /' | tee -a "$LOG"
fi
if want calibrate; then
  step calibrate 900 "$B" launch --nproc-per-node 2 -- calibrate --base hardware/h200-nvlink.toml --out "$OUT/calibrated-2.toml"
  if [ -f "$OUT/calibrated-2.toml" ]; then
    for w in "2x1 nccl" "2x1 copy" "1x2 nccl" "1x2 copy"; do
      set -- $w
      step "simulate-$1-$2" 120 "$B" simulate --hardware "$OUT/calibrated-2.toml" --mesh "$1" --transport "$2"
    done
  fi
fi
if want confirm; then
  step confirm 600 "$B" tune --config examples/gpu/gpu_2x1.toml --hardware hardware/h200-nvlink.toml --confirm 2 --confirm-steps 21 --confirm-dir "$OUT/confirm"
fi
if want validate; then
  step validate 900 bash scripts/gpu-validate.sh "$B" "$OUT/validate"
fi
echo "done: $LOG"
