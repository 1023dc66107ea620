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
//! - any other kernel launched on the stream, or a wait on it (so the stream's order
//!   with everything else is the order the caller issued);
//! - a wait for, or a query of, an event recorded on the stream behind held kernels;
//! - an optimizer kernel that shares a buffer with a held one (a parameter updated
//!   twice stays in order);
//! - an upload, a download, [`super::CudaBackend::raw_stream`], a reset or the drop.
//!
//! A record on a stream that holds kernels does not flush it: the record is deferred
//! ([`Issue::defer_record`]) and made after the flush, one record for every event
//! deferred behind it (a plan records an event after each optimizer, for its publish,
//! and would otherwise cut the held set into single launches).
//!
//! Held kernels touch pairwise distinct parameters and states, so running them in
//! another order, or together, gives the same bits. Held kernels keep their buffers
//! alive (the pool frees a buffer only after its last clone is gone and the stream has
//! passed it). With timings on, a flush is timed as one kernel under the first held
//! kernel's tag.
//!
//! The global norm's clip ([`crate::Kernel::Clip`]) is held the same way, and fused: a
//! held optimizer whose gradient the held clip scales reads the factor on the device,
//! scales the gradient as it reads it and stores it back (`FusedClip`), so the clip
//! costs no pass of its own over those gradients; at the flush a separate clip kernel
//! scales only the clip's buffers that no held optimizer read. A clip is held only
//! behind nothing or a held norm (the stream is flushed first otherwise), and an
//! optimizer that would write a buffer the clip scales (other than reading it as its
//! gradient) flushes the clip first, so every buffer ends as the unfused order leaves
//! it.
//!
//! The global norm ([`crate::Kernel::SumSquares`]) is held too, behind nothing, and
//! issued first at the flush (`flush.rs`), so a clipped tail (the norm, the clip, the
//! guarded optimizers) is one flush and, once it repeats, one replayed graph
//! (`tail_graph.rs`). An optimizer that would write a buffer the norm reads, or the
//! norm itself, flushes it first.
//!
//! Invariant: a held kernel is issued before any work that the caller issued after it
//! on the same stream, and before the record of any event the caller records on that
//! stream after it (a deferred record is made after the flush, and no wait or query
//! sees the event before).

use std::sync::Arc;

use cudarc::driver::sys;
use overlap_graph::Stream;

use super::backend::Shared;
use super::event::{CudaEvent, Record};
use super::flush_cache::{role, FlushCache, RowNames, Shape, StepNames};
use super::issue::Issue;
use super::memory::CudaBuffer;
use super::optim::{adamw_scalars, muon_scalars};
use super::row::{HeldRow, RowMemo};
use crate::{AdamwParams, Kernel, MuonParams, OpsError, Tag};

/// Most kernels held per stream before a flush.
pub(super) const MAX_HELD: usize = 512;

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

/// What a held step's scalar block in a flush's words is made of (`flush.rs`): AdamW's
/// settings and step, or Muon's settings and shape.
#[derive(Debug, Clone, Copy)]
pub(super) enum StepScalars {
    Adamw(AdamwParams, u64),
    Muon(MuonParams, (usize, usize)),
}

impl StepScalars {
    /// Writes the block (f64 bits) into the start of `words`.
    pub(super) fn write(&self, words: &mut [u64]) {
        let mut put = |xs: &[f64]| {
            for (w, x) in words.iter_mut().zip(xs) {
                *w = x.to_bits();
            }
        };
        match self {
            StepScalars::Adamw(hp, step) => put(&adamw_scalars(hp, *step)),
            StepScalars::Muon(hp, shape) => put(&muon_scalars(hp, *shape)),
        }
    }
}

/// A flush's held steps: one by one, or a row held as one (`row.rs`).
#[derive(Clone, Copy)]
pub(super) enum HeldSteps<'a> {
    Entries(&'a [Entry]),
    Row(&'a HeldRow),
}

impl HeldSteps<'_> {
    /// Step `e`'s scalars.
    pub(super) fn scalars(&self, e: usize) -> StepScalars {
        match self {
            HeldSteps::Entries(held) => held[e].1.scalars(),
            HeldSteps::Row(row) => row.scalars(e),
        }
    }
}

