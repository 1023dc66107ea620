#!/usr/bin/env bash
# The host time of the optimizer tail on one GPU, GPT-2 small's 148 parameters:
#   scripts/gpu-tail-host.sh [BINARY (target/release/overlap)] [OUTDIR]
# BINARY is an `overlap` built with --features cuda. It runs, twice each,
#   overlap run --config examples/gpu/gpt2_small_1x1_{muon,adamw}.toml --timing-every 1000
# (20 steps through the executor: the plan's norm, clip, 148 optimizer and 148 publish
# nodes), whose closing table gives the host time by node kind and the tail's sum, and
#   overlap bench-optimizer --shapes gpt2-small --muon --clip
# (the same kernels handed to the backend directly, no executor), all with
# OVERLAP_FLUSH_CLOCK=1, which adds one line per kind of flush: where the backend's
# flush spends its host time. Everything goes to OUTDIR/log.txt as well.
set -u
BIN=${1:-target/release/overlap}
OUT=${2:-${TMPDIR:-/tmp}/overlap-tail-host}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OVERLAP_FLUSH_CLOCK=1
{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "== host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ($(nproc) cores)"
  for rep in 1 2; do
    for opt in muon adamw; do
      cfg=examples/gpu/gpt2_small_1x1_$opt.toml
      echo "== run $rep: $BIN run --config $cfg --timing-every 1000"
      timeout 300 "$BIN" run --config "$cfg" --timing-every 1000 >"$OUT/run-$opt-$rep.out" 2>"$OUT/run-$opt-$rep.err"
      echo "exit $?"
      grep -E "^step (1|2|3|20)/" "$OUT/run-$opt-$rep.out"
      sed -n '/^host issue time by node kind/,$p' "$OUT/run-$opt-$rep.out"
      grep -E "held \(" "$OUT/run-$opt-$rep.err"
    done
  done
  echo "== $BIN bench-optimizer --shapes gpt2-small --muon --clip"
  timeout 300 "$BIN" bench-optimizer --shapes gpt2-small --muon --clip >"$OUT/bench.out" 2>"$OUT/bench.err"
  echo "exit $?"
  cat "$OUT/bench.out"
  grep -E "held \(" "$OUT/bench.err"
} 2>&1 | tee "$OUT/log.txt"
