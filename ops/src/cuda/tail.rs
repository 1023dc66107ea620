//! The step's tail as issued: the global norm ([`Kernel::SumSquares`], two atomics-free
//! passes through the stream's scratch), [`Kernel::Clip`], and the optimizer kernels
//! ([`Kernel::Adamw`], [`Kernel::Muon`], guarded or not by [`Kernel::IfFinite`]),
//! validated here and then held on their stream (`defer.rs`) until a flush issues
//! them together (`flush.rs`).
//!
//! Invariant: the norm never reaches the host during a step: the clip and the guarded
//! optimizers read it in device memory.

use std::sync::Arc;

use overlap_graph::Stream;

use super::backend::Shared;
use super::checks::{check_adamw, check_muon, expect};
use super::defer::{Held, HeldClip, HeldNorm, MAX_HELD};
use super::issue::Issue;
use super::memory::CudaBuffer;
use super::row::HeldRow;
use crate::{Kernel, OpsError, Tag};

impl Issue {
    /// A kernel of the step's tail: an optimizer (guarded by [`Kernel::IfFinite`] or
    /// not), [`Kernel::SumSquares`] or [`Kernel::Clip`].
    pub(super) fn tail(
        &mut self,
        shared: &Shared,
        (stream, tag): (Stream, Tag),
        kernel: Kernel<CudaBuffer>,
    ) -> Result<(), OpsError> {
        let rank = shared.rank;
        match kernel {
            Kernel::SumSquares { dst, srcs } => self.sum_squares(shared, (stream, tag), dst, srcs),
            Kernel::Clip {
                norm,
                bufs,
                max_norm,
            } => self.clip(shared, (stream, tag), norm, bufs, max_norm),
            // The optimizer, told to read the norm on the device and do nothing when it
            // is not finite: no extra launch, no host synchronisation.
            Kernel::IfFinite { norm, kernel } => {
                expect("if_finite", rank, "norm", &norm, 1)?;
                self.optimizer(shared, (stream, tag), rank, *kernel, Some(&norm))
            }
            optimizer => self.optimizer(shared, (stream, tag), rank, optimizer, None),
        }
    }

    /// [`Kernel::Optimizers`]: held as one where that is certain to flush as its steps
    /// would (`row.rs`); else each step validated and held as its own kernel would be,
    /// under its own tag, without a kernel of its own (no guard boxed). A poisoned
    /// stream issues none; a step that fails poisons the stream, so the steps after it
    /// are skipped, as when launched one by one; gradients that do not match the steps
    /// fail the row under its tag.
    pub(super) fn optimizers(
        &mut self,
        shared: &Shared,
        (stream, tag): (Stream, Tag),
        row: HeldRow,
    ) {
        let rank = shared.rank;
        if self.poison[stream.index()].is_some() {
            return;
        }
        if row.grads.len() != row.steps.len() {
            let e = crate::optimizers_mismatch(row.steps.len(), row.grads.len());
            return self.fail(shared, (stream, tag), e);
        }
        // The guard is every step's: checked once, a bad one fails the first step (and
        // so, the stream poisoned, the row), as the steps launched one by one would.
        if let Some(norm) = &row.guard {
            if let (Err(e), Some(first)) = (
                expect("if_finite", rank, "norm", norm, 1),
                row.steps.first(),
            ) {
                return self.fail(shared, (stream, first.tag), e);
            }
        }
        let row = if self.row_hold {
            let memo = self.rows.of(rank, &row.steps, MAX_HELD);
            match self.pending[stream.index()].hold_row(row, memo, self.fuse_clip) {
                Ok(()) => return,
                Err(row) => row,
            }
        } else {
            row
        };
        let guard = row.guard.as_ref();
        for (s, grad) in row.steps.iter().zip(row.grads) {
            if self.poison[stream.index()].is_some() {
                return;
            }
            let kernel = s.kernel(grad, row.step, row.lr_factor);
            if let Err(e) = self.optimizer(shared, (stream, s.tag), rank, kernel, guard) {
                self.fail(shared, (stream, s.tag), e);
            }
        }
    }

