//! The cost model: what resource each node uses and how long it takes alone.
//!
//! - the backward (`grad_ready`): [`Backward`], on the SMs (class `Compute`);
//! - NCCL collectives over a group of two or more (stages, the publish, the norm's
//!   all-reduces): NCCL's ring model, `latency + bus bytes / bus bandwidth` with the
//!   latency `base + steps within a node · nvlink.hop_us + steps across nodes ·
//!   network.hop_us`, and for an all-reduce across nodes the faster of ring and tree
//!   (NCCL's `src/graph/tuning.cc`); bus bytes are nccl-tests' (`(n − 1)/n` of the data
//!   for reduce-scatter and all-gather, `2(n − 1)/n` for all-reduce, all of it for
//!   broadcast and reduce);
//! - copy-transport exchanges and gathers: copy-engine copies to each peer (a fixed cost
//!   per ring-slot piece, then the bytes at `copy_engine.peer_gbs`) and, where the
//!   receive is copied out of the ring, a local copy at `copy_engine.local_gbs`;
//! - the combine: the bytes it reads and writes at `combine.gbs`; every other executor
//!   kernel (pack, unpack, fold, accumulate, a group-of-one stage, the norm, the clip,
//!   AdamW) at `memory.hbm_gbs`; Muon's Newton–Schulz at the rate of the precision it
//!   runs in ([`ns_tflops`]: bf16 at `compute.gemm_tflops`, TF32 at half of it, f32 at
//!   `compute.fp32_tflops`), plus `memory.kernel_us` for each of its device operations:
//!   the CUDA backend runs a step's Muon matrices of one shape as one batch
//!   ([`muon_batch_launches`] operations), so each is charged its share of them;
//! - a node the executor aliases (it launches a marker, [`Options::aliased`]): nothing.
//!
//! The host issues a node in `host.issue_us_per_node`, plus `host.launch_us` for each
//! further device operation it makes ([`launches`]: one for every node but Muon's).

use overlap_graph::mesh::Group;
use overlap_graph::node::{BucketId, Collective, CollectiveKind, Node, Op, OptimizerKind};
use overlap_graph::param::ParamId;
use overlap_graph::plan::Plan;

use overlap::NsDtype;

use super::profile::Profile;
use super::{Backward, Options, SimError};

/// Which resource a node's work occupies (and so what it contends with).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// Launches nothing that takes time (an aliased node, a backward of zero).
    Marker,
    /// The SMs, fully: the backward's GEMMs, Muon.
    Compute,
    /// A memory-bound kernel: the combine and the executor's other elementwise kernels.
    Memory,
    /// An NCCL collective (links, and SMs for its CTAs).
    Nccl,
    /// Copy-engine transfers (exchange, gather).
    Copy,
}

impl Class {
    /// Whether nodes of the class are cross-rank rendezvous (all members must reach them).
    pub fn is_collective(self) -> bool {
        matches!(self, Class::Nccl | Class::Copy)
    }
}

/// A node's resource and its time alone, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    /// What it occupies.
    pub class: Class,
    /// Seconds alone.
    pub seconds: f64,
    /// Of those, seconds of copy-engine copies within the GPU (a receive copied out of
    /// the ring), which stretch by `interference.copy_engine.local_stretch` beside the
    /// backward instead of `stretch`.
    pub local_seconds: f64,
}

const F32: f64 = 4.0;

/// Newton–Schulz iterations the cost model assumes for Muon (the default `ns_steps`).
pub const MUON_NS_STEPS: u32 = 5;

/// Host operations of one Muon node as the host model counts them (the CUDA backend
/// ran Muon matrix by matrix when `host.launch_us` was measured: the momentum, the
/// norm's two passes, the initial scaling, per Newton–Schulz iteration three SGEMMs and
/// two copies, and the update).
pub const MUON_LAUNCHES: u32 = 5 + 5 * MUON_NS_STEPS;

