//! The backend's lifecycle: [`CudaBackend`] and what its host side shares with the
//! waiter thread ([`Shared`]), opening the GPU ([`CudaBackend::new`]), creating the
//! communicators and the copy transport's rings, the settings a job changes between
//! steps, and the teardown (drained, then every handle released in order).
//!
//! Invariant: every handle the backend holds is created and destroyed with the context
//! bound on the calling thread; the drop waits for in-flight work (up to
//! [`DRAIN_ON_DROP`]) before it frees what that work may still touch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use overlap_graph::{Mesh, Stream};

use super::device::{self, Device};
use super::event::{lock, CudaEvent, EventPool, Record, Waiter};
use super::exchange::{self, CopySetup};
use super::issue::Issue;
use super::kernels::Kernels;
use super::loader;
use super::memory::Memory;
use super::muon::Blas;
use super::nccl::{self, Comm, NcclUniqueId};
use super::options::{CudaOptions, DeviceInfo};
use super::timing::Timings;
use crate::{CommId, EventStatus, OpsError, Tag};
#[cfg(doc)]
use {
    super::{copy_ring_bytes, mesh_comms, DEFAULT_COPY_RING_DEPTH, DEFAULT_COPY_SLOT_BYTES},
    crate::{Backend, Kernel},
};

/// One root cause: the rank, the stream, the failing kernel's tag and the error.
pub(super) type RootCause = (u32, Stream, Tag, OpsError);

/// How long dropping the backend waits for in-flight work before tearing down.
const DRAIN_ON_DROP: Duration = Duration::from_secs(10);

/// The tag under which host-side misuse and device errors are reported.
pub(super) fn host_tag(op: &'static str) -> Tag {
    Tag {
        node: u32::MAX,
        op,
        micro_batch: u32::MAX,
    }
}

/// The backend for one rank on one GPU.
pub struct CudaBackend {
    pub(super) shared: Arc<Shared>,
    pub(super) issue: Mutex<Issue>,
    pub(super) waiter: Option<Waiter>,
    pub(super) info: DeviceInfo,
}

/// What the host side and the waiter thread share.
pub(super) struct Shared {
    pub(super) rank: u32,
    pub(super) mesh: Mesh,
    pub(super) device: Arc<Device>,
    pub(super) memory: Arc<Memory>,
    pub(super) events: Arc<EventPool>,
    pub(super) errors: Mutex<Vec<RootCause>>,
}

impl Shared {
    /// Records a root cause, once per distinct error.
    pub(super) fn report(&self, stream: Stream, tag: Tag, error: OpsError) {
        let mut errors = lock(&self.errors);
        if !errors.iter().any(|(_, _, _, e)| *e == error) {
            errors.push((self.rank, stream, tag, error));
        }
    }
}

