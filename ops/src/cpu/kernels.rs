//! The rank-local kernels (everything but collectives and exchanges): validate, then
//! compute.
//!
//! Invariant: a kernel checks every length, offset, rank and aliasing rule before it
//! writes anything, so a kernel that fails validation leaves its buffers untouched; the
//! arithmetic is [`crate::math`]'s, so the CPU backend is the reference bit for bit.

use std::ops::Range;

use overlap_graph::{Collective, CopySeg, DType, ReduceOp};

use super::buffer::{lock_distinct, CpuBuffer};
use crate::{math, AdamwParams, Kernel, MuonParams, OpsError};

/// Runs a rank-local kernel launched on `rank`.
///
/// Collectives and exchanges need their communicator and are run by the stream worker;
/// passed here one is reported as a backend error.
pub(super) fn run(rank: u32, kernel: &Kernel<CpuBuffer>) -> Result<(), OpsError> {
    match kernel {
        Kernel::Marker => Ok(()),
        Kernel::Spin { micros } => {
            spin(*micros);
            Ok(())
        }
        Kernel::Gemm { m, n, k, count } => gemms((*m, *n, *k), *count),
        Kernel::Add {
            dst,
            src,
            accumulate,
        } => add(rank, dst, src, *accumulate),
        Kernel::Pack { dst, segs } => pack(rank, dst, segs),
        Kernel::Unpack {
            src,
            segs,
            accumulate,
        } => unpack(rank, src, segs, *accumulate),
        Kernel::Adamw {
            param,
            grad,
            state,
            hp,
            step,
        } => adamw(rank, param, grad, state, hp, *step),
        Kernel::Muon {
            param,
            grad,
            momentum,
            rows,
            cols,
            hp,
        } => muon(rank, param, grad, momentum, *rows, *cols, hp),
        Kernel::Combine {
            desc,
            size,
            index,
            own,
            own_offset,
            recv,
            dst,
        } => combine(
            rank,
            desc,
            Member {
                size: *size,
                index: *index,
            },
            own,
            *own_offset,
            recv,
            dst,
        ),
        Kernel::SumSquares { dst, srcs } => sum_squares(rank, dst, srcs),
        Kernel::Clip {
            norm,
            bufs,
            max_norm,
        } => clip(rank, norm, bufs, *max_norm),
        Kernel::IfFinite { norm, kernel } => if_finite(rank, norm, kernel),
        Kernel::Optimizers(row) => {
            row.check()?;
            row.kernels().try_for_each(|(_, k)| run(rank, &k))
        }
        Kernel::Collective { .. } | Kernel::Exchange { .. } | Kernel::Gather { .. } => {
            Err(OpsError::Backend(format!(
                "the {} kernel needs its communicator",
                kernel.name()
            )))
        }
    }
}

/// [`Kernel::IfFinite`]: runs the optimizer `kernel` only when the squared global norm
/// in `norm[0]` is finite.
fn if_finite(rank: u32, norm: &CpuBuffer, kernel: &Kernel<CpuBuffer>) -> Result<(), OpsError> {
    expect("if_finite", rank, "norm", norm, 1)?;
    let sq = norm.lock()[0];
    if sq.is_finite() {
        run(rank, kernel)
    } else {
        Ok(())
    }
}

/// [`Kernel::Gemm`]: `count` products of `m × k` by `k × n`, one after another.
fn gemms((m, n, k): (u32, u32, u32), count: u32) -> Result<(), OpsError> {
    for _ in 0..count {
        gemm(m, n, k)?;
    }
    Ok(())
}

/// Keeps the calling stream busy for `micros` µs. The stream thread sleeps through all
/// but the last [`SPIN_TAIL`] and spins through that: a GPU stream busy with a kernel
/// does not take the host's cores from the other streams, and on a machine with fewer
/// cores than streams a pure spin would starve the very streams it should overlap with;
/// the spun tail keeps the end accurate to a few µs despite the sleep's coarse wake-up.
fn spin(micros: u32) {
    let start = std::time::Instant::now();
    let total = std::time::Duration::from_micros(u64::from(micros));
    if let Some(sleep) = total.checked_sub(SPIN_TAIL) {
        std::thread::sleep(sleep);
    }
    while start.elapsed() < total {
        std::hint::spin_loop();
    }
}