    /// [`Kernel::Clip`]: validated (no gradient may be the norm), then held on the
    /// stream (`defer.rs`): the optimizers held after it that read a gradient it scales
    /// apply the factor themselves, and one clip kernel scales the rest at the flush,
    /// each from the norm on the device.
    pub(super) fn clip(
        &mut self,
        shared: &Shared,
        (stream, tag): (Stream, Tag),
        norm: CudaBuffer,
        bufs: Arc<[CudaBuffer]>,
        max_norm: f32,
    ) -> Result<(), OpsError> {
        const K: &str = "clip";
        expect(K, shared.rank, "norm", &norm, 1)?;
        // Scaling exactly what the held norm sums (no empty buffer aside), by the norm's
        // result, it passes the norm's checks: no need to repeat them.
        let norms_list = self.pending[stream.index()].norm().is_some_and(|n| {
            n.dst.same(&norm)
                && n.srcs.len() == bufs.len()
                && n.srcs.iter().zip(bufs.iter()).all(|(a, b)| a.same(b))
        });
        for b in bufs.iter().filter(|_| !norms_list) {
            expect(K, shared.rank, "grad", b, b.len)?;
            if b.same(&norm) {
                return Err(OpsError::Shape {
                    kernel: K,
                    reason: "a gradient is the norm buffer".into(),
                });
            }
        }
        let held = HeldClip {
            tag,
            norm,
            bufs: non_empty(bufs),
            max_norm,
            norms_list,
        };
        self.hold_clip(shared, stream, held);
        Ok(())
    }

    /// An optimizer kernel (AdamW or Muon), guarded by the global norm (`guard`: it does
    /// nothing when the norm there is not finite) or not: validated, then held on the
    /// stream until its next flush (`defer.rs`).
    pub(super) fn optimizer(
        &mut self,
        shared: &Shared,
        (stream, tag): (Stream, Tag),
        rank: u32,
        kernel: Kernel<CudaBuffer>,
        guard: Option<&CudaBuffer>,
    ) -> Result<(), OpsError> {
        let held = Held::of(kernel).map_err(|other| OpsError::Shape {
            kernel: "if_finite",
            reason: format!(
                "the CUDA backend guards optimizers (adamw, muon) only, got {}",
                other.name()
            ),
        })?;
        match &held {
            Held::Adamw {
                param,
                grad,
                state,
                step,
                ..
            } => check_adamw(rank, (param, grad, state), *step, guard)?,
            Held::Muon {
                param,
                grad,
                momentum,
                rows,
                cols,
                ..
            } => {
                check_muon(rank, (param, grad, momentum), (*rows, *cols), guard)?;
                if *rows == 0 || *cols == 0 {
                    return Ok(());
                }
            }
        }
        self.hold(shared, stream, tag, held, guard);
        Ok(())
    }

    /// [`Kernel::SumSquares`]: validated as the CPU backend does, then held on the
    /// stream (`defer.rs`) and issued first at its flush as two passes (`kernels.cu`'s
    /// `ov_sumsq_spans` and `ov_sumsq_final`) through the stream's scratch
    /// (`flush.rs`). Buffers hold f32 on this backend (reduced gradients included,
    /// whatever the wire dtype), and the sum is taken in f64 and stored as f32, as the
    /// reference.
    pub(super) fn sum_squares(
        &mut self,
        shared: &Shared,
        (stream, tag): (Stream, Tag),
        dst: CudaBuffer,
        srcs: Arc<[CudaBuffer]>,
    ) -> Result<(), OpsError> {
        const K: &str = "sum_squares";
        expect(K, shared.rank, "dst", &dst, 1)?;
        for src in srcs.iter() {
            expect(K, shared.rank, "src", src, src.len)?;
            if src.same(&dst) {
                return Err(OpsError::Shape {
                    kernel: K,
                    reason: "a source is the destination".into(),
                });
            }
        }
        let srcs = non_empty(srcs);
        self.hold_norm(shared, stream, HeldNorm { tag, dst, srcs });
        Ok(())
    }
}

/// `bufs` without its empty buffers: the same list, not a copy, when it has none.
fn non_empty(bufs: Arc<[CudaBuffer]>) -> Arc<[CudaBuffer]> {
    if bufs.iter().all(|b| b.len > 0) {
        bufs
    } else {
        bufs.iter().filter(|b| b.len > 0).cloned().collect()
    }
}
