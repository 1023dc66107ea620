//! `overlap cuda-smoke`'s optimizer-tail checks: many AdamW kernels launched back to back
//! (which the backend issues as multi-tensor launches) bit for bit against
//! [`overlap_ops::math::adamw`], and Muon steps of several shapes launched together
//! (batched by shape, Newton–Schulz in each precision) against the f64 reference.
//!
//! Invariant: as the rest of the smoke test, every figure compares with values computed
//! on the host from the same inputs.

use overlap_graph::Stream;
use overlap_ops::cuda::CudaBackend;
use overlap_ops::math::pseudo_random as random;
use overlap_ops::{math, AdamwParams, Backend, Kernel, MuonParams, NsDtype};

use super::smoke::{buffer, download, rel, tag, Check};
use overlap::Error;
use overlap_dist::cuda::muon_update_tolerance;

type Buf = <CudaBackend as Backend>::Buffer;

/// Launches `kernels` back to back on the compute stream, then waits for them.
async fn run_all(b: &CudaBackend, kernels: Vec<Kernel<Buf>>) -> Result<(), String> {
    let rank = b.rank();
    for (i, k) in kernels.into_iter().enumerate() {
        b.launch(rank, Stream::Compute, tag(i as u32, "smoke"), k);
    }
    let ev = b.event(rank);
    b.record(rank, Stream::Compute, &ev);
    let waited = b.host_wait(&ev).await;
    let errors = b.errors();
    if !errors.is_empty() {
        b.reset();
        return Err(format!("{errors:?}"));
    }
    waited.map_err(|e| e.to_string())
}

/// The checks of the batched optimizer kernels.
pub async fn optimizer_batches(b: &CudaBackend, checks: &mut Vec<Check>) -> Result<(), Error> {
    adamw_batch(b, checks).await?;
    for dtype in NsDtype::ALL {
        muon_batch(b, dtype, checks).await?;
    }
    Ok(())
}

/// 150 AdamW kernels of lengths from 1 to 1.8 M (odd ones take the one-float path),
/// in two hyper-parameter groups, launched back to back: every parameter and moment the
/// reference's bits.
async fn adamw_batch(b: &CudaBackend, checks: &mut Vec<Check>) -> Result<(), Error> {
    let lens: Vec<usize> = (0..150)
        .map(|i| match i % 6 {
            0 => 768,
            1 => 3 + i,
            2 => 4096 * (1 + i % 5),
            3 => 10_007,
            4 => 65_536 + 5,
            _ => 768 * 2304,
        })
        .collect();
    let hps = [
        AdamwParams::default(),
        AdamwParams::default().with_weight_decay(0.0).with_lr(3e-4),
    ];
    let mut host = Vec::new();
    let mut kernels = Vec::new();
    for (i, &n) in lens.iter().enumerate() {
        let seed = 100 + 4 * i as u64;
        let (p, g) = (random(n, seed), random(n, seed + 1));
        let m: Vec<f32> = random(n, seed + 2).iter().map(|v| v * 0.1).collect();
        let v: Vec<f32> = random(n, seed + 3).iter().map(|v| v * v * 0.01).collect();
        let state: Vec<f32> = m.iter().chain(&v).copied().collect();
        let (pb, gb, sb) = (buffer(b, &p)?, buffer(b, &g)?, buffer(b, &state)?);
        kernels.push(Kernel::Adamw {
            param: pb.clone(),
            grad: gb,
            state: sb.clone(),
            hp: hps[i % 2],
            step: 7,
        });
        host.push((p, g, m, v, pb, sb));
    }
    let r = run_all(b, kernels).await;
    let mut wrong = 0;
    let total: usize = lens.iter().sum();
    for (i, (mut p, g, mut m, mut v, pb, sb)) in host.into_iter().enumerate() {
        math::adamw(&mut p, &g, &mut m, &mut v, &hps[i % 2], 7);
        let (got_p, got_s) = (download(b, &pb)?, download(b, &sb)?);
        let n = p.len();
        if got_p != p || got_s[..n] != m[..] || got_s[n..] != v[..] {
            wrong += 1;
        }
    }
    checks.push(Check {
        name: "adamw, 150 tensors back to back (multi-tensor) vs ops::math::adamw".into(),
        ok: r.is_ok() && wrong == 0,
        detail: format!("{r:?}, {wrong} of 150 tensors differ ({total} elements, bit for bit)"),
    });
    Ok(())
}

/// Muon on 3 + 2 + 2 matrices of three shapes (wide, tall, GPT-2-like), launched
/// together, Newton–Schulz in `dtype`: each update within [`muon_update_tolerance`] of the f64
/// reference, each momentum buffer bit for bit.
async fn muon_batch(b: &CudaBackend, dtype: NsDtype, checks: &mut Vec<Check>) -> Result<(), Error> {
    let shapes = [(96usize, 40usize, 3usize), (40, 96, 2), (256, 768, 2)];
    let hp = MuonParams::default()
        .with_weight_decay(0.1)
        .with_ns_dtype(dtype);
    let mut host = Vec::new();
    let mut kernels = Vec::new();
    for (s, &(rows, cols, count)) in shapes.iter().enumerate() {
        for j in 0..count {
            let k = rows * cols;
            let seed = 500 + 10 * (s * 4 + j) as u64;
            let (p0, g, buf0) = (random(k, seed), random(k, seed + 1), random(k, seed + 2));
            let (pb, gb, mb) = (buffer(b, &p0)?, buffer(b, &g)?, buffer(b, &buf0)?);
            kernels.push(Kernel::Muon {
                param: pb.clone(),
                grad: gb,
                momentum: mb.clone(),
                rows,
                cols,
                hp,
            });
            host.push((rows, cols, p0, g, buf0, pb, mb));
        }
    }
    let r = run_all(b, kernels).await;
    let mut worst: Vec<(String, f64)> = Vec::new();
    let mut momentum_exact = true;
    for (rows, cols, p0, g, buf0, pb, mb) in host {
        let (mut p, mut buf) = (p0.clone(), buf0);
        math::muon(&mut p, &g, &mut buf, rows, cols, &hp);
        let got = download(b, &pb)?;
        let du_gpu: Vec<f32> = got.iter().zip(&p0).map(|(a, b)| a - b).collect();
        let du_ref: Vec<f32> = p.iter().zip(&p0).map(|(a, b)| a - b).collect();
        let e = rel(&du_gpu, &du_ref);
        momentum_exact &= download(b, &mb)? == buf;
        let name = format!("{rows}x{cols}");
        match worst.iter_mut().find(|(n, _)| *n == name) {
            Some((_, w)) => *w = w.max(e),
            None => worst.push((name, e)),
        }
    }
    let tol = muon_update_tolerance(dtype);
    let max = worst.iter().map(|(_, e)| *e).fold(0.0, f64::max);
    let figures: Vec<String> = worst.iter().map(|(n, e)| format!("{n} {e:.2e}")).collect();
    checks.push(Check {
        name: format!(
            "muon, 7 matrices of 3 shapes batched, Newton–Schulz in {} vs ops::math::muon",
            dtype.name()
        ),
        ok: r.is_ok() && max <= tol && momentum_exact,
        detail: format!(
            "{r:?}, worst update rel err per shape: {} (tolerance {tol:.0e}), momentum bit-exact: {momentum_exact}",
            figures.join(", ")
        ),
    });
    Ok(())
}
