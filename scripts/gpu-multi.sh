#!/usr/bin/env bash
# The four- and eight-GPU validation and measurement of docs/gpu-validation.md ("Not yet
# run: four and eight GPUs"), on one machine with N GPUs (N = 4 or 8).
#
#   cargo build --release --features cuda --bin overlap
#   [ANCHOR=/path/to/torch_reduce_overlap.py] [PARTS="smoke verify bench collectives anchor run"] \
#     [BUDGET_S=540] [ITERS=20] scripts/gpu-multi.sh N [BINARY] [OUTDIR]
#
# Meshes: N=4: 4x1, 2x2, 1x4; N=8: 8x1, 4x2, 2x4. PARTS picks what runs, so the work can
# be split over several shorter runs (each part takes about 1 to 5 minutes):
#   smoke        `overlap cuda-smoke` on N ranks (every collective, the kernels, bandwidth);
#   verify       `overlap verify --backend cuda` on the three meshes, with --transport nccl
#                and --transport copy, f32 and bf16, gates off,on and no_sync,off,on, on
#                examples/gpu/gpu_2x1.toml with its [mesh] rewritten (every route, odd
#                shapes, several buckets per layer); then, copy transport only,
#                examples/gpu/gpu_2x1_in_place.toml rewritten the same way (in-place
#                receives; on 1xR meshes the gather lane);
#   bench        `overlap bench` on the three workloads over N GPUs (rs: Nx1 with 3 GEMMs
#                per layer, ar: 1xN with 3, rs_mm1: Nx1 with 1) and on the mixed mesh
#                (2x2 or 4x2, 3 GEMMs), each with NCCL and with the copy transport;
#   collectives  `overlap bench-collectives` on Nx1 (reduce-scatter) and 1xN (all-reduce);
#   anchor       the PyTorch FSDP2-style anchor on N GPUs (rs, ar, rs with MM=1), if ANCHOR
#                names its script (not in this repository). The anchor starts one process
#                per visible GPU itself (torch.multiprocessing), so it runs under
#                `CUDA_VISIBLE_DEVICES=0,...,N-1 python3`, not torchrun; set ANCHOR_CMD
#                (e.g. "torchrun --nproc-per-node N") for an anchor that expects a launcher;
#   run          `overlap run --backend cuda` on the mixed mesh (transport auto: copy).
#
# Every command runs under `timeout` and writes its own log, named by date and command
# (OUTDIR/DATE-verify-4x1-nccl-f32-off-on.log, ...); OUTDIR/log.txt lists each command
# with its exit status and the log it wrote. OUTDIR defaults to
# out/gpu-multi-DATE-NgpuN. Commands that would start after BUDGET_S seconds are skipped.
set -u
N=${1:?usage: scripts/gpu-multi.sh N [BINARY] [OUTDIR]   (N = 4 or 8)}
BIN=${2:-target/release/overlap}
DATE=$(date +%F)
OUT=${3:-out/gpu-multi-$DATE-${N}gpu}
BUDGET=${BUDGET_S:-540}
ITERS=${ITERS:-20}
PARTS=${PARTS:-smoke verify bench collectives anchor run}
case $N in
  4) MESHES="4x1 2x2 1x4" MIXED=2x2 ;;
  8) MESHES="8x1 4x2 2x4" MIXED=4x2 ;;
  *) echo "N must be 4 or 8, got $N" >&2; exit 2 ;;
esac
[ -x "$BIN" ] || { echo "no binary at $BIN (cargo build --release --features cuda --bin overlap)" >&2; exit 2; }
mkdir -p "$OUT/configs"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
port=29800
failures=0
W="--layers 16 --grad-mib 64 --d 4096 --iters $ITERS --warmup 3 --json"

has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }

# step NAME TIMEOUT COMMAND...: runs COMMAND under `timeout`, its output (stdout and
# stderr) to OUT/DATE-NAME.log, and notes the command and exit status in OUT/log.txt.
step() {
  local name=$1 t=$2; shift 2
  local log="$OUT/$DATE-$name.log"
  # A fresh rendezvous port for each command (`@PORT@` in its arguments).
  port=$((port + 1))
  local args=() a
  for a in "$@"; do args+=("${a//@PORT@/$port}"); done
  set -- "${args[@]}"
  if [ "$SECONDS" -gt "$BUDGET" ]; then
    echo "== $name: skipped (time budget)" | tee -a "$OUT/log.txt"
    return
  fi
  echo "== $name: $*" | tee -a "$OUT/log.txt"
  { echo "\$ $*"; } > "$log"
  local s=$SECONDS
  timeout "$t" "$@" >> "$log" 2>&1
  local rc=$?
  echo "exit $rc ($((SECONDS - s)) s)" >> "$log"
  echo "   exit $rc ($((SECONDS - s)) s) -> $(basename "$log")" | tee -a "$OUT/log.txt"
  [ "$rc" -eq 0 ] || failures=$((failures + 1))
  # The result lines (rank 0's JSON: verify's report, bench's figures; the anchor's JSON)
  # go to the summary too, so that `scripts/bench-summary.py OUT/log.txt` tabulates them.
  grep -h -E '^\[rank 0\] \{|^\{' "$log" >> "$OUT/log.txt"
}

