//! The optimizer tail in few launches: AdamW and Muon kernels are validated when they
//! are launched, then held per stream and issued together at the next point where
//! anything could observe them.
//!
//! The executor launches one optimizer kernel per parameter. Launched one by one, 148
//! AdamW updates cost 148 launches and leave the small ones far from the memory
//! bandwidth; Muon's Newton–Schulz runs a matrix at a time. So a stream's consecutive
//! optimizer kernels wait in [`Pending`] and are flushed as multi-tensor AdamW launches
//! (grouped by hyper-parameters, step and guard) and batched Muon steps (grouped by
//! shape, hyper-parameters and guard), before whichever comes first:
//!
//! - any other kernel launched on the stream, a record on it or a wait on it (so the
//!   stream's order with everything else is the order the caller issued);
//! - an optimizer kernel that shares a buffer with a held one (a parameter updated
//!   twice stays in order);
//! - an upload, a download, [`super::CudaBackend::raw_stream`], a reset or the drop.
//!
//! Held kernels touch pairwise distinct parameters and states, so running them in
//! another order, or together, gives the same bits. Held kernels keep their buffers
//! alive (the pool frees a buffer only after its last clone is gone and the stream has
//! passed it). With timings on, a flush is timed as one kernel under the first held
//! kernel's tag.
//!
//! Invariant: a held kernel is issued before any work that the caller issued after it
//! on the same stream, and before any event the caller records on that stream.

use cudarc::driver::sys;
use overlap_graph::Stream;

use super::backend::Shared;
use super::issue::Issue;
use super::memory::CudaBuffer;
use super::muon::{self, BatchLayout};
use super::optim::{adamw_scalars, adamw_tables, AdamwTensor, MuonMats, MUON_MATS};
use crate::{AdamwParams, MuonParams, OpsError, Tag};

/// Most kernels held per stream before a flush.
const MAX_HELD: usize = 512;

/// One validated optimizer step, held until its stream is flushed.
#[derive(Debug)]
pub(super) enum Held {
    Adamw {
        param: CudaBuffer,
        grad: CudaBuffer,
        state: CudaBuffer,
        hp: AdamwParams,
        step: u64,
    },
    Muon {
        param: CudaBuffer,
        grad: CudaBuffer,
        momentum: CudaBuffer,
        rows: usize,
        cols: usize,
        hp: MuonParams,
    },
}

impl Held {
    fn buffers(&self) -> [&CudaBuffer; 3] {
        match self {
            Held::Adamw {
                param, grad, state, ..
            } => [param, grad, state],
            Held::Muon {
                param,
                grad,
                momentum,
                ..
            } => [param, grad, momentum],
        }
    }
}

/// A stream's held optimizer kernels, in launch order, each with its tag and guard.
#[derive(Debug, Default)]
pub(super) struct Pending {
    held: Vec<(Tag, Held, Option<CudaBuffer>)>,
}

impl Pending {
    /// Whether `step` (guarded by `guard`) shares a buffer with a held kernel.
    fn conflicts(&self, step: &Held, guard: Option<&CudaBuffer>) -> bool {
        let new = step.buffers();
        self.held.iter().any(|(_, h, g)| {
            let old = h.buffers();
            new.iter().any(|b| old.iter().any(|o| o.same(b)))
                || g.as_ref().is_some_and(|g| new.iter().any(|b| b.same(g)))
                || guard.is_some_and(|g| old.iter().any(|o| o.same(g)))
        })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// AdamW groups: tensors sharing hyper-parameters, step and guard, in first-seen order.
type AdamwGroups = Vec<((AdamwParams, u64, sys::CUdeviceptr), Vec<AdamwTensor>)>;
/// Muon groups: matrices sharing shape, hyper-parameters and guard.
type MuonKey = ((usize, usize), MuonParams, sys::CUdeviceptr);
type MuonGroups = Vec<(MuonKey, Vec<(u64, u64, u64)>)>;

/// The held kernels grouped for their launches.
fn groups(held: &[(Tag, Held, Option<CudaBuffer>)]) -> (AdamwGroups, MuonGroups) {
    let mut adamw: AdamwGroups = Vec::new();
    let mut muon: MuonGroups = Vec::new();
    for (_, h, guard) in held {
        let g = guard.as_ref().map_or(0, CudaBuffer::ptr);
        match h {
            Held::Adamw {
                param,
                grad,
                state,
                hp,
                step,
            } => {
                let key = (*hp, *step, g);
                let t = AdamwTensor {
                    p: param.ptr(),
                    g: grad.ptr(),
                    m: state.ptr(),
                    v: state.at(param.len as u64),
                    n: param.len as u64,
                    block0: 0,
                };
                match adamw.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.push(t),
                    None => adamw.push((key, vec![t])),
                }
            }
            Held::Muon {
                param,
                grad,
                momentum,
                rows,
                cols,
                hp,
            } => {
                let key = ((*rows, *cols), *hp, g);
                let m = (param.ptr(), momentum.ptr(), grad.ptr());
                match muon.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.push(m),
                    None => muon.push((key, vec![m])),
                }
            }
        }
    }
    (adamw, muon)
}