impl CudaBackend {
    /// Opens the GPU for one rank: checks the libraries, creates the context's streams,
    /// compiles the kernels and creates the cuBLAS handles. Communicators come with
    /// [`CudaBackend::connect`].
    pub fn new(opts: CudaOptions) -> Result<CudaBackend, OpsError> {
        opts.mesh
            .check()
            .map_err(|e| OpsError::Backend(e.to_string()))?;
        if opts.rank >= opts.mesh.world() {
            return Err(OpsError::Backend(format!(
                "rank {} is not a rank of mesh {} ({} ranks)",
                opts.rank,
                opts.mesh,
                opts.mesh.world()
            )));
        }
        let libraries = loader::check()?;
        let device = Device::open(opts.device, opts.uniform_priority)?;
        device.bind()?;
        let events = EventPool::new(Arc::clone(&device));
        let memory = Memory::new(Arc::clone(&device), Arc::clone(&events));
        let kernels = Kernels::compile(&device)?;
        let blas = Stream::ALL
            .iter()
            .map(|&s| Blas::new(device.stream(s), &memory))
            .collect::<Result<Vec<_>, _>>()?;
        let epoch = events.take_timed()?;
        // SAFETY: live handles of the bound context.
        unsafe { cu::event::record(epoch, device.stream(Stream::Compute)) }
            .and_then(|()| unsafe { cu::event::synchronize(epoch) })
            .map_err(|e| device::backend("recording the timing epoch", e))?;
        let info = DeviceInfo {
            ordinal: device.ordinal,
            name: device.name.clone(),
            capability: device.capability,
            driver: Device::driver_version(),
            nccl: nccl::version(),
            libraries,
        };
        let shared = Arc::new(Shared {
            rank: opts.rank,
            mesh: opts.mesh,
            device: Arc::clone(&device),
            memory,
            events,
            errors: Mutex::new(Vec::new()),
        });
        let sink_shared = Arc::clone(&shared);
        let waiter = Waiter::start(
            device,
            Arc::new(move |e| sink_shared.report(Stream::Compute, host_tag("device"), e)),
        )?;
        Ok(CudaBackend {
            shared,
            issue: Mutex::new(Issue {
                poison: Default::default(),
                comms: Vec::new(),
                copy: Vec::new(),
                kernels,
                in_place: HashMap::new(),
                combine_ctas: None,
                combine_streaming: true,
                poisoned_join: true,
                blas,
                scratch: Default::default(),
                gemm: None,
                timings: Timings {
                    on: opts.timings,
                    epoch,
                    pending: Vec::new(),
                },
                pending: Default::default(),
                fuse_clip: true,
                row_hold: std::env::var("OVERLAP_ROW_HOLD").as_deref() != Ok("0"),
                rows: Default::default(),
                tail_graphs: Default::default(),
                plans: Default::default(),
                flush_clock: super::defer::flush_clocks_from_env(),
                flushes: 0,
                tickets: 0,
                last_wait: Default::default(),
            }),
            waiter: Some(waiter),
            info,
        })
    }

    /// Creates this rank's NCCL communicators: for each `(comm, id)` in order, the
    /// member of it when this rank belongs to its group. Every rank must pass the same
    /// list (rank 0's ids for [`mesh_comms`]), so all create them in one global order;
    /// each creation blocks until the group's members have joined.
    ///
    /// `max_ctas` limits every communicator's collectives to that many CTAs (SMs) through
    /// `ncclConfig_t` (`None`: NCCL's own choice).
    pub fn connect(
        &mut self,
        comms: &[(CommId, NcclUniqueId)],
        max_ctas: Option<u32>,
    ) -> Result<(), OpsError> {
        let (rank, mesh) = (self.shared.rank, self.shared.mesh);
        let (_, issue) = self.set_up()?;
        let ids: Vec<CommId> = comms.iter().map(|&(id, _)| id).collect();
        for (id, size, index) in memberships(mesh, rank, &ids)? {
            if issue.comms.iter().any(|c| c.id == id) {
                return Err(OpsError::Backend(format!(
                    "communicator {id} was created twice"
                )));
            }
            let uid = comms.iter().find(|(c, _)| *c == id).map(|&(_, uid)| uid);
            let uid = uid.ok_or_else(|| OpsError::Backend(format!("no NCCL id for {id}")))?;
            issue
                .comms
                .push(Comm::init(id, uid, size, index, max_ctas)?);
        }
        Ok(())
    }

    /// Caps every [`Kernel::Combine`] at `ctas` CTAs of 256 threads (`None`: one element
    /// per thread up to the launch cap, i.e. the whole GPU for the combines of
    /// `overlap bench`). A narrow combine takes longer alone but leaves the other SMs to
    /// a GEMM it runs beside (`overlap bench --combine-ctas`; measured slower on H200s,
    /// docs/performance.md).
    pub fn set_combine_ctas(&self, ctas: Option<u32>) {
        lock(&self.issue).combine_ctas = ctas;
    }

    /// Whether [`Kernel::Combine`] loads and stores with cache-streaming (evict-first)
    /// hints, so the bytes it moves once do not evict from L2 what a GEMM beside it
    /// reuses (default on; the results are the same bits either way; `overlap bench
    /// --combine-cache normal` turns it off for comparison).
    pub fn set_combine_streaming(&self, on: bool) {
        lock(&self.issue).combine_streaming = on;
    }

