//! Saving off the critical path: a save stages a host copy of the local ranks' pieces
//! between steps (the only part the training loop waits for), and a background thread
//! writes and commits it while the next steps run. One save is in flight at a time: the
//! next one first waits for it. A failure of a background save is returned by the next
//! call that waits for it ([`crate::Session::wait_for_saves`], [`crate::Session::poll_save`],
//! the next save); a session dropped with a save in flight waits for it and logs a
//! failure.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use super::err;
use super::protocol::{self, SaveWork};
use crate::Error;

/// How the processes of a multi-process job save a checkpoint together
/// ([`crate::Session::set_save_job`]): the job's id, which every process must be given
/// and which no earlier job saving into the same checkpoint root used (a random value
/// rank 0 draws and sends to the others, as `overlap run` does), and how long the
/// process holding rank 0 waits for the other ranks' reports.
///
/// The id names the save's partial directory, so that what a crashed earlier job left
/// there is never taken for this job's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SaveJob {
    /// The job's id.
    pub id: u64,
    /// How long the process holding rank 0 waits for every rank's report before the save
    /// fails ([`SaveJob::DEFAULT_REPORT_TIMEOUT`] by default).
    pub report_timeout: Duration,
}

impl SaveJob {
    /// The default report timeout: ten minutes.
    pub const DEFAULT_REPORT_TIMEOUT: Duration = Duration::from_secs(600);

    /// A job of id `id`, with the default report timeout.
    pub fn new(id: u64) -> SaveJob {
        SaveJob {
            id,
            report_timeout: SaveJob::DEFAULT_REPORT_TIMEOUT,
        }
    }

    /// A job with a fresh id, unlike any other job's (drawn from the clock, the process
    /// id and a counter, hashed): what rank 0 sends to the other processes.
    pub fn fresh() -> SaveJob {
        use std::sync::atomic::{AtomicU64, Ordering};
        static DRAWN: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut h = Sha256::new();
        h.update(nanos.to_le_bytes());
        h.update(std::process::id().to_le_bytes());
        h.update(DRAWN.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        let digest = h.finalize();
        let mut id = [0u8; 8];
        id.copy_from_slice(&digest[..8]);
        SaveJob::new(u64::from_le_bytes(id))
    }

    /// The same job with another report timeout.
    pub fn with_report_timeout(mut self, timeout: Duration) -> SaveJob {
        self.report_timeout = timeout;
        self
    }
}

/// A save started by [`crate::Session::save_in_background`]: the checkpoint it writes
/// and what it cost the training loop.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SaveTicket {
    /// The step saved (steps completed).
    pub step: u64,
    /// The checkpoint directory it will be (`root/step-NNNNNN`).
    pub path: PathBuf,
    /// Time spent copying the local ranks' pieces to the host.
    pub staged: Duration,
    /// Time spent waiting for the previous save to finish first.
    pub waited: Duration,
    /// The previous save, if it was still in flight (this one waited for it): what it
    /// saved.
    pub previous: Option<Saved>,
}

impl SaveTicket {
    /// What the save cost the training loop: the wait for the previous save plus the
    /// staging.
    pub fn stall(&self) -> Duration {
        self.staged + self.waited
    }
}

/// A save that finished.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Saved {
    /// The step saved.
    pub step: u64,
    /// The checkpoint directory (`root/step-NNNNNN`).
    pub path: PathBuf,
    /// Whether this process committed it (wrote the manifest and switched `latest`):
    /// the process holding global rank 0. The others are done once their files and
    /// reports are written.
    pub committed: bool,
    /// Time the background thread took to write (and commit) it.
    pub written: Duration,
}

/// A save in flight.
struct Pending {
    step: u64,
    thread: JoinHandle<Result<Saved, Error>>,
}

/// A session's saves: the job it saves with and the save in flight.
pub(crate) struct Saves {
    job: Option<SaveJob>,
    /// A fault injected into every save ([`crate::Session::inject_faults`]).
    fault: Option<super::SaveFault>,
    own: SaveJob,
    pending: Mutex<Option<Pending>>,
}

impl Default for Saves {
    fn default() -> Self {
        Saves {
            job: None,
            fault: None,
            own: SaveJob::fresh(),
            pending: Mutex::new(None),
        }
    }
}

impl Saves {
    pub(crate) fn set_job(&mut self, job: SaveJob) {
        self.job = Some(job);
    }

    pub(crate) fn set_fault(&mut self, fault: Option<super::SaveFault>) {
        self.fault = fault;
    }

    pub(crate) fn fault(&self) -> Option<super::SaveFault> {
        self.fault
    }

    /// The job a save uses: the one set, or for a session that drives every rank of its
    /// mesh (which saves alone) one of its own; `None` when the session drives only some
    /// ranks and no job was set.
    pub(crate) fn job(&self, all_local: bool) -> Option<SaveJob> {
        self.job.or(all_local.then_some(self.own))
    }

    fn lock(&self) -> MutexGuard<'_, Option<Pending>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts `work` on a thread of its own. Call after [`Saves::wait`].
    pub(crate) fn start(&self, work: SaveWork) -> Result<(), Error> {
        let step = work.staged.step;
        let root = work.root.clone();
        let thread = std::thread::Builder::new()
            .name(format!("checkpoint-save-{step}"))
            .spawn(move || protocol::run(work))
            .map_err(|e| err(&root, format!("cannot start the save's thread: {e}")))?;
        *self.lock() = Some(Pending { step, thread });
        Ok(())
    }

    /// Waits for the save in flight, if any: what it saved, or its failure.
    pub(crate) fn wait(&self) -> Result<Option<Saved>, Error> {
        let pending = self.lock().take();
        pending.map(join).transpose()
    }

    /// The save in flight if it has finished (what it saved, or its failure); `None`
    /// while it runs or when there is none.
    pub(crate) fn poll(&self) -> Result<Option<Saved>, Error> {
        let mut slot = self.lock();
        if !slot.as_ref().is_some_and(|p| p.thread.is_finished()) {
            return Ok(None);
        }
        slot.take().map(join).transpose()
    }
}

fn join(p: Pending) -> Result<Saved, Error> {
    p.thread.join().unwrap_or_else(|_| {
        Err(Error::Usage(format!(
            "the background save of step {} panicked",
            p.step
        )))
    })
}

impl Drop for Saves {
    /// A session never drops a save in flight: it waits for it, and logs a failure
    /// nobody asked for.
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            tracing::error!("checkpoint: a background save failed: {e}");
        }
    }
}
