//! The facade's error type: one enum a trainer can match on.

use overlap_executor::ExecError;
use overlap_graph::{PlanError, Violation};

use crate::config::ConfigError;

/// Everything that can go wrong through the `overlap` facade.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The config file is wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The planner's input is wrong.
    #[error("plan: {0}")]
    Plan(#[from] PlanError),
    /// A plan broke the validator's invariants.
    #[error("plan rejected by the validator:\n{}", .0.iter().map(|v| format!("  {v}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Violation>),
    /// The step ended with partials or no_sync accumulations that no gate-on micro-batch
    /// flushed: the optimizer would consume a gradient missing those micro-batches.
    #[error(
        "step after a micro-batch that left gradients unflushed (gates {gates}): partials or no_sync accumulations of {} are not reduced; \
         end the step with a gate-on micro-batch, or call zero_grad() to discard them",
        names(.params)
    )]
    Unflushed {
        /// The gate pattern of the step so far.
        gates: String,
        /// The parameters left unflushed.
        params: Vec<String>,
    },
    /// The execution failed.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// The API was used out of order.
    #[error("{0}")]
    Usage(String),
    /// The job needs more than this machine can give (memory; see
    /// [`crate::resources`]).
    #[error("resources: {0}")]
    Resources(String),
    /// The requested backend is not available in this build or on this machine.
    #[error("backend: {0}")]
    Backend(String),
    /// The multi-process set-up failed: launcher variables, the rendezvous, `overlap
    /// launch`, or another rank.
    #[error(transparent)]
    Dist(#[from] DistError),
    /// A checkpoint could not be saved, or was refused when loading (missing, truncated
    /// or corrupted file, another model, a newer format); nothing was loaded.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file or directory at fault.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
}

impl From<overlap_graph::Rejected> for Error {
    fn from(e: overlap_graph::Rejected) -> Self {
        match e {
            overlap_graph::Rejected::Plan(e) => Error::Plan(e),
            overlap_graph::Rejected::Invalid(v) => Error::Invalid(v),
        }
    }
}

fn names(params: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut s = params
        .iter()
        .take(SHOWN)
        .map(|p| format!("`{p}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if params.len() > SHOWN {
        s.push_str(&format!(" and {} more", params.len() - SHOWN));
    }
    s
}

/// Errors of the distributed set-up: environment, rendezvous and launch.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A launcher variable is missing or malformed.
    #[error("environment variable {var}: {reason}")]
    Env {
        /// The variable.
        var: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The variables disagree with each other or with the job.
    #[error("{0}")]
    Inconsistent(String),
    /// The TCP rendezvous failed (a rank did not arrive, a peer spoke another protocol).
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// Another rank failed; this one stops too.
    #[error("rank {rank} failed: {reason}")]
    Peer {
        /// The rank that failed.
        rank: u32,
        /// Its error.
        reason: String,
    },
    /// `overlap launch` could not start or watch its ranks.
    #[error("launch: {0}")]
    Launch(String),
    /// The ranks would run different things (configs, builds): their fingerprints
    /// differ (`overlap_dist::fingerprint`). The message names two ranks and the field.
    #[error("{0}")]
    Disagree(String),
}
