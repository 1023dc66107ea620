//! The issuing state ([`Issue`]) and the issue of one kernel: [`Issue::launch`] decides
//! what a poisoned stream still issues, holds optimizer kernels (`defer.rs`), times the
//! rest (`timing.rs`) and turns a failure into the stream's poison; [`Issue::run`]
//! dispatches each kernel kind to its family (`copies.rs`, `collective.rs`,
//! `transport.rs`, `tail.rs`, `gemm.rs`), each validating its arguments first
//! (`checks.rs`).
//!
//! Invariant: everything is issued under the one issue lock, in the order the caller
//! launched it, so that cuBLAS handles and per-stream scratch are never used
//! concurrently and every rank issues in plan order.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys;
use overlap_graph::Stream;

use super::backend::Shared;
use super::defer::Pending;
use super::exchange::{CopyRing, InPlace};
use super::kernels::Kernels;
use super::memory::{CudaBuffer, DevMem};
use super::muon::Blas;
use super::nccl::Comm;
use super::row::HeldRow;
use super::tail_graph::TailGraphs;
use super::timing::{PendingTiming, Timings};
use crate::{CommId, Kernel, OpsError, Tag};

/// The issuing state, behind one lock so that every rank issues in plan order and
/// cuBLAS handles and scratch are never used concurrently.
pub(super) struct Issue {
    /// Each stream's poison (a cancellation naming the root cause).
    pub(super) poison: [Option<OpsError>; Stream::COUNT],
    pub(super) comms: Vec<Comm>,
    /// The copy transport's rings, one per communicator of more than one member, once
    /// [`CudaBackend::connect_copy`] ran.
    pub(super) copy: Vec<CopyRing>,
    pub(super) kernels: Kernels,
    /// Exchanges received in place and not yet combined, by their receive buffer's
    /// address: the combine reads the ring there and acknowledges the pieces.
    pub(super) in_place: HashMap<sys::CUdeviceptr, (CommId, InPlace)>,
    /// At most this many CTAs per [`Kernel::Combine`] (`None`: enough for one element
    /// per thread, up to the launch cap).
    pub(super) combine_ctas: Option<u32>,
    /// Combines load and store with cache-streaming hints ([`CudaBackend::set_combine_streaming`]).
    pub(super) combine_streaming: bool,
    /// Whether a poisoned stream's collectives still join their peers (module docs).
    pub(super) poisoned_join: bool,
    /// One cuBLAS handle per stream, at [`Stream::index`].
    pub(super) blas: Vec<Blas>,
    /// Scratch per stream, at [`Stream::index`].
    pub(super) scratch: [Option<Arc<DevMem>>; Stream::COUNT],
    /// The read-only bf16 operands `A` then `B` of [`Kernel::Gemm`], filled once with
    /// pseudo-random values, with their `(m, n, k)`.
    pub(super) gemm: Option<((u32, u32, u32), Arc<DevMem>)>,
    pub(super) timings: Timings,
    /// Optimizer kernels validated and held per stream, at [`Stream::index`], until
    /// the stream is flushed (`defer.rs`).
    pub(super) pending: [Pending; Stream::COUNT],
    /// Whether a row of optimizers may be held as one (`row.rs`; `OVERLAP_ROW_HOLD=0`
    /// holds every row step by step, a diagnostic).
    pub(super) row_hold: bool,
    /// What is known of the lists of optimizer steps last held as rows (`row.rs`).
    pub(super) rows: super::row::RowMemos,
    /// Whether optimizers apply a held clip to the gradients they read (`defer.rs`;
    /// [`CudaBackend::set_clip_fusion`]).
    pub(super) fuse_clip: bool,
    /// Each stream's captured optimizer flushes, at [`Stream::index`]
    /// (`tail_graph.rs`).
    pub(super) tail_graphs: [TailGraphs; Stream::COUNT],
    /// Each stream's flush planned once per shape (`flush_cache.rs`).
    pub(super) plans: [super::flush_cache::FlushCache; Stream::COUNT],
    /// Where the flushes' host time goes (`OVERLAP_FLUSH_CLOCK=1`; `defer.rs`).
    pub(super) flush_clock: Option<super::defer::FlushClocks>,
    /// Flushes that issued held kernels ([`super::CudaBackend::flushes`]).
    pub(super) flushes: u64,
    /// The last ticket of a record deferred behind held kernels (`defer.rs`).
    pub(super) tickets: u64,
    /// The record each stream last waited for, at [`Stream::index`]: waiting for it
    /// again orders nothing more, so it costs no `cuStreamWaitEvent` (the events
    /// deferred behind one flush share one record, and a plan waits for each).
    pub(super) last_wait: [Option<Arc<super::event::Record>>; Stream::COUNT],
}

