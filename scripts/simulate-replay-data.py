#!/usr/bin/env python3
"""Extracts `overlap bench --json` lines from logs under docs/perf/ into the rows that
`overlap simulate` is checked against (cli/tests/data/measured.json) or calibrated on.

usage: python3 scripts/simulate-replay-data.py LOG[:nccl][@RUN,...]... > cli/tests/data/measured.json

(`LOG:nccl` takes only the log's NCCL runs: a log whose copy-transport runs ran an earlier
binary than the profile describes; `LOG@RUN,...` only the runs named, e.g. the
`stage1_window` runs of a log whose other runs calibrated the profile.)

cli/tests/data/measured.json is

    python3 scripts/simulate-replay-data.py docs/perf/2026-12-01-bench-defaults.log \
      docs/perf/2026-12-01-bench-tuned.log docs/perf/2026-12-01-levers-buckets-per-layer.log \
      docs/perf/2026-12-01-levers-combine-lag.log docs/perf/2026-12-01-levers-combine-cache.log \
      docs/perf/2026-12-01-levers-gather-lane-ring-depth.log:nccl \
      docs/perf/2026-11-30-bench-nccl-no-alias.log@bench_rs_w2,bench_rs_w16

Each row: the log, the run's name in it (`== NAME:`), the workload (rs, ar, rs-1, or the
mesh and GEMMs), the `overlap simulate` flags that reproduce its `overlap bench` flags
(only those that differ from the defaults), the setting (`default`: the transport's
defaults; `tuned`: docs/performance.md's tuned settings, two buckets per layer,
`copy_ring_depth = 4` and `combine_lag = 0` for rs, `combine_lag = 0` for ar; `lever`:
any other variant) with the bound `cli/tests/simulate.rs` holds it to (10 % for default
and tuned, 15 % for levers), and the measured figures. Runs whose flags a
simulation does not model (`--combine-ctas`, `--nccl-max-ctas`, `--combine-cache normal`,
`--uniform-priority`, `--no-alias`) are left out.
"""
import json
import re
import sys

DEFAULTS = {
    "mesh": "2x1", "layers": 16, "grad_mib": 64, "gemms": 3, "d": 4096,
    "transport": "nccl", "combine_lag": 1, "combine_stream": "reduce",
    "exchange_stream": "copy", "pack_stream": "reduce", "copy_slot_mib": 32,
    "buckets_per_layer": 1, "copy_ring_depth": 2, "no_in_place": False,
    "no_early_tail_gathers": False, "combine_after_exchanges": False, "window": 8,
}
UNMODELLED = {"combine_ctas": None, "nccl_max_ctas": None, "combine_cache": "streaming",
              "uniform_priority": False, "no_alias": False}
FIGURES = ["compute_only_ms", "comm_only_ms", "serial_ms", "overlap_ms", "ideal_ms", "eta"]


def rows(arg):
    arg, _, runs = arg.partition("@")
    runs = set(runs.split(",")) if runs else None
    path, _, only = arg.partition(":")
    name = None
    for line in open(path):
        if line.startswith("== "):
            name = line[3:].split(":")[0].strip()
        m = re.match(r"(\[rank 0\] )?(\{.*\})\s*$", line)
        if not m:
            continue
        try:
            d = json.loads(m.group(2))
        except json.JSONDecodeError:
            continue
        if "overlap_ms" not in d or d.get("backend") != "cuda":
            continue
        if any(d.get(k, v) != v for k, v in UNMODELLED.items()):
            continue
        if only and d.get("transport", "nccl") != only:
            continue
        if runs is not None and name not in runs:
            continue
        flags = []
        for k, v in DEFAULTS.items():
            got = d.get(k, v)
            if got == v:
                continue
            flag = "--" + k.replace("_", "-")
            flags += [flag] if got is True else [flag, str(got)]
        workload = {("2x1", 3): "rs", ("1x2", 3): "ar", ("2x1", 1): "rs-1"}.get(
            (d["mesh"], d["gemms"]), f'{d["mesh"]} {d["gemms"]} GEMMs')
        rest = [a for a in flags if a not in ("--mesh", "1x2", "--gemms", "1", "--transport", "copy")]
        tuned = {"rs": ["--combine-lag", "0", "--buckets-per-layer", "2", "--copy-ring-depth", "4"],
                 "ar": ["--combine-lag", "0"]}
        if not rest:
            setting = "default"
        elif d.get("transport") == "copy" and sorted(rest) == sorted(tuned.get(workload, ["-"])):
            setting = "tuned"
        else:
            setting = "lever"
        row = {"log": path, "run": name, "workload": workload,
               "transport": d.get("transport", "nccl"), "setting": setting,
               "bound": 0.15 if setting == "lever" else 0.10, "args": flags}
        row.update({k: d[k] for k in FIGURES})
        yield row


out = [r for p in sys.argv[1:] for r in rows(p)]
print(json.dumps({
    "hardware": "hardware/h200-nvlink.toml",
    "note": "overlap bench --json figures (rank 0, mean of the timed steps) of the logs named; "
            "written by scripts/simulate-replay-data.py; replayed by cli/tests/simulate.rs",
    "rows": out,
}, indent=1))
