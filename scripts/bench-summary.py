#!/usr/bin/env python3
"""Summarises a scripts/bench-gpu.sh log: one line per workload and variant with
compute, comm, serial, overlapped, ideal (ms), eta and host us per node, the anchor's
eta computed with the same formula; with a second argument (`kinds`), host us per node
by node kind too; the other ranks' spans (`bench rank N:` lines); `overlap
bench-interference` lines as they come. With `rounds` instead of `kinds`, then a table
of a scripts/bench-levers.sh log: per workload and variant (runs named
VARIANT_WORKLOAD_rN), the overlapped ms of each round, their mean and the difference
from the first variant's mean. Usage: scripts/bench-summary.py OUT/log.txt [kinds|rounds]"""
import json
import re
import sys

name = None
runs = []
for line in open(sys.argv[1]):
    m = re.match(r"== (\S+):", line)
    if m:
        name = m.group(1)
        continue
    if line.startswith("[rank 0] {") and '"eta"' in line:
        d = json.loads(line[len("[rank 0] "):])
        host = f"host {d['host_us_per_node']:.1f} (untimed {d['host_us_per_node_untimed']:.1f}"
        if "host_us_per_node_comm_only" in d:
            host += f", comm_only {d['host_us_per_node_comm_only']:.1f}"
        if "host_us_per_node_comm_only_untimed" in d:
            host += f", comm_only untimed {d['host_us_per_node_comm_only_untimed']:.1f}"
        host += ")"
        eta = d["eta"] if d["eta"] is not None else float("nan")
        print(f"{name:24s} compute {d['compute_only_ms']:.2f} comm {d['comm_only_ms']:.2f} "
              f"serial {d['serial_ms']:.2f} overlap {d['overlap_ms']:.2f} ideal {d['ideal_ms']:.2f} "
              f"eta {eta:.2f} {host}")
        runs.append((name, d["overlap_ms"], eta))
        if len(sys.argv) > 2 and sys.argv[2] == "kinds" and "host_us_by_kind" in d:
            for key in ("host_us_by_kind", "host_us_by_kind_comm_only",
                        "host_us_in_backend_by_kind", "host_us_in_backend_by_kind_comm_only",
                        "host_us_by_kind_comm_only_untimed",
                        "host_us_in_backend_by_kind_comm_only_untimed"):
                if key not in d:
                    continue
                kinds = " ".join(f"{k} {v:.1f}" for k, v in sorted(d[key].items()))
                print(f"{'':24s} {key}: {kinds}")
    elif re.match(r"(\[rank \d+\] )?bench rank \d+:", line):
        # The other ranks' own spans (a slower GPU holds every step back).
        print(f"{'':24s} {line.split('bench ', 1)[1].strip()}")
    elif line.startswith("{") and "overlap_fsdp2" in line:
        d = json.loads(line)
        c, m_, s, o = d["compute_only"], d["comm_only"], d["serial"], d["overlap_fsdp2"]
        ideal = max(c, m_) + m_ / d["layers"]
        print(f"{name:24s} compute {c:.2f} comm {m_:.2f} serial {s:.2f} overlap {o:.2f} "
              f"ideal {ideal:.2f} eta {(s - o) / (s - ideal):.2f} host {d['host_us_per_collective']:.1f} per collective")
    elif line.startswith("{") and "cost_per_layer_ms" in line:
        d = json.loads(line)
        print(f"{name or 'interference':24s} gemms {d['gemms_ms']:.2f} combines {d['combines_ms']:.2f} "
              f"beside {d['beside_ms']:.2f} (plain loads {d['beside_normal_ms']:.2f}, "
              f"low priority {d.get('beside_low_ms', float('nan')):.2f}) serial {d['serial_ms']:.2f} "
              f"cost per layer {d['cost_per_layer_ms']:.4f}")
        if "copy_beside_ms" in d:
            print(f"{'':24s} copy beside {d['copy_beside_ms']:.2f} (cost per layer "
                  f"{d['copy_cost_per_layer_ms']:.4f}), copy and combine beside "
                  f"{d['both_beside_ms']:.2f} (cost per layer {d['both_cost_per_layer_ms']:.4f})"
                  + (f", copy then combine {d['copy_then_combine_ms']:.2f} (cost per layer "
                     f"{d['copy_then_combine_cost_per_layer_ms']:.4f})"
                     if "copy_then_combine_ms" in d else ""))

if len(sys.argv) > 2 and sys.argv[2] == "rounds":
    # VARIANT_WORKLOAD_rN, the workload itself possibly containing "_" (rs_mm1).
    table = {}
    order = []
    for run, ms, eta in runs:
        m = re.match(r"(.+?)_(rs_mm1|ar_mm1|rs|ar)_r(\d+)$", run or "")
        if not m:
            continue
        variant, workload = m.group(1), m.group(2)
        if (workload, variant) not in table:
            order.append((workload, variant))
        table.setdefault((workload, variant), []).append((ms, eta))
    print()
    print(f"{'workload':8s} {'variant':12s} {'rounds (ms, eta)':40s} {'mean':>7s} {'vs first':>9s}")
    first = {}
    for workload, variant in order:
        rows = table[(workload, variant)]
        mean = sum(ms for ms, _ in rows) / len(rows)
        first.setdefault(workload, mean)
        cells = ", ".join(f"{ms:.2f} ({eta:.2f})" for ms, eta in rows)
        print(f"{workload:8s} {variant:12s} {cells:40s} {mean:7.2f} {mean - first[workload]:+9.2f}")
