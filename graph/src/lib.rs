//! # overlap-graph
//!
//! Pure planning for `overlap`: the HSDP [`Mesh`], parameters and their [`Route`]s,
//! owner assignment, buckets, the per-rank micro-batch DAG, its lowering to stream
//! programs with explicit events, the validator, and exports (text, DOT, JSON).
//!
//! This crate does no I/O, spawns no threads and knows no device: a [`Plan`] is a value
//! computed from a [`PlanSpec`] and a gate pattern, and [`validate()`] proves its
//! invariants before an executor runs it.
//!
//! ```
//! use overlap_graph::{validate, Gate, Mesh, Mode, ParamSpec, PlanSpec, Planner, Route};
//!
//! let spec = PlanSpec::new(
//!     Mesh::new(2, 2)?,
//!     vec![
//!         ParamSpec::new("w", [6, 4], Route::Muon, 1),
//!         ParamSpec::new("norm", [5], Route::Fsdp, 1),
//!     ],
//! )
//! .with_bucket_cap_bytes(1 << 20)
//! .with_grad_norm(true);
//! let plan = Planner::new(spec)?.plan(&[Gate::ReplicateOff, Gate::On])?;
//! assert!(validate(&plan, Mode::Step).is_empty());
//! # Ok::<(), overlap_graph::PlanError>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod build;
pub mod dag;
mod error;
pub mod export;
pub mod gate;
pub mod memory;
pub mod mesh;
pub mod node;
pub mod order;
pub mod owner;
pub mod param;
pub mod plan;
pub mod ring;
pub mod spec;
pub mod validate;

pub use build::Planner;
pub use error::{PlanError, Violation};
pub use gate::Gate;
pub use memory::RankMemory;
pub use mesh::{Coord, Group, Mesh, MAX_WORLD};
pub use node::{
    BucketId, Buffer, Collective, CollectiveKind, DType, EventId, Instr, Node, NodeId, Op,
    OptimizerKind, Pass, ReduceOp, Stream,
};
pub use order::HappensBefore;
pub use owner::UpdateRates;
pub use param::{ModelSpec, ParamId, ParamSpec, Route, MAX_MODEL_LAYERS, MAX_NUMEL};
pub use plan::{
    Access, Bindings, Bucket, CopySeg, ForwardSpec, PlacedParam, Plan, PlanSpec, RankProgram,
    ReduceSpec, Schedule, StreamProgram, Transport, DEFAULT_BUCKET_CAP_BYTES,
};
pub use spec::{MAX_MICRO_BATCHES, MAX_PARAMS, MAX_STEP_NODES};
pub use validate::{validate, Mode, Rejected, Validated};