impl Held {
    /// An AdamW or Muon kernel as held (any other kernel back).
    pub(super) fn of(kernel: Kernel<CudaBuffer>) -> Result<Held, Kernel<CudaBuffer>> {
        match kernel {
            Kernel::Adamw {
                param,
                grad,
                state,
                hp,
                step,
            } => Ok(Held::Adamw {
                param,
                grad,
                state,
                hp,
                step,
            }),
            Kernel::Muon {
                param,
                grad,
                momentum,
                rows,
                cols,
                hp,
            } => Ok(Held::Muon {
                param,
                grad,
                momentum,
                rows,
                cols,
                hp,
            }),
            other => Err(other),
        }
    }

    /// Its scalar settings.
    pub(super) fn scalars(&self) -> StepScalars {
        match self {
            Held::Adamw { hp, step, .. } => StepScalars::Adamw(*hp, *step),
            Held::Muon { hp, rows, cols, .. } => StepScalars::Muon(*hp, (*rows, *cols)),
        }
    }

    pub(super) fn buffers(&self) -> [&CudaBuffer; 3] {
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

/// A held [`crate::Kernel::SumSquares`] (the global norm), validated: issued first at
/// the flush, so the clip and the guarded optimizers held behind it read its result.
#[derive(Debug)]
pub(super) struct HeldNorm {
    pub(super) tag: Tag,
    /// The one-float squared norm it writes.
    pub(super) dst: CudaBuffer,
    /// The gradients it reads (the non-empty ones): the kernel's own list when none is
    /// empty (no copy).
    pub(super) srcs: Arc<[CudaBuffer]>,
}

/// A held [`crate::Kernel::Clip`], validated.
#[derive(Debug)]
pub(super) struct HeldClip {
    pub(super) tag: Tag,
    /// The one-float squared global norm.
    pub(super) norm: CudaBuffer,
    /// The gradients it scales (the non-empty ones), as [`HeldNorm::srcs`].
    pub(super) bufs: Arc<[CudaBuffer]>,
    pub(super) max_norm: f32,
    /// Whether it scales exactly the held norm's sources, in their order, and reads the
    /// norm's result: then the norm's checks were its own, and a flush's shape names the
    /// buffers once (`flush_cache.rs`).
    pub(super) norms_list: bool,
}

/// One held optimizer step: its tag, the step, its guard, and whether it applies the
/// held clip to its gradient.
pub(super) type Entry = (Tag, Held, Option<CudaBuffer>, bool);

/// A stream's held norm, clip and optimizer kernels, in launch order (the norm, then
/// the clip, first), with the flush's shape so far ([`Shape`]: its key, its buffers'
/// numbers and each buffer's roles), so that checking a new kernel against everything
/// held is a few lookups of its buffers.
#[derive(Debug, Default)]
pub(super) struct Pending {
    norm: Option<HeldNorm>,
    clip: Option<HeldClip>,
    held: Vec<Entry>,
    /// A row held as one (`row.rs`): nothing is held after it.
    row: Option<HeldRow>,
    shape: Shape,
    /// Events recorded on the stream behind the held kernels, with their tickets: they
    /// land on one record made after the flush.
    records: Vec<(CudaEvent, u64)>,
}

impl Pending {
    /// Whether a step whose guard and buffers had `roles` before it was named shares a
    /// buffer with a held kernel (a guard shared by two is no conflict: nothing writes
    /// it), or touches one the held clip scales or reads other than as its gradient.
    fn conflicts(&self, roles: [u8; 4]) -> bool {
        let [guard, p, g, s] = roles;
        let any = p | g | s;
        let with_held = any & (role::HELD | role::GUARD) != 0 || guard & role::HELD != 0;
        // The norm is issued first: a step may read what it reads (its gradient, which
        // a fused clip then scales) and its result (as the guard), but not write it.
        let with_norm = self.norm.is_some()
            && ((p | s) & (role::NORM_SRC | role::NORM_DST) != 0 || g & role::NORM_DST != 0);
        let scaled = self.scaled();
        let with_clip = self.clip.is_some()
            && ((p | s) & scaled != 0 || any & role::CLIP_NORM != 0 || guard & scaled != 0);
        with_held || with_clip || with_norm
    }

    /// The role of the buffers the held clip scales: its own list's, or the norm's
    /// sources when it scales those.
    fn scaled(&self) -> u8 {
        match &self.clip {
            Some(c) if c.norms_list => role::NORM_SRC,
            _ => role::CLIP_BUF,
        }
    }

    /// Whether the held clip scales the gradient of a step whose buffers had `roles`.
    fn clips(&self, roles: [u8; 4]) -> bool {
        self.clip.is_some() && roles[2] & self.scaled() != 0
    }

    pub(super) fn is_empty(&self) -> bool {
        self.held.is_empty() && self.row.is_none() && self.clip.is_none() && self.norm.is_none()
    }

    /// The held norm, if any.
    pub(super) fn norm(&self) -> Option<&HeldNorm> {
        self.norm.as_ref()
    }

    /// What is held, taken out (the norm, the clip, the steps, the row, the shape);
    /// what stays is empty.
    fn take(&mut self) -> Taken {
        let held = std::mem::take(&mut self.held);
        let shape = std::mem::take(&mut self.shape);
        (
            self.norm.take(),
            self.clip.take(),
            held,
            self.row.take(),
            shape,
        )
    }

    /// Holds a step named by [`Shape::name_step`] and found in no conflict: whether it
    /// applies the held clip is decided here (`entry.3` is ignored).
    fn push_named(&mut self, mut entry: Entry, names: &StepNames, fuse_clip: bool) {
        entry.3 = fuse_clip && self.clips(names.roles);
        self.shape.add_step(&entry, names);
        self.held.push(entry);
    }

    /// Holds `row` as one (`row.rs`) when its steps' numbering in the shape is certain:
    /// nothing held but (for a guarded row) the norm of exactly its gradients, guarding
    /// it, and that norm's clip; every parameter and state distinct (`memo`, the memo of
    /// its list) and none of them a gradient or the norm. The row back otherwise, to be
    /// held step by step.
    pub(super) fn hold_row(
        &mut self,
        mut row: HeldRow,
        memo: &RowMemo,
        fuse_clip: bool,
    ) -> Result<(), HeldRow> {
        if !memo.fits(&row) || !self.held.is_empty() || self.row.is_some() {
            return Err(row);
        }
        let n = row.grads.len();
        let names = match (&self.norm, &self.clip, &row.guard) {
            (Some(norm), clip, Some(guard)) => {
                // The norm named its result, then each gradient in order, all distinct
                // (one number each); its clip, if any, named nothing new.
                let behind = guard.same(&norm.dst)
                    && clip.as_ref().map_or(true, |c| c.norms_list)
                    && norm.srcs.len() == n
                    && self.shape.addresses().len() == n + 1
                    && norm.srcs.iter().zip(&row.grads).all(|(a, b)| a.same(b));
                if !behind || !memo.clear_of(self.shape.addresses()) {
                    return Err(row);
                }
                row.clipped = fuse_clip && clip.is_some();
                RowNames::BehindNorm
            }
            (None, None, None) if self.shape.addresses().is_empty() => {
                let grads: Vec<u64> = row.grads.iter().map(CudaBuffer::ptr).collect();
                let mut sorted = grads.clone();
                sorted.sort_unstable();
                if sorted.windows(2).any(|w| w[0] == w[1]) || !memo.clear_of(&grads) {
                    return Err(row);
                }
                RowNames::Alone(grads)
            }
            _ => return Err(row),
        };
        self.shape.add_row(&row, &names, &memo.ptrs);
        self.row = Some(row);
        Ok(())
    }
}

/// What [`Pending::take`] takes out: the norm, the clip, the steps, the row, the shape.
type Taken = (
    Option<HeldNorm>,
    Option<HeldClip>,
    Vec<Entry>,
    Option<HeldRow>,
    Shape,
);

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
        if pending.held.len() >= MAX_HELD || pending.row.is_some() {
            self.flush(shared, stream);
        }
        let mut names = self.pending[stream.index()].shape.name_step(&step, guard);
        if self.pending[stream.index()].conflicts(names.roles) {
            // The flush clears the shape: named again, the step conflicts with nothing.
            self.flush(shared, stream);
            names = self.pending[stream.index()].shape.name_step(&step, guard);
        }
        let entry = (tag, step, guard.cloned(), false);
        self.pending[stream.index()].push_named(entry, &names, self.fuse_clip);
    }