impl Issue {
    /// Holds a validated optimizer step on `stream` (flushing first what it conflicts
    /// with, or a full queue).
    pub(super) fn hold(
        &mut self,
        shared: &Shared,
        stream: Stream,
        tag: Tag,
        step: Held,
        guard: Option<&CudaBuffer>,
    ) {
        let pending = &self.pending[stream.index()];
        if pending.held.len() >= MAX_HELD || pending.conflicts(&step, guard) {
            self.flush(shared, stream);
        }
        self.pending[stream.index()]
            .held
            .push((tag, step, guard.cloned()));
    }

    /// Issues every optimizer step held on `stream`. A failure is reported under the
    /// first held kernel's tag and poisons the stream, as a failed launch does.
    pub(super) fn flush(&mut self, shared: &Shared, stream: Stream) {
        let held = std::mem::take(&mut self.pending[stream.index()].held);
        let Some(&(tag, _, _)) = held.first() else {
            return;
        };
        let raw = shared.device.stream(stream);
        let start = if self.timings.on {
            self.timing_event(shared, raw)
        } else {
            None
        };
        let result = self.issue_held(shared, stream, raw, &held);
        self.end_timing(
            shared,
            (stream, raw),
            tag,
            start,
            result.as_ref().ok().map(|()| 0),
        );
        if let Err(e) = result {
            let cause = format!(
                "{} (node {}) on rank {}, {stream} stream failed: {e}",
                tag.op, tag.node, shared.rank
            );
            shared.report(stream, tag, e);
            self.poison[stream.index()].get_or_insert(OpsError::Cancelled(cause));
        }
        // The buffers go back to the pool only now, after their kernels were issued.
        drop(held);
    }

    /// Flushes every stream.
    pub(super) fn flush_all(&mut self, shared: &Shared) {
        for s in Stream::ALL {
            self.flush(shared, s);
        }
    }

    fn issue_held(
        &mut self,
        shared: &Shared,
        stream: Stream,
        raw: sys::CUstream,
        held: &[(Tag, Held, Option<CudaBuffer>)],
    ) -> Result<(), OpsError> {
        let (adamw, muon) = groups(held);
        for ((hp, step, guard), tensors) in adamw {
            for launch in adamw_tables(&tensors, adamw_scalars(&hp, step), guard) {
                self.kernels.optim.adamw_multi(raw, &launch)?;
            }
        }
        for (((rows, cols), hp, guard), mats) in muon {
            for chunk in mats.chunks(MUON_MATS) {
                let layout =
                    BatchLayout::new((rows, cols), chunk.len(), hp.ns_dtype).ok_or_else(|| {
                        OpsError::Shape {
                            kernel: "muon",
                            reason: format!(
                            "{} matrices of {rows} × {cols} need more scratch than fits in memory",
                            chunk.len()
                        ),
                        }
                    })?;
                let scratch = self.scratch(shared, stream, layout.bytes)?;
                muon::run_batch(
                    &self.kernels,
                    &self.blas[stream.index()],
                    raw,
                    (scratch, &layout),
                    &MuonMats::of(chunk),
                    &hp,
                    guard,
                )?;
            }
        }
        Ok(())
    }
}
