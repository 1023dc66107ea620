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
//! [`observe`] shows what ran: Prometheus metrics of every step (one call,
//! [`observe::metrics::install_prometheus`]), Chrome traces for Perfetto and a Gantt
//! picture of a step.
//!
//! Multi-process jobs (one process per GPU): [`dist`] reads a rank's place in the job
//! from the launcher's environment, [`rendezvous`] connects the ranks over TCP,
//! [`launch`] is `overlap launch`, and `cuda` (with the `cuda` feature) runs sessions on
//! the CUDA + NCCL backend.

pub mod bench;
pub mod checkpoint;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dist;
pub mod drive;
mod error;
pub mod interference;
pub mod launch;
pub mod observe;
pub mod rendezvous;
pub mod session;
pub mod synthetic;
pub mod verify;

pub use checkpoint::Loaded;
pub use config::{Config, ConfigError};
pub use error::Error;
pub use overlap_executor as executor;
pub use overlap_graph as graph;
pub use overlap_graph::{Gate, Mesh, ParamSpec, Plan, PlanSpec, Route};
pub use overlap_ops as ops;
pub use session::{Session, StepReport};
