#!/usr/bin/env bash
# The optimizer tail of overlap and of PyTorch on one GPU, on the same shapes, in one run:
#   scripts/bench-optimizer.sh [BINARY] [SHAPES] [OUTDIR]
# BINARY: an `overlap` built with --features cuda (default target/release/overlap);
# SHAPES: gpt2-small (default), llama-1b or a shape file (see `overlap bench-optimizer
# --help`); OUTDIR: where the two JSON reports and the log go.
# Prints overlap's report, PyTorch's, and the comparison (ratios, fraction of the
# memory-bandwidth limit). Needs python3 with PyTorch (torch.optim.Muon: 2.9 or later).
set -euo pipefail
BIN=${1:-target/release/overlap}
SHAPES=${2:-gpt2-small}
OUT=${3:-/tmp/overlap-bench-optimizer}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
name=$(basename "$SHAPES")
echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) overlap bench-optimizer --shapes $SHAPES --muon"
timeout 300 "$BIN" bench-optimizer --shapes "$SHAPES" --muon --json > "$OUT/overlap-$name.json"
echo "== python3 scripts/bench_optimizer.py --shapes $SHAPES"
timeout 500 python3 scripts/bench_optimizer.py --shapes "$SHAPES" > "$OUT/torch-$name.json"
echo "== comparison"
python3 scripts/bench_optimizer.py --compare "$OUT/overlap-$name.json" "$OUT/torch-$name.json"