# The launcher's words before the subcommand (the port is filled in by `step`).
L=("$BIN" launch --nproc-per-node "$N" --master-port @PORT@ --)

# A config for mesh SxR from a two-GPU validation config: the same parameters, buckets
# and gates, with [mesh] rewritten.
config() {
  local src=$1 mesh=$2 dst=$3
  local s=${mesh%x*} r=${mesh#*x}
  sed -e "s/^shard = .*/shard = $s/" -e "s/^replicate = .*/replicate = $r/" "$src" > "$dst"
}

{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv
  nvidia-smi topo -m
} > "$OUT/$DATE-nvidia-smi.log" 2>&1
cat "$OUT/$DATE-nvidia-smi.log" >> "$OUT/log.txt"

if has smoke; then
  step "cuda-smoke-${N}gpu" 120 "${L[@]}" cuda-smoke --mib 1,16,64,256 --iters 20
fi

if has verify; then
  for mesh in $MESHES; do
    config examples/gpu/gpu_2x1.toml "$mesh" "$OUT/configs/gpu_$mesh.toml"
    config examples/gpu/gpu_2x1_in_place.toml "$mesh" "$OUT/configs/gpu_${mesh}_in_place.toml"
    for transport in nccl copy; do
      for dtype in f32 bf16; do
        for gates in off,on no_sync,off,on; do
                  step "verify-$mesh-$transport-$dtype-${gates//,/-}" 150 "${L[@]}" verify \
            --config "$OUT/configs/gpu_$mesh.toml" --backend cuda --transport "$transport" \
            --gates "$gates" --dtype "$dtype" --steps 3 --json
        done
      done
    done
    for dtype in f32 bf16; do
          step "verify-${mesh}_in_place-copy-$dtype-off-on" 150 "${L[@]}" verify \
        --config "$OUT/configs/gpu_${mesh}_in_place.toml" --backend cuda --transport copy \
        --gates off,on --dtype "$dtype" --steps 3 --json
    done
  done
fi

if has bench; then
  for wl in "rs ${N}x1 3" "ar 1x$N 3" "rs_mm1 ${N}x1 1" "hsdp $MIXED 3"; do
    set -- $wl
    name=$1 mesh=$2 mm=$3
    for transport in nccl copy; do
      # shellcheck disable=SC2086
      step "bench-$name-$mesh-$transport" 180 "${L[@]}" bench --mesh "$mesh" --gemms "$mm" \
        --transport "$transport" $W
    done
  done
fi

if has collectives; then
  for mesh in "${N}x1" "1x$N"; do
      step "bench-collectives-$mesh" 180 "${L[@]}" bench-collectives --mesh "$mesh" --iters 20 --warmup 3
  done
fi

if has anchor; then
  if [ -f "${ANCHOR:-}" ]; then
    visible=$(seq -s, 0 $((N - 1)))
    for wl in "rs 3" "ar 3" "rs 1"; do
      set -- $wl
      mode=$1 mm=$2
      name=anchor-$mode$([ "$mm" = 1 ] && echo _mm1)-${N}gpu
      # shellcheck disable=SC2086
      step "$name" 180 env CUDA_VISIBLE_DEVICES="$visible" MM="$mm" ITERS="$ITERS" \
        ${ANCHOR_CMD:-python3} "$ANCHOR" "$mode" "$OUT/$DATE-$name.json"
    done
  else
    echo "== anchor: skipped (set ANCHOR to torch_reduce_overlap.py)" | tee -a "$OUT/log.txt"
  fi
fi

if has run; then
  [ -f "$OUT/configs/gpu_$MIXED.toml" ] || config examples/gpu/gpu_2x1.toml "$MIXED" "$OUT/configs/gpu_$MIXED.toml"
  step "run-$MIXED" 150 "${L[@]}" run --config "$OUT/configs/gpu_$MIXED.toml" --backend cuda \
    --steps 4 --trace "$OUT/$DATE-trace-$MIXED.json"
fi

echo "failures: $failures" | tee -a "$OUT/log.txt"
[ "$failures" -eq 0 ]
