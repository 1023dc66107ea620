#!/usr/bin/env python3
"""The predicted scaling table of docs/scaling.md: `overlap simulate` of a 7B-parameter
transformer's gradient path on HSDP meshes of 8 x R ranks (shard 8 within a node,
replicate across nodes) on hardware/h200-8x-400g.toml, for 1, 4 and 16 micro-batches
per step, with the replicate gate on only on the last micro-batch and on every one;
then `overlap tune` at each scale (4 micro-batches, gate on the last).

Predictions, not measurements. Usage (from the repository root, after `cargo build`):

    python3 scripts/scaling.py [--overlap target/debug/overlap] [--replicas 1,4,16,64,256]
        [--micro-batches 1,4,16] [--no-tune | --tune-replicas 1,4]
        [--backward-us N] > table.md

Prints a Markdown table on stdout and each run's wall time on stderr.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HARDWARE = "hardware/h200-8x-400g.toml"
MODEL = "[model]\nlayers = 32\nhidden = 4096\nvocab = 32000\n"


BACKWARD_US = 0


def config(replicate, micro_batches):
    run = f"\n[run]\nbackward_us_per_layer = {BACKWARD_US}\n" if BACKWARD_US else ""
    return (
        f"[mesh]\nshard = 8\nreplicate = {replicate}\n\n{MODEL}\n"
        f"[accumulation]\nmicro_batches = {micro_batches}\n{run}"
    )


def run(binary, args):
    """One JSON line of `overlap ...`, or None (with the error on stderr) if refused."""
    t0 = time.time()
    out = subprocess.run([binary] + args, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"refused: {' '.join(args)}: {out.stderr.strip()}", file=sys.stderr)
        return None, time.time() - t0
    return json.loads(out.stdout.strip().splitlines()[-1]), time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--overlap", default="target/debug/overlap")
    ap.add_argument("--replicas", default="1,4,16,64,256")
    ap.add_argument("--micro-batches", default="1,4,16")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--tune-micro-batches", type=int, default=4)
    ap.add_argument("--tune-replicas", default=None, help="default: --replicas")
    ap.add_argument(
        "--backward-us",
        type=int,
        default=0,
        help="backward per layer and micro-batch, us (default 0: the profile's)",
    )
    a = ap.parse_args()
    global BACKWARD_US
    BACKWARD_US = a.backward_us
    reps = [int(x) for x in a.replicas.split(",")]
    mbs = [int(x) for x in a.micro_batches.split(",")]
    tmp = tempfile.mkdtemp(prefix="overlap-scaling-")
    print(
        "| ranks | micro-batches | compute_only ms | comm_only ms | step ms (gate last) "
        "| exposed comm ms | η | step ms (gate every) | exposed comm ms (every) "
        "| gate saves ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in reps:
        for m in mbs:
            path = os.path.join(tmp, f"8x{r}-m{m}.toml")
            with open(path, "w") as f:
                f.write(config(r, m))
            base = ["simulate", "--hardware", HARDWARE, "--config", path, "--json"]
            last, t1 = run(a.overlap, base + ["--gates", f"off*{m - 1},on" if m > 1 else "on"])
            if last is None:
                print(f"| 8×{r} = {8 * r} | {m} | refused (stderr says why) | | | | | | | |")
                continue
            if m > 1:
                every, t2 = run(a.overlap, base + ["--gates", f"on*{m}"])
            else:
                every, t2 = last, 0.0
            print(
                f"8x{r}-m{m}: {t1:.1f} s + {t2:.1f} s", file=sys.stderr, flush=True
            )
            eta = "n/a" if last["eta"] is None else f"{last['eta']:.2f}"
            print(
                f"| 8×{r} = {8 * r} | {m} | {last['compute_only_ms']:.1f} "
                f"| {last['comm_only_ms']:.1f} | {last['overlap_ms']:.1f} "
                f"| {last['exposed_comm_ms']:.1f} | {eta} | {every['overlap_ms']:.1f} "
                f"| {every['exposed_comm_ms']:.1f} "
                f"| {every['overlap_ms'] - last['overlap_ms']:.1f} |",
                flush=True,
            )
    if a.no_tune:
        return
    m = a.tune_micro_batches
    print()
    print(
        f"`overlap tune` ({m} micro-batches, gate on the last):\n\n"
        "| ranks | config's own ms | best ms | gain | best setting |\n"
        "| --- | --- | --- | --- | --- |"
    )
    for r in [int(x) for x in (a.tune_replicas or a.replicas).split(",")]:
        path = os.path.join(tmp, f"8x{r}-m{m}.toml")
        with open(path, "w") as f:
            f.write(config(r, m))
        t, secs = run(
            a.overlap,
            ["tune", "--hardware", HARDWARE, "--config", path, "--json"],
        )
        print(f"tune 8x{r}: {secs:.1f} s", file=sys.stderr, flush=True)
        if t is None:
            print(f"| 8×{r} = {8 * r} | refused (stderr says why) | | | |")
            continue
        print(
            f"| 8×{r} = {8 * r} | {t['own_ms']:.1f} | {t['best_ms']:.1f} "
            f"| {t['gain_pct']:.1f} % | {t['top'][0]['label']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