    /// How many times held optimizer kernels were issued (`defer.rs`): once per step's
    /// tail when nothing in between observes them, however many events the plan records
    /// behind them. A diagnostic of how the tail is issued.
    pub fn flushes(&self) -> u64 {
        lock(&self.issue).flushes
    }

    /// How many of [`Self::flushes`] reused the plan of an earlier flush of the same
    /// shape on their stream (`flush_cache.rs`), only their addresses and scalars
    /// written anew. A diagnostic of how the tail is issued.
    pub fn tail_plan_reuses(&self) -> u64 {
        lock(&self.issue).plans.iter().map(|p| p.reuses).sum()
    }

    /// How many of [`Self::flushes`] were one launch of a captured graph
    /// (`tail_graph.rs`): every flush of the same shapes after the first two, whichever
    /// buffers it updates. A diagnostic of how the tail is issued.
    pub fn tail_replays(&self) -> u64 {
        lock(&self.issue)
            .tail_graphs
            .iter()
            .map(|g| g.replays)
            .sum()
    }

    /// Whether each stream's optimizer flush (the held clip, AdamW and Muon kernels,
    /// Newton–Schulz included) is captured into a CUDA graph when it repeats and
    /// replayed (default on: one graph launch instead of dozens of launches and cuBLASLt
    /// calls; the results are the same bits either way; `overlap bench-optimizer
    /// --muon` times the first precision both ways).
    pub fn set_tail_graphs(&self, on: bool) {
        let mut issue = lock(&self.issue);
        issue.tail_graphs.iter_mut().for_each(|g| g.off = !on);
    }

    /// Whether the global norm's clip ([`Kernel::Clip`]) is fused into the optimizer
    /// kernels that read the gradients it scales (default on: no pass of its own over
    /// them; the results are the same bits either way; `overlap bench-optimizer --clip`
    /// times both).
    pub fn set_clip_fusion(&self, on: bool) {
        let mut issue = lock(&self.issue);
        issue.fuse_clip = on;
    }

    /// Whether a collective or exchange issued on a poisoned stream still joins its
    /// peers (moving no data; the default), so that they do not wait for it. A job whose
    /// ranks tell each other of a failure (`Rendezvous::watch` in the `overlap` crate)
    /// turns it off: a failed rank's later collectives are then skipped, its peers wait
    /// in them until the failure reaches them and their communicators are aborted (or
    /// their step times out), and none of them finishes a step on data the failed rank
    /// never produced.
    pub fn set_poisoned_collectives_join(&self, join: bool) {
        lock(&self.issue).poisoned_join = join;
    }

    /// Sets up the copy transport of [`Kernel::Exchange`]: for every communicator of
    /// this rank with more than one member on one of `setup.streams` (created by
    /// [`CudaBackend::connect`], which must come first), a receive ring of `setup.depth`
    /// slots of `setup.slot_bytes` (rounded up to 256 bytes; [`DEFAULT_COPY_SLOT_BYTES`]
    /// and [`DEFAULT_COPY_RING_DEPTH`] are good sizes) per peer and lane, mapped by the
    /// other members through CUDA IPC; communicators in `setup.gather_lane` get a
    /// second lane for their gathers. Device memory per communicator: `lanes · depth ·
    /// slot_bytes · (n − 1)` plus 4 KiB ([`copy_ring_bytes`]).
    ///
    /// Collective: every rank calls it once, after `connect`, with the same `setup`;
    /// it blocks until the members of each group have joined. Every member of a group
    /// must run on one node with peer access between the GPUs; otherwise (or when the
    /// driver lacks CUDA IPC or stream memory operations) every member of that group
    /// returns an error naming it.
    ///
    /// `setup.in_place`: the communicators whose exchanges leave what they receive in
    /// the ring for their combines to read there and then acknowledge: no copy out of
    /// the ring on the exchange's stream. The caller promises what makes that safe (and
    /// names the same communicators on every member): their gathers, if any, have a
    /// lane of their own (a gather on an in-place ring without one is an error), every
    /// exchange's message per peer fits one slot, and at most `depth − 1` exchanges of
    /// a communicator are issued between an exchange and its combine, on any stream
    /// (otherwise an exchange could wait for an acknowledgement only a combine not yet
    /// issued writes). A message too large
    /// for a slot is refused by every member before anything is issued: an error, not
    /// a hang. Combines read peers' copies after a `cuStreamWaitValue32` on the
    /// peer's ready flag, which the peer writes after its copy with the default
    /// (fencing) flags.
    pub fn connect_copy(&mut self, setup: &CopySetup) -> Result<(), OpsError> {
        let (shared, issue) = self.set_up()?;
        if !issue.copy.is_empty() {
            return Err(OpsError::Backend(
                "the copy transport was set up twice (connect_copy is called once)".into(),
            ));
        }
        issue.copy = exchange::connect(
            &issue.comms,
            &shared.device,
            &shared.memory,
            shared.rank,
            setup,
        )?;
        Ok(())
    }

