//! Stopping a rank because another rank of its job failed.
//!
//! A multi-process job learns of a failure on another rank through its rendezvous
//! connection (`overlap::rendezvous`), on a thread of its own; [`PeerAbort::trigger`]
//! hands it to the executor, whose host waits (the end-of-step drain, the Stage-1
//! backpressure) end at once with [`ExecError::PeerFailed`](crate::ExecError::PeerFailed)
//! instead of waiting for collectives whose peer will never come. The executor then aborts
//! the backend's communicators ([`Backend::abort`](overlap_ops::Backend::abort)) and
//! refuses further work, as after a timeout.
//!
//! Invariant: the first failure reported wins; later ones are ignored, so every message
//! names the root cause.

use std::sync::Arc;

use tokio::sync::watch;

/// Which rank failed, and why (its own error message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerFailure {
    /// The global rank that failed (or whose connection was lost).
    pub rank: u32,
    /// What that rank reported, or how its connection ended.
    pub reason: String,
}

/// A signal shared by the thread that watches the job and the executor.
#[derive(Debug, Clone)]
pub struct PeerAbort {
    tx: Arc<watch::Sender<Option<PeerFailure>>>,
}

impl Default for PeerAbort {
    fn default() -> Self {
        PeerAbort::new()
    }
}

impl PeerAbort {
    /// A signal nobody triggered yet.
    pub fn new() -> PeerAbort {
        PeerAbort {
            tx: Arc::new(watch::channel(None).0),
        }
    }

    /// Reports a failure; returns whether it was the first (only the first is kept).
    pub fn trigger(&self, failure: PeerFailure) -> bool {
        self.tx.send_if_modified(|slot| {
            if slot.is_some() {
                return false;
            }
            *slot = Some(failure);
            true
        })
    }

    /// The failure reported, if any.
    pub fn failure(&self) -> Option<PeerFailure> {
        self.tx.borrow().clone()
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Option<PeerFailure>> {
        self.tx.subscribe()
    }
}

/// Resolves once a failure is reported (never, when there is no signal).
pub(crate) async fn failed(rx: Option<watch::Receiver<Option<PeerFailure>>>) -> PeerFailure {
    if let Some(mut rx) = rx {
        let seen = rx
            .wait_for(|f| f.is_some())
            .await
            .ok()
            .and_then(|f| f.clone());
        if let Some(f) = seen {
            return f;
        }
    }
    // No signal (or its sender is gone, which the executor's own copy prevents).
    std::future::pending().await
}

/// The deadline of the step in progress, readable from any thread: a watchdog outside
/// the issuing thread ends a process whose host is stuck where the executor's own
/// deadline cannot reach it (inside a device call that waits for a kernel that never
/// ends).
#[derive(Debug, Clone)]
pub struct StepDeadline {
    base: std::time::Instant,
    /// Nanoseconds after `base`, plus one; 0 when no step is in progress.
    at: Arc<std::sync::atomic::AtomicU64>,
}

impl StepDeadline {
    pub(crate) fn new() -> StepDeadline {
        StepDeadline {
            base: std::time::Instant::now(),
            at: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        }
    }

    pub(crate) fn set(&self, deadline: Option<std::time::Instant>) {
        let v = deadline.map_or(0, |d| {
            let n = d.saturating_duration_since(self.base).as_nanos();
            u64::try_from(n).unwrap_or(u64::MAX - 1) + 1
        });
        self.at.store(v, std::sync::atomic::Ordering::Release);
    }

    /// When the step in progress must have ended; `None` between steps.
    pub fn get(&self) -> Option<std::time::Instant> {
        match self.at.load(std::sync::atomic::Ordering::Acquire) {
            0 => None,
            n => Some(self.base + std::time::Duration::from_nanos(n - 1)),
        }
    }
}
