#!/usr/bin/env python3
"""PyTorch's optimizer tail on the shapes `overlap bench-optimizer` times.

Times, on one GPU with CUDA events, on the same shape sets as the Rust command
(`gpt2-small`, `llama-1b`, or a file of `name d0 [d1] [adamw|muon]` lines):

- `AdamW(fused=True)` and `AdamW(foreach=True)` on every parameter;
- `torch.optim.Muon` on the 2-D block matrices plus fused AdamW on the rest;
- Newton-Schulz alone (5 quintic steps, Muon's coefficients), batched by shape with
  `torch.bmm`-style batched matmuls, in bf16 (with and without `torch.compile`), TF32
  and f32.

Each figure is a median of steps issued alone (synchronised before and after) and the
time per step of steps issued back to back. Prints one JSON object.

Usage: python3 scripts/bench_optimizer.py --shapes gpt2-small [--iters 20] [--warmup 3]
       python3 scripts/bench_optimizer.py --compare OVERLAP.json TORCH.json
(`--compare` needs no GPU: it prints the two runs side by side, with the ratios and the
fraction of the memory-bandwidth limit each AdamW reaches; scripts/bench-optimizer.sh
runs both and compares.)
"""

import argparse
import json
import statistics
import sys

import torch

NS = (3.4445, -4.7750, 2.0315)


def gpt2_small():
    d = 768
    out = [("wte", (50257, d), False), ("wpe", (1024, d), False)]
    for l in range(12):
        p = f"h.{l}."
        out += [
            (p + "ln_1.weight", (d,), False),
            (p + "ln_1.bias", (d,), False),
            (p + "attn.c_attn.weight", (d, 3 * d), True),
            (p + "attn.c_attn.bias", (3 * d,), False),
            (p + "attn.c_proj.weight", (d, d), True),
            (p + "attn.c_proj.bias", (d,), False),
            (p + "ln_2.weight", (d,), False),
            (p + "ln_2.bias", (d,), False),
            (p + "mlp.c_fc.weight", (d, 4 * d), True),
            (p + "mlp.c_fc.bias", (4 * d,), False),
            (p + "mlp.c_proj.weight", (4 * d, d), True),
            (p + "mlp.c_proj.bias", (d,), False),
        ]
    out += [("ln_f.weight", (d,), False), ("ln_f.bias", (d,), False)]
    return out


def llama_1b():
    d, kv, ff = 2048, 512, 8192
    out = [("embed_tokens", (128256, d), False)]
    for l in range(16):
        p = f"layers.{l}."
        out += [
            (p + "input_layernorm", (d,), False),
            (p + "self_attn.q_proj", (d, d), True),
            (p + "self_attn.k_proj", (kv, d), True),
            (p + "self_attn.v_proj", (kv, d), True),
            (p + "self_attn.o_proj", (d, d), True),
            (p + "post_attention_layernorm", (d,), False),
            (p + "mlp.gate_proj", (ff, d), True),
            (p + "mlp.up_proj", (ff, d), True),
            (p + "mlp.down_proj", (d, ff), True),
        ]
    out.append(("norm", (d,), False))
    return out


def from_file(path):
    out = []
    for line in open(path):
        line = line.split("#")[0].split()
        if not line:
            continue
        name, rest = line[0], line[1:]
        muon = "adamw" not in rest
        dims = tuple(int(w) for w in rest if w not in ("adamw", "muon"))
        out.append((name, dims, muon and len(dims) == 2))
    return out


def shape_set(spec):
    if spec == "gpt2-small":
        return gpt2_small()
    if spec == "llama-1b":
        return llama_1b()
    return from_file(spec)


# Cycles of the spin issued before a covered step's start event (about 20 ms on an
# H200): longer than the host takes to issue any step here.
COVER_CYCLES = 40_000_000


