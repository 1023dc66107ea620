//! The CPU backend: every rank of a mesh in one process, each of its streams a thread,
//! with the exact reference math of [`crate::math`]; or one rank of a mesh per process,
//! its communicators reaching the other processes over TCP ([`CpuBackend::one_rank`],
//! [`CpuLinks`]).
//!
//! [`CpuBackend`] owns one OS thread per (rank, stream), named `r{rank}-{stream}`, that
//! executes a FIFO of commands (run a kernel, record an event, wait for an event) in
//! order; `launch`, `record` and `wait` only enqueue, as with CUDA streams. It also owns
//! one communicator per group of the mesh and stream ([`CommId`]) that has a local
//! member, the rendezvous its members' stream threads meet at. With one rank per
//! process the rendezvous completes each round from every member's arrival, the remote
//! ones received over the links, with the same code as in one process, so both modes
//! compute the same bits (the `remote` module's docs).
//!
//! Invariants:
//! - a stream runs its commands in issue order; after a kernel fails the stream is
//!   *poisoned*: later kernels are skipped, later records fail, and a stream waiting on
//!   a failed record is poisoned with the same cause; `reset` clears it;
//! - a poisoned stream still takes part in collectives and exchanges (marked as unable),
//!   so its peers fail instead of hanging; every such wait is bounded by a timeout; with
//!   one rank per process, a peer whose connection closes fails every call waiting for
//!   it at once, naming it, and [`Backend::abort`] ends every wait;
//! - root causes (never cancellations) are kept in the order they happened, one per
//!   stream at most between resets, for [`Backend::errors`];
//! - nothing panics on bad input: kernels return [`OpsError::Shape`] and misuse of the
//!   backend (an unknown rank) is reported through [`Backend::errors`].

mod buffer;
mod comm;
mod event;
mod kernels;
mod remote;
#[cfg(test)]
mod remote_tests;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam::channel::{self, Receiver, SendError, Sender};
use overlap_graph::{Collective, Group, Mesh, Stream};

pub use buffer::CpuBuffer;
use comm::{Arrival, Call, Comm, Failure, Halt};
pub use event::CpuEvent;
use event::{HostWait, Slot};
pub use kernels::{gemm, gemm_operand, GEMM_CPU_MAX_MACS};
pub use remote::{CpuLinks, SEND_TIMEOUT};

use crate::{Backend, BoxFuture, CommId, EventStatus, Kernel, OpsError, Tag, Timing};

/// The most ranks a [`CpuBackend`] drives. Each rank costs one thread per stream
/// (five, `Stream::ALL`), and `overlap verify` runs two backends, so 1024 ranks are
/// 10 240 threads; measured with the debug build on 2 cores, `overlap verify` of a
/// two-layer model takes 4.9 s and 115 MB on 256 ranks (16x16) and 25–40 s and
/// 0.4–0.5 GB on 1024 (32x32, 1024x1). Past this the operating system's thread limits
/// (`ulimit -u`, often 4096–100 000) and the rendezvous of every collective decide.
pub const MAX_RANKS: u32 = 1024;

/// A [`Kernel::Spin`] longer than this (one second) is slept in slices that watch for
/// the backend being dropped.
const LONG_SPIN_US: u32 = 1_000_000;

/// How long a collective waits for its peers unless configured otherwise.
const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// One root cause: the rank, the stream, the failing kernel's tag and the error.
type RootCause = (u32, Stream, Tag, OpsError);

/// Locks a mutex, recovering the data if a thread panicked while holding it (every
/// structure guarded here stays consistent between statements).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A duration in nanoseconds, saturating (about 584 years).
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The tag under which host-side misuse of `record` or `wait` is reported.
fn host_tag(op: &'static str) -> Tag {
    Tag {
        node: u32::MAX,
        op,
        micro_batch: u32::MAX,
    }
}

/// The backend for every rank of a mesh in one process ([`CpuBackend::new`]), or for one
/// rank of it in a job of one process per rank ([`CpuBackend::one_rank`]).
pub struct CpuBackend {
    shared: Arc<Shared>,
    /// The queue of each local (rank, stream), at [`Shared::slot`].
    queues: Vec<Sender<Command>>,
    threads: Vec<JoinHandle<()>>,
}

/// What one stream thread executes.
enum Command {
    Launch(Tag, Kernel<CpuBuffer>),
    Record(Arc<Slot>),
    Wait(Arc<Slot>),
}