/// Device operations of a batch of Muon matrices of one shape, precision and iteration
/// count on the CUDA backend (`ops/src/cuda/muon.rs`), which a flush runs together: the
/// momentum, the norms and the scaling, per Newton–Schulz iteration three products
/// (the direct iteration), and the update. A matrix alone is a batch of one.
pub const fn muon_batch_launches(steps: u32) -> u32 {
    4 + 3 * steps
}

/// How many device operations the host issues for `op` (the first costs it
/// `host.issue_us_per_node`, each further one `host.launch_us`): [`MUON_LAUNCHES`] for
/// Muon, one for every other node.
pub fn launches(op: &Op) -> u32 {
    match op {
        Op::Optimizer {
            optimizer: OptimizerKind::Muon,
            ..
        } => MUON_LAUNCHES,
        _ => 1,
    }
}

fn kernel(p: &Profile, bytes: f64, gbs: f64) -> Cost {
    Cost {
        class: Class::Memory,
        seconds: p.kernel_us * 1e-6 + bytes / (gbs * 1e9),
        local_seconds: 0.0,
    }
}

/// Where a group's members sit: (nodes, most members on one node).
fn placement(plan: &Plan, p: &Profile, group: Group) -> (u32, u32) {
    let per = p.gpus_per_node.max(1);
    let mut nodes: Vec<u32> = plan.mesh.members(group).iter().map(|g| g / per).collect();
    nodes.sort_unstable();
    let mut most = 0;
    let mut distinct = 0;
    let mut i = 0;
    while i < nodes.len() {
        let j = nodes[i..].iter().take_while(|&&x| x == nodes[i]).count();
        most = most.max(j as u32);
        distinct += 1;
        i += j;
    }
    (distinct, most)
}

/// Seconds of one NCCL collective over a group of `n ≥ 2` members (module docs).
pub fn nccl_seconds(plan: &Plan, p: &Profile, c: &Collective) -> Result<f64, SimError> {
    let n = plan.mesh.group_size(c.group).max(1);
    let (nodes, local) = placement(plan, p, c.group);
    let nf = f64::from(n);
    let dsize = c.dtype.size() as f64;
    let count = c.count as f64;
    // nccl-tests' size and the bus bytes of the ring algorithm.
    let (size, factor, bw) = match c.kind {
        CollectiveKind::ReduceScatter => (
            nf * count * dsize,
            (nf - 1.0) / nf,
            p.nvlink_busbw.reduce_scatter,
        ),
        CollectiveKind::AllGather => (
            nf * count * dsize,
            (nf - 1.0) / nf,
            p.nvlink_busbw.all_gather,
        ),
        CollectiveKind::AllReduce => (
            count * dsize,
            2.0 * (nf - 1.0) / nf,
            p.nvlink_busbw.all_reduce,
        ),
        CollectiveKind::Broadcast => (count * dsize, 1.0, p.nvlink_busbw.broadcast),
        CollectiveKind::Reduce => (count * dsize, 1.0, p.nvlink_busbw.reduce),
    };
    let steps = match c.kind {
        CollectiveKind::AllReduce => 2 * (n - 1),
        _ => n - 1,
    };
    if nodes <= 1 {
        let lat = p.nvlink_base_us + f64::from(steps) * p.nvlink_hop_us;
        return Ok(lat * 1e-6 + size * factor / (bw * 1e9));
    }
    let net = p.network.ok_or_else(|| SimError::NoNetwork {
        group: format!("{} ({} ranks on {nodes} nodes)", c.group, n),
    })?;
    let inter = match c.kind {
        CollectiveKind::AllReduce => 2 * (nodes - 1),
        _ => nodes - 1,
    };
    let bus = bw.min(f64::from(local) * net.nic_gbs);
    let ring_lat = p.nvlink_base_us
        + f64::from(steps - inter.min(steps)) * p.nvlink_hop_us
        + f64::from(inter) * net.hop_us;
    let ring = ring_lat * 1e-6 + size * factor / (bus * 1e9);
    if c.kind != CollectiveKind::AllReduce {
        return Ok(ring);
    }
    // NCCL's tree: up and down a chain within each node and a binary tree across nodes,
    // algorithm bandwidth half the bus bandwidth.
    let levels = f64::from(32 - (nodes - 1).leading_zeros());
    let tree_lat =
        p.nvlink_base_us + 2.0 * (f64::from(local - 1) * p.nvlink_hop_us + levels * net.hop_us);
    let tree = tree_lat * 1e-6 + size / (0.5 * bus * 1e9);
    Ok(ring.min(tree))
}

