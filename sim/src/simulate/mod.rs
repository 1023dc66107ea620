//! A discrete-event simulation of a lowered plan on a cost model: what a step would take on
//! the hardware a [`Profile`] describes, without running it (`overlap simulate`,
//! `docs/simulate.md`).
//!
//! Every rank's stream programs run as the backends run them: a stream executes its
//! instructions in order; a `record` marks the moment everything issued before it on its
//! stream has completed; a `wait` holds its stream until that moment (a wait issued
//! before any record of its event waits for nothing); a node cannot start before its
//! rank's host has issued it (`host.issue_us_per_node` each, in the host issue order of
//! [`overlap_graph::order::issue_order`]); with a Stage-1 window ([`Stage1Window`], the
//! executor's `stage1_window` backpressure) the host, before it issues the pack that
//! opens the `k`-th Stage-1 buffer, waits until the nodes that free the buffer `k −
//! window` have completed (those it has issued by then), as the executor waits for their
//! release events. A collective, exchange or gather over two or more
//! ranks is a rendezvous of its communicator (group and stream): the `k`-th one each
//! member reaches runs once every member has reached its `k`-th, and ends on all of them
//! at once; where the copy transport's combines read their exchanges in place, an
//! exchange also waits for the combine of the exchange `copy_ring_depth` before it on
//! every member (its ring slot). What each node costs alone is the
//! cost model of `cost.rs` (docs/simulate.md lists it).
//!
//! Work running at the same time shares its resources, with rates constant between
//! events (processor sharing), per rank:
//! - memory-bound kernels (the combine and the other elementwise kernels) share the
//!   memory bandwidth equally, NCCL collectives share the links equally, and at most
//!   `copy_engine.concurrency` copy-engine transfers run at full rate (more share it);
//! - beside the backward (a `Compute` node running), a communication kernel of kind `k`
//!   runs `interference.k.stretch` times slower, and the backward loses
//!   `interference.k.gemm_cost` seconds per second of that kernel's own work (its rate
//!   times the time), the kinds' losses adding up (the backward keeps at least 5 % of its
//!   rate);
//! - a rendezvous progresses at the slowest member's rate.
//!
//! Invariant: pure and deterministic: the same plan, profile and options give the same
//! timings, bit for bit; no clock, no I/O, no threads.

mod cost;
mod engine;
mod profile;
#[cfg(test)]
mod tests;

use overlap::NsDtype;
use overlap_graph::node::{NodeId, Stream};
use overlap_graph::plan::Plan;

pub use cost::{
    copy_seconds, launches, muon_batch_launches, nccl_seconds, ns_tflops, Class, Cost,
    MUON_LAUNCHES, MUON_NS_STEPS,
};
pub use engine::simulate;
pub use profile::{Beside, BusBandwidth, Key, Network, Profile, ProfileError, Rule, KEYS};

/// The default copy-transport ring: 32 MiB slots (`[overlap] copy_slot_mib`).
pub const DEFAULT_SLOT_BYTES: u64 = 32 << 20;
/// The default ring depth (`[overlap] copy_ring_depth`).
pub const DEFAULT_RING_DEPTH: u32 = 2;

/// What a `grad_ready` node costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Backward {
    /// Nothing (the bench's `comm_only` variant: markers).
    None,
    /// The profile's `compute.backward_us_per_layer`.
    Profile,
    /// This many seconds per layer and micro-batch.
    Seconds(f64),
    /// `count` bf16 GEMMs of `d × d · d × d` at the profile's `compute.gemm_tflops`
    /// (`overlap bench`'s synthetic backward).
    Gemms {
        /// GEMMs per layer.
        count: u32,
        /// Their size.
        d: u32,
    },
}

/// The copy transport's receive rings (`[overlap] copy_slot_mib`, `copy_ring_depth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRing {
    /// Bytes per slot: a larger message per peer moves in several pieces.
    pub slot_bytes: u64,
    /// Slots per peer.
    pub depth: u32,
    /// Whether combines may read their exchanges in place where the backend's rule
    /// allows it (`overlap bench --no-in-place` turns it off).
    pub in_place: bool,
}

impl Default for CopyRing {
    fn default() -> Self {
        CopyRing {
            slot_bytes: DEFAULT_SLOT_BYTES,
            depth: DEFAULT_RING_DEPTH,
            in_place: true,
        }
    }
}

pub use overlap_executor::Stage1Release;

/// The executor's Stage-1 backpressure (`[overlap] stage1_window`, `overlap bench
/// --window`): before issuing a pack, the host waits while `window` Stage-1 buffers are
/// in flight, for the releases of the oldest one it knows of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage1Window {
    /// At most this many Stage-1 buffers in flight per rank (at least 1).
    pub window: u32,
    /// Per rank (one entry per rank of the plan): what frees its Stage-1 buffers.
    pub releases: Vec<Vec<Stage1Release>>,
}

