//! Events with the CPU backend's semantics on real `CUevent`s, and the host waiter.
//!
//! A [`CudaEvent`] points at its latest [`Record`]: every `record` takes a fresh
//! `CUevent` from the pool and records it (`cuEventRecord`), so a wait issued earlier
//! (`cuStreamWaitEvent`, which captures the record current at the call) or a host wait
//! that captured the old record is never redirected by a re-record. A record also carries
//! the host-side poison of its stream at record time, so a stream waiting on a record of
//! a poisoned stream is poisoned in turn, as on the CPU backend.
//!
//! A record on a stream that holds optimizer kernels (`defer.rs`) is deferred: the
//! event remembers the stream and a ticket, and the record is made when the stream is
//! flushed, after the held kernels; every event deferred behind one flush shares that
//! one record. Whoever looks at a deferred event (a wait, a status, a host wait)
//! flushes its stream first (`Issue::resolve`).
//!
//! Ordering events are created with `CU_EVENT_DISABLE_TIMING` (the cheapest kind, and
//! the one that lets `cuStreamWaitEvent` be resolved without timestamps); only the
//! kernel timings use timing-capable events ([`EventPool::take_timed`]).
//!
//! [`Waiter`] is one host thread that polls the events futures wait for
//! (`cuEventQuery`, never a blocking synchronise, so a hung peer cannot wedge it) and
//! wakes the futures: `host_wait` blocks no tokio worker.
//!
//! Invariants: a pooled `CUevent` is reused only after the record that held it was
//! dropped (nobody can wait for it any more); every host wait resolves, with the
//! event's outcome, or with a cancellation when the backend shuts down.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel::{self, Receiver, Sender};
use cudarc::driver::result as cu;
use cudarc::driver::sys;

use overlap_graph::Stream;

use super::device::{backend, describe, Device};
use crate::OpsError;

/// Locks a mutex, recovering the data after a panic elsewhere (the guarded structures
/// stay consistent between statements).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Spare `CUevent`s of the device: ordering ones and timing-capable ones.
pub(super) struct EventPool {
    device: Arc<Device>,
    plain: Mutex<Vec<sys::CUevent>>,
    timed: Mutex<Vec<sys::CUevent>>,
}

// SAFETY: `CUevent`s are driver handles usable from any thread with the context bound;
// the lists are behind mutexes.
unsafe impl Send for EventPool {}
// SAFETY: as for `Send`.
unsafe impl Sync for EventPool {}

impl EventPool {
    pub(super) fn new(device: Arc<Device>) -> Arc<EventPool> {
        Arc::new(EventPool {
            device,
            plain: Mutex::new(Vec::new()),
            timed: Mutex::new(Vec::new()),
        })
    }

    fn take(&self, timed: bool) -> Result<sys::CUevent, OpsError> {
        let spare = if timed { &self.timed } else { &self.plain };
        if let Some(ev) = lock(spare).pop() {
            return Ok(ev);
        }
        let flags = if timed {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        cu::event::create(flags).map_err(|e| backend("cuEventCreate", e))
    }

    /// An ordering event (timing disabled). The caller has the context bound.
    pub(super) fn take_plain(&self) -> Result<sys::CUevent, OpsError> {
        self.take(false)
    }

    /// A timing-capable event. The caller has the context bound.
    pub(super) fn take_timed(&self) -> Result<sys::CUevent, OpsError> {
        self.take(true)
    }

    /// Returns an event nobody waits for any more.
    pub(super) fn put_plain(&self, ev: sys::CUevent) {
        lock(&self.plain).push(ev);
    }

    /// Returns a timing event nobody reads any more.
    pub(super) fn put_timed(&self, ev: sys::CUevent) {
        lock(&self.timed).push(ev);
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        if self.device.bind().is_err() {
            return;
        }
        let all = std::mem::take(&mut *lock(&self.plain))
            .into_iter()
            .chain(std::mem::take(&mut *lock(&self.timed)));
        for ev in all {
            // SAFETY: each pooled event was created by `take` and is destroyed once;
            // destroying an event whose record is pending is allowed (resources are
            // released when it completes).
            let _ = unsafe { cu::event::destroy(ev) };
        }
    }
}

/// One record of an event: a `CUevent` recorded on a stream, and whether that stream
/// was poisoned when it was recorded.
pub(super) struct Record {
    ev: sys::CUevent,
    /// The recording stream's poison at record time.
    pub(super) failed: Option<OpsError>,
    /// Seen complete by [`Record::query`]: a completed record never becomes pending
    /// again, and `cuEventQuery` of a completed event costs about 1.5 µs, so the
    /// executor's pool, which looks at the same release events until all of a
    /// buffer's are done, asks the driver once.
    done: AtomicBool,
    pool: Arc<EventPool>,
}

// SAFETY: the handle is a driver object; `Record` is immutable after creation.
unsafe impl Send for Record {}
// SAFETY: as for `Send`.
unsafe impl Sync for Record {}

impl Record {
    /// Takes an event from the pool and records it on `stream`. The caller has the
    /// context bound.
    pub(super) fn new(
        pool: &Arc<EventPool>,
        stream: sys::CUstream,
        failed: Option<OpsError>,
    ) -> Result<Record, OpsError> {
        let ev = pool.take_plain()?;
        let record = Record {
            ev,
            failed,
            done: AtomicBool::new(false),
            pool: Arc::clone(pool),
        };
        // SAFETY: `ev` and `stream` are live handles of the bound context.
        unsafe { cu::event::record(ev, stream) }.map_err(|e| backend("cuEventRecord", e))?;
        Ok(record)
    }

