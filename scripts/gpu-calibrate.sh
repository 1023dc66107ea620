#!/usr/bin/env bash
# `overlap calibrate` on one GPU, then `overlap simulate` with the profile it wrote, to
# show that the profile is accepted (docs/simulate.md, "Calibrating a profile").
#
# Build (anywhere, no CUDA needed):
#   cargo build --release --features cuda --bin overlap
# Run on the GPU machine, from the repository root:
#   bash scripts/gpu-calibrate.sh BINARY OUTDIR
#   (defaults: target/release/overlap and /tmp/overlap-gpu-calibrate)
#
# One GPU (device 0, or the first of CUDA_VISIBLE_DEVICES) measures what it can: the GEMM
# rate, kernels, combines, copies within the GPU, the host's cost per node and the
# slowdowns beside the GEMMs of the combine and of a copy within the GPU. Everything that
# needs two or more GPUs (NCCL, copies into a peer, their slowdowns, gpus_per_node) and
# copy_engine.concurrency are kept from hardware/h200-nvlink.toml, each marked so in the
# profile's comments.
#
# Writes OUTDIR/calibrated.toml (the profile), OUTDIR/calibrate.out (its summary table)
# and .err (its progress), and OUTDIR/simulate-*.out (the bench workloads predicted on
# the calibrated profile and on the base one). Prints every command with its exit status
# and the predictions side by side; the last line is `failures: N` (0 when everything ran).
set -u
BIN=${1:-target/release/overlap}
OUT=${2:-${TMPDIR:-/tmp}/overlap-gpu-calibrate}
BASE=hardware/h200-nvlink.toml
PROFILE=$OUT/calibrated.toml
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
failures=0

# step NAME ARGS...: runs the binary under a timeout, stdout and stderr to
# OUTDIR/NAME.out and .err; prints the command and its exit status.
step() {
  local name=$1; shift
  echo "\$ $BIN $*"
  local t0=$SECONDS
  timeout 900 "$BIN" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  echo "  exit $rc ($((SECONDS - t0)) s); output in $OUT/$name.out, $OUT/$name.err"
  if [ "$rc" != 0 ]; then
    failures=$((failures + 1))
    tail -n 5 "$OUT/$name.err" | sed 's/^/  | /'
  fi
  return "$rc"
}

rm -f "$PROFILE"
if step calibrate calibrate --base "$BASE" --out "$PROFILE"; then
  echo "profile written: $PROFILE"
  cat "$OUT/calibrate.out"
  echo "progress (stderr):"
  sed 's/^/  | /' "$OUT/calibrate.err"
fi

# The bench workloads of docs/performance.md (rs on mesh 2x1, ar on 1x2, with NCCL and
# the copy transport), predicted on the calibrated profile and on the base.
if [ -f "$PROFILE" ]; then
  for w in "rs nccl 2x1" "rs copy 2x1" "ar nccl 1x2" "ar copy 1x2"; do
    set -- $w
    for p in calibrated base; do
      hw=$PROFILE
      [ "$p" = base ] && hw=$BASE
      if step "simulate-$1-$2-$p" simulate --hardware "$hw" --mesh "$3" --transport "$2"; then
        echo "  $1 $2 on $p: $(grep -m1 'compute_only' "$OUT/simulate-$1-$2-$p.out")"
      fi
    done
  done
else
  echo "no profile was written: nothing to simulate"
  failures=$((failures + 1))
fi
echo "failures: $failures"