    /// Holds a validated global norm on `stream`, behind nothing: what is held there
    /// is issued first.
    pub(super) fn hold_norm(&mut self, shared: &Shared, stream: Stream, norm: HeldNorm) {
        self.flush(shared, stream);
        let pending = &mut self.pending[stream.index()];
        pending.shape.add_norm(&norm);
        pending.norm = Some(norm);
    }

    /// Holds a validated clip on `stream`, behind nothing but a held norm: what else
    /// is held there is issued first (the norm with it, and the clip then no longer
    /// shares the norm's list).
    pub(super) fn hold_clip(&mut self, shared: &Shared, stream: Stream, mut clip: HeldClip) {
        let pending = &self.pending[stream.index()];
        if !pending.held.is_empty() || pending.row.is_some() || pending.clip.is_some() {
            self.flush(shared, stream);
            clip.norms_list = false;
        }
        let pending = &mut self.pending[stream.index()];
        clip.norms_list &= pending.norm.is_some();
        pending.shape.add_clip(&clip);
        pending.clip = Some(clip);
    }

    /// Defers a record of `event` on `stream` behind the kernels held there (`false`,
    /// and nothing done, when none is held): the event lands on the record the flush
    /// makes after them, so recording after each held optimizer (as a plan does, for
    /// its publish) does not break the held set into single launches.
    pub(super) fn defer_record(&mut self, stream: Stream, event: &CudaEvent) -> bool {
        let pending = &mut self.pending[stream.index()];
        if pending.is_empty() {
            return false;
        }
        self.tickets += 1;
        event.defer(stream, self.tickets);
        pending.records.push((event.clone(), self.tickets));
        true
    }

