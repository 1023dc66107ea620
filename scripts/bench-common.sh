# Shared by scripts/bench-gpu.sh and scripts/bench-levers.sh (sourced, not run): the
# GPU machine's environment, and `step NAME TIMEOUT COMMAND...`, which logs the command
# and its exit status to $OUT/log.txt, appends its stdout there (stderr to
# $OUT/stderr.txt, but for `bench rank N:` lines, which go to the log too; its last
# line to the terminal) and skips it once $SECONDS passes ${BUDGET_S:-520}.
OUT=${OUT:-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
BIN=./target/release/overlap
ITERS=${ITERS:-20}
W="--layers 16 --grad-mib 64 --d 4096 --iters $ITERS --warmup 3 --json"
step() {
  local name=$1 t=$2; shift 2
  if [ "$SECONDS" -gt "${BUDGET_S:-520}" ]; then echo "== $name: skipped (budget)" | tee -a "$OUT/log.txt"; return; fi
  echo "== $name: $*" | tee -a "$OUT/log.txt"
  local s=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  echo "   exit $rc ($((SECONDS - s)) s)" | tee -a "$OUT/log.txt"
  cat "$OUT/$name.out" >> "$OUT/log.txt"; tail -n 1 "$OUT/$name.out"
  # The other ranks' spans (`overlap bench` prints them on stderr) belong with the run.
  grep -h "bench rank" "$OUT/$name.err" >> "$OUT/log.txt"
  cat "$OUT/$name.err" >> "$OUT/stderr.txt"; rm -f "$OUT/$name.out" "$OUT/$name.err"
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$OUT/log.txt" 2>&1
