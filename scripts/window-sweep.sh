#!/usr/bin/env bash
# The backpressure sweep behind the default `[overlap] stage1_window = 8` (docs/observe.md,
# "Pictures and timelines"): runs examples/hsdp_2x2.toml with each window on the CPU
# backend and prints the overlap efficiency of the last four steps.
#
#   cargo build --release && scripts/window-sweep.sh [BINARY]
set -eu
BIN=${1:-target/release/overlap}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for w in 1 2 4 8 16 64; do
  sed "s/^stage1_window = .*/stage1_window = $w/" examples/hsdp_2x2.toml > "$dir/w$w.toml"
  eta=$("$BIN" run --config "$dir/w$w.toml" --steps 6 | tail -4 | grep -o 'overlap -\?[0-9.]*' | cut -d' ' -f2 | tr '\n' ' ')
  echo "stage1_window $w: eta $eta"
done