    /// The raw event.
    pub(super) fn raw(&self) -> sys::CUevent {
        self.ev
    }

    /// The device-side state: `Ok(true)` complete, `Ok(false)` pending, or the error the
    /// device reported.
    pub(super) fn query(&self) -> Result<bool, OpsError> {
        if self.done.load(Ordering::Relaxed) {
            return Ok(true);
        }
        // SAFETY: the event lives as long as the record.
        match unsafe { cu::event::query(self.ev) } {
            Ok(()) => {
                self.done.store(true, Ordering::Relaxed);
                Ok(true)
            }
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(OpsError::Failed {
                kernel: "device",
                reason: format!("the GPU reported an error: {}", describe(e)),
            }),
        }
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        self.pool.put_plain(self.ev);
    }
}

/// An event of the CUDA backend (a shared handle: clones name the same event).
#[derive(Clone)]
pub struct CudaEvent {
    pub(super) rank: u32,
    pub(super) latest: Arc<Mutex<Latest>>,
}

/// What an event points at: its latest record, or a record deferred behind the
/// optimizer kernels held on a stream (`defer.rs`), which lands when that stream is
/// flushed.
#[derive(Default)]
pub(super) struct Latest {
    record: Option<Arc<Record>>,
    /// The stream and ticket of a deferred record; `record` is stale while it is set.
    deferred: Option<(Stream, u64)>,
}

impl CudaEvent {
    pub(super) fn new(rank: u32) -> CudaEvent {
        CudaEvent {
            rank,
            latest: Arc::new(Mutex::new(Latest::default())),
        }
    }

    /// The latest record (`None`: never recorded), or, when the event's record is
    /// deferred, `Err` with the stream whose flush lands it. One lock: a status query,
    /// which the executor's pool makes often, pays nothing for deferral.
    pub(super) fn current(&self) -> Result<Option<Arc<Record>>, Stream> {
        let l = lock(&self.latest);
        match l.deferred {
            Some((stream, _)) => Err(stream),
            None => Ok(l.record.clone()),
        }
    }

    /// Defers the event's record behind what is held on `stream`, under `ticket`.
    pub(super) fn defer(&self, stream: Stream, ticket: u64) {
        lock(&self.latest).deferred = Some((stream, ticket));
    }

    /// Lands the record deferred under `(stream, ticket)` as `record` (`None`: the
    /// record could not be made, and the event keeps its earlier one). A record made
    /// since (the event re-recorded) is left alone.
    pub(super) fn land(&self, (stream, ticket): (Stream, u64), record: Option<&Arc<Record>>) {
        let mut l = lock(&self.latest);
        if l.deferred == Some((stream, ticket)) {
            l.deferred = None;
            if let Some(r) = record {
                l.record = Some(Arc::clone(r));
            }
        }
    }

    /// The latest record, or `None` when the event was never recorded. A deferred
    /// record is not seen here: the backend lands it first (`Issue::resolve`).
    pub(super) fn latest(&self) -> Option<Arc<Record>> {
        lock(&self.latest).record.clone()
    }

    /// Points the event at a new record (a deferred one is forgotten).
    pub(super) fn set(&self, record: Record) {
        *lock(&self.latest) = Latest {
            record: Some(Arc::new(record)),
            deferred: None,
        };
    }
}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaEvent(rank {})", self.rank)
    }
}

