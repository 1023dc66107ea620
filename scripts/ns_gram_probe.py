#!/usr/bin/env python3
"""Newton-Schulz iterated on the Gram matrix against the direct iteration, in bf16.

For a few shapes (12 matrices each; a low-rank-plus-noise set, seed 7, and a Gaussian
set, seed 8), prints one JSON line per shape and set: the relative Frobenius error and
the largest absolute error against the direct iteration in f64, for the direct
iteration in bf16 and f32 and the Gram iteration (X_k = Q_k X_0 with the m x m
matrices Q and R = X Xt) in bf16 without a restart and with one before iteration 2 or
3, and in f32; and the time of five iterations of each in bf16 (torch.bmm-style
batched products, CUDA events). docs/performance.md cites its result.

Usage (one GPU, PyTorch): python3 scripts/ns_gram_probe.py
"""
import torch, json, sys
torch.backends.cuda.matmul.allow_tf32 = False
dev = 'cuda'
a, b, c = 3.4445, -4.7750, 2.0315
def gen(cnt, m, n, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    r = 32
    L = torch.randn(cnt, m, r, device=dev, generator=g, dtype=torch.float64)
    R = torch.randn(cnt, r, n, device=dev, generator=g, dtype=torch.float64)
    s = torch.logspace(0, -3, r, device=dev, dtype=torch.float64)
    G = (L * s) @ R + 0.02 * torch.randn(cnt, m, n, device=dev, generator=g, dtype=torch.float64)
    if seed == 8:
        G = torch.randn(cnt, m, n, device=dev, generator=g, dtype=torch.float64)
    return G
def std_ns(G, dt, steps=5):
    X = G.to(dt)
    X = X / (X.norm(dim=(1, 2), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.transpose(1, 2)
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X
def gram_ns(G, dt, steps=5, restart=()):
    X0 = G.to(dt)
    X0 = X0 / (X0.norm(dim=(1, 2), keepdim=True) + 1e-7)
    R = X0 @ X0.transpose(1, 2)
    m = R.shape[-1]
    I = torch.eye(m, device=dev, dtype=dt).expand_as(R)
    Q = None
    for k in range(steps):
        if k in restart and Q is not None:
            X0 = Q @ X0
            R = X0 @ X0.transpose(1, 2)
            Q = None
        Z = a * I + b * R + c * (R @ R)
        Q = Z if Q is None else Z @ Q
        if k + 1 < steps:
            R = Z @ (R @ Z)
    return Q @ X0
def timeit(f, reps=10):
    for _ in range(2): f()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps
for (m, n) in [(768, 2304), (768, 3072), (768, 768), (512, 2048), (128, 4096)]:
  for seed in (7, 8):
      G = gen(12, m, n, seed)
      ref = std_ns(G, torch.float64)
      def err(X):
          d = X.double() - ref
          return dict(rel_fro=(d.norm() / ref.norm()).item(), max_abs=d.abs().max().item(), ref_max=ref.abs().max().item())
      row = dict(shape=[m, n], seed=seed)
      row['std_bf16'] = err(std_ns(G, torch.bfloat16))
      row['gram_bf16'] = err(gram_ns(G, torch.bfloat16))
      row['gram_bf16_r2'] = err(gram_ns(G, torch.bfloat16, restart=(2,)))
      row['gram_bf16_r3'] = err(gram_ns(G, torch.bfloat16, restart=(3,)))
      row['gram_f32'] = err(gram_ns(G, torch.float32))
      row['std_f32'] = err(std_ns(G, torch.float32))
      Gb = G.to(torch.bfloat16)
      row['t_std'] = timeit(lambda: std_ns(Gb, torch.bfloat16))
      row['t_gram'] = timeit(lambda: gram_ns(Gb, torch.bfloat16))
      row['t_gram_r2'] = timeit(lambda: gram_ns(Gb, torch.bfloat16, restart=(2,)))
      print(json.dumps(row)); sys.stdout.flush()