def timed(fn, iters, warmup):
    """(median ms of one call alone, median ms of one call covered, ms per call back to
    back). Alone: from an event recorded before the host issues the call; covered: the
    same while a spin still occupies the stream (the host's issue time hidden, as a
    tail issued during the backward)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    alone, covered = [], []
    for i in range(2 * iters):
        if i % 2:
            torch.cuda._sleep(COVER_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        (covered if i % 2 else alone).append(start.elapsed_time(end))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return statistics.median(alone), statistics.median(covered), start.elapsed_time(end) / iters


def copy_gbps():
    n = 256 << 20
    a = torch.empty(n, device="cuda")
    b = torch.empty(n, device="cuda")
    alone, covered, b2b = timed(lambda: b.copy_(a), 10, 2)
    return 2 * 4 * n / (b2b * 1e-3) / 1e9


def newton_schulz(x, steps=5):
    """Muon's quintic iteration on a batch (B, m, n), any dtype; transposed when m > n."""
    a, b, c = NS
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = x @ x.mT
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.mT if tall else x


def ns_flops(shape, steps=5):
    m, n = min(shape), max(shape)
    return steps * (4 * m * m * n + 2 * m * m * m)


def compare(ours_path, theirs_path):
    ours = json.load(open(ours_path))
    theirs = json.load(open(theirs_path))
    o = {r["tail"]: r for r in ours["rows"]}
    t = {r["tail"]: r for r in theirs["rows"]}
    print(f"shapes {ours['shapes']}: {ours['tensors']} parameters, {ours['values'] / 1e6:.1f} M values, "
          f"{ours['muon_matrices']} on Muon; {ours['device']}; torch {theirs['torch']}")
    print(f"copy bandwidth: overlap {ours['copy_gbps']:.0f} GB/s, torch {theirs['copy_gbps']:.0f} GB/s")
    print(f"{'tail':<30} {'alone ms':>9} {'device ms':>10} {'b2b ms':>8} {'x (alone)':>10} "
          f"{'x (device)':>11} {'x (b2b)':>8} {'of limit (device/b2b)':>22}")

    def line(name, r, ref):
        fmt = lambda x: "%.2f" % x
        lim = r.get("adamw_limit_ms")
        frac = f"{fmt(lim / r['device_ms'])} / {fmt(lim / r['back_to_back_ms'])}" if lim else "-"
        ra = r["alone_ms"] / ref["alone_ms"]
        rd = r["device_ms"] / ref["device_ms"]
        rb = r["back_to_back_ms"] / ref["back_to_back_ms"]
        print(f"{name:<30} {r['alone_ms']:>9.3f} {r['device_ms']:>10.3f} {r['back_to_back_ms']:>8.3f} "
              f"{fmt(ra):>10} {fmt(rd):>11} {fmt(rb):>8} {frac:>22}")

    ref = o.get("adamw")
    if ref:
        line("overlap adamw", ref, ref)
        for k in ("adamw-fused", "adamw-foreach"):
            if k in t:
                line("torch " + k, t[k], ref)
    ref = o.get("muon-bf16")
    if ref:
        for k in ("muon-bf16", "muon-bf16-direct", "muon-tf32", "muon-f32"):
            if k in o:
                line("overlap " + k + " (+adamw)", o[k], ref)
        for k in ("torch-muon+adamw-fused", "ns-batched-bf16", "ns-batched-bf16-compiled",
                  "ns-batched-tf32", "ns-batched-f32"):
            if k in t:
                line("torch " + k, t[k], ref)
        flops = ref["ns_tflop"]
        print(f"Newton-Schulz: {flops:.2f} TFLOP a step; overlap muon-bf16 tail at "
              f"{flops / (ref['device_ms'] * 1e-3):.0f} TFLOP/s (whole tail, device time)")
    for ours, theirs in (("norm", "grad-norm"), ("adamw+clip", "clip+adamw-fused"),
                         ("muon-bf16+clip", "clip+torch-muon+adamw-fused")):
        ref = o.get(ours)
        if not ref:
            continue
        line("overlap " + ours, ref, ref)
        unfused = ours.replace("+clip", "+clip-pass")
        if unfused in o and unfused != ours:
            line("overlap " + unfused, o[unfused], ref)
        if theirs in t:
            line("torch " + theirs, t[theirs], ref)
    print("(x: time / overlap's time, above 1 = overlap faster; alone: from an event recorded "
          "before the host issues the step; device: issued while a spin occupies the stream; "
          "of limit: the AdamW part's 28 bytes a value at the copy bandwidth / the time)")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gpt2-small")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes = shape_set(args.shapes)
    params = [torch.randn(s, device="cuda", requires_grad=True) for _, s, _ in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    mats = [p for p, (_, s, muon) in zip(params, shapes) if muon]
    rest = [p for p, (_, s, muon) in zip(params, shapes) if not muon]
    rows = []
    copy = copy_gbps()
    values = sum(p.numel() for p in params)
    rest_values = sum(p.numel() for p in rest)

    def row(name, fn, limit_values, flops=0.0):
        alone, covered, b2b = timed(fn, args.iters, args.warmup)
        rows.append({
            "tail": name,
            "alone_ms": alone,
            "device_ms": covered,
            "back_to_back_ms": b2b,
            "adamw_limit_ms": 28 * limit_values / (copy * 1e9) * 1e3,
            "ns_tflop": flops / 1e12,
        })
        print(f"{name}: alone {alone:.3f} ms, covered {covered:.3f} ms, back to back {b2b:.3f} ms",
              file=sys.stderr)

    fused = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    row("adamw-fused", fused.step, values)
    grads = [p.grad for p in params]
    # The global norm alone, and the norm, the clip and the update as a training step
    # with clipping runs them (`clip_grad_norm_` always scales, by at most 1).
    row("grad-norm", lambda: torch.nn.utils.get_total_norm(grads, foreach=True), values / 7)

    def clipped_fused():
        torch.nn.utils.clip_grad_norm_(params, 1e-3, foreach=True)
        fused.step()

    row("clip+adamw-fused", clipped_fused, values * 8 / 7)
    del fused
    foreach = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    row("adamw-foreach", foreach.step, values)
    del foreach
    flops = sum(ns_flops(tuple(p.shape)) for p in mats)
    if mats:
        muon = torch.optim.Muon(mats, lr=0.02, momentum=0.95, weight_decay=0.0)
        rest_opt = torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.01, fused=True)

        def muon_step():
            muon.step()
            rest_opt.step()

        row("torch-muon+adamw-fused", muon_step, rest_values, flops)

        def clipped_muon_step():
            torch.nn.utils.clip_grad_norm_(params, 1e-3, foreach=True)
            muon_step()

        row("clip+torch-muon+adamw-fused", clipped_muon_step, rest_values + values / 7, flops)
        del muon, rest_opt
        by_shape = {}
        for p in mats:
            by_shape.setdefault(tuple(p.shape), []).append(p.grad)
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "tf32"), (torch.float32, "f32")):
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            batches = [torch.stack(g).to(dtype) for g in by_shape.values()]

            def ns_eager():
                for x in batches:
                    newton_schulz(x)

            row(f"ns-batched-{name}", ns_eager, 0, flops)
            if name == "bf16" and not args.no_compile:
                compiled = torch.compile(newton_schulz, dynamic=False)

                def ns_compiled():
                    for x in batches:
                        compiled(x)

                row("ns-batched-bf16-compiled", ns_compiled, 0, flops)
        torch.backends.cuda.matmul.allow_tf32 = False
    print(json.dumps({
        "shapes": args.shapes,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tensors": len(params),
        "values": values,
        "muon_matrices": len(mats),
        "copy_gbps": copy,
        "iters": args.iters,
        "warmup": args.warmup,
        "rows": rows,
    }))


if __name__ == "__main__":
    main()