/// A host wait's outcome (once known) and the waker of the future waiting for it.
type SlotState = (Option<Result<(), OpsError>>, Option<Waker>);

/// Where a host wait's outcome lands.
#[derive(Default)]
pub(super) struct WaitSlot {
    state: Mutex<SlotState>,
}

impl WaitSlot {
    fn complete(&self, outcome: Result<(), OpsError>) {
        let waker = {
            let mut st = lock(&self.state);
            if st.0.is_some() {
                return;
            }
            st.0 = Some(outcome);
            st.1.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The future of `host_wait`.
pub(super) struct HostWait {
    pub(super) ready: Option<Result<(), OpsError>>,
    pub(super) slot: Option<Arc<WaitSlot>>,
}

impl Future for HostWait {
    type Output = Result<(), OpsError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Some(r) = self.ready.take() {
            return Poll::Ready(r);
        }
        let Some(slot) = &self.slot else {
            return Poll::Ready(Ok(()));
        };
        let mut st = lock(&slot.state);
        if let Some(r) = st.0.take() {
            return Poll::Ready(r);
        }
        st.1 = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// What the waiter reports a device error to.
pub(super) type ErrorSink = Arc<dyn Fn(OpsError) + Send + Sync>;

/// The host thread that polls awaited events.
pub(super) struct Waiter {
    tx: Option<Sender<(Arc<Record>, Arc<WaitSlot>)>>,
    shutdown: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Waiter {
    /// Starts the waiter thread for a device; device errors it sees go to `sink`.
    pub(super) fn start(device: Arc<Device>, sink: ErrorSink) -> Result<Waiter, OpsError> {
        let (tx, rx) = channel::unbounded();
        let shutdown = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&shutdown);
        let thread = std::thread::Builder::new()
            .name(format!("cuda{}-waiter", device.ordinal))
            .spawn(move || poll_loop(&device, &rx, &flag, &sink))
            .map_err(|e| OpsError::Backend(format!("cannot start the event waiter thread: {e}")))?;
        Ok(Waiter {
            tx: Some(tx),
            shutdown,
            thread: Some(thread),
        })
    }

    /// A future that resolves when `record` has executed.
    pub(super) fn wait(&self, record: Arc<Record>) -> HostWait {
        let slot = Arc::new(WaitSlot::default());
        let sent = self
            .tx
            .as_ref()
            .map(|tx| tx.send((record, Arc::clone(&slot))).is_ok())
            .unwrap_or(false);
        if !sent {
            slot.complete(Err(OpsError::Cancelled(
                "the CUDA backend was dropped".into(),
            )));
        }
        HostWait {
            ready: None,
            slot: Some(slot),
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::Release);
        self.tx = None;
        if let Some(t) = self.thread.take() {
            // The loop does not panic; if it did there is nothing left to undo.
            let _ = t.join();
        }
    }
}

/// Polls pending waits until each completes; parks on the channel when none is pending.
fn poll_loop(
    device: &Device,
    rx: &Receiver<(Arc<Record>, Arc<WaitSlot>)>,
    shutdown: &AtomicBool,
    sink: &ErrorSink,
) {
    let bound = device.bind();
    let mut pending: Vec<(Arc<Record>, Arc<WaitSlot>)> = Vec::new();
    let mut idle_polls = 0u32;
    loop {
        if pending.is_empty() {
            match rx.recv() {
                Ok(w) => pending.push(w),
                Err(_) => return,
            }
        }
        pending.extend(rx.try_iter());
        if shutdown.load(Ordering::Acquire) {
            for (_, slot) in pending.drain(..) {
                slot.complete(Err(OpsError::Cancelled(
                    "the CUDA backend was dropped".into(),
                )));
            }
            return;
        }
        let before = pending.len();
        pending.retain(|(record, slot)| {
            let outcome = match &bound {
                Err(e) => Err(e.clone()),
                Ok(()) => match record.query() {
                    Ok(false) => return true,
                    Ok(true) => record.failed.clone().map_or(Ok(()), Err),
                    Err(e) => {
                        sink(e.clone());
                        Err(e)
                    }
                },
            };
            slot.complete(outcome);
            false
        });
        if pending.len() < before {
            idle_polls = 0;
        } else {
            idle_polls = idle_polls.saturating_add(1);
        }
        if !pending.is_empty() {
            // Yield first (a record typically completes within microseconds of being
            // awaited), then back off to short sleeps so an idle wait costs little CPU.
            if idle_polls < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}