/// Whether `kernel` is held on its stream rather than issued at once (`defer.rs`): an
/// optimizer, guarded or not, the global norm or its clip.
fn is_held(kernel: &Kernel<CudaBuffer>) -> bool {
    match kernel {
        Kernel::Adamw { .. }
        | Kernel::Muon { .. }
        | Kernel::Clip { .. }
        | Kernel::SumSquares { .. } => true,
        Kernel::IfFinite { kernel, .. } => {
            matches!(**kernel, Kernel::Adamw { .. } | Kernel::Muon { .. })
        }
        _ => false,
    }
}

// SAFETY: `Issue` holds driver, cuBLAS and NCCL handles that are only used under the
// backend's mutex with the context bound; none is tied to the thread that created it.
unsafe impl Send for Issue {}

impl Issue {
    /// Issues `kernel`, launched by `tag` on `stream`: skipped on a poisoned stream
    /// (unless it must still join its peers), held when it is an optimizer, timed when
    /// timings are on; a failure is reported and poisons the stream.
    pub(super) fn launch(
        &mut self,
        shared: &Shared,
        stream: Stream,
        tag: Tag,
        kernel: Kernel<CudaBuffer>,
    ) {
        let kernel = match kernel {
            Kernel::Optimizers(crate::OptimizerRow {
                steps,
                grads,
                guard,
                step,
                lr_factor,
            }) => {
                let row = HeldRow {
                    steps,
                    grads,
                    guard,
                    step,
                    lr_factor,
                    clipped: false,
                };
                return self.optimizers(shared, (stream, tag), row);
            }
            kernel => kernel,
        };
        // An optimizer kernel is validated now and held (`defer.rs`); anything else
        // issues the held ones first, keeping the stream's order.
        let held = is_held(&kernel);
        if !held {
            self.flush(shared, stream);
        }
        let poison = self.poison[stream.index()].clone();
        // Collectives and exchanges run even on a poisoned stream, unless the job is told
        // of failures another way: their peers wait for them (`set_poisoned_collectives_join`).
        let collective = self.poisoned_join
            && matches!(
                kernel,
                Kernel::Collective { .. } | Kernel::Exchange { .. } | Kernel::Gather { .. }
            );
        if poison.is_some() && !collective {
            // A combine that read a ring in place still acknowledges its pieces.
            if let Kernel::Combine { recv, desc, .. } = &kernel {
                if let Some((id, k)) = self.take_in_place(recv, desc) {
                    let _ = self.ack_in_place(shared.device.stream(stream), id, &k);
                }
            }
            return;
        }
        let raw = shared.device.stream(stream);
        if matches!(kernel, Kernel::Marker) {
            // A marker launches nothing (stream order already orders it); with timings on
            // it is one timing event, a zero-length point of the stream's timeline, as
            // the CPU backend reports it.
            if self.timings.on {
                if let Some(at) = self.timing_event(shared, raw) {
                    self.timings.pending.push(PendingTiming {
                        stream,
                        tag,
                        start: at,
                        end: at,
                        bytes: 0,
                    });
                }
            }
            return;
        }
        let start = if self.timings.on && poison.is_none() && !held {
            self.timing_event(shared, raw)
        } else {
            None
        };
        let result = self.run(shared, (stream, raw, tag), kernel, poison);
        self.end_timing(
            shared,
            (stream, raw),
            tag,
            start,
            result.as_ref().ok().copied(),
        );
        if let Err(e) = result {
            self.fail(shared, (stream, tag), e);
        }
    }

