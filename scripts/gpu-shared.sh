#!/usr/bin/env bash
# The multi-process GPU path with two ranks on ONE GPU (OVERLAP_SHARE_GPU=1, a test mode:
# every collective over the copy transport, docs/gpus.md "Several ranks on one GPU"),
# each command under a timeout with its own log:
#
#   cargo build --release --features cuda --bin overlap --example train
#   mkdir -p bin && cp target/release/overlap target/release/examples/train bin/
#   [PARTS="refuse verify train ckpt faults"] bash scripts/gpu-shared.sh bin OUT
#
# PARTS (default: all; verify's first two runs come first, the rest of its matrix last):
#   refuse  `verify --transport nccl` is refused naming NCCL (exit 2, before any GPU work);
#   verify  `verify --backend cuda --transport copy` of gpu_2x1.toml and gpu_1x2.toml with
#           every gate pattern (on; off,on; off,off,on; on,on; no_sync,on; no_sync,off,on),
#           bf16 on the wire, the in-place configs, and [forward] (the unshards'
#           all-gathers and broadcasts as copy-engine relays);
#   train   examples/train.rs --backend cuda on 2x1 and 1x2 against the CPU backend;
#   ckpt    a two-rank save and resume: 8 steps straight against 4 + 4 resumed, and a
#           job whose rank 1 fails in step 6 restarted by `--max-restarts 1`; the
#           step-8 files must be the same bytes;
#   four    four ranks on the GPU: `verify` of gpu_2x1.toml rewritten to 2x2 (HSDP's two
#           stages, both over the copy transport) and 4x1, gates off,on and no_sync,off,on;
#   faults  an injected failure and hang on rank 1 under `overlap launch`; then ranks
#           started by hand (no launcher to kill them): rank 1 hangs in step 2, rank 0
#           waits for it on a copy-transport flag, rank 1 is killed with SIGKILL, and rank
#           0 must exit non-zero on its own within the 30 s bound.
#
# OUT/log.txt lists every command with its exit status and wall time; the script ends
# with `failures: N`. Timings from this mode say nothing about two GPUs.
set -u
BIN=${1:?BIN_DIR holding overlap and train}
OUT=${2:?OUT_DIR}
PARTS=${PARTS:-refuse verify train ckpt faults four}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OVERLAP_SHARE_GPU=1
B=$BIN/overlap
LOG=$OUT/log.txt
PORT=29710
FAILURES=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"

# step NAME LIMIT_S WANT COMMAND...: runs the command, its output to OUT/NAME.log; WANT is
# `ok` (exit 0) or `fail` (non-zero, not a timeout).
step() {
  local name=$1 limit=$2 want=$3; shift 3
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local verdict=PASS
  if [ "$want" = ok ] && [ $rc -ne 0 ]; then verdict=FAIL; fi
  if [ "$want" = fail ] && { [ $rc -eq 0 ] || [ $rc -eq 124 ]; }; then verdict=FAIL; fi
  [ $verdict = FAIL ] && FAILURES=$((FAILURES + 1))
  echo "$verdict $name: exit $rc in $((SECONDS - t0)) s: $*" | tee -a "$LOG"
  tail -n 3 "$OUT/$name.log" | cut -c1-400 | sed 's/^/  | /'
  return $rc
}
# next [FLAGS...]: L becomes `overlap launch` of NPROC ranks (2 unless set) on a fresh
# port, with FLAGS.
next() { PORT=$((PORT + 1)); L=("$B" launch --nproc-per-node "${NPROC:-2}" --master-port "$PORT" "$@"); }
want() { [[ " $PARTS " == *" $1 "* ]]; }
sums() { (cd "$1" && sha256sum -- * | sort -k2); }

if want refuse; then
  next
  step refuse-nccl 60 fail "${L[@]}" -- verify --config examples/gpu/gpu_2x1.toml --backend cuda --transport nccl --steps 1
  grep -q "NCCL refuses two ranks on one device" "$OUT/refuse-nccl.log" || { echo "FAIL refuse-nccl: no message naming NCCL" | tee -a "$LOG"; FAILURES=$((FAILURES + 1)); }
fi

if want verify; then
  V="verify --backend cuda --transport copy --steps 3 --json"
  next
  step verify-2x1-off,on 90 ok "${L[@]}" -- $V --config examples/gpu/gpu_2x1.toml --gates off,on
  if [ $? -eq 124 ]; then echo "the first verify hung: stopping" | tee -a "$LOG"; echo "failures: $((FAILURES + 1))"; exit 1; fi
  next
  step verify-1x2-off,on 90 ok "${L[@]}" -- $V --config examples/gpu/gpu_1x2.toml --gates off,on
fi

if want train; then
  for mesh in 2x1 1x2; do
    next
    step "train-$mesh" 180 ok "${L[@]}" -- "$BIN/train" --backend cuda --mesh "$mesh" --steps 30 --json
  done
fi