/// State shared by the host side and every stream thread.
struct Shared {
    mesh: Mesh,
    /// Ranks driven: `0..world` in one process (empty for an invalid mesh), `rank..rank
    /// + 1` for one rank of a multi-process job.
    local: Range<u32>,
    /// Whether the communicators have members in other processes, and where this
    /// process's farewell goes ([`Backend::abort`]).
    remote: Option<remote::Outbox>,
    epoch: Instant,
    comms: HashMap<CommId, Comm>,
    /// Each local stream's poison (always a cancellation naming the root cause), at
    /// [`Shared::slot`].
    poison: Vec<Mutex<Option<OpsError>>>,
    /// The kernel each local stream runs now, at [`Shared::slot`] ([`Backend::running`]).
    running: Vec<Mutex<Option<Tag>>>,
    errors: Mutex<Vec<RootCause>>,
    faults: Mutex<Vec<(u32, &'static str)>>,
    /// `faults.len()`, so kernels skip the lock when no fault is armed.
    armed_faults: AtomicUsize,
    timings: Mutex<Vec<Timing>>,
    timeout_ns: AtomicU64,
    halt: Halt,
    next_buffer: AtomicU64,
}

impl CpuBackend {
    /// Whether this backend can drive `mesh`: a valid mesh of at most [`MAX_RANKS`]
    /// ranks. Call it before [`CpuBackend::new`] to report an oversized mesh as an error.
    pub fn check_mesh(mesh: Mesh) -> Result<(), OpsError> {
        mesh.check()
            .map_err(|e| OpsError::Backend(format!("the CPU backend cannot drive it: {e}")))?;
        if mesh.world() > MAX_RANKS {
            return Err(OpsError::Backend(format!(
                "mesh {mesh} has {} ranks, more than the CPU backend's limit of {MAX_RANKS} (it runs every rank in this process, {} threads per rank); run it on GPUs, or plan it with `overlap plan` and `overlap check`",
                mesh.world(),
                Stream::ALL.len()
            )));
        }
        Ok(())
    }

    /// A backend driving every rank of `mesh`, with a stream thread per rank and
    /// stream ([`Stream::ALL`]) and a communicator per group and stream.
    ///
    /// `mesh` should pass [`CpuBackend::check_mesh`]. An invalid mesh drives no ranks; a
    /// valid one past [`MAX_RANKS`] starts no thread and reports a `Backend` error,
    /// naming the limit, through [`Backend::errors`] for everything issued to it, as does
    /// a stream whose thread cannot be spawned.
    pub fn new(mesh: Mesh) -> CpuBackend {
        let world = if mesh.check().is_ok() {
            mesh.world()
        } else {
            0
        };
        let comms = comms_of(mesh, 0..world, None);
        let shared = Arc::new(Shared::new(mesh, 0..world, comms, None));
        CpuBackend::start(shared, world <= MAX_RANKS)
    }

    /// A backend driving rank `rank` of `mesh` alone, in a job of one process per rank:
    /// its communicators' other members are the other processes, reached over `links`
    /// (this process's connections to every other rank, [`CpuLinks`]). Every process
    /// makes its backends over one set of links in the same order (each backend's
    /// messages are told apart by that order). The results are those of
    /// [`CpuBackend::new`] on the whole mesh, bit for bit.
    ///
    /// Errors: an invalid mesh, or links of another rank or world size.
    pub fn one_rank(mesh: Mesh, rank: u32, links: &CpuLinks) -> Result<CpuBackend, OpsError> {
        mesh.check()
            .map_err(|e| OpsError::Backend(format!("the CPU backend cannot drive it: {e}")))?;
        if links.world() != mesh.world() || links.rank() != rank {
            return Err(OpsError::Backend(format!(
                "rank {rank} of mesh {mesh} ({} ranks) cannot run over the links of rank {} of {}",
                mesh.world(),
                links.rank(),
                links.world()
            )));
        }
        let shared = links.register(|outbox| {
            let comms = comms_of(mesh, rank..rank + 1, Some(outbox.clone()));
            Arc::new(Shared::new(mesh, rank..rank + 1, comms, Some(outbox)))
        });
        Ok(CpuBackend::start(shared, true))
    }