/// The most multiply-adds one [`Kernel::Gemm`] product may take on the CPU backend
/// (2^30, about a second): beyond that the plain loop is no stand-in for a GPU GEMM.
pub const GEMM_CPU_MAX_MACS: u64 = 1 << 30;

/// One [`Kernel::Gemm`] product on the CPU: `C = A·B` in f32 with a plain loop over
/// operands [`gemm_operand`] fills, returned row-major (`m × n`). Products larger than
/// [`GEMM_CPU_MAX_MACS`] are refused with [`OpsError::Shape`].
pub fn gemm(m: u32, n: u32, k: u32) -> Result<Vec<f32>, OpsError> {
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let macs = (m as u64) * (n as u64) * (k as u64);
    if macs > GEMM_CPU_MAX_MACS {
        return Err(OpsError::Shape {
            kernel: "gemm",
            reason: format!(
                "{m}×{k}·{k}×{n} is {macs} multiply-adds; the CPU backend runs at most {GEMM_CPU_MAX_MACS} per product (use the CUDA backend for real sizes)"
            ),
        });
    }
    let a = gemm_operand(m * k, 1);
    let b = gemm_operand(k * n, 2);
    let mut c = vec![0.0f32; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = a[i * k + p];
            for j in 0..n {
                c[i * n + j] += x * b[p * n + j];
            }
        }
    }
    Ok(c)
}

/// The deterministic operand `which` (1: `A`, 2: `B`) of a CPU [`Kernel::Gemm`]:
/// element `i` is `((i · 7 + which) mod 5) − 2`, small integers, so products are exact.
pub fn gemm_operand(len: usize, which: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + which) % 5) as f32 - 2.0)
        .collect()
}

/// The end of a [`Kernel::Spin`] that is spun rather than slept.
const SPIN_TAIL: std::time::Duration = std::time::Duration::from_micros(100);

/// Checks that `buf` lives on `rank` and holds `len` elements.
pub(super) fn expect(
    kernel: &'static str,
    rank: u32,
    what: &str,
    buf: &CpuBuffer,
    len: usize,
) -> Result<(), OpsError> {
    if buf.rank() == rank && buf.len() == len {
        Ok(())
    } else {
        Err(OpsError::Shape {
            kernel,
            reason: format!(
                "{what} must be a buffer of {len} elements on rank {rank}, got {buf:?}"
            ),
        })
    }
}

/// `dst = src` or `dst += src`; `dst` and `src` may be the same buffer.
fn add(rank: u32, dst: &CpuBuffer, src: &CpuBuffer, accumulate: bool) -> Result<(), OpsError> {
    const K: &str = "add";
    expect(K, rank, "dst", dst, dst.len())?;
    expect(K, rank, "src", src, dst.len())?;
    if dst.same(src) {
        if accumulate {
            dst.lock().iter_mut().for_each(|x| *x += *x);
        }
        return Ok(());
    }
    let all = 0..dst.len();
    copy(K, dst, all.clone(), src, all, accumulate)
}