    /// Connects ranks that share one GPU, where NCCL cannot run (it refuses two ranks
    /// of a communicator on one device): instead of [`CudaBackend::connect`] and
    /// [`CudaBackend::connect_copy`], this rank's member of every communicator of
    /// `comms` (the global list, the same on every rank) whose group it belongs to,
    /// without NCCL, and a copy ring for each of more than one member, whatever its
    /// stream (`setup.streams` is not consulted). Every collective on them, not only
    /// the copy transport's exchanges and gathers, then moves over the ring: broadcasts
    /// and all-gathers as relays of the copy engines, reductions as an exchange, a
    /// combine kernel and, for an all-reduce, a gather. The rings' records and verdicts
    /// go through `all_gather` (this rank's bytes in, every rank's out in rank order),
    /// called exactly twice on every rank. A test mode: the ranks share the GPU's
    /// engines, so its timings say nothing of a job on several GPUs.
    pub fn connect_copy_only(
        &mut self,
        comms: &[CommId],
        setup: &CopySetup,
        mut all_gather: impl FnMut(&[u8]) -> Result<Vec<Vec<u8>>, String>,
    ) -> Result<(), OpsError> {
        let (rank, mesh) = (self.shared.rank, self.shared.mesh);
        let (shared, issue) = self.set_up()?;
        if !issue.comms.is_empty() || !issue.copy.is_empty() {
            return Err(OpsError::Backend(
                "connect_copy_only is called once, instead of connect and connect_copy".into(),
            ));
        }
        for (id, size, index) in memberships(mesh, rank, comms)? {
            issue.comms.push(Comm::copy_only(id, size, index));
        }
        issue.copy =
            exchange::connect_shared(&issue.comms, &shared.device, rank, setup, &mut all_gather)?;
        Ok(())
    }

    /// For setting up (the `connect` calls, before any work): the context bound on this
    /// thread, the shared state and the issue state, taken without the lock (`&mut`).
    fn set_up(&mut self) -> Result<(Arc<Shared>, &mut Issue), OpsError> {
        self.shared.device.bind()?;
        let shared = Arc::clone(&self.shared);
        let issue = self
            .issue
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok((shared, issue))
    }

    /// The global rank this backend drives.
    pub fn rank(&self) -> u32 {
        self.shared.rank
    }

    /// The ordinal of the GPU this rank drives (among the visible devices): a trainer
    /// opens the same device's primary context (`cudarc`'s `CudaContext::new(ordinal)`)
    /// to run its own kernels beside the backend's.
    pub fn ordinal(&self) -> u32 {
        self.shared.device.ordinal
    }

