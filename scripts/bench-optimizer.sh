#!/usr/bin/env bash
# The optimizer tail of overlap and of PyTorch on one GPU, on the same shapes, in one run:
#   scripts/bench-optimizer.sh [BINARY] [SHAPES] [OUTDIR]
# BINARY: an `overlap` built with --features cuda (default target/release/overlap);
# SHAPES: gpt2-small (default), llama-1b or a shape file (see `overlap bench-optimizer
# --help`); OUTDIR: where the two JSON reports and the log go.
# Prints overlap's report, PyTorch's, and the comparison (ratios, fraction of the
# memory-bandwidth limit). Needs python3 with PyTorch (torch.optim.Muon: 2.9 or later).
# ITERS and WARMUP (default 20 and 3) set both sides' timed and untimed steps.
set -euo pipefail
BIN=${1:-target/release/overlap}
SHAPES=${2:-gpt2-small}
OUT=${3:-/tmp/overlap-bench-optimizer}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
name=$(basename "$SHAPES")
echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) overlap bench-optimizer --shapes $SHAPES --muon --clip --json --iters ${ITERS:-20} --warmup ${WARMUP:-3}"
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-3}
timeout 300 "$BIN" bench-optimizer --shapes "$SHAPES" --muon --clip --json --iters "$ITERS" --warmup "$WARMUP" > "$OUT/overlap-$name.json"
echo "== python3 scripts/bench_optimizer.py --shapes $SHAPES --iters $ITERS --warmup $WARMUP"
timeout 500 python3 scripts/bench_optimizer.py --shapes "$SHAPES" --iters "$ITERS" --warmup "$WARMUP" > "$OUT/torch-$name.json"
echo "== comparison"
python3 scripts/bench_optimizer.py --compare "$OUT/overlap-$name.json" "$OUT/torch-$name.json"
