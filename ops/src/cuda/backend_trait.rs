//! [`Backend`] for [`CudaBackend`]: what the executor calls. Buffers come from the pool
//! and move to and from the host on the private host stream; `launch` issues under the
//! issue lock (`issue.rs`); `record` and `wait` are the plan's cross-stream edges, one
//! `cuEventRecord` and one `cuStreamWaitEvent`; failures are the root causes
//! [`Shared::report`] kept.
//!
//! Invariant: every call binds the context first and adds no ordering the caller did
//! not ask for (a held optimizer kernel is flushed first where it could be observed).

use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use overlap_graph::Stream;

#[cfg(doc)]
use super::backend::Shared;
use super::backend::{host_tag, CudaBackend, RootCause, ABORT_WAIT};
use super::device;
use super::event::{lock, CudaEvent, HostWait, Record};
use super::exchange::InPlace;
use super::memory::CudaBuffer;
use super::nccl;
use crate::{Backend, BoxFuture, CommId, EventStatus, Kernel, OpsError, Tag, Timing};

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Event = CudaEvent;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn local_ranks(&self) -> Vec<u32> {
        vec![self.shared.rank]
    }

    fn alloc(&self, rank: u32, len: usize) -> Result<CudaBuffer, OpsError> {
        if rank != self.shared.rank {
            return Err(OpsError::Backend(self.not_mine(rank)));
        }
        self.shared.device.bind()?;
        self.shared.memory.alloc_zeroed(rank, len)
    }

    /// No zeroing: the memory comes from the pool (or the driver) as it is, and the
    /// call makes no device work and no synchronisation.
    fn alloc_uninit(&self, rank: u32, len: usize) -> Result<CudaBuffer, OpsError> {
        if rank != self.shared.rank {
            return Err(OpsError::Backend(self.not_mine(rank)));
        }
        self.shared.device.bind()?;
        self.shared.memory.alloc_uninit(rank, len)
    }

    fn len(&self, buf: &CudaBuffer) -> usize {
        buf.len
    }

    fn same_buffer(&self, a: &CudaBuffer, b: &CudaBuffer) -> bool {
        a.same(b) && a.len == b.len
    }

    fn upload(&self, buf: &CudaBuffer, data: &[f32]) -> Result<(), OpsError> {
        if data.len() != buf.len {
            return Err(OpsError::Shape {
                kernel: "upload",
                reason: format!("{} host elements for {buf:?}", data.len()),
            });
        }
        if data.is_empty() {
            return Ok(());
        }
        let device = &self.shared.device;
        device.bind()?;
        lock(&self.issue).flush_all(&self.shared);
        // SAFETY: the buffer holds `data.len()` floats and no stream uses it (the
        // trait's contract); the host stream is synchronised before `data` is released.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                buf.ptr(),
                data.as_ptr().cast(),
                std::mem::size_of_val(data),
                device.host_stream(),
            )
        }
        .result()
        .map_err(|e| device::backend("upload (cuMemcpyHtoDAsync)", e))?;
        device.sync_host_stream("upload")
    }

    fn download(&self, buf: &CudaBuffer) -> Result<Vec<f32>, OpsError> {
        let mut out = vec![0.0f32; buf.len];
        if out.is_empty() {
            return Ok(out);
        }
        let device = &self.shared.device;
        device.bind()?;
        lock(&self.issue).flush_all(&self.shared);
        // SAFETY: `out` holds `buf.len` floats and outlives the synchronised copy.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                out.as_mut_ptr().cast(),
                buf.ptr(),
                std::mem::size_of_val(out.as_slice()),
                device.host_stream(),
            )
        }
        .result()
        .map_err(|e| device::backend("download (cuMemcpyDtoHAsync)", e))?;
        device.sync_host_stream("download")?;
        Ok(out)
    }

    fn event(&self, rank: u32) -> CudaEvent {
        CudaEvent::new(rank)
    }

    fn launch(&self, rank: u32, stream: Stream, tag: Tag, kernel: Kernel<CudaBuffer>) {
        if rank != self.shared.rank {
            let reason = self.not_mine(rank);
            self.shared.report(stream, tag, OpsError::Backend(reason));
            return;
        }
        let mut st = lock(&self.issue);
        // A marker launches nothing: without timings it is not even a timing event,
        // and stream order already orders it (the step's tail has one per publish on a
        // one-member group).
        if matches!(kernel, Kernel::Marker) && !st.timings.on {
            return;
        }
        if let Err(e) = self.shared.device.bind() {
            self.shared.report(stream, tag, e);
            return;
        }
        st.launch(&self.shared, stream, tag, kernel);
    }

    fn launch_row(&self, rank: u32, stream: Stream, kernels: Vec<(Tag, Kernel<CudaBuffer>)>) {
        if rank != self.shared.rank {
            for (tag, kernel) in kernels {
                self.launch(rank, stream, tag, kernel);
            }
            return;
        }
        // One lock and one context bind for the row (a step's optimizers, or its
        // publishes), each kernel then as `launch` handles it.
        let mut st = lock(&self.issue);
        let mut bound = None;
        for (tag, kernel) in kernels {
            if matches!(kernel, Kernel::Marker) && !st.timings.on {
                continue;
            }
            match bound.get_or_insert_with(|| self.shared.device.bind()) {
                Ok(()) => st.launch(&self.shared, stream, tag, kernel),
                Err(e) => self.shared.report(stream, tag, e.clone()),
            }
        }
    }

    fn record(&self, rank: u32, stream: Stream, event: &CudaEvent) {
        let mut st = lock(&self.issue);
        let mine = rank == self.shared.rank && event.rank == self.shared.rank;
        // Behind held optimizer kernels the record waits for their flush (`defer.rs`).
        if mine && st.defer_record(stream, event) {
            return;
        }
        let device = &self.shared.device;
        if !st.pending[stream.index()].is_empty() && device.bind().is_ok() {
            st.flush(&self.shared, stream);
        }
        let mut failed = st.poison[stream.index()].clone();
        if rank != self.shared.rank || event.rank != self.shared.rank {
            let reason = self.not_mine(if rank != self.shared.rank {
                rank
            } else {
                event.rank
            });
            self.misuse(stream, "record", reason.clone());
            failed = Some(OpsError::Backend(reason));
        }
        let recorded = device
            .bind()
            .and_then(|()| Record::new(&self.shared.events, device.stream(stream), failed));
        match recorded {
            Ok(r) => event.set(r),
            Err(e) => self.shared.report(stream, host_tag("record"), e),
        }
    }

    fn wait(&self, rank: u32, stream: Stream, event: &CudaEvent) {
        let mut st = lock(&self.issue);
        let Some(record) = st.resolve(&self.shared, event) else {
            // Waiting for a never-recorded event is a no-op, as in CUDA.
            return;
        };
        if rank != self.shared.rank {
            drop(st);
            self.misuse(stream, "wait", self.not_mine(rank));
            return;
        }
        if !st.pending[stream.index()].is_empty() && self.shared.device.bind().is_ok() {
            st.flush(&self.shared, stream);
        }
        if let Some(cause) = &record.failed {
            let cancel = match cause {
                OpsError::Cancelled(_) => cause.clone(),
                other => OpsError::Cancelled(other.to_string()),
            };
            st.poison[stream.index()].get_or_insert(cancel);
        }
        let last = &mut st.last_wait[stream.index()];
        if last.as_ref().is_some_and(|w| Arc::ptr_eq(w, &record)) {
            // The stream already waits for this very record.
            return;
        }
        let device = &self.shared.device;
        // The one cross-stream edge: the consumer stream waits for the producer's record.
        let waited = device.bind().and_then(|()| {
            // SAFETY: live handles of the bound context; the record keeps its event.
            unsafe {
                cu::stream::wait_event(
                    device.stream(stream),
                    record.raw(),
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(|e| device::backend("cuStreamWaitEvent", e))
        });
        match waited {
            Ok(()) => *last = Some(record),
            Err(e) => self.shared.report(stream, host_tag("wait"), e),
        }
    }

    fn status(&self, event: &CudaEvent) -> EventStatus {
        let Some(record) = self.resolve(event) else {
            return EventStatus::Complete;
        };
        self.status_of(&record)
    }

    fn host_wait(&self, event: &CudaEvent) -> BoxFuture<Result<(), OpsError>> {
        let ready = |r| {
            Box::pin(HostWait {
                ready: Some(r),
                slot: None,
            })
        };
        let Some(record) = self.resolve(event) else {
            return ready(Ok(()));
        };
        match self.status_of(&record) {
            EventStatus::Complete => ready(Ok(())),
            EventStatus::Failed(e) => ready(Err(e)),
            EventStatus::Pending => match &self.waiter {
                Some(w) => Box::pin(w.wait(record)),
                None => ready(Err(OpsError::Cancelled(
                    "the CUDA backend was dropped".into(),
                ))),
            },
        }
    }

    /// Root causes in the order they were seen, including NCCL's asynchronous errors.
    /// Host-side misuse is reported with the tag `{ node: u32::MAX, op: "record" |
    /// "wait" }`, errors the GPU reported with `op: "device"`.
    fn errors(&self) -> Vec<RootCause> {
        {
            let st = lock(&self.issue);
            if self.shared.device.bind().is_ok() {
                for c in &st.comms {
                    if let Some(e) = c.async_error() {
                        self.shared.report(c.id.stream, host_tag("nccl"), e);
                    }
                }
            }
        }
        lock(&self.shared.errors).clone()
    }

    /// Aborts every NCCL communicator (`ncclCommAbort`; a collective in flight on it
    /// ends with an error) and releases every wait on the copy transport's flags
    /// (`exchange.rs`, `CopyRing::release`; the rings stay, refusing later
    /// exchanges).
    ///
    /// The aborts run on a thread of their own, waited for at most [`ABORT_WAIT`]:
    /// `ncclCommAbort` frees pinned host memory, which waits for the device, and a
    /// device that runs a kernel that never ends (the hang a timeout is about) would
    /// hold the caller there forever. Past the wait the thread is left behind, the
    /// communicators are gone from the backend either way, and the caller goes on to
    /// report the timeout (the process must exit: its device never becomes idle).
    fn abort(&self, _why: &str) {
        let comms: Vec<nccl::Comm> = {
            let mut st = lock(&self.issue);
            if !st.copy.is_empty() && self.shared.device.bind().is_ok() {
                release_rings(&mut st.copy);
            }
            st.comms.drain(..).collect()
        };
        if comms.is_empty() {
            return;
        }
        let device = Arc::clone(&self.shared.device);
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let spawned = std::thread::Builder::new()
            .name("nccl-abort".into())
            .spawn(move || {
                if device.bind().is_ok() {
                    for c in comms {
                        c.close();
                    }
                }
                let _ = done.send(());
            });
        if spawned.is_ok() {
            let _ = finished.recv_timeout(ABORT_WAIT);
        }
    }

    /// Clears every stream's poison and the error list. An error the GPU itself
    /// reported (a sticky CUDA error, an NCCL failure) cannot be cleared: the next
    /// operation reports it again, and the process should exit.
    fn reset(&self) {
        let mut st = lock(&self.issue);
        if self.shared.device.bind().is_ok() {
            st.flush_all(&self.shared);
        }
        st.poison = Default::default();
        lock(&self.shared.errors).clear();
        // In-place receives whose combine never came (a failed or discarded step):
        // acknowledge them, oldest first, on their ring's stream, or the peers' next
        // exchanges would wait for those slots forever.
        if !st.in_place.is_empty() && self.shared.device.bind().is_ok() {
            let mut left: Vec<(CommId, InPlace)> = st.in_place.drain().map(|(_, v)| v).collect();
            left.sort_by_key(|(id, k)| (*id, k.seq));
            for (id, k) in left {
                let raw = self.shared.device.stream(id.stream);
                // A failure breaks the ring: reported now, and its next exchange fails.
                if let Err(e) = st.ack_in_place(raw, id, &k) {
                    self.shared.report(id.stream, host_tag("reset"), e);
                }
            }
        }
    }

    fn set_timings(&self, on: bool) {
        lock(&self.issue).timings.on = on;
    }

    fn needs_markers(&self, rank: u32) -> bool {
        // Another rank's marker still goes to `launch`, which reports the misuse.
        rank != self.shared.rank || lock(&self.issue).timings.on
    }

    fn receives_in_place(&self, comm: CommId) -> bool {
        lock(&self.issue)
            .copy
            .iter()
            .any(|r| r.id == comm && r.in_place())
    }

    fn take_timings(&self) -> Vec<Timing> {
        let mut st = lock(&self.issue);
        if self.shared.device.bind().is_err() {
            return Vec::new();
        }
        st.take_timings(&self.shared)
    }
}

/// Releases every copy ring's waits ([`super::exchange::CopyRing::release`]) on a
/// stream of its own (the backend's may all be blocked behind those waits), destroyed
/// once its writes are done. Best effort: the process is giving up on the device.
fn release_rings(rings: &mut [super::exchange::CopyRing]) {
    let mut stream: cudarc::driver::sys::CUstream = std::ptr::null_mut();
    let flags = cudarc::driver::sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: an out-parameter; the context is bound by the caller.
    if unsafe { cudarc::driver::sys::cuStreamCreate(&mut stream, flags) }
        .result()
        .is_err()
    {
        return;
    }
    for ring in rings.iter_mut() {
        let _ = ring.release(stream);
    }
    // SAFETY: a stream created above; the driver frees it once its work is done.
    let _ = unsafe { cudarc::driver::sys::cuStreamDestroy_v2(stream) };
}
