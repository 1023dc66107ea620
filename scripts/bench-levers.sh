#!/usr/bin/env bash
# A sweep of `overlap bench` variants on the three workloads of docs/performance.md, in
# one run on 2 GPUs. Each variant is one line of VARIANTS: a name, then the bench flags
# that make it (on top of the workload's). Results go to ${OUT:-out}/log.txt, one JSON
# line per run; `python3 scripts/bench-summary.py $OUT/log.txt` tabulates them.
#
#   VARIANTS=$'nccl|\ncopy|--transport copy\nctas16|--transport copy --combine-ctas 16' \
#     OUT=$OUT/levers BUDGET_S=400 bash scripts/bench-levers.sh
#
# WORKLOADS picks among rs (2x1, 3 GEMMs), ar (1x2, 3 GEMMs), rs_mm1 (2x1, 1 GEMM),
# ar_mm1 (1x2, 1 GEMM: an all-reduce with less compute than communication per layer);
# ROUNDS repeats the whole sweep. The workload's size (--layers 16 --grad-mib 64 --d 4096,
# bench-common.sh's W) comes after the variant's flags and clap refuses a flag given
# twice, so a variant cannot change it. Needs target/release/overlap (--features cuda).
set -u
source "$(dirname "$0")/bench-common.sh"
VARIANTS=${VARIANTS:-$'nccl|\ncopy|--transport copy'}
WORKLOADS=${WORKLOADS:-"rs ar rs_mm1"}
port=29700
total=$(( $(printf '%s\n' "$VARIANTS" | grep -c .) * $(echo $WORKLOADS | wc -w) * ${ROUNDS:-1} ))
n=0
for round in $(seq 1 "${ROUNDS:-1}"); do
  for wl in $WORKLOADS; do
    case $wl in
      rs) mesh=2x1 mm=3 ;;
      ar) mesh=1x2 mm=3 ;;
      rs_mm1) mesh=2x1 mm=1 ;;
      ar_mm1) mesh=1x2 mm=1 ;;
      *) echo "unknown workload $wl" >&2; exit 2 ;;
    esac
    while IFS='|' read -r vname flags; do
      [ -n "$vname" ] || continue
      n=$((n + 1))
      echo "[$n/$total] ${vname}_${wl}_r$round" >&2
      port=$((port + 1))
      # shellcheck disable=SC2086
      step "${vname}_${wl}_r$round" 90 "$BIN" launch --nproc-per-node 2 --master-port "$port" -- \
        bench --mesh "$mesh" --gemms "$mm" $flags $W
    done <<< "$VARIANTS"
  done
done
