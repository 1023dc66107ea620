#!/usr/bin/env bash
# The host time of the optimizer tail on one GPU, GPT-2 small's 148 parameters:
#   scripts/gpu-tail-host.sh [BINARY (target/release/overlap)] [OUTDIR] [BASELINE]
# BINARY is an `overlap` built with --features cuda. It runs, three times each,
#   overlap run --config examples/gpu/gpt2_small_1x1_{muon,adamw}.toml --timing-every 1000
# (20 steps through the executor: the plan's norm, clip, 148 optimizer and 148 publish
# nodes), whose closing table gives the host time by node kind and the tail's sum, and
#   overlap bench-optimizer --shapes gpt2-small --muon --clip
# (the same kernels handed to the backend directly, no executor), all with
# OVERLAP_FLUSH_CLOCK=1, which adds one line per kind of flush: where the backend's
# flush spends its host time. With BASELINE (another `overlap` binary, say one built
# from an earlier commit) each run of BINARY is preceded by the same run of BASELINE, so
# both see the same host; the last lines compare their tail sums (median of the runs).
# GRADS="host device" (default "host") runs BINARY once per gradient source
# ([run] grads: "device" hands the gradients in where they are on the GPU, as a trainer
# whose backward runs there, instead of writing them on the host each step); BASELINE
# runs with the configs as they are (host), or as BASE_GRADS (default "host") says.
# REPS (default 3) runs of each; BENCH=0 leaves the bench-optimizer run out.
# Everything goes to OUTDIR/log.txt as well.
set -u
BIN=${1:-target/release/overlap}
OUT=${2:-${TMPDIR:-/tmp}/overlap-tail-host}
BASE=${3:-}
mkdir -p "$OUT"
rm -f "$OUT/tails.txt"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OVERLAP_FLUSH_CLOCK=1
{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "== host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ($(nproc) cores)"
  for rep in $(seq 1 "${REPS:-3}"); do
    for opt in muon adamw; do
      for who in ${BASE:+base} $(for g in ${GRADS:-host}; do [ "$g" = host ] && echo new || echo "new-$g"; done); do
        bin=$BIN
        [ "$who" = base ] && bin=$BASE
        cfg=examples/gpu/gpt2_small_1x1_$opt.toml
        grads=${who#new-}
        [ "$who" = base ] && grads=${BASE_GRADS:-host}
        if [ "$grads" != "$who" ] && [ "$grads" != host ]; then
          sed "s/^\[run\]/[run]\ngrads = \"$grads\"/" "$cfg" >"$OUT/$opt-$who.toml"
          cfg=$OUT/$opt-$who.toml
        fi
        o=$OUT/run-$opt-$who-$rep
        echo "== run $rep ($who): $bin run --config $cfg --timing-every 1000"
        timeout 300 "$bin" run --config "$cfg" --timing-every 1000 >"$o.out" 2>"$o.err"
        echo "exit $?"
        grep -E "^step (1|2|3|20)/" "$o.out"
        sed -n '/^host issue time by node kind/,$p' "$o.out"
        grep -E "held \(|^flush graph captured" "$o.err"
        echo "$opt $who $(awk '$1 == "tail" { print $3 }' "$o.out")" >>"$OUT/tails.txt"
      done
    done
  done
  echo "== tail host us/step, median of the runs (optimizer, binary: runs)"
  for opt in muon adamw; do
    for who in ${BASE:+base} $(for g in ${GRADS:-host}; do [ "$g" = host ] && echo new || echo "new-$g"; done); do
      awk -v o="$opt" -v w="$who" '$1 == o && $2 == w { print $3 }' "$OUT/tails.txt" | sort -n |
        awk -v o="$opt" -v w="$who" '{ v[NR] = $1 } END { printf "%-6s %-10s median %s (runs:", o, w, v[int((NR + 1) / 2)]; for (i = 1; i <= NR; i++) printf " %s", v[i]; print ")" }'
    done
  done
  [ "${BENCH:-1}" = 0 ] && exit 0
  echo "== $BIN bench-optimizer --shapes gpt2-small --muon --clip"
  timeout 300 "$BIN" bench-optimizer --shapes gpt2-small --muon --clip >"$OUT/bench.out" 2>"$OUT/bench.err"
  echo "exit $?"
  cat "$OUT/bench.out"
  grep -E "held \(" "$OUT/bench.err"
} 2>&1 | tee "$OUT/log.txt"
