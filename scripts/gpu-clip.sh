#!/usr/bin/env bash
# GPU validation of global-norm clipping ([clip]) on the CUDA backend: one H200, mesh 1x1
# (and, when the machine has two or more GPUs, meshes 2x1 and 1x2 as well).
#
# Build (anywhere, no CUDA needed):
#   cargo build --release --features cuda --bin overlap
#   # optional, the kernel-level test (SumSquares/Clip/IfFinite against ops::math):
#   cargo test --release -p overlap-ops --features cuda --test cuda_norm --no-run
# Run on the GPU machine, from the repository root:
#   bash scripts/gpu-clip.sh [BINARY (target/release/overlap)] [OUTDIR (/tmp/overlap-gpu-clip)]
#
# Every check prints PASS or FAIL with its figures; the last line is `failures: N`
# (0 when everything is correct). Everything also goes to OUTDIR/log.txt, each run's
# stdout and stderr to OUTDIR/<name>.out / .err.
set -u
BIN=${1:-target/release/overlap}
OUT=${2:-${TMPDIR:-/tmp}/overlap-gpu-clip}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
unset OVERLAP_FAULT
CLIP=examples/gpu/gpu_1x1_clip.toml
NONFINITE=examples/gpu/gpu_1x1_nonfinite.toml
NAN2=rank=0,kind=grad_norm,step=2,mode=nan
failures=0
port=29700

# run NAME [ENV=VALUE ...] -- ARGS...: runs the binary (one process: mesh 1x1 needs no
# launcher) under a timeout; stdout/stderr to OUTDIR/NAME.out/.err; echoes the exit code.
run() {
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "\$ ${envs[*]} $BIN $*" >&2
  local t0=$SECONDS
  env ${envs[@]+"${envs[@]}"} timeout 600 "$BIN" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  echo "  exit $rc ($((SECONDS - t0)) s)" >&2
  echo "$rc"
}

# launched NAME NPROC [ENV=VALUE ...] -- ARGS...: the same under `overlap launch`.
launched() {
  local name=$1 n=$2; shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  port=$((port + 1))
  run "$name" ${envs[@]+"${envs[@]}"} -- launch --nproc-per-node "$n" --master-port "$port" -- "$@"
}

verdict() { # verdict NAME OK(0|1) DETAIL
  if [ "$2" = 0 ]; then echo "PASS $1: $3"; else echo "FAIL $1: $3"; failures=$((failures + 1)); fi
}

# judge NAME RC PYTHON-CONDITION: the last JSON line of OUTDIR/NAME.out is `v`; passes
# when the run exited 0 and the condition holds. Prints the norm figures.
judge() {
  local name=$1 rc=$2 cond=$3
  local detail
  detail=$(python3 - "$OUT/$name.out" "$cond" <<'EOF'
import json, sys
lines = [l.split('] ', 1)[-1] if l.startswith('[rank') else l
         for l in open(sys.argv[1]).read().splitlines()]
js = [l for l in lines if l.startswith('{')]
if not js:
    print('no JSON report'); sys.exit(1)
v = json.loads(js[-1])
keys = ['ok', 'worst_rel_err', 'param_rel_err', 'update_rel_err', 'grad_norms',
        'grad_norm_rel_err', 'grad_norm_cpu_rel_err', 'skipped_steps', 'expected_skips']
print(' '.join(f'{k}={v.get(k)}' for k in keys))
sys.exit(0 if eval(sys.argv[2], {'v': v}) else 1)
EOF
)
  local ok=$?
  [ "$rc" = 0 ] || ok=1
  verdict "$name" "$ok" "exit $rc; $detail"
}

