#!/usr/bin/env python3
"""Sweeps one key of a hardware profile and prints, per value, how well `overlap simulate`
reproduces a set of measured rows (from scripts/simulate-replay-data.py): the RMS and the
largest relative error of `overlap_ms`, and each workload's prediction. How the calibrated
figures of hardware/h200-nvlink.toml were chosen (docs/simulate.md, "Calibration").

usage: python3 scripts/simulate-calibrate.py PROFILE KEY V1,V2,... ROWS.json [OVERLAP_BINARY]

e.g. python3 scripts/simulate-replay-data.py docs/perf/2026-11-30-bench-in-place.log:nccl > /tmp/rows.json
     python3 scripts/simulate-calibrate.py hardware/h200-nvlink.toml interference.nccl.gemm_cost 0.35,0.42,0.5 /tmp/rows.json
"""
import json
import os
import subprocess
import sys
import tempfile


def set_key(text, path, value):
    table, _, key = path.rpartition(".")
    lines = text.split("\n")
    inside = table == ""
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("["):
            inside = s == f"[{table}]"
            continue
        if inside and s.split("=")[0].strip() == key and "=" in s:
            lines[i] = f"{key} = {value}"
            return "\n".join(lines)
    sys.exit(f"{path} is not in the profile")


def main():
    profile, key, values, rows_file = sys.argv[1:5]
    binary = sys.argv[5] if len(sys.argv) > 5 else "target/release/overlap"
    text = open(profile).read()
    rows = json.load(open(rows_file))["rows"]
    for v in values.split(","):
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(set_key(text, key, v))
        cache = {}
        errs = []
        for r in rows:
            args = tuple(r["args"])
            if args not in cache:
                out = subprocess.run([binary, "simulate", "--hardware", f.name, "--json", *args],
                                     capture_output=True, text=True, check=True).stdout
                cache[args] = json.loads(out)["overlap_ms"]
            errs.append(cache[args] / r["overlap_ms"] - 1)
        os.unlink(f.name)
        rms = (sum(e * e for e in errs) / len(errs)) ** 0.5
        worst = max(errs, key=abs)
        print(f"{key} = {v}: rms {rms * 100:.2f} %, worst {worst * 100:+.1f} % over {len(errs)} rows; "
              + ", ".join(f"{' '.join(a) or 'defaults'}: {p:.3f}" for a, p in cache.items()))


main()
