//! Memory figures of a plan: peak parameter and gradient bytes per rank.
//!
//! Computed from the plan alone, by walking a rank's nodes in serial order with each
//! buffer alive from its first to its last access (every buffer the executor allocates
//! holds f32, 4 bytes an element, whatever the wire dtype):
//!
//! - **parameter bytes**: the rank's own pieces ([`Buffer::Param`]: its shards of the
//!   sharded routes, the whole tensors of the owned routes on the owner's shard
//!   column), held for the whole step, plus the full parameters a forward plan gathers
//!   ([`Buffer::Full`]), each from its gather to its free;
//! - **gradient bytes**: every buffer of the gradient path (the trainer's gradients
//!   handed in, no_sync accumulations, send buffers, Stage-1 and Stage-2 outputs,
//!   partials, receive buffers, reduced gradients, the norm).
//!
//! The serial order is the order whose results the execution must equal; streams run
//! ahead of it and the executor returns memory to its pool behind events, so a real
//! run's peak can be somewhat higher, and buffer aliasing (`prepared.rs`) lower. The
//! figures compare plans and configurations, and bound what the plan itself asks for.

use serde::Serialize;

use crate::node::Buffer;
use crate::param::ParamId;
use crate::plan::Plan;

/// Bytes of one f32 element.
const F32: u64 = 4;

/// A rank's memory figures ([`Plan::memory`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RankMemory {
    /// The rank.
    pub rank: u32,
    /// Bytes of the parameter pieces the rank holds (shards, owned tensors).
    pub shard_bytes: u64,
    /// Peak bytes of parameters: the pieces plus the gathered full parameters alive at
    /// once.
    pub param_peak_bytes: u64,
    /// Peak bytes of gathered full parameters alone (0 without the forward).
    pub full_peak_bytes: u64,
    /// Peak bytes of the gradient path's buffers.
    pub grad_peak_bytes: u64,
}

impl Plan {
    /// Bytes of every parameter once: what a full replica (DDP) holds of parameters on
    /// every rank, and of gradients.
    pub fn replica_bytes(&self) -> u64 {
        self.params.iter().map(|p| p.spec.numel() * F32).sum()
    }

    /// A rank's peak parameter and gradient bytes along its serial order (module docs).
    pub fn memory(&self, rank: u32) -> RankMemory {
        let rp = self.rank(rank);
        let shard_bytes: u64 = (0..self.params.len() as ParamId)
            .filter(|&p| match self.param(p).owner {
                None => true,
                Some(o) => self.mesh.coord(rank).shard == o.shard,
            })
            .map(|p| self.local_elems(p, rank) * F32)
            .sum();
        // First and last access of every buffer.
        let mut span: std::collections::HashMap<Buffer, (usize, usize)> =
            std::collections::HashMap::new();
        for (i, n) in rp.nodes.iter().enumerate() {
            let a = self.access(rank, n);
            for b in a.reads.iter().chain(&a.writes) {
                span.entry(*b).and_modify(|s| s.1 = i).or_insert((i, i));
            }
        }
        let len = rp.nodes.len();
        // Per node: bytes that become alive there, and bytes freed after it.
        let mut full_delta = vec![0i64; len + 1];
        let mut grad_delta = vec![0i64; len + 1];
        for (b, &(first, last)) in &span {
            let bytes = (self.buffer_len(rank, b) * F32) as i64;
            let delta = match b {
                Buffer::Full { .. } => &mut full_delta,
                Buffer::Param { .. } | Buffer::OptState { .. } => continue,
                _ => &mut grad_delta,
            };
            delta[first] += bytes;
            delta[last + 1] -= bytes;
        }
        let peak = |delta: &[i64]| {
            let mut cur = 0i64;
            let mut best = 0i64;
            for d in delta {
                cur += d;
                best = best.max(cur);
            }
            best as u64
        };
        let full_peak_bytes = peak(&full_delta);
        RankMemory {
            rank,
            shard_bytes,
            param_peak_bytes: shard_bytes + full_peak_bytes,
            full_peak_bytes,
            grad_peak_bytes: peak(&grad_delta),
        }
    }
}
