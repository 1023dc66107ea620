//! The CUDA + NCCL backend: one rank of a mesh on one GPU, one process per GPU.
//!
//! [`CudaBackend`] drives the rank it was opened for ([`Backend::local_ranks`] is
//! `[rank]`), the way trainers run: `overlap launch` (or torchrun, Slurm, `mpirun`)
//! starts one process per GPU and the facade's rendezvous shares the NCCL unique ids.
//! Setting one up takes three steps:
//!
//! 1. [`CudaBackend::new`] checks that the driver, NVRTC, cuBLAS and NCCL can be
//!    loaded (a clear error naming the library otherwise, never a panic from inside a
//!    loader), retains the device's primary context, creates the rank's four streams
//!    (the reduce stream at high priority), compiles the kernels with NVRTC and creates a
//!    cuBLAS handle per stream;
//! 2. rank 0 calls [`unique_ids`] for every communicator of [`mesh_comms`] and shares
//!    them;
//! 3. every rank calls [`CudaBackend::connect`] with the same list, creating its NCCL
//!    communicators in that global order;
//! 4. for the copy transport ([`Kernel::Exchange`]), every rank then calls
//!    [`CudaBackend::connect_copy`] with the same slot size, which maps each
//!    communicator's CUDA IPC receive rings between its members (see `exchange.rs`).
//!
//! What the backend keeps (the [`crate`] semantics, on real hardware):
//! - **Streams and events.** `launch`, `record` and `wait` enqueue on the rank's CUDA
//!   streams and return at once. A plan's event edge is one `cuEventRecord` on the
//!   producer's stream and one `cuStreamWaitEvent` on the consumer's; nothing else
//!   orders the streams: they are non-blocking streams, buffers are raw device
//!   allocations (cudarc's `CudaSlice` and its automatic event tracking are not used at
//!   all), and the libraries are told which stream to use on every call.
//! - **Buffers** stay alive until every stream has passed their last use, and their
//!   memory is reused from a pool (see [`CudaBuffer`]); scratch (bf16 staging, Newton–Schulz
//!   work matrices) is per stream, so stream order alone protects it.
//! - **Collectives** go to the NCCL communicator of the kernel's `(group, stream)`,
//!   issued under one lock in the plan's order. `avg` is NCCL's `ncclAvg`. `bf16`
//!   reductions convert the f32 input to bfloat16 (round to nearest even, as
//!   [`crate::math::round_bf16`]), reduce in NCCL's bfloat16 (half the bytes on the
//!   wire; NCCL rounds its partial sums to bf16, which is where the GPU and the CPU
//!   reference, which reduces in f32, differ), and widen the result back to f32.
//! - **Poisoning.** Validation happens on the host at launch: a bad kernel is reported
//!   through [`Backend::errors`] and poisons its stream (later kernels are skipped, its
//!   records fail, and streams waiting on them are poisoned). By default a poisoned or
//!   invalid member of a collective still joins the NCCL call, with scratch buffers of
//!   the right size, so its peers never hang; they cannot learn of the failure from the
//!   collective and finish with undefined data, while the failing rank reports the root
//!   cause. A job whose ranks tell each other of failures turns that off
//!   ([`CudaBackend::set_poisoned_collectives_join`]): its peers then wait until the
//!   failure reaches them. Errors the GPU reports asynchronously surface when an event
//!   is queried.
//! - **Copy transport.** An exchange runs on its communicator's stream as copy-engine
//!   copies into the peers' rings and stream memory operations (flag writes and waits);
//!   like a collective, a poisoned or invalid member still joins it (moving no data) so
//!   its peers never hang. [`Kernel::Combine`] is an ordinary kernel on any stream.
//! - **Timings** (when enabled) come from timing-capable events recorded around every
//!   kernel and `cuEventElapsedTime`; ordering events have timing disabled.
//! - **The global norm** (`[clip]`) never reaches the host during a step:
//!   [`Kernel::SumSquares`] is two atomics-free passes through the stream's scratch,
//!   [`Kernel::Clip`] reads the squared norm in device memory, and
//!   [`Kernel::IfFinite`] hands the optimizer's kernels the norm's address (null when
//!   unguarded): AdamW's kernel and Muon's momentum and update kernels return at once
//!   when it is not finite (Muon's Newton–Schulz still runs, on scratch).
//!
//! Invariant: the backend adds no ordering the plan did not ask for, and every CUDA call
//! is made with the context bound on the calling thread.

mod defer;
mod device;
mod event;
mod exchange;
mod kernels;
mod loader;
mod memory;
mod muon;
mod nccl;
mod optim;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use overlap_graph::{
    Bindings, Collective, CollectiveKind, CopySeg, DType, Group, Mesh, ReduceOp, Stream,
};

use crate::{
    collective_roles, Backend, BoxFuture, CollectiveRoles, CommId, EventStatus, Kernel, OpsError,
    Tag, Timing,
};
/// The CUDA bindings the backend is built on, for a trainer that runs its own kernels
/// beside it in the same primary context (`examples/train.rs --backend cuda`): the same
/// version, so its handles (`CUstream`, device addresses) are the backend's types.
pub use cudarc;
use defer::{Held, Pending};
use device::Device;
pub use event::CudaEvent;
use event::{lock, EventPool, HostWait, Record, Waiter};
pub use exchange::{
    copy_ring_bytes, CopySetup, DEFAULT_COPY_RING_DEPTH, DEFAULT_COPY_SLOT_BYTES,
    MAX_COPY_RING_DEPTH,
};
use exchange::{CopyRing, InPlace};
use kernels::{Kernels, Seg, Span};
pub use loader::check as check_libraries;
pub use memory::CudaBuffer;
use memory::{DevMem, Memory};
use muon::Blas;
use nccl::Comm;
pub use nccl::NcclUniqueId;

/// One root cause: the rank, the stream, the failing kernel's tag and the error.
type RootCause = (u32, Stream, Tag, OpsError);

/// How long dropping the backend waits for in-flight work before tearing down.
const DRAIN_ON_DROP: Duration = Duration::from_secs(10);

/// The tag under which host-side misuse and device errors are reported.
fn host_tag(op: &'static str) -> Tag {
    Tag {
        node: u32::MAX,
        op,
        micro_batch: u32::MAX,
    }
}

/// What a [`CudaBackend`] drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// The mesh of the whole job.
    pub mesh: Mesh,
    /// This process's global rank.
    pub rank: u32,
    /// The CUDA device ordinal to use (the local rank, as torchrun assigns GPUs).
    pub device: u32,
    /// Record kernel timings with timing events (two event records per kernel).
    pub timings: bool,
    /// Create every stream at the same priority (for measurement: by default the
    /// reduce stream gets the device's greatest).
    pub uniform_priority: bool,
}

/// What the backend found at start, for logs and `overlap` diagnostics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: u32,
    /// Device name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability.
    pub capability: (i32, i32),
    /// CUDA driver version.
    pub driver: String,
    /// NCCL version.
    pub nccl: String,
    /// The library files opened: driver, NVRTC, cuBLAS, NCCL.
    pub libraries: Vec<String>,
}

/// Every communicator a mesh needs with these stream bindings, in the one global order
/// in which every rank creates its members: each shard group on the Stage-1 stream,
/// each replicate group on the Stage-2 stream and on the publish stream, and with the
/// copy transport (`copy`) every group on the exchange stream too.
///
/// ```
/// use overlap_ops::cuda::mesh_comms;
/// use overlap_ops::graph::{Bindings, Mesh};
///
/// let comms = mesh_comms(Mesh { shard: 2, replicate: 1 }, &Bindings::default(), false);
/// // shard(r=0)@reduce, replicate(s=0)@replicate, replicate(s=0)@publish, ...
/// assert_eq!(comms.len(), 1 + 2 * 2);
/// let copy = mesh_comms(Mesh { shard: 2, replicate: 1 }, &Bindings::default(), true);
/// assert_eq!(copy.len(), 2 + 2 * 3);
/// ```
pub fn mesh_comms(mesh: Mesh, bindings: &Bindings, copy: bool) -> Vec<CommId> {
    let mut comms: Vec<CommId> = (0..mesh.replicate)
        .flat_map(|replicate| {
            let group = Group::Shard { replicate };
            std::iter::once(CommId {
                group,
                stream: bindings.stage1,
            })
            .chain(copy.then_some(CommId {
                group,
                stream: bindings.exchange,
            }))
        })
        .chain((0..mesh.shard).flat_map(|shard| {
            let group = Group::Replicate { shard };
            [bindings.stage2, bindings.publish]
                .map(|stream| CommId { group, stream })
                .into_iter()
                .chain(copy.then_some(CommId {
                    group,
                    stream: bindings.exchange,
                }))
        }))
        .collect();
    comms.sort();
    comms.dedup();
    comms
}

