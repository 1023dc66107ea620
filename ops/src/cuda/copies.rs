//! The local copy kernels: [`Kernel::Add`], [`Kernel::Pack`] (sources summed into the
//! send buffer two per pass) and [`Kernel::Unpack`], as batched segment launches.
//!
//! Invariant: copies run in the caller's order; a batch only ever holds copies whose
//! destinations do not overlap.

use cudarc::driver::sys;
use overlap_graph::CopySeg;

use super::checks::{expect, segment};
use super::device;
use super::issue::Issue;
use super::kernels::{self, Kernels, Seg};
use super::memory::CudaBuffer;
#[cfg(doc)]
use crate::Kernel;
use crate::OpsError;

impl Issue {
    /// [`Kernel::Add`]: `dst = src` (or `+=`), both checked to hold `dst`'s length.
    pub(super) fn add(
        &self,
        rank: u32,
        raw: sys::CUstream,
        (dst, src): (&CudaBuffer, &CudaBuffer),
        accumulate: bool,
    ) -> Result<(), OpsError> {
        expect("add", rank, "dst", dst, dst.len)?;
        expect("add", rank, "src", src, dst.len)?;
        self.kernels
            .add(raw, dst.ptr(), src.ptr(), dst.len as u64, accumulate)
    }

    /// [`Kernel::Pack`]: validated, then summed into `dst` in passes of two sources
    /// ([`pack_phases`]), `dst` zeroed first unless the first pass writes it whole.
    pub(super) fn pack(
        &self,
        rank: u32,
        raw: sys::CUstream,
        dst: &CudaBuffer,
        segs: &[(CopySeg, Vec<CudaBuffer>)],
    ) -> Result<(), OpsError> {
        const K: &str = "pack";
        expect(K, rank, "dst", dst, dst.len)?;
        let phases = pack_phases(rank, dst, segs)?;
        let covers = first_phase_covers(&phases, dst.len);
        if dst.len > 0 && !covers {
            // SAFETY: `dst` holds `len` words; the memset is ordered on `raw`.
            unsafe { sys::cuMemsetD32Async(dst.ptr(), 0, dst.len, raw) }
                .result()
                .map_err(|e| device::failed(K, e))?;
        }
        for (k, phase) in phases.into_iter().enumerate() {
            run_disjoint(&self.kernels, K, raw, phase, !(covers && k == 0))?;
        }
        Ok(())
    }

    /// [`Kernel::Unpack`]: validated, then copied (or added) from `src` into each
    /// segment's destination.
    pub(super) fn unpack(
        &self,
        rank: u32,
        raw: sys::CUstream,
        src: &CudaBuffer,
        segs: &[(CopySeg, CudaBuffer)],
        accumulate: bool,
    ) -> Result<(), OpsError> {
        const K: &str = "unpack";
        let mut copies = Vec::with_capacity(segs.len());
        for (seg, dst) in segs.iter() {
            segment(K, rank, seg, src, dst)?;
            copies.push(Seg {
                a: src.at(seg.src),
                b: 0,
                dst: dst.at(seg.dst),
                len: seg.len,
            });
        }
        run_disjoint(&self.kernels, K, raw, copies, accumulate)
    }
}

/// Validates a pack's segments and groups its copies into passes: pass `k` sums the
/// sources `2k` and `2k + 1` of every segment into `dst` (`dst = (dst + a) + b`).
fn pack_phases(
    rank: u32,
    dst: &CudaBuffer,
    segs: &[(CopySeg, Vec<CudaBuffer>)],
) -> Result<Vec<Vec<Seg>>, OpsError> {
    let mut phases: Vec<Vec<Seg>> = Vec::new();
    for (seg, srcs) in segs.iter() {
        for src in srcs {
            segment("pack", rank, seg, src, dst)?;
        }
        // Sources are summed in order, two per pass: dst = (dst + a) + b.
        for (k, pair) in srcs.chunks(2).enumerate() {
            if phases.len() <= k {
                phases.push(Vec::new());
            }
            phases[k].push(Seg {
                a: pair[0].at(seg.src),
                b: pair.get(1).map_or(0, |b| b.at(seg.src)),
                dst: dst.at(seg.dst),
                len: seg.len,
            });
        }
    }
    Ok(phases)
}

/// Whether a pack's first pass copies single sources over every one of the `len`
/// elements of `dst` exactly once, writing it whole: then no memset, and a copy
/// instead of an accumulate (one pass over `dst` instead of three).
fn first_phase_covers(phases: &[Vec<Seg>], len: usize) -> bool {
    phases.first().is_some_and(|first| {
        let mut spans: Vec<(u64, u64)> = first
            .iter()
            .filter(|s| s.b == 0)
            .map(|s| (s.dst, s.dst + s.len * 4))
            .collect();
        spans.sort_unstable();
        spans.len() == first.len()
            && spans.windows(2).all(|w| w[0].1 <= w[1].0)
            && first.iter().map(|s| s.len).sum::<u64>() == len as u64
    })
}

/// Runs copies in order, batching those whose destinations do not overlap (a copy that
/// overlaps an earlier one of the batch starts the next batch, keeping program order).
fn run_disjoint(
    kernels: &Kernels,
    kernel: &'static str,
    stream: sys::CUstream,
    copies: Vec<Seg>,
    accumulate: bool,
) -> Result<(), OpsError> {
    let mut batch: Vec<Seg> = Vec::with_capacity(kernels::MAX_SEGS);
    for c in copies {
        let end = c.dst + c.len * 4;
        let overlaps = batch
            .iter()
            .any(|b| c.dst < b.dst + b.len * 4 && b.dst < end);
        if overlaps || batch.len() == kernels::MAX_SEGS {
            kernels.segments(kernel, stream, &batch, accumulate)?;
            batch.clear();
        }
        batch.push(c);
    }
    kernels.segments(kernel, stream, &batch, accumulate)
}
