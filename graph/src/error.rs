//! Errors of planning and validation.

use crate::node::{NodeId, Stream};

/// Why a plan could not be built or loaded.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// The mesh is unusable.
    #[error("mesh: {0}")]
    Mesh(String),
    /// The model generator's settings are unusable.
    #[error("model: {0}")]
    Model(String),
    /// A parameter is unusable.
    #[error("parameter `{}`: {reason}", crate::export::printable(.name))]
    Param {
        /// The parameter's name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// Something else about the planner's input.
    #[error("{key}: {reason}")]
    Input {
        /// The setting at fault.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// A rank's program is not well formed (ids out of range, a node on the wrong
    /// stream, a node never run, ...).
    #[error("{path}: {reason}")]
    Malformed {
        /// JSON path of the offending entry, e.g. `ranks[1].streams[0].instrs[3]`.
        path: String,
        /// What is wrong.
        reason: String,
        /// The rank whose program it is.
        rank: u32,
        /// The stream concerned, when one is.
        stream: Option<Stream>,
        /// The node concerned, when one is.
        node: Option<NodeId>,
    },
    /// The plan JSON could not be read.
    #[error("plan JSON: {0}")]
    Json(String),
}

/// A plan that breaks one of the invariants the validator proves.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("invariant `{invariant}` violated on rank {rank}, stream {}, node {}: {detail}",
    stream.map(|s| s.name()).unwrap_or("-"),
    node.map(|n| n.to_string()).unwrap_or_else(|| "-".into()))]
pub struct Violation {
    /// The invariant's stable name, e.g. `stage1-consumed-once`.
    pub invariant: &'static str,
    /// The rank whose program breaks it.
    pub rank: u32,
    /// The stream concerned, when one is.
    pub stream: Option<Stream>,
    /// The node concerned, when one is.
    pub node: Option<NodeId>,
    /// What exactly is wrong, naming the node's operation and buffers.
    pub detail: String,
}
