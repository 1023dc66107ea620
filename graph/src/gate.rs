//! Gates: what one micro-batch does with its gradients, as in FSDP2.
//!
//! `reduce` off is `no_sync` (no collectives, local accumulation); `replicate` off runs
//! Stage 1 and folds into the partial; both on run both stages. A micro-batch's state is
//! one [`Gate`]; a step is a sequence of them.

use serde::{Deserialize, Serialize};

/// The state of one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gate {
    /// Reduce gate off: no collectives; the full gradient accumulates locally.
    NoSync,
    /// Replicate gate off: Stage 1, then fold into the partial on the reduce stream.
    #[serde(rename = "off")]
    ReplicateOff,
    /// Both gates on: fold the partial into Stage 1's output, run Stage 2, unpack.
    On,
}

impl Gate {
    /// The gate from FSDP2-style flags: `reduce` off wins over `replicate`.
    pub fn from_flags(reduce: bool, replicate: bool) -> Gate {
        match (reduce, replicate) {
            (false, _) => Gate::NoSync,
            (true, false) => Gate::ReplicateOff,
            (true, true) => Gate::On,
        }
    }

    /// The short name used in CLI output and metrics labels: `no_sync`, `off`, `on`.
    pub fn label(self) -> &'static str {
        match self {
            Gate::NoSync => "no_sync",
            Gate::ReplicateOff => "off",
            Gate::On => "on",
        }
    }

    /// Parses `no_sync`, `off` or `on`.
    pub fn parse(s: &str) -> Result<Gate, String> {
        match s {
            "no_sync" => Ok(Gate::NoSync),
            "off" => Ok(Gate::ReplicateOff),
            "on" => Ok(Gate::On),
            _ => Err(format!("unknown gate `{s}`; expected no_sync, off or on")),
        }
    }

    /// The default pattern for `m` micro-batches: replicate gate off for all but the last.
    pub fn default_pattern(m: usize) -> Vec<Gate> {
        (0..m)
            .map(|i| {
                if i + 1 == m {
                    Gate::On
                } else {
                    Gate::ReplicateOff
                }
            })
            .collect()
    }

    /// Formats a pattern as `off,on`.
    pub fn pattern_label(gates: &[Gate]) -> String {
        gates
            .iter()
            .map(|g| g.label())
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl std::fmt::Display for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}
