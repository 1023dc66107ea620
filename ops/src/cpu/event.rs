//! Events with CUDA semantics: a record is a point of a stream; a wait or query is about
//! the record that was latest when it was issued.
//!
//! Invariant: every call to `record` creates a fresh [`Slot`] that completes exactly once
//! (when the recording stream reaches it, or at once when it can never be reached), and
//! an event only ever points at its latest slot. A wait captures the slot at enqueue
//! time, so re-recording an event never changes what an earlier wait waits for.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use super::lock;
use crate::{EventStatus, OpsError};

/// An event of the CPU backend (a shared handle: clones name the same event).
#[derive(Clone, Default)]
pub struct CpuEvent {
    latest: Arc<Mutex<Option<Arc<Slot>>>>,
}

impl CpuEvent {
    /// Points the event at a new record and returns it, for the recording stream.
    pub(super) fn new_record(&self) -> Arc<Slot> {
        let slot = Arc::new(Slot::default());
        *lock(&self.latest) = Some(Arc::clone(&slot));
        slot
    }

    /// The latest record, or `None` when the event was never recorded.
    pub(super) fn latest(&self) -> Option<Arc<Slot>> {
        lock(&self.latest).clone()
    }

    /// The host's view of the latest record; a never-recorded event is complete (as in
    /// CUDA).
    pub(super) fn status(&self) -> EventStatus {
        let Some(slot) = self.latest() else {
            return EventStatus::Complete;
        };
        match slot.outcome() {
            None => EventStatus::Pending,
            Some(Ok(())) => EventStatus::Complete,
            Some(Err(e)) => EventStatus::Failed(e),
        }
    }
}

/// One record of an event: pending until its stream executes it.
#[derive(Default)]
pub(super) struct Slot {
    state: Mutex<SlotState>,
    done: Condvar,
}

#[derive(Default)]
struct SlotState {
    outcome: Option<Result<(), OpsError>>,
    wakers: Vec<Waker>,
}

impl Slot {
    fn state(&self) -> MutexGuard<'_, SlotState> {
        lock(&self.state)
    }

    /// Completes the record (only the first completion counts) and wakes every waiter.
    pub(super) fn complete(&self, outcome: Result<(), OpsError>) {
        let wakers = {
            let mut st = self.state();
            if st.outcome.is_some() {
                return;
            }
            st.outcome = Some(outcome);
            std::mem::take(&mut st.wakers)
        };
        self.done.notify_all();
        wakers.into_iter().for_each(Waker::wake);
    }

    /// The outcome, or `None` while pending.
    fn outcome(&self) -> Option<Result<(), OpsError>> {
        self.state().outcome.clone()
    }

    /// Blocks the calling stream thread until the record has executed.
    pub(super) fn wait(&self) -> Result<(), OpsError> {
        let mut st = self.state();
        loop {
            if let Some(outcome) = &st.outcome {
                return outcome.clone();
            }
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The future of `host_wait`: polls the captured record and parks its waker there.
pub(super) struct HostWait {
    /// The record waited for; `None` for a never-recorded event (ready at once).
    pub(super) slot: Option<Arc<Slot>>,
}

impl Future for HostWait {
    type Output = Result<(), OpsError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(slot) = &self.slot else {
            return Poll::Ready(Ok(()));
        };
        let mut st = slot.state();
        if let Some(outcome) = &st.outcome {
            return Poll::Ready(outcome.clone());
        }
        if !st.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            st.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}