    /// The record `event` points at, its deferred record landed first (its stream
    /// flushed); `None` when it was never recorded.
    pub(super) fn resolve(&mut self, shared: &Shared, event: &CudaEvent) -> Option<Arc<Record>> {
        match event.current() {
            Ok(record) => record,
            Err(stream) => {
                if shared.device.bind().is_ok() {
                    self.flush(shared, stream);
                }
                event.latest()
            }
        }
    }

    /// Issues every optimizer step held on `stream`, then lands the records deferred
    /// behind them. A failure is reported under the first held kernel's tag and
    /// poisons the stream, as a failed launch does.
    pub(super) fn flush(&mut self, shared: &Shared, stream: Stream) {
        let pending = &mut self.pending[stream.index()];
        if pending.is_empty() && pending.records.is_empty() {
            return;
        }
        let records = std::mem::take(&mut pending.records);
        let (norm, clip, mut held, row, mut shape) = pending.take();
        self.flush_held(shared, stream, (norm, clip, row), (&mut held, &mut shape));
        // The steps' vector and the shape go back, empty, for the stream's next tail.
        held.clear();
        shape.clear();
        let pending = &mut self.pending[stream.index()];
        pending.held = held;
        pending.shape = shape;
        if !records.is_empty() {
            self.land_records(shared, stream, records);
        }
    }

    /// One record on `stream` (carrying its poison, as a record does), shared by every
    /// event deferred behind the flush.
    fn land_records(&mut self, shared: &Shared, stream: Stream, records: Vec<(CudaEvent, u64)>) {
        let raw = shared.device.stream(stream);
        let failed = self.poison[stream.index()].clone();
        let made = Record::new(&shared.events, raw, failed).map(Arc::new);
        if let Err(e) = &made {
            shared.report(stream, super::backend::host_tag("record"), e.clone());
        }
        for (event, ticket) in records {
            event.land((stream, ticket), made.as_ref().ok());
        }
    }