/// The piece sizes and per-peer chunks of a copy-transport stage, for member `index`.
fn chunk_bytes(c: &Collective, n: u32, index: u32) -> f64 {
    c.member_chunk(n, index).1 as f64 * F32
}

fn pieces(bytes: f64, slot: u64) -> f64 {
    (bytes / slot.max(1) as f64).ceil().max(1.0)
}

/// Seconds of member `index`'s side of an exchange (`gather = false`) or gather.
pub fn copy_seconds(
    p: &Profile,
    c: &Collective,
    n: u32,
    index: u32,
    gather: bool,
    copy_out: bool,
    slot: u64,
) -> (f64, f64) {
    let piece = p.ce_piece_us * 1e-6;
    let peer = p.ce_peer_gbs * 1e9;
    let local = p.ce_local_gbs * 1e9;
    let mut t = 0.0;
    let mut out = 0.0;
    let mine = chunk_bytes(c, n, index);
    for j in (0..n).filter(|&j| j != index) {
        // An exchange sends each peer the chunk that peer reduces and receives its own
        // from each; a gather sends its reduced chunk and receives each peer's.
        let (sent, received) = if gather {
            (mine, chunk_bytes(c, n, j))
        } else {
            (chunk_bytes(c, n, j), mine)
        };
        t += pieces(sent, slot) * piece + sent / peer;
        if copy_out {
            out += received / local;
        }
    }
    (t + out, out)
}

/// The cost of a node on a rank, and for a collective the member's own side of it.
pub(super) fn node_cost(
    plan: &Plan,
    p: &Profile,
    opts: &Options,
    in_place: &dyn Fn(&Collective, overlap_graph::node::Stream) -> bool,
    rank: u32,
    node: &Node,
) -> Result<Cost, SimError> {
    if aliased(opts, rank, node) {
        return Ok(Cost::MARKER);
    }
    let hbm = p.hbm_gbs;
    let backward = backward_seconds(p, opts);
    Ok(match node.op {
        // A forward plan's trainer points: a layer's forward costs half its backward
        // (the backward computes the gradients of the inputs and of the weights, each a
        // forward's worth of work); the backward point itself is the `grad_ready`
        // that follows it; a free costs nothing.
        Op::Forward { .. } if backward > 0.0 => Cost::compute(backward / 2.0),
        Op::Forward { .. } | Op::Backward { .. } | Op::Reshard { .. } => Cost::MARKER,
        Op::GradReady { .. } if backward > 0.0 => Cost::compute(backward),
        Op::GradReady { .. } => Cost::MARKER,
        Op::Accumulate {
            bucket, accumulate, ..
        } => {
            let n = bucket_numel(plan, bucket);
            kernel(p, n as f64 * F32 * passes(accumulate), hbm)
        }
        Op::Pack {
            bucket, with_accum, ..
        } => {
            let send = plan.send_elems(bucket) as f64 * F32;
            kernel(p, send * passes(with_accum), hbm)
        }
        Op::Stage1 { collective, .. }
        | Op::Stage2 { collective, .. }
        | Op::Publish { collective, .. }
        | Op::Unshard { collective, .. }
        | Op::NormReduce { collective } => collective_cost(plan, p, &collective)?,
        Op::Fold { bucket, .. } | Op::FoldPartial { bucket, .. } => {
            kernel(p, 3.0 * (plan.stage1_elems(bucket) as f64 * F32), hbm)
        }
        Op::Exchange { collective, .. } | Op::Gather { collective, .. } => {
            copy_cost(plan, p, opts, in_place, rank, node, &collective)?
        }
        Op::Combine { collective, .. } => combine_cost(plan, p, rank, &collective),
        Op::Unpack {
            bucket, accumulate, ..
        } => {
            let n: u64 = plan
                .unpack_segments(bucket, rank)
                .iter()
                .map(|s| s.len)
                .sum();
            kernel(p, n as f64 * F32 * passes(accumulate), hbm)
        }
        Op::GradNorm => {
            let n = local_numel(plan, &plan.norm_params(rank), rank);
            kernel(p, n as f64 * F32, hbm)
        }
        Op::Clip => {
            let n = local_numel(plan, &plan.held_params(rank), rank);
            kernel(p, 2.0 * n as f64 * F32, hbm)
        }
        Op::Optimizer { param, optimizer } => match optimizer {
            OptimizerKind::Adamw => {
                // Reads the parameter, its gradient and two moments; writes three.
                let n = plan.local_elems(param, rank) as f64;
                kernel(p, 7.0 * n * F32, hbm)
            }
            OptimizerKind::Muon => muon_cost(plan, p, opts, (rank, param)),
        },
    })
}

