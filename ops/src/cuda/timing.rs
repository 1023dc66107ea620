//! Kernel timings: with timings on, a timing event recorded before and after each
//! kernel ([`Issue::end_timing`]), read back with `cuEventElapsedTime` once both have
//! completed ([`Issue::take_timings`]), relative to an epoch event recorded at start.
//!
//! Invariant: timing events are the only events with timing enabled; ordering events
//! never carry it, and a timing never orders anything.

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use overlap_graph::Stream;

use super::backend::Shared;
use super::event::EventPool;
use super::issue::Issue;
use crate::{Tag, Timing};

/// Kernel timings: a timing event recorded before and after each kernel.
pub(super) struct Timings {
    pub(super) on: bool,
    /// Recorded (and completed) when the backend started: time zero.
    pub(super) epoch: sys::CUevent,
    pub(super) pending: Vec<PendingTiming>,
}

pub(super) struct PendingTiming {
    pub(super) stream: Stream,
    pub(super) tag: Tag,
    pub(super) start: sys::CUevent,
    /// The same event as `start` for a marker.
    pub(super) end: sys::CUevent,
    pub(super) bytes: u64,
}

impl PendingTiming {
    /// Returns the events to the pool (each once).
    pub(super) fn recycle(&self, events: &EventPool) {
        events.put_timed(self.start);
        if self.end != self.start {
            events.put_timed(self.end);
        }
    }
}

impl Issue {
    /// Closes a timing opened by `start` on `stream` (`raw`): an end event and a pending
    /// timing of `bytes` when the work was issued (`Some`); otherwise, or when no end
    /// event records, the start event goes back to the pool.
    pub(super) fn end_timing(
        &mut self,
        shared: &Shared,
        (stream, raw): (Stream, sys::CUstream),
        tag: Tag,
        start: Option<sys::CUevent>,
        bytes: Option<u64>,
    ) {
        let Some(start) = start else {
            return;
        };
        match bytes.and_then(|b| Some((b, self.timing_event(shared, raw)?))) {
            Some((bytes, end)) => self.timings.pending.push(PendingTiming {
                stream,
                tag,
                start,
                end,
                bytes,
            }),
            None => shared.events.put_timed(start),
        }
    }

    /// A timing event recorded on `stream`, or `None` (timings are best effort).
    pub(super) fn timing_event(
        &self,
        shared: &Shared,
        stream: sys::CUstream,
    ) -> Option<sys::CUevent> {
        let ev = shared.events.take_timed().ok()?;
        // SAFETY: live handles of the bound context.
        match unsafe { cu::event::record(ev, stream) } {
            Ok(()) => Some(ev),
            Err(_) => {
                shared.events.put_timed(ev);
                None
            }
        }
    }

    pub(super) fn take_timings(&mut self, shared: &Shared) -> Vec<Timing> {
        let pending = std::mem::take(&mut self.timings.pending);
        let mut ready = Vec::new();
        for p in pending {
            // SAFETY: a live timing event.
            match unsafe { cu::event::query(p.end) } {
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => {
                    self.timings.pending.push(p)
                }
                _ => ready.push(p),
            }
        }
        let elapsed = |a: sys::CUevent, b: sys::CUevent| -> Option<f64> {
            // SAFETY: both events are live and complete.
            unsafe { cu::event::elapsed(a, b) }
                .ok()
                .map(|ms| f64::from(ms) / 1e3)
        };
        // Offsets within a batch are measured from its first start (full resolution);
        // only the batch's anchor is placed relative to the epoch.
        let anchor = ready.first().map(|p| p.start);
        let anchor_at = anchor.and_then(|a| elapsed(self.timings.epoch, a));
        let mut out = Vec::with_capacity(ready.len());
        for p in &ready {
            if let (Some(anchor), Some(at)) = (anchor, anchor_at) {
                if let (Some(s), Some(e)) = (elapsed(anchor, p.start), elapsed(anchor, p.end)) {
                    out.push(Timing {
                        rank: shared.rank,
                        stream: p.stream,
                        tag: p.tag,
                        start: at + s,
                        end: at + e,
                        bytes: p.bytes,
                    });
                }
            }
        }
        ready.iter().for_each(|p| p.recycle(&shared.events));
        out
    }
}
