//! # overlap
//!
//! The gradient path of sharded data-parallel training (FSDP / HSDP) as an explicit,
//! validated task graph: reduce-scatter, fold, all-reduce, optimizer and publish nodes
//! bound to streams and ordered by events, so that communication hides behind compute.
//!
//! This crate is the facade: the config file ([`config`]), the embedding API
//! ([`Session`]), verification against the no_sync reference ([`verify`]) and what the
//! `overlap` command line runs. The work is done by three libraries usable on their own:
//! [`graph`] (planning and validation, pure), [`ops`] (operations and backends) and
//! [`executor`] (issuing plans on a backend).
//!
//! [`checkpoint`] saves and restores a session (parameters, optimizer state, step
//! counter) as per-rank safetensors files with a manifest, onto the same mesh or another.
//!
//! [`observe`] shows what ran: Prometheus metrics of every step (with the `metrics`
//! feature, one call: `observe::metrics::install_prometheus`), Chrome traces for
//! Perfetto and a Gantt picture of a step.
//!
//! # Embedding it in a trainer
//!
//! Build a [`PlanSpec`] (the mesh and the parameters, [`PlanSpec::new`] fills in the
//! defaults) or load a [`Config`], make a [`Session`] on a backend ([`Session::cpu`], or
//! [`Session::new`] with an [`ExecConfig`] and a [`CpuBackend`]; `Session::cuda` with the
//! `cuda` feature), and drive it from your training loop; `examples/embed.rs` is the loop
//! to copy, and `examples/train.rs` a complete trainer (a small MLP whose every rank
//! computes its own gradients layer by layer, parameter groups, a warm-up + cosine
//! schedule, clipping and a checkpoint mid-run, checked against a reference trainer).
//!
//! - **Runtime.** The session's methods are `async`: call them from a tokio runtime. A
//!   current-thread runtime is enough (`tokio::runtime::Builder::new_current_thread()`);
//!   the backends run their streams on threads of their own.
//! - **Order of calls.** Per step: for each micro-batch, [`Session::begin_micro_batch`]
//!   with its gate, then [`Session::grad_ready`] once per layer in [`Session::layers`]
//!   order (highest first, as backward produces them); then [`Session::step`], which runs
//!   the optimizers and publishes and returns a [`StepReport`]. With the forward's
//!   parameter gathers (`[forward]`, [`PlanSpec::with_forward`]) a micro-batch first runs
//!   [`Session::forward_ready`] for every layer of [`Session::forward_layers`] (lowest
//!   first), each handing the layer's full parameters, and each layer's
//!   [`Session::backward_ready`] (its full parameters again) comes before its
//!   `grad_ready`. A full parameter lives for the call that hands it. A trainer that looks at
//!   the reduced gradients before the update splits the step in two:
//!   [`Session::reduce`] runs every reduction and waits, [`Session::reduced_grad`] reads
//!   them, [`Session::step`] runs the rest (`tests/two_phase.rs`). [`Session::zero_grad`]
//!   drops a step in progress. [`Session::init_params`], [`Session::param_values`],
//!   [`Session::reduced_grad`], checkpoints ([`Session::save`], [`Session::load`]) and
//!   the learning rate ([`Session::set_lr_factor`]) are for between steps. A call out of order is an
//!   [`Error::Usage`] naming what was expected, never a panic.
//! - **Gradient scaling.** Each rank hands in the gradient of its own loss. The optimizer
//!   consumes the *no_sync reference*: each rank's gradients summed over the step's
//!   micro-batches, then averaged over the `S·R` ranks (`[reduce] op = "avg"`; `"sum"`
//!   skips the division). The average is over ranks only: if your loss is a mean over
//!   the step's samples, divide each micro-batch's loss by the number of micro-batches,
//!   as with PyTorch's gradient accumulation.
//! - **What you get back.** Every plan is validated before it runs (a broken plan is an
//!   [`Error::Invalid`] naming the invariant); a step that would leave partials unflushed
//!   is an [`Error::Unflushed`] naming the parameters.
//!
//! Multi-process jobs (one process per GPU) are the control plane's, the `overlap-dist`
//! crate: the launcher's environment, the authenticated rendezvous, the fingerprints
//! ranks compare before the first step, the job watch and the CUDA world set-up. Here,
//! `cuda` (with the `cuda` feature) runs a session on a rank's CUDA + NCCL backend. The
//! `overlap` command line, its launcher and the GPU benchmarks are the `overlap-cli`
//! crate, not part of this library.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod checkpoint;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod drive;
mod error;
pub mod faults;
pub mod observe;
pub mod resources;
pub mod session;
pub mod synthetic;
pub mod verify;

pub use checkpoint::Loaded;
pub use config::{Config, ConfigError};
pub use error::{DistError, Error};
pub use overlap_executor as executor;
pub use overlap_graph as graph;
pub use overlap_ops as ops;
pub use session::{PlanCache, Session, StepReport};

// What an embedder touches, documented here as well as in its own crate.
#[doc(inline)]
pub use overlap_executor::{
    Backward, ClipConfig, ExecConfig, OnNonFinite, PeerAbort, PeerFailure, StepDeadline, StepStats,
};
#[doc(inline)]
pub use overlap_graph::{
    Bindings, DType, Gate, Mesh, ModelSpec, ParamId, ParamSpec, PlacedParam, Plan, PlanSpec,
    Planner, ReduceOp, ReduceSpec, Route, Schedule, Stream, Transport, Violation,
};
#[doc(inline)]
pub use overlap_ops::{cpu::CpuBackend, AdamwParams, Backend, MuonParams, NsDtype};