impl Cost {
    /// What a node that launches nothing costs.
    const MARKER: Cost = Cost {
        class: Class::Marker,
        seconds: 0.0,
        local_seconds: 0.0,
    };

    /// `seconds` on the SMs.
    fn compute(seconds: f64) -> Cost {
        Cost {
            class: Class::Compute,
            seconds,
            local_seconds: 0.0,
        }
    }
}

/// Whether the executor aliases `node` on `rank` ([`Options::aliased`]; no by default).
fn aliased(opts: &Options, rank: u32, node: &Node) -> bool {
    opts.aliased
        .get(rank as usize)
        .and_then(|v| v.get(node.id as usize))
        .copied()
        .unwrap_or(false)
}

/// Seconds of one layer's backward, as [`Options::backward`] says (0 for none).
fn backward_seconds(p: &Profile, opts: &Options) -> f64 {
    match opts.backward {
        Backward::None => 0.0,
        Backward::Profile => p.backward_us_per_layer * 1e-6,
        Backward::Seconds(s) => s,
        Backward::Gemms { count, d } => {
            f64::from(count) * 2.0 * f64::from(d).powi(3) / (p.gemm_tflops * 1e12)
        }
    }
}

/// Passes over the bytes of a kernel that reads and writes, with an accumulator read
/// too where `accumulate`: 3 or 2.
fn passes(accumulate: bool) -> f64 {
    if accumulate {
        3.0
    } else {
        2.0
    }
}

/// Elements of the whole parameters of `bucket`.
fn bucket_numel(plan: &Plan, bucket: BucketId) -> u64 {
    plan.bucket(bucket)
        .params
        .iter()
        .map(|&q| plan.param(q).spec.numel())
        .sum()
}

/// Elements of `params` that `rank` holds.
fn local_numel(plan: &Plan, params: &[ParamId], rank: u32) -> u64 {
    params.iter().map(|&q| plan.local_elems(q, rank)).sum()
}

/// A stage, publish, unshard or norm reduction: NCCL over a group of two or more, a
/// copy of the buffer over a group of one.
fn collective_cost(plan: &Plan, p: &Profile, collective: &Collective) -> Result<Cost, SimError> {
    Ok(if plan.mesh.group_size(collective.group) > 1 {
        Cost {
            class: Class::Nccl,
            seconds: nccl_seconds(plan, p, collective)?,
            local_seconds: 0.0,
        }
    } else {
        // A group of one: a copy of the buffer.
        let bytes = collective.count as f64 * collective.dtype.size() as f64;
        kernel(p, 2.0 * bytes, p.hbm_gbs)
    })
}

