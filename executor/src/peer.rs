//! Stopping a rank because another rank of its job failed.
//!
//! A multi-process job learns of a failure on another rank through its rendezvous
//! connection (`overlap_dist::rendezvous`), on a thread of its own; [`PeerAbort::trigger`]
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