    /// The kernels of [`Self::flush`].
    fn flush_held(
        &mut self,
        shared: &Shared,
        stream: Stream,
        (norm, clip, mut row): (Option<HeldNorm>, Option<HeldClip>, Option<HeldRow>),
        (held, shape): (&mut Vec<Entry>, &mut Shape),
    ) {
        let first = norm.as_ref().map(|n| n.tag);
        let first = first.or_else(|| clip.as_ref().map(|c| c.tag));
        let first = first.or_else(|| held.first().map(|e| e.0));
        let Some(tag) = first.or_else(|| row.as_ref().and_then(HeldRow::first_tag)) else {
            return;
        };
        self.flushes += 1;
        let raw = shared.device.stream(stream);
        let start = if self.timings.on {
            self.timing_event(shared, raw)
        } else {
            None
        };
        let result = self.issue_held(
            shared,
            (stream, raw),
            (norm.as_ref(), clip.as_ref()),
            (held, &mut row),
            shape,
        );
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
        drop((norm, clip, row));
        held.clear();
    }

    /// Flushes every stream.
    pub(super) fn flush_all(&mut self, shared: &Shared) {
        for s in Stream::ALL {
            self.flush(shared, s);
        }
    }

    /// Plans the flush of `held` behind `norm` and `clip` (`flush.rs`; once per shape,
    /// `flush_cache.rs`), uploads its words and issues it on `stream`: replayed as a
    /// graph when it repeats (`tail_graph.rs`).
    fn issue_held(
        &mut self,
        shared: &Shared,
        (stream, raw): (Stream, sys::CUstream),
        (norm, clip): (Option<&HeldNorm>, Option<&HeldClip>),
        held: (&mut Vec<Entry>, &mut Option<HeldRow>),
        shape: &mut Shape,
    ) -> Result<(), OpsError> {
        let mut plans = std::mem::take(&mut self.plans[stream.index()]);
        let ran = self.issue_planned(
            shared,
            (stream, raw),
            (&mut plans, shape),
            (norm, clip),
            held,
        );
        self.plans[stream.index()] = plans;
        ran
    }

    /// [`Self::issue_held`] with the stream's plans taken out.
    fn issue_planned(
        &mut self,
        shared: &Shared,
        (stream, raw): (Stream, sys::CUstream),
        (plans, shape): (&mut FlushCache, &mut Shape),
        (norm, clip): (Option<&HeldNorm>, Option<&HeldClip>),
        (held, row): (&mut Vec<Entry>, &mut Option<HeldRow>),
    ) -> Result<(), OpsError> {
        // Timed only with `OVERLAP_FLUSH_CLOCK=1`: no clock reads on the hot path else.
        let clocked = self.flush_clock.is_some();
        let now = || clocked.then(std::time::Instant::now);
        // What the flush holds (steps, Muon among them), for the clock's kind.
        let counts = clocked.then(|| {
            let muon = held
                .iter()
                .filter(|e| matches!(e.1, Held::Muon { .. }))
                .count();
            let (rows, row_muon) = row
                .as_ref()
                .map_or((0, 0), |r| (r.steps.len(), r.muon_count()));
            (held.len() + rows, muon + row_muon)
        });
        let t0 = now();
        let plan = plans.plan(shape, (norm, clip), (held, row))?;
        if plan.is_empty() {
            return Ok(());
        }
        let t1 = now();
        let scratch = self.scratch(shared, stream, plan.scratch_bytes().max(8))?;
        plan.upload(raw, scratch)?;
        let t2 = now();
        let (kernels, blas) = (&self.kernels, &self.blas[stream.index()]);
        let keyed = std::cell::Cell::new(std::time::Duration::ZERO);
        let key = || {
            let t = now();
            let k = plan.key(scratch);
            keyed.set(t.map_or(std::time::Duration::ZERO, |t| t.elapsed()));
            k
        };
        let ran = self.tail_graphs[stream.index()].run((raw, kernels.fill), key, || {
            plan.issue(kernels, blas, raw, scratch)
        });
        let clock = (&mut self.flush_clock, t0, t1, t2, counts);
        if let (Some(c), Some(t0), Some(t1), Some(t2), Some((steps, muon))) = clock {
            let graphs = !self.tail_graphs[stream.index()].off;
            let kind = (steps, muon, norm.is_some(), clip.is_some(), graphs);
            let parts = [t1 - t0, t2 - t1, keyed.get(), t2.elapsed() - keyed.get()];
            let nodes = self.tail_graphs[stream.index()].last_nodes;
            c.entry(kind).or_default().add(parts, nodes);
        }
        ran
    }
}