    /// The driver handle of one of this rank's streams. A trainer may issue its own
    /// work on [`Stream::Compute`] (the stream the plan's `grad_ready`, `forward` and
    /// `backward` points stand on): then that work is ordered with the plan without
    /// any event. The handle stays valid while the backend lives; the trainer must not
    /// destroy or synchronise-and-reset it, and must bind the backend's context
    /// ([`CudaBackend::ordinal`]'s primary context) on the thread that uses it.
    pub fn raw_stream(&self, stream: Stream) -> sys::CUstream {
        // Optimizer kernels held on the stream go first (`defer.rs`).
        let mut st = lock(&self.issue);
        if !st.pending[stream.index()].is_empty() && self.shared.device.bind().is_ok() {
            st.flush(&self.shared, stream);
        }
        self.shared.device.stream(stream)
    }

    /// The record `event` points at, a record deferred behind held optimizer kernels
    /// landed first (`defer.rs`); `None` when it was never recorded. Takes the issue
    /// lock only for a deferred record.
    pub(super) fn resolve(&self, event: &CudaEvent) -> Option<Arc<Record>> {
        match event.current() {
            Ok(record) => record,
            Err(_) => lock(&self.issue).resolve(&self.shared, event),
        }
    }

    /// A record's state as the [`crate::Backend`] reports an event's.
    pub(super) fn status_of(&self, record: &Record) -> EventStatus {
        if let Err(e) = self.shared.device.bind() {
            return EventStatus::Failed(e);
        }
        match record.query() {
            Ok(false) => EventStatus::Pending,
            Ok(true) => match &record.failed {
                None => EventStatus::Complete,
                Some(e) => EventStatus::Failed(e.clone()),
            },
            Err(e) => {
                self.shared
                    .report(Stream::Compute, host_tag("device"), e.clone());
                EventStatus::Failed(e)
            }
        }
    }

    /// Records `event` on a stream the trainer owns, capturing the work issued on it so
    /// far: a plan stream that then waits on the event (`Session::grad_ready_device`'s
    /// `after`) runs only after that work. The record carries no poison (the trainer's
    /// stream is not the plan's).
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream of this device's primary context (or null, the
    /// legacy default stream) for the duration of the call.
    pub unsafe fn record_on(
        &self,
        event: &CudaEvent,
        stream: sys::CUstream,
    ) -> Result<(), OpsError> {
        if event.rank != self.shared.rank {
            return Err(OpsError::Backend(self.not_mine(event.rank)));
        }
        let device = &self.shared.device;
        device.bind()?;
        let record = Record::new(&self.shared.events, stream, None)?;
        event.set(record);
        Ok(())
    }

    /// What was found at start.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Turns kernel timings on or off (they cost two event records per kernel).
    pub fn set_timings(&self, on: bool) {
        lock(&self.issue).timings.on = on;
    }

    /// Device memory obtained from the driver (in use, or pooled for reuse), in bytes.
    pub fn memory_held(&self) -> usize {
        self.shared.memory.held_bytes()
    }

    /// Reports misuse of the backend by the host.
    pub(super) fn misuse(&self, stream: Stream, op: &'static str, reason: String) {
        self.shared
            .report(stream, host_tag(op), OpsError::Backend(reason));
    }

    pub(super) fn not_mine(&self, rank: u32) -> String {
        format!(
            "rank {rank} is not driven by this backend (it drives rank {} of mesh {})",
            self.shared.rank, self.shared.mesh
        )
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Stop host waits first: nothing may wait on the device while it is torn down.
        self.waiter = None;
        let shared = Arc::clone(&self.shared);
        let st = self
            .issue
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if shared.device.bind().is_err() {
            return;
        }
        st.flush_all(&shared);
        if let Some(c) = &st.flush_clock {
            eprintln!("{}", super::defer::flush_clock_report(c));
        }
        // Every peer's last acknowledgement must land in our rings before they go.
        for ring in &st.copy {
            let _ = ring.await_acks(shared.device.stream(ring.comm().stream));
        }
        let idle = wait_idle(&shared, DRAIN_ON_DROP);
        // The rings go once nothing in flight copies to or from them or waits on their
        // flags; a device that did not drain keeps them (leaked, as the process ends).
        for ring in st.copy.drain(..) {
            if idle {
                ring.close();
            } else {
                std::mem::forget(ring);
            }
        }
        for c in st.comms.drain(..) {
            c.close();
        }
        for g in &mut st.tail_graphs {
            if idle {
                g.clear();
            } else {
                g.leak();
            }
        }
        for b in &st.blas {
            b.destroy();
        }
        st.blas.clear();
        for p in st.timings.pending.drain(..) {
            p.recycle(&shared.events);
        }
        shared.events.put_timed(st.timings.epoch);
        if idle {
            st.kernels.unload();
        }
        st.scratch = Default::default();
    }
}