    /// A kernel of `tag` failed on `stream`: a cancellation poisons the stream with
    /// itself, anything else is reported as a root cause and poisons the stream with a
    /// cancellation that names it.
    pub(super) fn fail(&mut self, shared: &Shared, (stream, tag): (Stream, Tag), e: OpsError) {
        if e.is_cancellation() {
            self.poison[stream.index()].get_or_insert(e);
            return;
        }
        let cause = format!(
            "{} (node {}) on rank {}, {stream} stream failed: {e}",
            tag.op, tag.node, shared.rank
        );
        shared.report(stream, tag, e);
        self.poison[stream.index()].get_or_insert(OpsError::Cancelled(cause));
    }

    /// Runs one kernel (validated first); returns the bytes a collective moved.
    fn run(
        &mut self,
        shared: &Shared,
        (stream, raw, tag): (Stream, sys::CUstream, Tag),
        kernel: Kernel<CudaBuffer>,
        poison: Option<OpsError>,
    ) -> Result<u64, OpsError> {
        let rank = shared.rank;
        match kernel {
            Kernel::Marker => Ok(0),
            Kernel::Spin { micros } => self.kernels.spin(raw, micros).map(|()| 0),
            Kernel::Gemm { m, n, k, count } => {
                self.gemm(shared, stream, (m, n, k), count).map(|()| 0)
            }
            Kernel::Add {
                dst,
                src,
                accumulate,
            } => self.add(rank, raw, (&dst, &src), accumulate).map(|()| 0),
            Kernel::Pack { dst, segs } => self.pack(rank, raw, &dst, &segs).map(|()| 0),
            Kernel::Unpack {
                src,
                segs,
                accumulate,
            } => self.unpack(rank, raw, &src, &segs, accumulate).map(|()| 0),
            Kernel::Collective {
                desc,
                comm,
                send,
                recv,
            } => self.collective(shared, stream, raw, &desc, comm, send, recv, poison),
            Kernel::Exchange {
                desc,
                comm,
                send,
                recv,
            } => {
                let bufs = (send, recv);
                self.exchange(shared, stream, raw, &desc, comm, bufs, false, poison)
            }
            // The gather's one buffer is both what it sends (its chunk) and where it
            // receives (the others').
            Kernel::Gather { desc, comm, buf } => {
                let bufs = (buf.clone(), buf);
                self.exchange(shared, stream, raw, &desc, comm, bufs, true, poison)
            }
            Kernel::Combine {
                desc,
                size,
                index,
                own,
                own_offset,
                recv,
                dst,
            } => {
                let own = (&own, own_offset);
                let ran = self.combine(rank, raw, &desc, (size, index), own, (&recv, &dst));
                ran.map(|()| 0)
            }
            tail @ (Kernel::Adamw { .. }
            | Kernel::Muon { .. }
            | Kernel::SumSquares { .. }
            | Kernel::Clip { .. }
            | Kernel::IfFinite { .. }) => self.tail(shared, (stream, tag), tail).map(|()| 0),
            // Taken apart in `launch`.
            Kernel::Optimizers(_) => Err(OpsError::Backend(
                "a row of optimizers reached the kernel dispatch".into(),
            )),
        }
    }

    /// The stream's scratch, grown to at least `bytes`. Only work on this stream uses
    /// it, so stream order protects it; a replaced block is retired (and fenced).
    pub(super) fn scratch(
        &mut self,
        shared: &Shared,
        stream: Stream,
        bytes: usize,
    ) -> Result<u64, OpsError> {
        let slot = &mut self.scratch[stream.index()];
        if let Some(mem) = slot.as_ref().filter(|m| m.bytes() >= bytes) {
            return Ok(mem.ptr());
        }
        let grown = slot.as_ref().map_or(0, |m| m.bytes().saturating_mul(2));
        *slot = None;
        let mem = shared.memory.alloc_raw(bytes.max(grown).max(1 << 20))?;
        let ptr = mem.ptr();
        *slot = Some(mem);
        Ok(ptr)
    }
}