/// Where the host's time in optimizer flushes goes, over the backend's life per kind of
/// flush (`OVERLAP_FLUSH_CLOCK=1`, a diagnostic: printed on stderr when the backend is
/// dropped, [`flush_clock_report`]): planning the launches, the scratch and the words'
/// upload, the graph key, and the launch itself (a replayed graph, or the
/// calls one by one). A kind is (kernels held, Muon among them, norm held, clip held,
/// graphs on).
pub(super) type FlushClocks =
    std::collections::BTreeMap<(usize, usize, bool, bool, bool), FlushClock>;

/// The clocks when `OVERLAP_FLUSH_CLOCK` is `1`.
pub(super) fn flush_clocks_from_env() -> Option<FlushClocks> {
    (std::env::var("OVERLAP_FLUSH_CLOCK").as_deref() == Ok("1")).then(FlushClocks::new)
}

/// One line per kind of flush.
pub(super) fn flush_clock_report(clocks: &FlushClocks) -> String {
    clocks
        .iter()
        .map(|(&(held, muon, norm, clip, graphs), c)| {
            format!(
                "{held} held ({muon} Muon), norm {norm}, clip {clip}, graphs {graphs}: {}",
                c.summary()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// One kind of flush's host time: every flush's parts (the first
/// [`FLUSH_CLOCK_SAMPLES`]), summarised by their medians, so that the one-time costs
/// (a first flush issued call by call, the capture of its graph) do not hide what a
/// steady step costs.
#[derive(Debug, Default)]
pub(super) struct FlushClock {
    flushes: u64,
    samples: Vec<[std::time::Duration; 4]>,
    /// The most nodes of a graph a flush of this kind launched.
    nodes: usize,
}

/// Most flushes of one kind kept for the medians.
const FLUSH_CLOCK_SAMPLES: usize = 100_000;

impl FlushClock {
    fn add(&mut self, parts: [std::time::Duration; 4], nodes: usize) {
        self.flushes += 1;
        self.nodes = self.nodes.max(nodes);
        if self.samples.len() < FLUSH_CLOCK_SAMPLES {
            self.samples.push(parts);
        }
    }

    /// The median of each part per flush, in µs.
    fn summary(&self) -> String {
        let us = |i: usize| {
            let mut v: Vec<f64> = self
                .samples
                .iter()
                .map(|s| s[i].as_secs_f64() * 1e6)
                .collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        };
        let graph = match self.nodes {
            0 => String::new(),
            n => format!(" (a graph of {n} nodes)"),
        };
        format!(
            "{} flushes, host µs per flush (median): plan {:.1}, scratch and upload {:.1}, graph key {:.1}, launch {:.1}{graph}",
            self.flushes,
            us(0),
            us(1),
            us(2),
            us(3)
        )
    }
}

#[cfg(test)]
#[path = "defer_row_tests.rs"]
mod row_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_flush_clock_reports_each_kind_of_flush_apart_as_medians() {
        let mut clocks = FlushClocks::new();
        let us = Duration::from_micros;
        let kind = (148, 48, true, true, true);
        clocks
            .entry(kind)
            .or_default()
            .add([us(10), us(4), us(2), us(30)], 63);
        clocks
            .entry(kind)
            .or_default()
            .add([us(20), us(6), us(4), us(50)], 63);
        clocks
            .entry(kind)
            .or_default()
            .add([us(15), us(5), us(3), us(40_000)], 0);
        clocks
            .entry((148, 0, false, false, false))
            .or_default()
            .add([us(1), us(1), us(0), us(500)], 0);
        let report = flush_clock_report(&clocks);
        let lines: Vec<&str> = report.lines().collect();
        assert_eq!(lines.len(), 2, "{report}");
        assert!(
            lines[1]
                .starts_with("148 held (48 Muon), norm true, clip true, graphs true: 3 flushes")
                && lines[1]
                    .ends_with("plan 15.0, scratch and upload 5.0, graph key 3.0, launch 50.0 (a graph of 63 nodes)"),
            "{report}"
        );
        assert!(
            lines[0].contains("graphs false: 1 flushes") && lines[0].ends_with("launch 500.0"),
            "{report}"
        );
    }
}