/// [`mesh_comms`] plus, for a plan that gathers the full parameters for the forward
/// (`PlanSpec::forward`), each shard group on the `unshard` binding's stream (the
/// gathers' all-gathers and broadcasts), in the same global order. Without the forward
/// it is exactly [`mesh_comms`], so such a job creates the communicators it always did.
///
/// ```
/// use overlap_ops::cuda::{mesh_comms, mesh_comms_with_forward};
/// use overlap_ops::graph::{Bindings, Mesh};
///
/// let mesh = Mesh { shard: 2, replicate: 1 };
/// let b = Bindings::default();
/// assert_eq!(mesh_comms_with_forward(mesh, &b, false, false), mesh_comms(mesh, &b, false));
/// // plus shard(r=0)@publish
/// assert_eq!(mesh_comms_with_forward(mesh, &b, false, true).len(), 1 + 2 * 2 + 1);
/// ```
pub fn mesh_comms_with_forward(
    mesh: Mesh,
    bindings: &Bindings,
    copy: bool,
    forward: bool,
) -> Vec<CommId> {
    let mut comms = mesh_comms(mesh, bindings, copy);
    if forward {
        comms.extend((0..mesh.replicate).map(|replicate| CommId {
            group: Group::Shard { replicate },
            stream: bindings.unshard,
        }));
        comms.sort();
        comms.dedup();
    }
    comms
}

/// `n` fresh NCCL unique ids (rank 0 generates them for every communicator of the
/// mesh). Fails with a clear error when the CUDA driver or NCCL cannot be loaded.
pub fn unique_ids(n: usize) -> Result<Vec<NcclUniqueId>, OpsError> {
    loader::DRIVER.check()?;
    loader::NCCL.check()?;
    nccl::generate(n)
}

/// The backend for one rank on one GPU.
pub struct CudaBackend {
    shared: Arc<Shared>,
    issue: Mutex<Issue>,
    waiter: Option<Waiter>,
    info: DeviceInfo,
}

/// What the host side and the waiter thread share.
struct Shared {
    rank: u32,
    mesh: Mesh,
    device: Arc<Device>,
    memory: Arc<Memory>,
    events: Arc<EventPool>,
    errors: Mutex<Vec<RootCause>>,
}

impl Shared {
    /// Records a root cause, once per distinct error.
    fn report(&self, stream: Stream, tag: Tag, error: OpsError) {
        let mut errors = lock(&self.errors);
        if !errors.iter().any(|(_, _, _, e)| *e == error) {
            errors.push((self.rank, stream, tag, error));
        }
    }
}

/// The issuing state, behind one lock so that every rank issues in plan order and
/// cuBLAS handles and scratch are never used concurrently.
struct Issue {
    /// Each stream's poison (a cancellation naming the root cause).
    poison: [Option<OpsError>; Stream::COUNT],
    comms: Vec<Comm>,
    /// The copy transport's rings, one per communicator of more than one member, once
    /// [`CudaBackend::connect_copy`] ran.
    copy: Vec<CopyRing>,
    kernels: Kernels,
    /// Exchanges received in place and not yet combined, by their receive buffer's
    /// address: the combine reads the ring there and acknowledges the pieces.
    in_place: HashMap<sys::CUdeviceptr, (CommId, InPlace)>,
    /// At most this many CTAs per [`Kernel::Combine`] (`None`: enough for one element
    /// per thread, up to the launch cap).
    combine_ctas: Option<u32>,
    /// Combines load and store with cache-streaming hints ([`CudaBackend::set_combine_streaming`]).
    combine_streaming: bool,
    /// Whether a poisoned stream's collectives still join their peers (module docs).
    poisoned_join: bool,
    /// One cuBLAS handle per stream, at [`Stream::index`].
    blas: Vec<Blas>,
    /// Scratch per stream, at [`Stream::index`].
    scratch: [Option<Arc<DevMem>>; Stream::COUNT],
    /// The read-only bf16 operands `A` then `B` of [`Kernel::Gemm`], filled once with
    /// pseudo-random values, with their `(m, n, k)`.
    gemm: Option<((u32, u32, u32), Arc<DevMem>)>,
    timings: Timings,
    /// Optimizer kernels validated and held per stream, at [`Stream::index`], until
    /// the stream is flushed (`defer.rs`).
    pending: [Pending; Stream::COUNT],
}

/// Kernel timings: a timing event recorded before and after each kernel.
struct Timings {
    on: bool,
    /// Recorded (and completed) when the backend started: time zero.
    epoch: sys::CUevent,
    pending: Vec<PendingTiming>,
}

struct PendingTiming {
    stream: Stream,
    tag: Tag,
    start: sys::CUevent,
    /// The same event as `start` for a marker.
    end: sys::CUevent,
    bytes: u64,
}

impl PendingTiming {
    /// Returns the events to the pool (each once).
    fn recycle(&self, events: &EventPool) {
        events.put_timed(self.start);
        if self.end != self.start {
            events.put_timed(self.end);
        }
    }
}

