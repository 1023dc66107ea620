#!/usr/bin/env python3
"""Copy-engine probe for the copy transport (2 GPUs, PyTorch): how fast 32 MiB moves
between the two GPUs when both send at once (as an exchange does), whole or split into
k pieces on k streams per GPU, and how fast a local 32 MiB device-to-device copy (an
exchange's `Take`) runs. Times with CUDA events, median of ITERS. Prints JSON lines.

    python3 scripts/ce-probe.py            # MIB=32 ITERS=50
"""
import json
import os

import torch

MIB = int(os.environ.get("MIB", "32"))
ITERS = int(os.environ.get("ITERS", "50"))
n = MIB << 18  # f32 elements
dev = [torch.device("cuda", i) for i in range(2)]
src = [torch.randn(n, device=d) for d in dev]
dst = [torch.empty(n, device=d) for d in dev]  # dst[i] lives on GPU i, filled by the peer
local = [torch.empty(n, device=d) for d in dev]


def timed(fn, streams):
    """Median ms of fn() over ITERS, both GPUs' streams joined."""
    out = []
    for _ in range(ITERS + 5):
        for d in dev:
            torch.cuda.synchronize(d)
        start = [torch.cuda.Event(enable_timing=True) for _ in dev]
        end = [torch.cuda.Event(enable_timing=True) for _ in dev]
        for i, d in enumerate(dev):
            start[i].record(torch.cuda.current_stream(d))
            for s in streams[i]:
                s.wait_event(start[i])
        fn()
        for i, d in enumerate(dev):
            cur = torch.cuda.current_stream(d)
            for s in streams[i]:
                cur.wait_stream(s)
            end[i].record(cur)
        for d in dev:
            torch.cuda.synchronize(d)
        out.append(max(start[i].elapsed_time(end[i]) for i in range(2)))
    out = sorted(out[5:])
    return out[len(out) // 2]


for k in (1, 2, 4):
    streams = [[torch.cuda.Stream(device=d) for _ in range(k)] for d in dev]
    piece = n // k

    def both_ways():
        for i in range(2):
            j = 1 - i
            for p, s in enumerate(streams[i]):
                with torch.cuda.stream(s):
                    # GPU i pushes its piece p into GPU j's memory.
                    dst[j][p * piece:(p + 1) * piece].copy_(src[i][p * piece:(p + 1) * piece], non_blocking=True)

    ms = timed(both_ways, streams)
    print(json.dumps({"probe": "peer_both_ways", "mib": MIB, "pieces": k, "ms": ms,
                      "gbs_per_direction": MIB * 2**20 / ms / 1e6}))

streams = [[torch.cuda.Stream(device=d)] for d in dev]


def local_copy():
    for i in range(2):
        with torch.cuda.stream(streams[i][0]):
            local[i].copy_(src[i], non_blocking=True)


ms = timed(local_copy, streams)
print(json.dumps({"probe": "local_d2d", "mib": MIB, "ms": ms, "gbs": MIB * 2**20 / ms / 1e6}))
