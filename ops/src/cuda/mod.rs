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
//!   [`Kernel::Clip`] reads the squared norm in device memory (held with the
//!   optimizers after it and fused into those that read the gradients it scales,
//!   `defer.rs`; [`CudaBackend::set_clip_fusion`]), and
//!   [`Kernel::IfFinite`] hands the optimizer's kernels the norm's address (null when
//!   unguarded): AdamW's kernel and Muon's momentum and update kernels return at once
//!   when it is not finite (Muon's Newton–Schulz still runs, on scratch).
//!
//! # Files
//!
//! - `backend.rs`: [`CudaBackend`], opening the GPU, the communicators, the settings
//!   and the teardown; `options.rs` what it is opened with; `comms.rs` the
//!   communicators a mesh needs, in their one global order;
//! - `backend_trait.rs`: the [`Backend`] trait the executor calls (buffers, launch,
//!   record and wait, status, errors, reset, abort);
//! - `issue.rs`: the issue lock's state and one kernel's issue (poison, hold, timing,
//!   dispatch); `checks.rs` the host-side argument checks; `timing.rs` kernel timings;
//! - one file per kernel family as issued: `copies.rs` (add, pack, unpack),
//!   `collective.rs` (NCCL), `transport.rs` (exchange, gather, combine), `tail.rs`
//!   (global norm, clip, optimizers), `gemm.rs` (the synthetic backward);
//! - `probe.rs`: benchmark probes around the plan (a copy-engine copy, the host's cost
//!   of each driver call);
//! - the driver layers below: `loader.rs` (libraries), `device.rs` (context and
//!   streams), `event.rs` (pooled events, the waiter thread), `memory.rs` (the buffer
//!   pool), `kernels.rs` with `kernels.cu` and `optim.cu` (NVRTC kernels), `defer.rs`,
//!   `optim.rs`, `muon.rs` and `ns_graph.rs` (the optimizer tail in few launches, a
//!   Muon batch's Newton–Schulz replayed as a CUDA graph), `nccl.rs` (communicators)
//!   and `exchange.rs` (the copy transport's rings, running the pure protocol of
//!   `crate::copy_protocol`).
//!
//! Invariant: the backend adds no ordering the plan did not ask for, and every CUDA call
//! is made with the context bound on the calling thread.

mod backend;
mod backend_trait;
mod checks;
mod collective;
mod comms;
mod copies;
mod defer;
mod device;
mod event;
mod exchange;
mod fast_hash;
mod flush;
mod flush_cache;
mod gemm;
mod issue;
mod kernels;
mod loader;
mod lt;
mod memory;
mod muon;
mod nccl;
mod optim;
mod options;
mod probe;
mod row;
mod tail;
mod tail_graph;
mod timing;
mod transport;

#[cfg(doc)]
use crate::{Backend, Kernel};

pub use backend::{CudaBackend, ABORT_WAIT};
pub use comms::{mesh_comms, mesh_comms_with_forward, unique_ids};
/// The CUDA bindings the backend is built on, for a trainer that runs its own kernels
/// beside it in the same primary context (`examples/train.rs --backend cuda`): the same
/// version, so its handles (`CUstream`, device addresses) are the backend's types.
pub use cudarc;
pub use event::CudaEvent;
pub use exchange::{
    copy_ring_bytes, CopySetup, DEFAULT_COPY_RING_DEPTH, DEFAULT_COPY_SLOT_BYTES,
    MAX_COPY_RING_DEPTH,
};
pub use loader::check as check_libraries;
pub use memory::CudaBuffer;
pub use nccl::NcclUniqueId;
pub use options::{CudaOptions, DeviceInfo};
