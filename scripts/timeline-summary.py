#!/usr/bin/env python3
"""Mean and count of node durations by kind in one step's timeline: an SVG written by
`overlap bench --timeline` / `overlap run --svg` (each bar's title is `label · duration`)
or the JSON lines `bench --timeline` writes next to it. The first `grad_ready` (the first
layer's backward, before any communication) is reported apart.

    python3 scripts/timeline-summary.py docs/timeline_copy_rs_mm1.svg
"""
import html
import json
import re
import sys
from collections import defaultdict

path = sys.argv[1]
spans = []  # (kind, label, µs) in file order
if path.endswith(".svg"):
    for title in re.findall(r"<title>([^<]*)</title>", open(path).read()):
        m = re.match(r"(.*) · ([0-9.]+) (µs|ms|s)$", html.unescape(title))
        if not m:
            continue
        label, v, unit = m.group(1), float(m.group(2)), m.group(3)
        us = v * {"µs": 1, "ms": 1e3, "s": 1e6}[unit]
        spans.append((label.split()[0], label, us))
else:
    for line in open(path):
        d = json.loads(line)
        spans.append((d["op"], d["label"], d["end_us"] - d["start_us"]))

by = defaultdict(list)
first = True
for kind, label, us in spans:
    if kind == "grad_ready" and first:
        first = False
        print(f"first grad_ready          {us:8.1f} µs  ({label})")
        continue
    by[kind].append(us)
for kind, v in sorted(by.items()):
    print(f"{kind:24s} mean {sum(v) / len(v):8.1f} µs over {len(v):3d}, max {max(v):8.1f}")