// SAFETY: `Issue` holds driver, cuBLAS and NCCL handles that are only used under the
// backend's mutex with the context bound; none is tied to the thread that created it.
unsafe impl Send for Issue {}

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
        self.shared.device.bind()?;
        let issue = self
            .issue
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for &(id, uid) in comms {
            if !mesh.has_group(id.group) {
                return Err(OpsError::Backend(format!(
                    "communicator {id} names a group that mesh {mesh} does not have"
                )));
            }
            let Some(index) = mesh.index_in(id.group, rank) else {
                continue;
            };
            if issue.comms.iter().any(|c| c.id == id) {
                return Err(OpsError::Backend(format!(
                    "communicator {id} was created twice"
                )));
            }
            let comm = Comm::init(id, uid, mesh.group_size(id.group), index, max_ctas)?;
            issue.comms.push(comm);
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

    /// Copies all of `src` into `dst` (the same length, this rank's) on `stream` with
    /// `cuMemcpyDtoDAsync`, i.e. on the copy engines, timed like a kernel tagged `tag`
    /// when timings are on. For probes of what copy-engine traffic costs the kernels
    /// beside it (`overlap bench-interference`); the plan's copies are kernels or
    /// exchanges.
    pub fn copy_engine_copy(
        &self,
        stream: Stream,
        tag: Tag,
        dst: &CudaBuffer,
        src: &CudaBuffer,
    ) -> Result<(), OpsError> {
        const K: &str = "copy";
        expect(K, self.shared.rank, "src", src, dst.len)?;
        expect(K, self.shared.rank, "dst", dst, src.len)?;
        let mut st = lock(&self.issue);
        self.shared.device.bind()?;
        let raw = self.shared.device.stream(stream);
        let start = if st.timings.on {
            st.timing_event(&self.shared, raw)
        } else {
            None
        };
        let bytes = src.len * 4;
        // SAFETY: both buffers are this rank's and hold `len` floats (checked above).
        let copied = unsafe { sys::cuMemcpyDtoDAsync_v2(dst.ptr(), src.ptr(), bytes, raw) }
            .result()
            .map_err(|e| device::failed(K, e));
        let issued = copied.as_ref().ok().map(|()| bytes as u64);
        st.end_timing(&self.shared, (stream, raw), tag, start, issued);
        copied
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
        self.shared.device.bind()?;
        let shared = Arc::clone(&self.shared);
        let issue = self
            .issue
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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

    /// What issuing costs the host, in microseconds per call: each driver call the
    /// backend's nodes are made of (and the backend's own record-and-wait edge and
    /// marker), issued `iters` times back to back on an idle stream, then the streams
    /// drained before the next. `overlap cuda-smoke` reports it: with the per-kind
    /// figures of `overlap bench` it says where a node's host time goes.
    pub fn host_costs(&self, iters: u32) -> Result<Vec<(&'static str, f64)>, OpsError> {
        let shared = &self.shared;
        let device = &shared.device;
        device.bind()?;
        let mut timer = HostTimer {
            streams: [device.stream(Stream::Copy), device.stream(Stream::Reduce)],
            iters: iters.max(1),
            out: Vec::new(),
        };
        let mem = shared.memory.alloc_raw(1 << 12)?;
        let ev = shared.events.take_plain()?;
        let measured = self.driver_costs(&mut timer, mem.ptr(), ev);
        shared.events.put_plain(ev);
        measured?;
        self.backend_costs(&mut timer)?;
        drop(mem);
        Ok(timer.out)
    }

    /// [`CudaBackend::host_costs`]' driver calls, under the issue lock: an event edge,
    /// flag operations on the 4 KiB `mem` at `flag`, a copy, a launch and event queries.
    fn driver_costs(
        &self,
        timer: &mut HostTimer,
        flag: sys::CUdeviceptr,
        ev: sys::CUevent,
    ) -> Result<(), OpsError> {
        let device = &self.shared.device;
        let [raw, other] = timer.streams;
        let flagged = |r: Result<(), String>| r.map_err(OpsError::Backend);
        let st = lock(&self.issue);
        timer.time("cuCtxSetCurrent", &mut |_| device.bind())?;
        timer.time("cuEventRecord", &mut |_| {
            // SAFETY: live handles of the bound context.
            unsafe { cu::event::record(ev, raw) }.map_err(|e| device::backend("cuEventRecord", e))
        })?;
        timer.time("cuStreamWaitEvent", &mut |_| {
            // SAFETY: live handles of the bound context.
            unsafe {
                cu::stream::wait_event(other, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
            }
            .map_err(|e| device::backend("cuStreamWaitEvent", e))
        })?;
        use exchange::Flag;
        timer.time("cuStreamWriteValue32", &mut |i| {
            flagged(exchange::flags(raw, &[Flag::Write(flag, i)]))
        })?;
        timer.time("cuStreamWaitValue32 (already reached)", &mut |_| {
            flagged(exchange::flags(raw, &[Flag::Wait(flag, 0)]))
        })?;
        timer.time("cuStreamBatchMemOp (a write and a wait)", &mut |i| {
            flagged(exchange::flags(
                raw,
                &[Flag::Write(flag, i), Flag::Wait(flag, i)],
            ))
        })?;
        timer.time("cuMemcpyDtoDAsync (2 KiB)", &mut |_| {
            // SAFETY: both halves of the 4 KiB `mem`, ordered on `raw`.
            unsafe { sys::cuMemcpyDtoDAsync_v2(flag + 2048, flag, 2048, raw) }
                .result()
                .map_err(|e| device::backend("cuMemcpyDtoDAsync", e))
        })?;
        timer.time("cuLaunchKernel (add, 1 element)", &mut |_| {
            st.kernels.add(raw, flag + 64, flag + 128, 1, false)
        })?;
        query_costs(timer, &st.kernels, ev)
    }

    /// [`CudaBackend::host_costs`]' calls to the backend itself: what the executor
    /// issues per cross-stream edge and per aliased node (the issue lock, a pooled
    /// event, the driver call).
    fn backend_costs(&self, timer: &mut HostTimer) -> Result<(), OpsError> {
        let rank = self.shared.rank;
        let edge = CudaEvent::new(rank);
        timer.time("Backend::record + Backend::wait (one edge)", &mut |_| {
            self.record(rank, Stream::Copy, &edge);
            self.wait(rank, Stream::Reduce, &edge);
            Ok(())
        })?;
        timer.time("Backend::launch (marker)", &mut |i| {
            let tag = Tag {
                node: i,
                op: "marker",
                micro_batch: 0,
            };
            self.launch(rank, Stream::Copy, tag, Kernel::Marker);
            Ok(())
        })
    }

    /// Reports misuse of the backend by the host.
    fn misuse(&self, stream: Stream, op: &'static str, reason: String) {
        self.shared
            .report(stream, host_tag(op), OpsError::Backend(reason));
    }

    fn not_mine(&self, rank: u32) -> String {
        format!(
            "rank {rank} is not driven by this backend (it drives rank {} of mesh {})",
            self.shared.rank, self.shared.mesh
        )
    }
}

/// Times host calls for [`CudaBackend::host_costs`], between drains of its two
/// streams.
struct HostTimer {
    /// The stream the calls issue on, and the one an event edge waits on.
    streams: [sys::CUstream; 2],
    /// Calls per figure, back to back.
    iters: u32,
    /// Each call's name and mean host time in microseconds.
    out: Vec<(&'static str, f64)>,
}

impl HostTimer {
    /// Waits until both streams are idle.
    fn drain(&self) -> Result<(), OpsError> {
        for s in self.streams {
            // SAFETY: live streams of the bound context.
            unsafe { cu::stream::synchronize(s) }
                .map_err(|e| device::backend("cuStreamSynchronize", e))?;
        }
        Ok(())
    }

    /// Calls `f` `iters` times (with the iteration) on idle streams and records the
    /// mean time per call under `name`, then drains the streams.
    fn time(
        &mut self,
        name: &'static str,
        f: &mut dyn FnMut(u32) -> Result<(), OpsError>,
    ) -> Result<(), OpsError> {
        self.drain()?;
        let t0 = Instant::now();
        for i in 0..self.iters {
            f(i)?;
        }
        let mean = t0.elapsed().as_secs_f64() * 1e6 / f64::from(self.iters);
        self.out.push((name, mean));
        self.drain()
    }
}

/// [`CudaBackend::host_costs`]' `cuEventQuery` figures, on an event complete and then
/// pending behind a spinning kernel.
fn query_costs(timer: &mut HostTimer, kernels: &Kernels, ev: sys::CUevent) -> Result<(), OpsError> {
    let [raw, _] = timer.streams;
    let iters = timer.iters;
    let query = |_| {
        // SAFETY: a live event of the bound context.
        match unsafe { cu::event::query(ev) } {
            Ok(()) => Ok(()),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(()),
            Err(e) => Err(device::backend("cuEventQuery", e)),
        }
    };
    // SAFETY: live handles of the bound context; `time` drained the stream.
    unsafe { cu::event::record(ev, raw) }.map_err(|e| device::backend("cuEventRecord", e))?;
    timer.time("cuEventQuery (complete)", &mut { query })?;
    // Pending: behind a kernel that spins longer than the queries take (launched
    // in the first iteration, whose two calls add ~4 µs to the whole loop).
    timer.time("cuEventQuery (pending)", &mut |i| {
        if i == 0 {
            kernels.spin(raw, (iters / 10).clamp(5, 100) * 1000)?;
            // SAFETY: live handles of the bound context.
            unsafe { cu::event::record(ev, raw) }
                .map_err(|e| device::backend("cuEventRecord", e))?;
        }
        query(i)
    })
}

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
        if let Err(e) = self.shared.device.bind() {
            self.shared.report(stream, tag, e);
            return;
        }
        st.launch(&self.shared, stream, tag, kernel);
    }

    fn record(&self, rank: u32, stream: Stream, event: &CudaEvent) {
        let mut st = lock(&self.issue);
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
        let Some(record) = event.latest() else {
            // Waiting for a never-recorded event is a no-op, as in CUDA.
            return;
        };
        if rank != self.shared.rank {
            self.misuse(stream, "wait", self.not_mine(rank));
            return;
        }
        let mut st = lock(&self.issue);
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
        if let Err(e) = waited {
            self.shared.report(stream, host_tag("wait"), e);
        }
    }

    fn status(&self, event: &CudaEvent) -> EventStatus {
        let Some(record) = event.latest() else {
            return EventStatus::Complete;
        };
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

    fn host_wait(&self, event: &CudaEvent) -> BoxFuture<Result<(), OpsError>> {
        let ready = |r| {
            Box::pin(HostWait {
                ready: Some(r),
                slot: None,
            })
        };
        let Some(record) = event.latest() else {
            return ready(Ok(()));
        };
        match self.status(event) {
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
    /// ends with an error). The copy transport's rings stay (their flag waits end with
    /// the process).
    ///
    /// The aborts run on a thread of their own, waited for at most [`ABORT_WAIT`]:
    /// `ncclCommAbort` frees pinned host memory, which waits for the device, and a
    /// device that runs a kernel that never ends (the hang a timeout is about) would
    /// hold the caller there forever. Past the wait the thread is left behind, the
    /// communicators are gone from the backend either way, and the caller goes on to
    /// report the timeout (the process must exit: its device never becomes idle).
    fn abort(&self) {
        let comms: Vec<nccl::Comm> = lock(&self.issue).comms.drain(..).collect();
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

impl Issue {
    fn launch(&mut self, shared: &Shared, stream: Stream, tag: Tag, kernel: Kernel<CudaBuffer>) {
        // An optimizer kernel is validated now and held (`defer.rs`); anything else
        // issues the held ones first, keeping the stream's order.
        let held = match &kernel {
            Kernel::Adamw { .. } | Kernel::Muon { .. } => true,
            Kernel::IfFinite { kernel, .. } => {
                matches!(**kernel, Kernel::Adamw { .. } | Kernel::Muon { .. })
            }
            _ => false,
        };
        if !held {
            self.flush(shared, stream);
        }
        let poison = self.poison[stream.index()].clone();
        // Collectives and exchanges run even on a poisoned stream, unless the job is told
        // of failures another way: their peers wait for them (`set_poisoned_collectives_join`).
        let collective = self.poisoned_join
            && matches!(
                kernel,
                Kernel::Collective { .. } | Kernel::Exchange { .. } | Kernel::Gather { .. }
            );
        if poison.is_some() && !collective {
            // A combine that read a ring in place still acknowledges its pieces.
            if let Kernel::Combine { recv, desc, .. } = &kernel {
                if let Some((id, k)) = self.take_in_place(recv, desc) {
                    let _ = self.ack_in_place(shared.device.stream(stream), id, &k);
                }
            }
            return;
        }
        let raw = shared.device.stream(stream);
        if matches!(kernel, Kernel::Marker) {
            // A marker launches nothing (stream order already orders it); with timings on
            // it is one timing event, a zero-length point of the stream's timeline, as
            // the CPU backend reports it.
            if self.timings.on {
                if let Some(at) = self.timing_event(shared, raw) {
                    self.timings.pending.push(PendingTiming {
                        stream,
                        tag,
                        start: at,
                        end: at,
                        bytes: 0,
                    });
                }
            }
            return;
        }
        let start = if self.timings.on && poison.is_none() && !held {
            self.timing_event(shared, raw)
        } else {
            None
        };
        let result = self.run(shared, (stream, raw, tag), kernel, poison);
        self.end_timing(
            shared,
            (stream, raw),
            tag,
            start,
            result.as_ref().ok().copied(),
        );
        match result {
            Ok(_) => {}
            Err(e) if e.is_cancellation() => {
                self.poison[stream.index()].get_or_insert(e);
            }
            Err(e) => {
                let cause = format!(
                    "{} (node {}) on rank {}, {stream} stream failed: {e}",
                    tag.op, tag.node, shared.rank
                );
                shared.report(stream, tag, e);
                self.poison[stream.index()].get_or_insert(OpsError::Cancelled(cause));
            }
        }
    }

    /// The in-place receive a combine of `desc` names by its `recv` key, taken out:
    /// only an exchange of the combine's own group (a stale entry of another
    /// communicator at a reused address stays for its own combine or the reset).
    fn take_in_place(&mut self, recv: &CudaBuffer, desc: &Collective) -> Option<(CommId, InPlace)> {
        let key = recv.ptr();
        if self.in_place.get(&key)?.0.group != desc.group {
            return None;
        }
        self.in_place.remove(&key)
    }

    /// Closes a timing opened by `start` on `stream` (`raw`): an end event and a pending
    /// timing of `bytes` when the work was issued (`Some`); otherwise, or when no end
    /// event records, the start event goes back to the pool.
    fn end_timing(
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
    fn timing_event(&self, shared: &Shared, stream: sys::CUstream) -> Option<sys::CUevent> {
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

    /// Runs one kernel (validated first); returns the bytes a collective moved.
    fn run(
        &mut self,
        shared: &Shared,
        (stream, raw, tag): (Stream, sys::CUstream, Tag),
        kernel: Kernel<CudaBuffer>,
        poison: Option<OpsError>,
    ) -> Result<u64, OpsError> {
        let rank = shared.rank;
        match kernel {
            Kernel::Marker => Ok(0),
            Kernel::Spin { micros } => self.kernels.spin(raw, micros).map(|()| 0),
            Kernel::Gemm { m, n, k, count } => {
                self.gemm(shared, stream, (m, n, k), count).map(|()| 0)
            }
            Kernel::Add {
                dst,
                src,
                accumulate,
            } => self.add(rank, raw, (&dst, &src), accumulate).map(|()| 0),
            Kernel::Pack { dst, segs } => self.pack(rank, raw, &dst, &segs).map(|()| 0),
            Kernel::Unpack {
                src,
                segs,
                accumulate,
            } => self.unpack(rank, raw, &src, &segs, accumulate).map(|()| 0),
            Kernel::Collective {
                desc,
                comm,
                send,
                recv,
            } => self.collective(shared, stream, raw, &desc, comm, send, recv, poison),
            Kernel::Exchange {
                desc,
                comm,
                send,
                recv,
            } => {
                let bufs = (send, recv);
                self.exchange(shared, stream, raw, &desc, comm, bufs, false, poison)
            }
            // The gather's one buffer is both what it sends (its chunk) and where it
            // receives (the others').
            Kernel::Gather { desc, comm, buf } => {
                let bufs = (buf.clone(), buf);
                self.exchange(shared, stream, raw, &desc, comm, bufs, true, poison)
            }
            Kernel::Combine {
                desc,
                size,
                index,
                own,
                own_offset,
                recv,
                dst,
            } => {
                let own = (&own, own_offset);
                let ran = self.combine(rank, raw, &desc, (size, index), own, (&recv, &dst));
                ran.map(|()| 0)
            }
            k @ (Kernel::Adamw { .. } | Kernel::Muon { .. }) => self
                .optimizer(shared, (stream, tag), rank, k, None)
                .map(|()| 0),
            Kernel::SumSquares { dst, srcs } => self
                .sum_squares(shared, stream, raw, &dst, &srcs)
                .map(|()| 0),
            Kernel::Clip {
                norm,
                bufs,
                max_norm,
            } => self.clip(rank, raw, &norm, &bufs, max_norm).map(|()| 0),
            // The optimizer, told to read the norm on the device and do nothing when it
            // is not finite: no extra launch, no host synchronisation.
            Kernel::IfFinite { norm, kernel } => {
                expect("if_finite", rank, "norm", &norm, 1)?;
                self.optimizer(shared, (stream, tag), rank, *kernel, Some(&norm))?;
                Ok(0)
            }
        }
    }

    /// [`Kernel::Add`]: `dst = src` (or `+=`), both checked to hold `dst`'s length.
    fn add(
        &self,
        rank: u32,
        raw: sys::CUstream,
        (dst, src): (&CudaBuffer, &CudaBuffer),
        accumulate: bool,
    ) -> Result<(), OpsError> {
        expect("add", rank, "dst", dst, dst.len)?;
        expect("add", rank, "src", src, dst.len)?;
        self.kernels
            .add(raw, dst.ptr(), src.ptr(), dst.len as u64, accumulate)
    }

    /// [`Kernel::Pack`]: validated, then summed into `dst` in passes of two sources
    /// ([`pack_phases`]), `dst` zeroed first unless the first pass writes it whole.
    fn pack(
        &self,
        rank: u32,
        raw: sys::CUstream,
        dst: &CudaBuffer,
        segs: &[(CopySeg, Vec<CudaBuffer>)],
    ) -> Result<(), OpsError> {
        const K: &str = "pack";
        expect(K, rank, "dst", dst, dst.len)?;
        let phases = pack_phases(rank, dst, segs)?;
        let covers = first_phase_covers(&phases, dst.len);
        if dst.len > 0 && !covers {
            // SAFETY: `dst` holds `len` words; the memset is ordered on `raw`.
            unsafe { sys::cuMemsetD32Async(dst.ptr(), 0, dst.len, raw) }
                .result()
                .map_err(|e| device::failed(K, e))?;
        }
        for (k, phase) in phases.into_iter().enumerate() {
            run_disjoint(&self.kernels, K, raw, phase, !(covers && k == 0))?;
        }
        Ok(())
    }

    /// [`Kernel::Unpack`]: validated, then copied (or added) from `src` into each
    /// segment's destination.
    fn unpack(
        &self,
        rank: u32,
        raw: sys::CUstream,
        src: &CudaBuffer,
        segs: &[(CopySeg, CudaBuffer)],
        accumulate: bool,
    ) -> Result<(), OpsError> {
        const K: &str = "unpack";
        let mut copies = Vec::with_capacity(segs.len());
        for (seg, dst) in segs.iter() {
            segment(K, rank, seg, src, dst)?;
            copies.push(Seg {
                a: src.at(seg.src),
                b: 0,
                dst: dst.at(seg.dst),
                len: seg.len,
            });
        }
        run_disjoint(&self.kernels, K, raw, copies, accumulate)
    }

    /// [`Kernel::Combine`]: validated, then this rank's chunk reduced from `own` (at
    /// `own_offset`) and what was received, read from the ring when it was received in
    /// place (acknowledged afterwards, whether or not the combine ran).
    fn combine(
        &mut self,
        rank: u32,
        raw: sys::CUstream,
        desc: &Collective,
        (size, index): (u32, u32),
        (own, own_offset): (&CudaBuffer, usize),
        (recv, dst): (&CudaBuffer, &CudaBuffer),
    ) -> Result<(), OpsError> {
        // Received in place: read the ring, then acknowledge (also when the
        // combine cannot run: the peers must not wait for it).
        let kept = self.take_in_place(recv, desc);
        // Read in place, `recv` was only the key: its length does not matter.
        let recv_len = match &kept {
            Some(_) => None,
            None => Some(recv.len),
        };
        let ran = check_combine(
            rank,
            desc,
            (size, index),
            (own, own_offset),
            (recv, recv_len),
            dst,
        )
        .and_then(|(c, at)| {
            let (from, stride) = match &kept {
                Some((_, k)) => (k.base, (k.stride / 4) as u64),
                None => (recv.ptr(), c as u64),
            };
            self.kernels.combine(
                raw,
                (self.combine_ctas, self.combine_streaming),
                (dst.at(at as u64), own.at(own_offset as u64), from),
                (c as u64, stride),
                size,
                index,
                desc.dtype == DType::Bf16,
                desc.op == ReduceOp::Avg,
            )
        });
        if let Some((id, k)) = kept {
            self.ack_in_place(raw, id, &k)?;
        }
        ran
    }

    /// [`Kernel::Clip`]: validated (no gradient may be the norm), then every gradient
    /// scaled in place by the factor the kernel derives from the norm on the device.
    fn clip(
        &self,
        rank: u32,
        raw: sys::CUstream,
        norm: &CudaBuffer,
        bufs: &[CudaBuffer],
        max_norm: f32,
    ) -> Result<(), OpsError> {
        const K: &str = "clip";
        expect(K, rank, "norm", norm, 1)?;
        for b in bufs.iter() {
            expect(K, rank, "grad", b, b.len)?;
            if b.same(norm) {
                return Err(OpsError::Shape {
                    kernel: K,
                    reason: "a gradient is the norm buffer".into(),
                });
            }
        }
        let spans: Vec<Span> = bufs.iter().map(span).collect();
        self.kernels.clip(raw, &spans, norm.ptr(), max_norm)
    }

    /// An optimizer kernel (AdamW or Muon), guarded by the global norm (`guard`: it does
    /// nothing when the norm there is not finite) or not: validated, then held on the
    /// stream until its next flush (`defer.rs`).
    fn optimizer(
        &mut self,
        shared: &Shared,
        (stream, tag): (Stream, Tag),
        rank: u32,
        kernel: Kernel<CudaBuffer>,
        guard: Option<&CudaBuffer>,
    ) -> Result<(), OpsError> {
        let held = match kernel {
            Kernel::Adamw {
                param,
                grad,
                state,
                hp,
                step,
            } => {
                check_adamw(rank, (&param, &grad, &state), step, guard)?;
                Held::Adamw {
                    param,
                    grad,
                    state,
                    hp,
                    step,
                }
            }
            Kernel::Muon {
                param,
                grad,
                momentum,
                rows,
                cols,
                hp,
            } => {
                check_muon(rank, (&param, &grad, &momentum), (rows, cols), guard)?;
                if rows == 0 || cols == 0 {
                    return Ok(());
                }
                Held::Muon {
                    param,
                    grad,
                    momentum,
                    rows,
                    cols,
                    hp,
                }
            }
            other => {
                return Err(OpsError::Shape {
                    kernel: "if_finite",
                    reason: format!(
                        "the CUDA backend guards optimizers (adamw, muon) only, got {}",
                        other.name()
                    ),
                })
            }
        };
        self.hold(shared, stream, tag, held, guard);
        Ok(())
    }

    /// [`Kernel::SumSquares`]: validated as the CPU backend does, then two passes
    /// (`kernels.cu`'s `ov_sumsq_spans` and `ov_sumsq_final`) through the stream's
    /// scratch. Buffers hold f32 on this backend (reduced gradients included, whatever
    /// the wire dtype), and the sum is taken in f64 and stored as f32, as the reference.
    fn sum_squares(
        &mut self,
        shared: &Shared,
        stream: Stream,
        raw: sys::CUstream,
        dst: &CudaBuffer,
        srcs: &[CudaBuffer],
    ) -> Result<(), OpsError> {
        const K: &str = "sum_squares";
        expect(K, shared.rank, "dst", dst, 1)?;
        for src in srcs {
            expect(K, shared.rank, "src", src, src.len)?;
            if src.same(dst) {
                return Err(OpsError::Shape {
                    kernel: K,
                    reason: "a source is the destination".into(),
                });
            }
        }
        let spans: Vec<Span> = srcs.iter().filter(|b| b.len > 0).map(span).collect();
        let (launches, partials) = kernels::sumsq_launches(&spans);
        let bytes = usize::try_from(partials)
            .ok()
            .and_then(|n| n.checked_mul(8))
            .ok_or_else(|| OpsError::Shape {
                kernel: K,
                reason: format!("{} sources need too many partial sums", srcs.len()),
            })?;
        let partial = self.scratch(shared, stream, bytes.max(8))?;
        self.kernels
            .sum_squares(raw, &spans, (&launches, partials), partial, dst.ptr())
    }

    /// `count` bf16 GEMMs `C = A·B` on `stream` (the synthetic backward of `overlap
    /// bench`): `A` and `B` are operands the backend fills once with pseudo-random bf16
    /// (as `torch.randn` operands, so the tensor cores do representative work), `C` is
    /// the stream's scratch.
    fn gemm(
        &mut self,
        shared: &Shared,
        stream: Stream,
        (m, n, k): (u32, u32, u32),
        count: u32,
    ) -> Result<(), OpsError> {
        const K: &str = "gemm";
        let dims = |x: u32| {
            i32::try_from(x).map_err(|_| OpsError::Shape {
                kernel: K,
                reason: format!("dimension {x} exceeds cuBLAS's int"),
            })
        };
        let (mi, ni, ki) = (dims(m)?, dims(n)?, dims(k)?);
        if m == 0 || n == 0 || k == 0 || count == 0 {
            return Ok(());
        }
        let (m, n, k) = (m as usize, n as usize, k as usize);
        let a_bytes = (m * k * 2).next_multiple_of(256);
        let b_bytes = k * n * 2;
        let have = self
            .gemm
            .as_ref()
            .filter(|(d, _)| *d == (m as u32, n as u32, k as u32));
        let operands = match have {
            Some((_, mem)) => mem.ptr(),
            None => {
                let mem = shared.memory.alloc_raw(a_bytes + b_bytes)?;
                // Pseudo-random bf16 in [-1, 1) (xorshift, truncated f32 bits).
                let mut s = 0x9e37_79b9_7f4a_7c15u64;
                let words: Vec<u16> = (0..(a_bytes + b_bytes) / 2)
                    .map(|_| {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        let x = (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                        (x.to_bits() >> 16) as u16
                    })
                    .collect();
                let device = &shared.device;
                // SAFETY: `mem` holds `words` bytes and nothing uses it yet; the host
                // stream is synchronised before `words` is released.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        mem.ptr(),
                        words.as_ptr().cast(),
                        words.len() * 2,
                        device.host_stream(),
                    )
                }
                .result()
                .map_err(|e| device::failed(K, e))?;
                device.sync_host_stream("gemm operands")?;
                let ptr = mem.ptr();
                self.gemm = Some(((m as u32, n as u32, k as u32), mem));
                ptr
            }
        };
        let c = self.scratch(shared, stream, m * n * 2)?;
        let blas = &self.blas[stream.index()];
        for _ in 0..count {
            blas.gemm_bf16((mi, ni, ki), operands, operands + a_bytes as u64, c)?;
        }
        Ok(())
    }

    /// The stream's scratch, grown to at least `bytes`. Only work on this stream uses
    /// it, so stream order protects it; a replaced block is retired (and fenced).
    fn scratch(&mut self, shared: &Shared, stream: Stream, bytes: usize) -> Result<u64, OpsError> {
        let slot = &mut self.scratch[stream.index()];
        if let Some(mem) = slot.as_ref().filter(|m| m.bytes() >= bytes) {
            return Ok(mem.ptr());
        }
        let grown = slot.as_ref().map_or(0, |m| m.bytes().saturating_mul(2));
        *slot = None;
        let mem = shared.memory.alloc_raw(bytes.max(grown).max(1 << 20))?;
        let ptr = mem.ptr();
        *slot = Some(mem);
        Ok(ptr)
    }

    /// Where this rank's communicator `id` is, or the error `kernel` reports (the
    /// poison, when the stream has one).
    fn comm_index(
        &self,
        shared: &Shared,
        id: CommId,
        kernel: &'static str,
        poison: &Option<OpsError>,
    ) -> Result<usize, OpsError> {
        self.comms.iter().position(|c| c.id == id).ok_or_else(|| {
            poison.clone().unwrap_or_else(|| OpsError::Shape {
                kernel,
                reason: format!(
                    "rank {} has no communicator {id} (mesh {}); only the (group, stream) pairs of the plan's bindings are created",
                    shared.rank, shared.mesh
                ),
            })
        })
    }

    /// Issues a collective. A member that is poisoned or whose call is invalid still
    /// joins, on scratch buffers of the size its role needs, so its peers never hang.
    #[allow(clippy::too_many_arguments)]
    fn collective(
        &mut self,
        shared: &Shared,
        stream: Stream,
        raw: sys::CUstream,
        desc: &Collective,
        id: CommId,
        send: Option<CudaBuffer>,
        recv: Option<CudaBuffer>,
        poison: Option<OpsError>,
    ) -> Result<u64, OpsError> {
        let kernel = desc.kind.name();
        let shape = |reason: String| OpsError::Shape { kernel, reason };
        let ci = self.comm_index(shared, id, kernel, &poison)?;
        let (size, index) = (self.comms[ci].size, self.comms[ci].index);
        let roles = collective_roles(desc, size, index).map_err(shape)?;
        let own = match poison.clone() {
            Some(p) => Err(p),
            None => {
                check_collective(shared.rank, stream, id, desc, &roles, &send, &recv).map_err(shape)
            }
        };
        let elem = desc.dtype.size() as usize;
        let send_len = roles.send.unwrap_or(0);
        let recv_len = roles.recv.unwrap_or(0);
        let count = usize::try_from(desc.count).map_err(|_| shape("count too large".into()))?;
        let root = desc.root.unwrap_or(0);
        let valid = own.is_ok();
        if valid && size == 1 && desc.dtype == DType::F32 {
            // A group of one: every collective is the identity (avg divides by 1), so
            // it is a device copy, or nothing in place; no NCCL launch.
            let s = send.as_ref().map_or(0, CudaBuffer::ptr);
            let r = recv.as_ref().map_or(0, CudaBuffer::ptr);
            if s != 0 && r != 0 && s != r && count > 0 {
                // SAFETY: both buffers hold `count` floats (checked above); the copy is
                // ordered on the collective's stream like the NCCL call it replaces.
                unsafe { sys::cuMemcpyDtoDAsync_v2(r, s, count * 4, raw) }
                    .result()
                    .map_err(|e| device::failed(kernel, e))?;
            }
        } else if valid && desc.dtype == DType::F32 {
            let s = send.as_ref().map_or(0, CudaBuffer::ptr);
            let r = recv.as_ref().map_or(0, CudaBuffer::ptr);
            let (s, r) = endpoints(desc.kind, s, r);
            self.comms[ci].issue(raw, desc.kind, desc.dtype, desc.op, root, s, r, count)?;
        } else {
            // Staging in the wire dtype: bf16 conversion, or the scratch a member that
            // cannot take part joins with.
            let s_bytes = (send_len * elem).next_multiple_of(256);
            let r_bytes = (recv_len * elem).next_multiple_of(256);
            let base = self.scratch(shared, stream, (s_bytes + r_bytes).max(256))?;
            let (s16, r16) = (base, base + s_bytes as u64);
            if valid {
                if let Some(src) = &send {
                    self.kernels
                        .round_bf16(raw, s16, src.ptr(), send_len as u64)?;
                }
            }
            let (s, r) = endpoints(
                desc.kind,
                if roles.send.is_some() { s16 } else { 0 },
                if roles.recv.is_some() { r16 } else { 0 },
            );
            self.comms[ci].issue(raw, desc.kind, desc.dtype, desc.op, root, s, r, count)?;
            if valid {
                if let Some(dst) = &recv {
                    self.kernels
                        .widen_bf16(raw, dst.ptr(), r16, recv_len as u64)?;
                }
            }
        }
        // Bytes this member contributes, as the CPU backend counts them.
        own.map(|()| (roles.send.unwrap_or(count) * elem) as u64)
    }

    /// Issues a copy-transport exchange on its communicator's ring. Like a collective,
    /// a member that is poisoned or whose call is invalid still joins (writing and
    /// waiting for every flag, copying no data), so its peers never hang. Returns the
    /// bytes this member receives.
    #[allow(clippy::too_many_arguments)]
    fn exchange(
        &mut self,
        shared: &Shared,
        stream: Stream,
        raw: sys::CUstream,
        desc: &Collective,
        id: CommId,
        (send, recv): (Option<CudaBuffer>, Option<CudaBuffer>),
        gather: bool,
        poison: Option<OpsError>,
    ) -> Result<u64, OpsError> {
        let kernel = if gather { "gather" } else { "exchange" };
        let shape = |reason: String| OpsError::Shape { kernel, reason };
        let ci = self.comm_index(shared, id, kernel, &poison)?;
        let (size, index) = (self.comms[ci].size, self.comms[ci].index);
        let (mut roles, received) = crate::copy_roles(desc, size, index, gather).map_err(shape)?;
        let recv_checked = if gather { None } else { recv.clone() };
        // On a ring read in place the receive buffer is only the combine's key
        // (`Backend::receives_in_place`): it must be this rank's, of any length, and
        // nothing is copied into it.
        let ri = self.copy.iter().position(|r| r.id == id);
        let keyed = !gather && ri.is_some_and(|ri| self.copy[ri].in_place());
        if let (Some(key), true, Some(_)) = (&recv_checked, keyed, roles.recv) {
            roles.recv = Some(key.len);
        }
        let own = match poison {
            Some(p) => Err(p),
            None => check_collective(shared.rank, stream, id, desc, &roles, &send, &recv_checked)
                .map_err(shape),
        };
        // What this member receives: f32 chunks as they are (the combine rounds).
        let bytes = (received * 4) as u64;
        if size > 1 {
            let plan = if gather {
                exchange::Plan::gather(desc, size, index)
            } else {
                exchange::Plan::new(desc, size, index)
            }
            .map_err(shape)?;
            let ri = ri.ok_or_else(|| not_set_up(id))?;
            let valid = own.is_ok();
            let s = send.as_ref().filter(|_| valid).map(CudaBuffer::ptr);
            // In place every received piece stays in the ring (`Op::Keep`): no address
            // to copy into, so a key of one element is never written past.
            let r = recv
                .as_ref()
                .filter(|_| valid && !keyed)
                .map(CudaBuffer::ptr);
            // A gather's buffer is its output, never a pending in-place receive.
            let key = recv.as_ref().filter(|_| !gather).map(CudaBuffer::ptr);
            // A receive buffer reused before its combine ran (a step cut short): release
            // the older pieces first, before this exchange waits for free slots.
            if let Some((old_id, old)) = key.and_then(|k| self.in_place.remove(&k)) {
                self.ack_in_place(raw, old_id, &old)?;
            }
            if let Some(kept) = self.copy[ri].exchange(raw, &plan, s, r)? {
                // Keyed by the receive buffer the combine will name, also when this
                // member could not take part: its combine (run or skipped) acknowledges
                // in order. Without a receive buffer there is no combine: acknowledge now.
                match key {
                    Some(key) => {
                        self.in_place.insert(key, (id, kept));
                    }
                    None => self.ack_in_place(raw, id, &kept)?,
                }
            }
        }
        own.map(|()| bytes)
    }

    /// Acknowledges the pieces an in-place exchange kept, on `raw` (the combine's stream).
    fn ack_in_place(
        &mut self,
        raw: sys::CUstream,
        id: CommId,
        kept: &InPlace,
    ) -> Result<(), OpsError> {
        match self.copy.iter_mut().find(|r| r.id == id) {
            Some(ring) => ring.ack(raw, &kept.acks),
            None => Err(OpsError::Collective {
                comm: id.to_string(),
                reason: "an in-place receive outlived its copy ring".into(),
            }),
        }
    }

    fn take_timings(&mut self, shared: &Shared) -> Vec<Timing> {
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

/// NCCL's send and receive addresses for a member's buffers: a broadcast root sends in
/// place, a non-root receives in place, and a reduce's non-root passes its send buffer
/// as the (unused) receive address.
fn endpoints(kind: CollectiveKind, send: u64, recv: u64) -> (u64, u64) {
    match kind {
        CollectiveKind::Broadcast if recv == 0 => (send, send),
        CollectiveKind::Broadcast => (recv, recv),
        CollectiveKind::Reduce if recv == 0 => (send, send),
        _ => (send, recv),
    }
}

/// Checks one member's call against the communicator and the buffers its role needs.
fn check_collective(
    rank: u32,
    stream: Stream,
    id: CommId,
    desc: &Collective,
    roles: &CollectiveRoles,
    send: &Option<CudaBuffer>,
    recv: &Option<CudaBuffer>,
) -> Result<(), String> {
    if desc.group != id.group || stream != id.stream {
        return Err(format!(
            "a collective on {} issued from the {stream} stream cannot use communicator {id}",
            desc.group
        ));
    }
    for (what, buf, want) in [("send", send, roles.send), ("recv", recv, roles.recv)] {
        match (buf, want) {
            (None, None) => {}
            (Some(b), Some(len)) if b.rank == rank && b.len == len => {}
            (Some(b), Some(len)) => {
                return Err(format!(
                    "{what} must be a buffer of {len} elements on rank {rank}, got {b:?}"
                ))
            }
            (None, Some(len)) => {
                return Err(format!(
                    "rank {rank} needs a {what} buffer of {len} elements"
                ))
            }
            (Some(b), None) => {
                return Err(format!("rank {rank} takes no {what} buffer, got {b:?}"))
            }
        }
    }
    Ok(())
}

/// The error of an exchange or gather on a communicator without a copy ring.
fn not_set_up(id: CommId) -> OpsError {
    OpsError::Collective {
        comm: id.to_string(),
        reason: "the copy transport was not set up on this communicator: call CudaBackend::connect_copy after connect (the run's transport must be `copy` on every rank)".into(),
    }
}

/// Checks a [`Kernel::Combine`] (as the CPU backend does); returns the length of the
/// member's chunk and where in `dst` the combine writes it.
fn check_combine(
    rank: u32,
    desc: &Collective,
    (size, index): (u32, u32),
    (own, own_offset): (&CudaBuffer, usize),
    (recv, recv_len): (&CudaBuffer, Option<usize>),
    dst: &CudaBuffer,
) -> Result<(usize, usize), OpsError> {
    const K: &str = "combine";
    let shape = |reason: String| OpsError::Shape { kernel: K, reason };
    for (what, buf) in [("own", own), ("recv", recv), ("dst", dst)] {
        expect(K, rank, what, buf, buf.len)?;
    }
    // `None`: the pieces were read in place and `recv` is only a key; check the rest
    // against the length a receive buffer would have.
    let recv_len = match recv_len {
        Some(len) => len,
        None => crate::exchange_roles(desc, size, index)
            .ok()
            .and_then(|r| r.recv)
            .unwrap_or(0),
    };
    let (c, at) = crate::combine_lengths(
        desc,
        (size, index),
        (own.len, own_offset),
        recv_len,
        dst.len,
    )
    .map_err(shape)?;
    if dst.same(own) && own_offset != at {
        return Err(shape(format!(
            "dst is own at own_offset {own_offset}: an in-place combine must write the chunk it reads (at {at})"
        )));
    }
    Ok((c, at))
}

/// Validates a [`Kernel::Adamw`] (`guard`: the norm of [`Kernel::IfFinite`], checked by
/// the caller).
fn check_adamw(
    rank: u32,
    (param, grad, state): (&CudaBuffer, &CudaBuffer, &CudaBuffer),
    step: u64,
    guard: Option<&CudaBuffer>,
) -> Result<(), OpsError> {
    const K: &str = "adamw";
    let n = param.len;
    expect(K, rank, "param", param, n)?;
    expect(K, rank, "grad", grad, n)?;
    expect(K, rank, "state (m then v)", state, 2 * n)?;
    distinct(K, &[param, grad, state])?;
    guarded(K, guard, &[param, state])?;
    if step == 0 {
        return Err(OpsError::Shape {
            kernel: K,
            reason: "step is 1-based, got 0".into(),
        });
    }
    Ok(())
}

/// Validates a [`Kernel::Muon`] (`guard` as for [`check_adamw`]), including that its
/// batch's scratch can be laid out.
fn check_muon(
    rank: u32,
    (param, grad, momentum): (&CudaBuffer, &CudaBuffer, &CudaBuffer),
    (rows, cols): (usize, usize),
    guard: Option<&CudaBuffer>,
) -> Result<(), OpsError> {
    const K: &str = "muon";
    let too_big = || OpsError::Shape {
        kernel: K,
        reason: format!("a {rows} × {cols} matrix has more elements than fit in memory"),
    };
    let n = rows.checked_mul(cols).ok_or_else(too_big)?;
    expect(K, rank, "param (rows × cols)", param, n)?;
    expect(K, rank, "grad (rows × cols)", grad, n)?;
    expect(K, rank, "momentum (rows × cols)", momentum, n)?;
    distinct(K, &[param, grad, momentum])?;
    guarded(K, guard, &[param, momentum])?;
    if n > 0 && muon::BatchLayout::new((rows, cols), 1, crate::NsDtype::F32).is_none() {
        return Err(too_big());
    }
    Ok(())
}

/// Checks that `buf` lives on `rank` and holds `len` elements.
fn expect(
    kernel: &'static str,
    rank: u32,
    what: &str,
    buf: &CudaBuffer,
    len: usize,
) -> Result<(), OpsError> {
    if buf.rank == rank && buf.len == len {
        Ok(())
    } else {
        Err(OpsError::Shape {
            kernel,
            reason: format!(
                "{what} must be a buffer of {len} elements on rank {rank}, got {buf:?}"
            ),
        })
    }
}

/// Checks that the buffers are pairwise distinct.
fn distinct(kernel: &'static str, bufs: &[&CudaBuffer]) -> Result<(), OpsError> {
    for (i, a) in bufs.iter().enumerate() {
        if bufs[i + 1..].iter().any(|b| a.same(b)) {
            return Err(OpsError::Shape {
                kernel,
                reason: format!("its buffers must be distinct, got {bufs:?}"),
            });
        }
    }
    Ok(())
}

/// Checks that an optimizer's guard (the norm of [`Kernel::IfFinite`]), if any, is none
/// of the buffers it writes: the kernels read it while they update those.
fn guarded(
    kernel: &'static str,
    guard: Option<&CudaBuffer>,
    written: &[&CudaBuffer],
) -> Result<(), OpsError> {
    match guard {
        Some(g) if written.iter().any(|b| b.same(g)) => Err(OpsError::Shape {
            kernel,
            reason: format!("the norm guarding the step is also a buffer it updates: {g:?}"),
        }),
        _ => Ok(()),
    }
}

/// A buffer as the global norm's kernels take it.
fn span(b: &CudaBuffer) -> Span {
    Span {
        p: b.ptr(),
        len: b.len as u64,
    }
}

/// Validates one copy `from[src..src+len] → to[dst..dst+len]`.
fn segment(
    kernel: &'static str,
    rank: u32,
    seg: &CopySeg,
    from: &CudaBuffer,
    to: &CudaBuffer,
) -> Result<(), OpsError> {
    let shape = |reason: String| OpsError::Shape { kernel, reason };
    for buf in [from, to] {
        expect(kernel, rank, "a segment's buffer", buf, buf.len)?;
    }
    if from.same(to) {
        return Err(shape(format!(
            "{from:?} is both a source and the destination"
        )));
    }
    for (what, off, buf) in [("source", seg.src, from), ("destination", seg.dst, to)] {
        match off.checked_add(seg.len) {
            Some(end) if end <= buf.len as u64 => {}
            _ => {
                return Err(shape(format!(
                    "segment of param {} ({what} offset {off}, {} elements) exceeds {buf:?}",
                    seg.param, seg.len
                )))
            }
        }
    }
    Ok(())
}

/// Validates a pack's segments and groups its copies into passes: pass `k` sums the
/// sources `2k` and `2k + 1` of every segment into `dst` (`dst = (dst + a) + b`).
fn pack_phases(
    rank: u32,
    dst: &CudaBuffer,
    segs: &[(CopySeg, Vec<CudaBuffer>)],
) -> Result<Vec<Vec<Seg>>, OpsError> {
    let mut phases: Vec<Vec<Seg>> = Vec::new();
    for (seg, srcs) in segs.iter() {
        for src in srcs {
            segment("pack", rank, seg, src, dst)?;
        }
        // Sources are summed in order, two per pass: dst = (dst + a) + b.
        for (k, pair) in srcs.chunks(2).enumerate() {
            if phases.len() <= k {
                phases.push(Vec::new());
            }
            phases[k].push(Seg {
                a: pair[0].at(seg.src),
                b: pair.get(1).map_or(0, |b| b.at(seg.src)),
                dst: dst.at(seg.dst),
                len: seg.len,
            });
        }
    }
    Ok(phases)
}

/// Whether a pack's first pass copies single sources over every one of the `len`
/// elements of `dst` exactly once, writing it whole: then no memset, and a copy
/// instead of an accumulate (one pass over `dst` instead of three).
fn first_phase_covers(phases: &[Vec<Seg>], len: usize) -> bool {
    phases.first().is_some_and(|first| {
        let mut spans: Vec<(u64, u64)> = first
            .iter()
            .filter(|s| s.b == 0)
            .map(|s| (s.dst, s.dst + s.len * 4))
            .collect();
        spans.sort_unstable();
        spans.len() == first.len()
            && spans.windows(2).all(|w| w[0].1 <= w[1].0)
            && first.iter().map(|s| s.len).sum::<u64>() == len as u64
    })
}

/// Runs copies in order, batching those whose destinations do not overlap (a copy that
/// overlaps an earlier one of the batch starts the next batch, keeping program order).
fn run_disjoint(
    kernels: &Kernels,
    kernel: &'static str,
    stream: sys::CUstream,
    copies: Vec<Seg>,
    accumulate: bool,
) -> Result<(), OpsError> {
    let mut batch: Vec<Seg> = Vec::with_capacity(kernels::MAX_SEGS);
    for c in copies {
        let end = c.dst + c.len * 4;
        let overlaps = batch
            .iter()
            .any(|b| c.dst < b.dst + b.len * 4 && b.dst < end);
        if overlaps || batch.len() == kernels::MAX_SEGS {
            kernels.segments(kernel, stream, &batch, accumulate)?;
            batch.clear();
        }
        batch.push(c);
    }
    kernels.segments(kernel, stream, &batch, accumulate)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_creates_the_same_communicators_in_one_order() {
        let mesh = Mesh {
            shard: 2,
            replicate: 3,
        };
        let comms = mesh_comms(mesh, &Bindings::default(), false);
        // 3 shard groups on the reduce stream; 2 replicate groups on replicate + publish.
        assert_eq!(comms.len(), 3 + 2 * 2);
        // The copy transport adds every group on the exchange stream.
        let copy = mesh_comms(mesh, &Bindings::default(), true);
        assert_eq!(copy.len(), 3 + 2 * 2 + 3 + 2);
        assert!(copy.contains(&CommId {
            group: Group::Shard { replicate: 2 },
            stream: Stream::Copy
        }));
        let mut sorted = comms.clone();
        sorted.sort();
        assert_eq!(comms, sorted);
        // Stage 2 and publish on one stream share one communicator.
        let shared = Bindings::default().with_publish(Stream::Replicate);
        assert_eq!(mesh_comms(mesh, &shared, false).len(), 3 + 2);
    }

    #[test]
    fn broadcast_and_reduce_endpoints_are_in_place_where_nccl_needs_them() {
        assert_eq!(endpoints(CollectiveKind::Broadcast, 8, 0), (8, 8));
        assert_eq!(endpoints(CollectiveKind::Broadcast, 0, 16), (16, 16));
        assert_eq!(endpoints(CollectiveKind::Reduce, 8, 0), (8, 8));
        assert_eq!(endpoints(CollectiveKind::Reduce, 8, 16), (8, 16));
        assert_eq!(endpoints(CollectiveKind::AllReduce, 8, 8), (8, 8));
    }

    #[test]
    fn opening_without_cuda_is_a_clear_error_not_a_panic() {
        let opts = CudaOptions {
            mesh: Mesh {
                shard: 1,
                replicate: 1,
            },
            rank: 0,
            device: 0,
            timings: false,
            uniform_priority: false,
        };
        if check_libraries().is_ok() {
            eprintln!("CUDA libraries present: the error path is not exercised here");
            return;
        }
        let err = CudaBackend::new(opts)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("cannot load lib"), "{err}");
        let bad = CudaOptions { rank: 3, ..opts };
        assert!(CudaBackend::new(bad).is_err());
    }
}