{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  "$BIN" --version 2>/dev/null

  # 1. The kernels alone (if the test binary was built): sum of squares within one f32
  #    rounding of ops::math and bit-reproducible, clip bit-exact, guarded AdamW/Muon
  #    bit-identical on a finite norm and untouched on NaN/Inf.
  tb=$(ls -t target/release/deps/cuda_norm-* 2>/dev/null | grep -v '\.d$' | head -1)
  if [ -n "$tb" ]; then
    echo "\$ OVERLAP_GPU_TESTS=1 $tb --test-threads 1"
    OVERLAP_GPU_TESTS=1 timeout 600 "$tb" --test-threads 1 >"$OUT/kernels.out" 2>&1
    rc=$?
    tail -3 "$OUT/kernels.out"
    verdict kernels "$rc" "$(grep -E '^test result' "$OUT/kernels.out")"
  else
    echo "SKIP kernels: no target/release/deps/cuda_norm-* (build it with the command at the top)"
  fi

  # 2. The unguarded optimizers still match the reference (their kernels gained a guard
  #    argument): cuda-smoke's AdamW and Muon checks, among the rest.
  rc=$(launched smoke 1 -- cuda-smoke --mib 1,16 --iters 5)
  grep -iE 'adamw|muon|fail' "$OUT/smoke.out" | head -8
  verdict smoke "$rc" "$(tail -1 "$OUT/smoke.out")"

  # 3. Clipping that engages (max_norm 0.5 against a norm near 590), f32: the GPU's norm
  #    against the f64 reference and the CPU backend's, gradients against the clipped
  #    reference, parameters and updates against the CPU backend.
  F32='v["ok"] and v["skipped_steps"] == 0 and v["grad_norm_rel_err"] <= 1e-6 and v["grad_norm_cpu_rel_err"] <= 1e-6 and all(n > 1.0 for n in v["grad_norms"])'
  rc=$(run clip_f32 -- verify --config $CLIP --backend cuda --json); judge clip_f32 "$rc" "$F32"
  rc=$(run clip_f32_gates -- verify --config $CLIP --backend cuda --json --gates no_sync,off,on); judge clip_f32_gates "$rc" "$F32"
  rc=$(run clip_f32_copy -- verify --config $CLIP --backend cuda --json --transport copy); judge clip_f32_copy "$rc" "$F32"
  rc=$(run clip_bf16 -- verify --config $CLIP --backend cuda --json --dtype bf16)
  judge clip_bf16 "$rc" 'v["ok"] and v["skipped_steps"] == 0 and v["grad_norm_cpu_rel_err"] <= 1e-2'
  # Through the launcher too (torchrun's variables, rank 0's report).
  rc=$(launched clip_launch 1 -- verify --config $CLIP --backend cuda --json); judge clip_launch "$rc" "$F32"

  # 4. Reproducible: the same run again gives the same norms, bit for bit (printed with
  #    full precision in the JSON).
  rc=$(run clip_again -- verify --config $CLIP --backend cuda --json)
  a=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["grad_norms"])' "$OUT/clip_f32.out" 2>&1)
  b=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["grad_norms"])' "$OUT/clip_again.out" 2>&1)
  [ "$rc" = 0 ] && [ "$a" = "$b" ]; verdict reproducible $? "$a vs $b"

  # 5. Against a separate CPU-backend process: its verify's norms, and `overlap run`'s
  #    step lines (grad_norm to 5 digits) on both backends.
  rc=$(run cpu_verify -- verify --config $CLIP --backend cpu --json)
  d=$(python3 - "$OUT/clip_f32.out" "$OUT/cpu_verify.out" <<'EOF'
import json, sys
g, c = (json.loads(open(p).read().splitlines()[-1])['grad_norms'] for p in sys.argv[1:])
d = max(abs(a - b) / b for a, b in zip(g, c))
print(f'gpu {g} cpu {c} max rel diff {d:.3e}'); sys.exit(0 if d <= 1e-6 and len(g) == len(c) == 3 else 1)
EOF
)
  ok=$?; [ "$rc" = 0 ] || ok=1; verdict norms_vs_cpu_process "$ok" "$d"
  rc1=$(run run_gpu -- run --config $CLIP --backend cuda --steps 3)
  rc2=$(run run_cpu -- run --config $CLIP --backend cpu --steps 3)
  g=$(grep -o 'grad_norm [^ ]*' "$OUT/run_gpu.out" | tr '\n' ' ')
  c=$(grep -o 'grad_norm [^ ]*' "$OUT/run_cpu.out" | tr '\n' ' ')
  [ "$rc1" = 0 ] && [ "$rc2" = 0 ] && [ -n "$g" ] && [ "$g" = "$c" ]; verdict run_lines $? "cuda: $g| cpu: $c"

  # 6. The norm without clipping (no max_norm; on_nonfinite = "error").
  rc=$(run norm_only -- verify --config $NONFINITE --backend cuda --json)
  judge norm_only "$rc" 'v["ok"] and v["skipped_steps"] == 0 and v["grad_norm_cpu_rel_err"] <= 1e-6'

  # 7. An injected NaN (OVERLAP_FAULT mode=nan: element 0 of a reduced gradient before
  #    the norm) in step 2, then in step 1: skipped on the GPU and in the CPU session,
  #    the norm null that step, parameters after step 3 still equal to the CPU backend's
  #    (a guard that let an optimizer write would show there), the other steps checked.
  NAN='v["ok"] and v["skipped_steps"] == 1 and v["expected_skips"] == 1 and v["grad_norms"][STEP] is None and v["grad_norm_cpu_rel_err"] <= 1e-6'
  rc=$(run nan_step2 OVERLAP_FAULT=$NAN2 -- verify --config $CLIP --backend cuda --json)
  judge nan_step2 "$rc" "${NAN//STEP/1}"
  rc=$(run nan_step1 OVERLAP_FAULT=rank=0,kind=grad_norm,step=1,mode=nan -- verify --config $CLIP --backend cuda --json --steps 3)
  judge nan_step1 "$rc" "${NAN//STEP/0}"
  rc=$(run nan_norm_only OVERLAP_FAULT=$NAN2 -- verify --config $NONFINITE --backend cuda --json)
  # on_nonfinite = "error": verify stops at the NaN step with the error.
  grep -q on_nonfinite "$OUT/nan_norm_only.err" && [ "$rc" != 0 ]
  verdict nan_refused_in_verify $? "exit $rc; $(grep -m1 error "$OUT/nan_norm_only.err")"
  rc=$(run nan_run_skip OVERLAP_FAULT=$NAN2 -- run --config $CLIP --backend cuda --steps 3)
  grep -q 'skipped (nonfinite)' "$OUT/nan_run_skip.out" && [ "$rc" = 0 ]
  verdict nan_run_skip $? "exit $rc; $(grep -m1 -o 'grad_norm NaN.*' "$OUT/nan_run_skip.out")"
  rc=$(run nan_run_error OVERLAP_FAULT=$NAN2 -- run --config $NONFINITE --backend cuda --steps 3)
  grep -q 'step 1/3' "$OUT/nan_run_error.out" && grep -q 'on_nonfinite' "$OUT/nan_run_error.err" && [ "$rc" != 0 ]
  verdict nan_run_error $? "exit $rc; $(grep -m1 error "$OUT/nan_run_error.err")"

  # 8. With two or more GPUs: the norm all-reduces through NCCL (meshes 2x1 and 1x2),
  #    the NaN on rank 1.
  if [ "$gpus" -ge 2 ]; then
    for mesh in 2x1 1x2; do
      s=${mesh%x*}; r=${mesh#*x}
      sed -e "s/^shard = 1$/shard = $s/" -e "s/^replicate = 1$/replicate = $r/" $CLIP >"$OUT/clip_$mesh.toml"
      rc=$(launched "clip_$mesh" 2 -- verify --config "$OUT/clip_$mesh.toml" --backend cuda --json)
      judge "clip_$mesh" "$rc" "$F32"
      rc=$(launched "nan_$mesh" 2 OVERLAP_FAULT=rank=1,kind=grad_norm,step=2,mode=nan -- verify --config "$OUT/clip_$mesh.toml" --backend cuda --json)
      judge "nan_$mesh" "$rc" "${NAN//STEP/1}"
    done
  else
    echo "SKIP meshes 2x1 and 1x2: $gpus GPU(s)"
  fi
  echo "failures: $failures"
} 2>&1 | tee "$OUT/log.txt"