    /// Starts the stream threads of the local ranks (none unless `spawn`).
    fn start(shared: Arc<Shared>, spawn: bool) -> CpuBackend {
        let (mut queues, mut threads) = (Vec::new(), Vec::new());
        for rank in shared.local.clone().filter(|_| spawn) {
            for stream in Stream::ALL {
                let (tx, rx) = channel::unbounded();
                let worker = Worker {
                    rank,
                    stream,
                    slot: shared.slot(rank, stream).unwrap_or(0),
                    shared: Arc::clone(&shared),
                };
                // On failure the receiver is dropped with the closure: sends then fail and
                // are reported.
                let spawned = thread::Builder::new()
                    .name(format!("r{rank}-{stream}"))
                    .spawn(move || worker.run(rx));
                queues.push(tx);
                threads.extend(spawned.ok());
            }
        }
        CpuBackend {
            shared,
            queues,
            threads,
        }
    }

    /// Sets how long a collective waits for all members before failing on every member
    /// that arrived (default 60 s).
    pub fn with_collective_timeout(self, timeout: Duration) -> CpuBackend {
        self.shared
            .timeout_ns
            .store(nanos(timeout), Ordering::Relaxed);
        self
    }

    /// Arms a fault: the next kernel on `rank` whose [`Tag::op`] is `op` fails with
    /// [`OpsError::Failed`] (`reason: "injected fault"`) instead of running. Faults
    /// are consumed one per kernel; kernels skipped on a poisoned stream consume none.
    pub fn inject_fault(&self, rank: u32, op: &'static str) {
        let mut faults = lock(&self.shared.faults);
        faults.push((rank, op));
        self.shared
            .armed_faults
            .store(faults.len(), Ordering::Release);
    }

    /// Disarms every injected fault that has not fired yet.
    pub fn clear_faults(&self) {
        let mut faults = lock(&self.shared.faults);
        faults.clear();
        self.shared.armed_faults.store(0, Ordering::Release);
    }

    /// Sends a command to a stream, or reports why it cannot run (failing a record so
    /// nobody waits for it forever).
    fn enqueue(&self, rank: u32, stream: Stream, tag: Tag, cmd: Command) {
        let queue = self
            .shared
            .slot(rank, stream)
            .and_then(|i| self.queues.get(i));
        let cmd = match queue {
            Some(queue) => match queue.send(cmd) {
                Ok(()) => return,
                Err(SendError(cmd)) => cmd,
            },
            None => cmd,
        };
        let err = match CpuBackend::check_mesh(self.shared.mesh) {
            Err(e) if !self.shared.local.is_empty() && self.shared.remote.is_none() => e,
            _ => OpsError::Backend(format!(
                "rank {rank} has no running {stream} stream on this backend ({})",
                self.shared.drives()
            )),
        };
        if let Command::Record(slot) = &cmd {
            slot.complete(Err(err.clone()));
        }
        lock(&self.shared.errors).push((rank, stream, tag, err));
    }