/// Zeroes `dst`, then sums every segment's sources into it.
fn pack(rank: u32, dst: &CpuBuffer, segs: &[(CopySeg, Vec<CpuBuffer>)]) -> Result<(), OpsError> {
    const K: &str = "pack";
    expect(K, rank, "dst", dst, dst.len())?;
    let copies = segs
        .iter()
        .flat_map(|(seg, srcs)| {
            srcs.iter()
                .map(move |src| segment(K, rank, seg, src, dst).map(|r| (src, r)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    dst.lock().fill(0.0);
    copies
        .into_iter()
        .try_for_each(|(src, (s, d))| copy(K, dst, d, src, s, true))
}

/// Copies (or adds) segments of `src` into each segment's destination.
fn unpack(
    rank: u32,
    src: &CpuBuffer,
    segs: &[(CopySeg, CpuBuffer)],
    accumulate: bool,
) -> Result<(), OpsError> {
    const K: &str = "unpack";
    let copies = segs
        .iter()
        .map(|(seg, dst)| segment(K, rank, seg, src, dst).map(|r| (dst, r)))
        .collect::<Result<Vec<_>, _>>()?;
    copies
        .into_iter()
        .try_for_each(|(dst, (s, d))| copy(K, dst, d, src, s, accumulate))
}

/// AdamW on one piece; `state` holds `m` then `v`.
fn adamw(
    rank: u32,
    param: &CpuBuffer,
    grad: &CpuBuffer,
    state: &CpuBuffer,
    hp: &AdamwParams,
    step: u64,
) -> Result<(), OpsError> {
    const K: &str = "adamw";
    let n = param.len();
    expect(K, rank, "param", param, n)?;
    expect(K, rank, "grad", grad, n)?;
    expect(K, rank, "state (m then v)", state, 2 * n)?;
    if step == 0 {
        return Err(OpsError::Shape {
            kernel: K,
            reason: "step is 1-based, got 0".into(),
        });
    }
    let [mut p, g, mut s] = lock_distinct(K, [param, grad, state])?;
    let (m, v) = s.split_at_mut(n);
    math::adamw(&mut p, &g, m, v, hp, step);
    Ok(())
}

/// `dst[0] = Σ x²` over `srcs`, in f64.
fn sum_squares(rank: u32, dst: &CpuBuffer, srcs: &[CpuBuffer]) -> Result<(), OpsError> {
    const K: &str = "sum_squares";
    expect(K, rank, "dst", dst, 1)?;
    let mut sum = 0.0f64;
    for src in srcs {
        expect(K, rank, "src", src, src.len())?;
        if src.same(dst) {
            return Err(OpsError::Shape {
                kernel: K,
                reason: "a source is the destination".into(),
            });
        }
        sum += math::sum_squares(&src.lock());
    }
    dst.lock()[0] = sum as f32;
    Ok(())
}

/// Scales `bufs` by the clip factor of the squared norm in `norm`.
fn clip(rank: u32, norm: &CpuBuffer, bufs: &[CpuBuffer], max_norm: f32) -> Result<(), OpsError> {
    const K: &str = "clip";
    expect(K, rank, "norm", norm, 1)?;
    for b in bufs {
        expect(K, rank, "grad", b, b.len())?;
        if b.same(norm) {
            return Err(OpsError::Shape {
                kernel: K,
                reason: "a gradient is the norm buffer".into(),
            });
        }
    }
    let sq = norm.lock()[0];
    let Some(f) = math::clip_factor(f64::from(sq), max_norm) else {
        return Ok(());
    };
    for b in bufs {
        math::scale(&mut b.lock(), f);
    }
    Ok(())
}

/// Muon on a whole `rows × cols` matrix.
fn muon(
    rank: u32,
    param: &CpuBuffer,
    grad: &CpuBuffer,
    momentum: &CpuBuffer,
    rows: usize,
    cols: usize,
    hp: &MuonParams,
) -> Result<(), OpsError> {
    const K: &str = "muon";
    let n = rows.checked_mul(cols).ok_or_else(|| OpsError::Shape {
        kernel: K,
        reason: format!("a {rows} × {cols} matrix has more elements than fit in memory"),
    })?;
    expect(K, rank, "param (rows × cols)", param, n)?;
    expect(K, rank, "grad (rows × cols)", grad, n)?;
    expect(K, rank, "momentum (rows × cols)", momentum, n)?;
    let [mut p, g, mut buf] = lock_distinct(K, [param, grad, momentum])?;
    math::muon(&mut p, &g, &mut buf, rows, cols, hp);
    Ok(())
}

/// A member of a group: its index and the group's size.
#[derive(Debug, Clone, Copy)]
struct Member {
    size: u32,
    index: u32,
}

/// The arithmetic half of a copy-transport stage ([`Kernel::Combine`]):
/// `dst = Σ_j x_j` over members `j = 0..size` in group order, `x_index` the rank's own
/// chunk `own[own_offset..own_offset + c]`, the others' chunks at their
/// [`crate::exchange_slot`] of `recv`; for an all-reduce `dst` is the whole output and
/// only the member's chunk of it is written.
///
/// The order of operations is the CPU collective's (`comm::execute`), so that
/// `Combine ∘ Exchange` gives the same bits as the collective: the sum starts from
/// member 0's value (not from zero, which would turn a `-0.0` into `+0.0`), adds the
/// members one by one in f32 (every value rounded to bfloat16 first for `bf16`), and
/// `avg` then divides by `size`.
///
/// `own` and `recv` may be longer than needed (the rest is ignored). `dst` may be the
/// same buffer as `own` (the lengths then force `own_offset` 0) or as `recv` (then a
/// group of two): the result is computed before it is written, and the aliasing is
/// element for element, which a device kernel can do in place too.
fn combine(
    rank: u32,
    desc: &Collective,
    member: Member,
    own: &CpuBuffer,
    own_offset: usize,
    recv: &CpuBuffer,
    dst: &CpuBuffer,
) -> Result<(), OpsError> {
    const K: &str = "combine";
    let shape = |reason: String| OpsError::Shape { kernel: K, reason };
    let Member { size, index } = member;
    for (what, buf) in [("own", own), ("recv", recv), ("dst", dst)] {
        expect(K, rank, what, buf, buf.len())?;
    }
    let (c, at) = crate::combine_lengths(
        desc,
        (size, index),
        (own.len(), own_offset),
        recv.len(),
        dst.len(),
    )
    .map_err(shape)?;
    let own_range = own_offset..own_offset + c;

    // Lock the distinct buffers at once (in id order); `roles` maps own, recv and dst to
    // their guard.
    let mut distinct: Vec<&CpuBuffer> = Vec::with_capacity(3);
    let roles = [own, recv, dst].map(|buf| match distinct.iter().position(|d| d.same(buf)) {
        Some(i) => i,
        None => {
            distinct.push(buf);
            distinct.len() - 1
        }
    });
    let mut guards: Vec<_> = match distinct[..] {
        [a] => lock_distinct(K, [a])?.into_iter().collect(),
        [a, b] => lock_distinct(K, [a, b])?.into_iter().collect(),
        [a, b, c] => lock_distinct(K, [a, b, c])?.into_iter().collect(),
        _ => {
            return Err(OpsError::Backend(format!(
                "combine: {} distinct buffers among three",
                distinct.len()
            )))
        }
    };
    let sum = {
        let (mine, peers) = (&guards[roles[0]][own_range], &guards[roles[1]][..]);
        let x = |j: u32| {
            if j == index {
                mine
            } else {
                let s = crate::exchange_slot(index, j) * c;
                &peers[s..s + c]
            }
        };
        let wire = |v: f32| {
            if desc.dtype == DType::Bf16 {
                math::round_bf16(v)
            } else {
                v
            }
        };
        let mut sum: Vec<f32> = x(0).iter().map(|&v| wire(v)).collect();
        for j in 1..size {
            sum.iter_mut().zip(x(j)).for_each(|(a, &v)| *a += wire(v));
        }
        if desc.op == ReduceOp::Avg {
            let n = size as f32;
            sum.iter_mut().for_each(|a| *a /= n);
        }
        sum
    };
    guards[roles[2]][at..at + c]
        .iter_mut()
        .zip(&sum)
        .for_each(|(d, &v)| *d = v);
    Ok(())
}

/// Validates one copy `from[src..src+len] → to[dst..dst+len]` and returns both ranges.
fn segment(
    kernel: &'static str,
    rank: u32,
    seg: &CopySeg,
    from: &CpuBuffer,
    to: &CpuBuffer,
) -> Result<(Range<usize>, Range<usize>), OpsError> {
    let shape = |reason: String| OpsError::Shape { kernel, reason };
    for buf in [from, to] {
        expect(kernel, rank, "a segment's buffer", buf, buf.len())?;
    }
    if from.same(to) {
        return Err(shape(format!(
            "{from:?} is both a source and the destination"
        )));
    }
    let range = |what: &str, off: u64, buf: &CpuBuffer| match off.checked_add(seg.len) {
        Some(end) if end <= buf.len() as u64 => Ok(off as usize..end as usize),
        _ => Err(shape(format!(
            "segment of param {} ({what} offset {off}, {} elements) exceeds {buf:?}",
            seg.param, seg.len
        ))),
    };
    Ok((
        range("source", seg.src, from)?,
        range("destination", seg.dst, to)?,
    ))
}

/// `to[d] = from[s]` (or `+=`), the ranges validated and of equal length.
fn copy(
    kernel: &'static str,
    to: &CpuBuffer,
    d: Range<usize>,
    from: &CpuBuffer,
    s: Range<usize>,
    accumulate: bool,
) -> Result<(), OpsError> {
    let [mut t, f] = lock_distinct(kernel, [to, from])?;
    let pairs = t[d].iter_mut().zip(&f[s]);
    if accumulate {
        pairs.for_each(|(t, &f)| *t += f);
    } else {
        pairs.for_each(|(t, &f)| *t = f);
    }
    Ok(())
}
