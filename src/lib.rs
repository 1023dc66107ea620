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

pub mod config;
pub mod drive;
mod error;
pub mod session;
pub mod synthetic;
pub mod verify;

pub use config::{Config, ConfigError};
pub use error::Error;
pub use overlap_executor as executor;
pub use overlap_graph as graph;
pub use overlap_graph::{Gate, Mesh, ParamSpec, Plan, PlanSpec, Route};
pub use overlap_ops as ops;
pub use session::{Session, StepReport};