    fn check_rank(&self, rank: u32) -> Result<(), OpsError> {
        if self.shared.local.contains(&rank) {
            Ok(())
        } else {
            Err(OpsError::Backend(format!(
                "rank {rank} is not on this backend ({})",
                self.shared.drives()
            )))
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;
    type Event = CpuEvent;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn local_ranks(&self) -> Vec<u32> {
        self.shared.local.clone().collect()
    }

    fn alloc(&self, rank: u32, len: usize) -> Result<CpuBuffer, OpsError> {
        self.check_rank(rank)?;
        CpuBuffer::zeroed(
            self.shared.next_buffer.fetch_add(1, Ordering::Relaxed),
            rank,
            len,
        )
    }

    /// Filled with NaN, as uninitialised device memory may hold anything: a read before
    /// the first full overwrite shows in the results.
    fn alloc_uninit(&self, rank: u32, len: usize) -> Result<CpuBuffer, OpsError> {
        self.check_rank(rank)?;
        CpuBuffer::filled(
            self.shared.next_buffer.fetch_add(1, Ordering::Relaxed),
            rank,
            len,
            f32::NAN,
        )
    }

    fn len(&self, buf: &CpuBuffer) -> usize {
        buf.len()
    }

    fn same_buffer(&self, a: &CpuBuffer, b: &CpuBuffer) -> bool {
        a.same(b)
    }

    fn upload(&self, buf: &CpuBuffer, data: &[f32]) -> Result<(), OpsError> {
        if data.len() != buf.len() {
            return Err(OpsError::Shape {
                kernel: "upload",
                reason: format!("{} host elements for {buf:?}", data.len()),
            });
        }
        buf.lock().copy_from_slice(data);
        Ok(())
    }

    fn download(&self, buf: &CpuBuffer) -> Result<Vec<f32>, OpsError> {
        Ok(buf.lock().clone())
    }

    fn event(&self, _rank: u32) -> CpuEvent {
        CpuEvent::default()
    }

    fn launch(&self, rank: u32, stream: Stream, tag: Tag, kernel: Kernel<CpuBuffer>) {
        self.enqueue(rank, stream, tag, Command::Launch(tag, kernel));
    }

    fn record(&self, rank: u32, stream: Stream, event: &CpuEvent) {
        self.enqueue(
            rank,
            stream,
            host_tag("record"),
            Command::Record(event.new_record()),
        );
    }

    fn wait(&self, rank: u32, stream: Stream, event: &CpuEvent) {
        if let Some(slot) = event.latest() {
            self.enqueue(rank, stream, host_tag("wait"), Command::Wait(slot));
        }
    }

    fn status(&self, event: &CpuEvent) -> EventStatus {
        event.status()
    }

    fn host_wait(&self, event: &CpuEvent) -> BoxFuture<Result<(), OpsError>> {
        Box::pin(HostWait {
            slot: event.latest(),
        })
    }

    /// Root causes in the order they happened. Misuse of `record`/`wait` (an unknown
    /// rank) is reported with the tag `{ node: u32::MAX, op: "record" | "wait" }`.
    fn errors(&self) -> Vec<RootCause> {
        lock(&self.shared.errors).clone()
    }

    /// Clears every stream's poison and the error list, and restarts every
    /// communicator (collectives in flight are abandoned, call numbering starts over), so
    /// members that diverged in a failed step meet again.
    fn reset(&self) {
        self.shared.poison.iter().for_each(|p| *lock(p) = None);
        lock(&self.shared.errors).clear();
        self.shared.comms.values().for_each(Comm::reset);
    }

    fn take_timings(&self) -> Vec<Timing> {
        std::mem::take(&mut *lock(&self.shared.timings))
    }

    fn running(&self, rank: u32, stream: Stream) -> Option<Tag> {
        let slot = self.shared.slot(rank, stream)?;
        self.shared.running.get(slot).and_then(|r| *lock(r))
    }

    /// In one process, nothing: its collectives time out by themselves and dropping the
    /// backend ends its streams. With one rank per process ([`CpuBackend::one_rank`]),
    /// every call waiting for other processes ends at once, cancelled, and so do later
    /// ones: the backend is not usable for communication after; and every other process
    /// is told `why` (a farewell on the links), so that a rank which learns of the end
    /// from this process's closed connection names the cause, not only this rank.
    fn abort(&self, why: &str) {
        if let Some(outbox) = &self.shared.remote {
            outbox.farewell(why);
            self.shared.halt.aborted.store(true, Ordering::Release);
            self.shared.comms.values().for_each(Comm::wake_all);
        }
    }
}

impl Drop for CpuBackend {
    /// Stops every stream: queued kernels are skipped, queued records fail, collectives
    /// in flight are released; then joins the threads.
    fn drop(&mut self) {
        self.shared.halt.shutdown.store(true, Ordering::Release);
        self.shared.comms.values().for_each(Comm::wake_all);
        self.queues.clear();
        for thread in self.threads.drain(..) {
            // A stream thread does not panic; if one did, there is nothing left to undo.
            let _ = thread.join();
        }
    }
}

/// The loop of one stream thread.
struct Worker {
    rank: u32,
    stream: Stream,
    /// Where its poison and running kernel live ([`Shared::slot`]).
    slot: usize,
    shared: Arc<Shared>,
}

impl Worker {
    fn run(self, queue: Receiver<Command>) {
        for cmd in queue {
            match cmd {
                Command::Launch(tag, kernel) => self.launch(tag, kernel),
                Command::Record(slot) => slot.complete(self.poison().map_or(Ok(()), Err)),
                Command::Wait(slot) => {
                    if let Err(e) = slot.wait() {
                        self.poison_with(match e {
                            OpsError::Cancelled(_) => e,
                            other => OpsError::Cancelled(other.to_string()),
                        });
                    }
                }
            }
        }
    }

    /// Sleeps `micros` µs in slices, giving up with a cancellation once the backend is
    /// dropped, so that a hung stream never keeps its process alive.
    fn long_spin(&self, micros: u32) -> Result<(), OpsError> {
        let end = Instant::now() + Duration::from_micros(u64::from(micros));
        while Instant::now() < end {
            if self.shared.halt.shutdown.load(Ordering::Acquire) {
                return Err(OpsError::Cancelled(
                    "the CPU backend was dropped during a spin".into(),
                ));
            }
            thread::sleep((end - Instant::now()).min(Duration::from_millis(10)));
        }
        Ok(())
    }

    fn poison_slot(&self) -> MutexGuard<'_, Option<OpsError>> {
        lock(&self.shared.poison[self.slot])
    }

    /// The stream's poison; a dropped backend poisons every stream.
    fn poison(&self) -> Option<OpsError> {
        let mut poison = self.poison_slot();
        if poison.is_none() && self.shared.halt.shutdown.load(Ordering::Acquire) {
            *poison = Some(OpsError::Cancelled("the CPU backend was dropped".into()));
        }
        poison.clone()
    }

    /// Poisons the stream unless it already is (the first cause wins).
    fn poison_with(&self, cause: OpsError) {
        self.poison_slot().get_or_insert(cause);
    }

    fn launch(&self, tag: Tag, kernel: Kernel<CpuBuffer>) {
        // A row of optimizer steps is its steps, each a kernel of its own under its
        // own tag (poison, faults, timings and errors per step).
        // (A row whose gradients do not match its steps fails as one kernel below.)
        let kernel = match kernel {
            Kernel::Optimizers(row) if row.check().is_ok() => {
                for (tag, kernel) in row.kernels() {
                    self.launch(tag, kernel);
                }
                return;
            }
            kernel => kernel,
        };
        let poison = self.poison();
        if poison.is_some()
            && !matches!(
                kernel,
                Kernel::Collective { .. } | Kernel::Exchange { .. } | Kernel::Gather { .. }
            )
        {
            return;
        }
        let fault = match poison {
            None => self.shared.take_fault(self.rank, tag.op, kernel.name()),
            Some(_) => Ok(()),
        };
        let start = self.shared.epoch.elapsed().as_secs_f64();
        let running = &self.shared.running[self.slot];
        *lock(running) = Some(tag);
        let result = match kernel {
            Kernel::Collective {
                desc,
                comm,
                send,
                recv,
            } => self.collective(Call::Collective, &desc, comm, send, recv, poison, fault),
            Kernel::Exchange {
                desc,
                comm,
                send,
                recv,
            } => self.collective(Call::Exchange, &desc, comm, send, recv, poison, fault),
            // The gather's one buffer travels as the send side: read (its chunk) and
            // written (the others') by the rendezvous.
            Kernel::Gather { desc, comm, buf } => {
                self.collective(Call::Gather, &desc, comm, buf, None, poison, fault)
            }
            // A long spin (an injected hang) ends when the backend is dropped.
            Kernel::Spin { micros } if micros > LONG_SPIN_US => {
                fault.and_then(|()| self.long_spin(micros)).map(|()| 0)
            }
            local => fault
                .and_then(|()| kernels::run(self.rank, &local))
                .map(|()| 0),
        };
        *lock(running) = None;
        match result {
            Ok(bytes) => {
                let end = self.shared.epoch.elapsed().as_secs_f64();
                let timing = Timing {
                    rank: self.rank,
                    stream: self.stream,
                    tag,
                    start,
                    end,
                    bytes,
                };
                lock(&self.shared.timings).push(timing);
            }
            Err(e) if e.is_cancellation() => self.poison_with(e),
            Err(e) => {
                let (rank, stream) = (self.rank, self.stream);
                let cause = format!(
                    "{} (node {}) on rank {rank}, {stream} stream failed: {e}",
                    tag.op, tag.node
                );
                lock(&self.shared.errors).push((rank, stream, tag, e));
                self.poison_with(OpsError::Cancelled(cause));
            }
        }
    }

    /// Takes part in a collective or an exchange, even when poisoned or invalid (then as
    /// unable, so the peers fail rather than wait); returns the bytes moved.
    #[allow(clippy::too_many_arguments)]
    fn collective(
        &self,
        call: Call,
        desc: &Collective,
        id: CommId,
        send: Option<CpuBuffer>,
        recv: Option<CpuBuffer>,
        poison: Option<OpsError>,
        fault: Result<(), OpsError>,
    ) -> Result<u64, OpsError> {
        let Some((comm, index)) = self
            .shared
            .comms
            .get(&id)
            .and_then(|c| Some((c, c.index_of(self.rank)?)))
        else {
            return Err(poison.unwrap_or_else(|| OpsError::Shape {
                kernel: call.kernel(desc),
                reason: format!(
                    "rank {} is not a member of a communicator {id} of mesh {}",
                    self.rank, self.shared.mesh
                ),
            }));
        };
        let own = fault.and_then(|()| {
            comm.check(self.stream, index, call, desc, send.as_ref(), recv.as_ref())
        });
        let failed = (poison.clone().or_else(|| own.as_ref().err().cloned())).map(Failure::Local);
        let timeout = Duration::from_nanos(self.shared.timeout_ns.load(Ordering::Relaxed));
        let result = comm.call(
            index,
            Arrival {
                call,
                desc: *desc,
                send,
                recv,
                failed,
            },
            timeout,
            &self.shared.halt,
        );
        match (poison, own) {
            (Some(cause), _) => Err(cause),
            (None, Err(e)) => Err(e),
            (None, Ok(bytes)) => result.map(|()| bytes),
        }
    }
}

/// A communicator per group of `mesh` that has a member in `local`, and stream; the
/// members outside `local` are reached through `outbox`.
fn comms_of(
    mesh: Mesh,
    local: Range<u32>,
    outbox: Option<remote::Outbox>,
) -> HashMap<CommId, Comm> {
    if local.is_empty() {
        return HashMap::new();
    }
    let shard = (0..mesh.replicate).map(|replicate| Group::Shard { replicate });
    let groups = shard.chain((0..mesh.shard).map(|shard| Group::Replicate { shard }));
    let mut comms = HashMap::new();
    for group in groups {
        let members = mesh.members(group);
        if !members.iter().any(|r| local.contains(r)) {
            continue;
        }
        for stream in Stream::ALL {
            let id = CommId { group, stream };
            let is_local = |r: u32| local.contains(&r);
            let out = outbox.clone();
            comms.insert(id, Comm::new(id, members.clone(), is_local, out));
        }
    }
    comms
}

impl Shared {
    fn new(
        mesh: Mesh,
        local: Range<u32>,
        comms: HashMap<CommId, Comm>,
        remote: Option<remote::Outbox>,
    ) -> Shared {
        let streams = local.len() * Stream::ALL.len();
        Shared {
            mesh,
            local,
            remote,
            epoch: Instant::now(),
            comms,
            poison: (0..streams).map(|_| Mutex::new(None)).collect(),
            running: (0..streams).map(|_| Mutex::new(None)).collect(),
            errors: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
            armed_faults: AtomicUsize::new(0),
            timings: Mutex::new(Vec::new()),
            timeout_ns: AtomicU64::new(nanos(DEFAULT_COLLECTIVE_TIMEOUT)),
            halt: Halt::default(),
            next_buffer: AtomicU64::new(0),
        }
    }

    /// Where a local (rank, stream)'s queue, poison and running kernel live.
    fn slot(&self, rank: u32, stream: Stream) -> Option<usize> {
        self.local
            .contains(&rank)
            .then(|| (rank - self.local.start) as usize * Stream::ALL.len() + stream.index())
    }

    /// What the backend drives, for errors: `mesh 2x2, 4 ranks` or `rank 1 of mesh 2x2`.
    fn drives(&self) -> String {
        if self.remote.is_some() {
            format!("rank {} of mesh {}", self.local.start, self.mesh)
        } else {
            format!("mesh {}, {} ranks", self.mesh, self.local.len())
        }
    }

    /// Consumes an armed fault for `(rank, op)`, failing the kernel `kernel`.
    fn take_fault(
        &self,
        rank: u32,
        op: &'static str,
        kernel: &'static str,
    ) -> Result<(), OpsError> {
        if self.armed_faults.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        let mut faults = lock(&self.faults);
        let Some(i) = faults.iter().position(|&(r, o)| r == rank && o == op) else {
            return Ok(());
        };
        faults.remove(i);
        self.armed_faults.store(faults.len(), Ordering::Release);
        Err(OpsError::Failed {
            kernel,
            reason: "injected fault".into(),
        })
    }
}