/// What the simulation needs besides the plan and the profile.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// What the backward costs.
    pub backward: Backward,
    /// Per rank, per node: whether the executor runs the node as an alias (a marker, no
    /// copy; `overlap_executor::aliased_nodes`). Missing entries are not aliased.
    pub aliased: Vec<Vec<bool>>,
    /// The copy transport's rings.
    pub copy: CopyRing,
    /// The Stage-1 backpressure; `None`: the host never waits (an unbounded window).
    pub stage1: Option<Stage1Window>,
    /// Per parameter (by id): the precision and iteration count of its Muon
    /// Newton–Schulz, as the config's optimizer groups resolve them
    /// (`overlap::config::Config::newton_schulz`). A parameter past the end runs
    /// Muon's defaults (bf16, 5 iterations).
    pub newton_schulz: Vec<(NsDtype, u32)>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            backward: Backward::Profile,
            aliased: Vec::new(),
            copy: CopyRing::default(),
            stage1: None,
            newton_schulz: Vec::new(),
        }
    }
}

/// Why a plan could not be simulated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// The profile breaks a rule.
    #[error("hardware profile: {0}")]
    Profile(#[from] ProfileError),
    /// A group spans nodes and the profile has no `[network]`.
    #[error("group {group} spans nodes and the hardware profile has no [network] section")]
    NoNetwork {
        /// The group.
        group: String,
    },
    /// A copy-transport exchange or gather over a group that spans nodes (the transport
    /// maps the peers' memory, so the backends refuse it).
    #[error("group {group} exchanges over the copy transport but spans nodes of the hardware profile; the copy transport needs every member on one node (use transport = \"nccl\")")]
    CopyAcrossNodes {
        /// The group.
        group: String,
    },
    /// The plan is not well formed.
    #[error("plan: {0}")]
    Plan(String),
    /// The options do not fit the plan (a Stage-1 window of 0, releases for another
    /// number of ranks or naming nodes the rank does not have).
    #[error("options: {0}")]
    Options(String),
    /// Some stream can never go on (a wait for a record that never comes, a
    /// rendezvous a member never reaches): the plan would hang.
    #[error("the simulated step cannot finish: {0}")]
    Stalled(String),
}

/// When a node ran in the simulation, seconds from the step's start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NodeTime {
    /// When its stream reached it (a collective's members then wait for each other).
    pub start: f64,
    /// When it completed.
    pub end: f64,
    /// Its resource.
    pub class: Class,
}

/// The simulated step: every node's times, per rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    /// Per rank, per node id.
    pub ranks: Vec<Vec<NodeTime>>,
}

/// The span of a set of `(start, end)` intervals: the last end minus the first start, 0
/// when there are none. A simulated step's device span, and a measured one's (`overlap
/// bench` over its kernel timings).
pub fn span_of(intervals: impl IntoIterator<Item = (f64, f64)>) -> f64 {
    let (start, end) = intervals
        .into_iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(s, e), (a, b)| {
            (s.min(a), e.max(b))
        });
    if end > start {
        end - start
    } else {
        0.0
    }
}

impl Simulation {
    /// A node's times.
    pub fn node(&self, rank: u32, node: NodeId) -> NodeTime {
        self.ranks[rank as usize][node as usize]
    }

    /// A rank's device span: its first node's start to its last node's end (what
    /// `overlap bench` times), seconds.
    pub fn span(&self, rank: u32) -> f64 {
        span_of(self.ranks[rank as usize].iter().map(|t| (t.start, t.end)))
    }

    /// Seconds a stream of a rank was busy (the union of its nodes' intervals).
    pub fn busy(&self, plan: &Plan, rank: u32, stream: Stream) -> f64 {
        let mut iv: Vec<(f64, f64)> = plan.ranks[rank as usize]
            .nodes
            .iter()
            .filter(|n| n.stream == stream)
            .map(|n| {
                let t = self.node(rank, n.id);
                (t.start, t.end)
            })
            .filter(|(s, e)| e > s)
            .collect();
        iv.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut total = 0.0;
        let mut cur: Option<(f64, f64)> = None;
        for (s, e) in iv {
            match cur {
                Some((cs, ce)) if s <= ce => cur = Some((cs, ce.max(e))),
                Some((cs, ce)) => {
                    total += ce - cs;
                    cur = Some((s, e));
                }
                None => cur = Some((s, e)),
            }
        }
        total + cur.map_or(0.0, |(s, e)| e - s)
    }
}

/// The communicators (group and stream) of a plan whose combines read their exchanges in
/// place in the copy ring ([`overlap_graph::ring::in_place_verdicts`], the rule the CUDA
/// backend sets its rings up by), when the ring allows reading in place at all.
pub fn in_place_comms(plan: &Plan, ring: CopyRing) -> Vec<(overlap_graph::mesh::Group, Stream)> {
    if !ring.in_place {
        return Vec::new();
    }
    overlap_graph::ring::in_place_verdicts(plan, ring.slot_bytes, ring.depth as usize)
        .into_iter()
        .filter(|&(_, ok)| ok)
        .map(|(id, _)| id)
        .collect()
}
