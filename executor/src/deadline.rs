//! The deadline of the step in progress, shared with other threads.
//!
//! The executor's own waits give up at the step's deadline; a host stuck inside a device
//! call never reaches one of them. [`StepDeadline`] lets a watchdog on another thread see
//! the deadline and end the process instead (`overlap run` does, 15 s past it).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The deadline of the step in progress, readable from any thread: a watchdog outside
/// the issuing thread ends a process whose host is stuck where the executor's own
/// deadline cannot reach it (inside a device call that waits for a kernel that never
/// ends).
#[derive(Debug, Clone)]
pub struct StepDeadline {
    base: Instant,
    /// Nanoseconds after `base`, plus one; 0 when no step is in progress.
    at: Arc<AtomicU64>,
}

impl StepDeadline {
    pub(crate) fn new() -> StepDeadline {
        StepDeadline {
            base: Instant::now(),
            at: Arc::new(AtomicU64::new(0)),
        }
    }

    pub(crate) fn set(&self, deadline: Option<Instant>) {
        let v = deadline.map_or(0, |d| {
            let n = d.saturating_duration_since(self.base).as_nanos();
            u64::try_from(n).unwrap_or(u64::MAX - 1) + 1
        });
        self.at.store(v, Ordering::Release);
    }

    /// When the step in progress must have ended; `None` between steps.
    pub fn get(&self) -> Option<Instant> {
        match self.at.load(Ordering::Acquire) {
            0 => None,
            n => Some(self.base + Duration::from_nanos(n - 1)),
        }
    }
}