if want ckpt; then
  C=examples/gpu/gpu_2x1.toml
  R="run --config $C --backend cuda --seed 3 --save-every 2"
  rm -rf "$OUT/ck-full" "$OUT/ck-part" "$OUT/ck-restart"
  next
  step ckpt-straight 120 ok "${L[@]}" -- $R --steps 8 --checkpoint "$OUT/ck-full"
  next
  step ckpt-first-4 120 ok "${L[@]}" -- $R --steps 4 --checkpoint "$OUT/ck-part"
  next
  step ckpt-resumed-4 120 ok "${L[@]}" -- $R --steps 4 --resume "$OUT/ck-part" --checkpoint "$OUT/ck-part"
  next --max-restarts 1
  OVERLAP_FAULT=rank=1,kind=pack,step=6,mode=fail,attempt=0 \
    step ckpt-restarted 180 ok "${L[@]}" -- $R --steps 8 --checkpoint "$OUT/ck-restart" --resume-latest
  for d in ck-full ck-part ck-restart; do
    sums "$OUT/$d/step-000008" >"$OUT/$d.sha" 2>&1
  done
  cat "$OUT/ck-full.sha"
  for d in ck-part ck-restart; do
    if [ -s "$OUT/ck-full.sha" ] && cmp -s "$OUT/ck-full.sha" "$OUT/$d.sha"; then
      echo "PASS $d: step 8 identical byte for byte to the straight run" | tee -a "$LOG"
    else
      echo "FAIL $d: step 8 differs from the straight run" | tee -a "$LOG"; FAILURES=$((FAILURES + 1))
      diff "$OUT/ck-full.sha" "$OUT/$d.sha" | head -8
    fi
  done
fi

if want faults; then
  cfg="$OUT/faults.toml"
  sed 's/^steps = 3$/steps = 6\nstep_timeout = 5/' examples/gpu/gpu_2x1.toml >"$cfg"
  F="run --config $cfg --backend cuda"
  next
  OVERLAP_FAULT=rank=1,kind=pack,step=2,mode=fail step faults-fail 90 fail "${L[@]}" -- $F
  next
  OVERLAP_FAULT=rank=1,kind=pack,step=2,mode=hang step faults-hang 90 fail "${L[@]}" -- $F
  # By hand: no launcher kills rank 0. Rank 1 hangs in its first pack of step 2 (a spin
  # kernel); rank 0 goes on to the exchange and waits on rank 1's ready flag.
  long="$OUT/faults-long.toml"
  sed 's/^steps = 3$/steps = 6\nstep_timeout = 300/' examples/gpu/gpu_2x1.toml >"$long"
  PORT=$((PORT + 1))
  export OVERLAP_JOB_SECRET=shared-gpu-kill-test-$RANDOM$RANDOM$RANDOM
  pids=()
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
      OVERLAP_FAULT=rank=1,kind=pack,step=2,mode=hang \
      "$B" run --config "$long" --backend cuda >"$OUT/kill-rank$r.log" 2>&1 &
    pids+=($!)
  done
  for _ in $(seq 1 60); do grep -q "step 1" "$OUT/kill-rank0.log" && break; sleep 1; done
  sleep 3
  if ! kill -0 "${pids[0]}" 2>/dev/null; then
    echo "FAIL kill: rank 0 ended before rank 1 was killed" | tee -a "$LOG"; FAILURES=$((FAILURES + 1))
  fi
  t0=$(date +%s%N)
  kill -9 "${pids[1]}"
  rc0=124
  for _ in $(seq 1 90); do
    if ! kill -0 "${pids[0]}" 2>/dev/null; then wait "${pids[0]}"; rc0=$?; break; fi
    sleep 0.5
  done
  ms=$((($(date +%s%N) - t0) / 1000000))
  tail -n 3 "$OUT/kill-rank0.log" | cut -c1-400 | sed 's/^/  | /'
  if [ "$rc0" -ne 0 ] && [ "$rc0" -ne 124 ] && [ "$ms" -lt 35000 ]; then
    echo "PASS kill: rank 0 (waiting on a copy flag) exited $rc0 $ms ms after rank 1's SIGKILL" | tee -a "$LOG"
  else
    echo "FAIL kill: rank 0 exit $rc0 after $ms ms" | tee -a "$LOG"; FAILURES=$((FAILURES + 1))
    kill -9 "${pids[0]}" 2>/dev/null
  fi
  nvidia-smi --query-compute-apps=pid,name --format=csv,noheader | sed 's/^/  left running: /' | tee -a "$LOG"
fi
if want verify; then
  # The rest of the matrix (off,on of both meshes ran first).
  for mesh in 2x1 1x2; do
    for gates in on off,on off,off,on on,on no_sync,on no_sync,off,on; do
      [ "$gates" = off,on ] && continue
      next
      step "verify-$mesh-$gates" 90 ok "${L[@]}" -- $V --config "examples/gpu/gpu_$mesh.toml" --gates "$gates"
    done
    next
    step "verify-$mesh-bf16" 90 ok "${L[@]}" -- $V --config "examples/gpu/gpu_$mesh.toml" --gates no_sync,off,on --dtype bf16
    next
    step "verify-$mesh-in-place" 90 ok "${L[@]}" -- $V --config "examples/gpu/gpu_${mesh}_in_place.toml" --gates off,on
    cfg="$OUT/fwd-$mesh.toml"
    { cat "examples/gpu/gpu_$mesh.toml"; printf '\n[forward]\nprefetch = 1\n'; } >"$cfg"
    next
    step "verify-$mesh-forward" 90 ok "${L[@]}" -- $V --config "$cfg" --gates off,on
  done
fi

if want four; then
  for mesh in 2x2 4x1; do
    cfg="$OUT/four-$mesh.toml"
    sed "s/^shard = 2$/shard = ${mesh%x*}/; s/^replicate = 1$/replicate = ${mesh#*x}/" examples/gpu/gpu_2x1.toml >"$cfg"
    for gates in off,on no_sync,off,on; do
      NPROC=4 next
      step "four-$mesh-$gates" 120 ok "${L[@]}" -- verify --backend cuda --transport copy --steps 3 --json --config "$cfg" --gates "$gates"
    done
  done
fi

echo "failures: $FAILURES" | tee -a "$LOG"
