#!/usr/bin/env bash
# One GPU: a checkpoint saved in the background by `overlap run --backend cuda` resumes
# bit-exactly: 6 steps straight against 4 steps and 2 more resumed from the step-4
# checkpoint; the step-6 files must be the same bytes (docs/checkpoints.md).
# Usage, on the GPU machine from the repository root: scripts/gpu-checkpoint-resume.sh BIN OUT
# (BIN: a `--features cuda` release build of `overlap`; OUT: a scratch folder.)
set -u
B=$1 OUT=$2 C=examples/gpu/gpu_1x1_clip.toml
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
rm -rf "$OUT/full" "$OUT/part"
echo "== 6 steps, saving every 2"
timeout 120 $B run --config $C --backend cuda --steps 6 --seed 3 --checkpoint $OUT/full --save-every 2 2>&1 | grep -E "checkpoint|save stall|error" | head -8
echo "== 4 steps, saving every 2"
timeout 120 $B run --config $C --backend cuda --steps 4 --seed 3 --checkpoint $OUT/part --save-every 2 2>&1 | grep -E "checkpoint|error" | head -4
echo "== 2 more, resumed"
timeout 120 $B run --config $C --backend cuda --steps 2 --seed 3 --resume $OUT/part --checkpoint $OUT/part --save-every 2 2>&1 | grep -E "resumed|checkpoint|error" | head -4
echo "== step 6 files"
(cd $OUT/full/step-000006 && sha256sum * ) > $OUT/full.sha
(cd $OUT/part/step-000006 && sha256sum * ) > $OUT/part.sha
cat $OUT/full.sha
if cmp -s $OUT/full.sha $OUT/part.sha; then echo "PASS resume: step 6 identical byte for byte"; else echo "FAIL resume: step 6 differs"; diff $OUT/full.sha $OUT/part.sha; fi