/// An exchange's or a gather's member side on the copy transport (one node only), its
/// receives copied out of the ring unless an exchange's combine reads them in place.
fn copy_cost(
    plan: &Plan,
    p: &Profile,
    opts: &Options,
    in_place: &dyn Fn(&Collective, overlap_graph::node::Stream) -> bool,
    rank: u32,
    node: &Node,
    collective: &Collective,
) -> Result<Cost, SimError> {
    let n = plan.mesh.group_size(collective.group);
    if placement(plan, p, collective.group).0 > 1 {
        // The copy transport maps its peers' memory: one node only.
        return Err(SimError::CopyAcrossNodes {
            group: format!("{} ({n} ranks)", collective.group),
        });
    }
    let index = plan.mesh.index_in(collective.group, rank).unwrap_or(0);
    let gather = matches!(node.op, Op::Gather { .. });
    // A gather always copies what it receives out of the ring; an exchange only
    // where its combine cannot read it in place.
    let copy_out = gather || !in_place(collective, node.stream);
    let (seconds, local_seconds) = copy_seconds(
        p,
        collective,
        n,
        index,
        gather,
        copy_out,
        opts.copy.slot_bytes,
    );
    Ok(Cost {
        class: Class::Copy,
        seconds,
        local_seconds,
    })
}

/// The combine of `rank`'s chunk: its `n` received chunks and its own read, one written,
/// at `combine.gbs`.
fn combine_cost(plan: &Plan, p: &Profile, rank: u32, collective: &Collective) -> Cost {
    let n = plan.mesh.group_size(collective.group);
    let index = plan.mesh.index_in(collective.group, rank).unwrap_or(0);
    let chunk = chunk_bytes(collective, n, index);
    kernel(p, f64::from(n + 1) * chunk, p.combine_gbs)
}

/// The rate of Newton–Schulz's products in `dtype`, TFLOP/s: bf16 at the profile's
/// GEMM rate (`compute.gemm_tflops`, the tensor cores' bf16), TF32 at half of it (the
/// H200 datasheet's ratio of dense TF32 to bf16, as owners are balanced by), f32 at
/// `compute.fp32_tflops`.
pub fn ns_tflops(p: &Profile, dtype: NsDtype) -> f64 {
    match dtype {
        NsDtype::Bf16 => p.gemm_tflops,
        NsDtype::Tf32 => p.gemm_tflops / 2.0,
        NsDtype::F32 => p.fp32_tflops,
    }
}

/// Muon on `param`'s whole matrix (the owner's): its share of its batch's launches
/// ([`muon_batch_launches`] over the matrices of `rank`'s step with its shape, precision
/// and iteration count), the Newton–Schulz iterations in the precision and count
/// [`Options::newton_schulz`] gives it ([`overlap_graph::owner::ns_flops`] at
/// [`ns_tflops`]) and the update's memory traffic.
fn muon_cost(plan: &Plan, p: &Profile, opts: &Options, (rank, param): (u32, ParamId)) -> Cost {
    let run = |q: ParamId| {
        let spec = &plan.param(q).spec;
        let dims = if spec.shape.is_empty() {
            (1, 1)
        } else {
            spec.matrix_dims()
        };
        let d = overlap::MuonParams::default();
        let ns = opts
            .newton_schulz
            .get(q as usize)
            .copied()
            .unwrap_or((d.ns_dtype, d.ns_steps));
        (dims, ns)
    };
    let mine = run(param);
    let ((rows, cols), (dtype, steps)) = mine;
    let batch = plan.ranks.get(rank as usize).map_or(1, |rp| {
        rp.nodes
            .iter()
            .filter(|n| match n.op {
                Op::Optimizer {
                    param: q,
                    optimizer: OptimizerKind::Muon,
                } => run(q) == mine,
                _ => false,
            })
            .count()
            .max(1)
    });
    let launches = f64::from(muon_batch_launches(steps)) / batch as f64;
    let numel = plan.param(param).spec.numel() as f64;
    let flops = overlap_graph::owner::ns_flops(rows, cols, steps);
    Cost::compute(
        launches * p.kernel_us * 1e-6
            + flops / (ns_tflops(p, dtype) * 1e12)
            + 5.0 * numel * F32 / (p.hbm_gbs * 1e9),
    )
}