/// How long [`Backend::abort`] waits for `ncclCommAbort` before it leaves it behind.
pub const ABORT_WAIT: Duration = Duration::from_secs(5);

/// Waits (polling) until every stream has executed what was issued, up to `limit`.
fn wait_idle(shared: &Shared, limit: Duration) -> bool {
    let mut marks = Vec::new();
    for s in Stream::ALL {
        match Record::new(&shared.events, shared.device.stream(s), None) {
            Ok(r) => marks.push(r),
            Err(_) => return false,
        }
    }
    let deadline = Instant::now() + limit;
    loop {
        match marks
            .iter()
            .try_fold(true, |all, r| Ok::<_, OpsError>(all && r.query()?))
        {
            Ok(true) => return true,
            Err(_) => return false,
            Ok(false) if Instant::now() >= deadline => return false,
            Ok(false) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Of the global list `comms`, the communicators `rank` of `mesh` is a member of, as
/// (communicator, group size, member index), in list order. A communicator that names
/// a group the mesh lacks, or one listed twice, is an error.
fn memberships(
    mesh: Mesh,
    rank: u32,
    comms: &[CommId],
) -> Result<Vec<(CommId, u32, u32)>, OpsError> {
    let mut out: Vec<(CommId, u32, u32)> = Vec::new();
    for (i, &id) in comms.iter().enumerate() {
        if !mesh.has_group(id.group) {
            return Err(OpsError::Backend(format!(
                "communicator {id} names a group that mesh {mesh} does not have"
            )));
        }
        if comms[..i].contains(&id) {
            return Err(OpsError::Backend(format!(
                "communicator {id} was created twice"
            )));
        }
        if let Some(index) = mesh.index_in(id.group, rank) {
            out.push((id, mesh.group_size(id.group), index));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_without_cuda_is_a_clear_error_not_a_panic() {
        let mesh = Mesh {
            shard: 1,
            replicate: 1,
        };
        let opts = CudaOptions::new(mesh, 0, 0);
        if loader::check().is_ok() {
            eprintln!("CUDA libraries present: the error path is not exercised here");
            return;
        }
        let err = CudaBackend::new(opts)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("cannot load lib"), "{err}");
        let bad = CudaOptions::new(mesh, 3, 0);
        assert!(CudaBackend::new(bad).is_err());
    }

    #[test]
    fn a_rank_joins_the_communicators_of_its_groups_in_list_order() {
        let mesh = Mesh::new(2, 3).unwrap();
        let comms = super::super::mesh_comms(mesh, &overlap_graph::Bindings::default(), true);
        // Rank 3 is shard 1 of replicate 1: one shard group and one replicate group per
        // stream that uses them.
        let mine = memberships(mesh, 3, &comms).unwrap();
        assert!(!mine.is_empty());
        for &(id, size, index) in &mine {
            assert_eq!(Some(index), mesh.index_in(id.group, 3), "{id}");
            assert_eq!(size, mesh.group_size(id.group), "{id}");
        }
        let order: Vec<CommId> = mine.iter().map(|m| m.0).collect();
        let listed: Vec<CommId> = comms
            .iter()
            .copied()
            .filter(|c| order.contains(c))
            .collect();
        assert_eq!(order, listed);
        let twice = [comms[0], comms[1], comms[0]];
        let e = memberships(mesh, 0, &twice).unwrap_err().to_string();
        assert!(e.contains("created twice"), "{e}");
        let small = Mesh::new(1, 1).unwrap();
        let e = memberships(small, 0, &comms).unwrap_err().to_string();
        assert!(e.contains("does not have"), "{e}");
    }
}
