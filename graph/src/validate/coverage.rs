//! `optimizer-coverage`: every parameter is in exactly one bucket, and every rank that
//! holds a piece of a parameter updates it exactly once per step, with the optimizer its
//! route requires; no rank updates what it does not hold.
//!
//! Holders: every rank for the sharded routes (`fsdp`, `sharded_adamw`: each its shard),
//! the owner alone for the owned ones (`muon`, `adamw`; the owner's shard column gets the
//! update through `publish`, which `publish-coverage` checks).

use std::collections::HashMap;

use super::violation;
use crate::node::{Buffer, Node, Op, OptimizerKind};
use crate::param::ParamId;
use crate::plan::Plan;
use crate::Violation;

const COVERAGE: &str = "optimizer-coverage";

/// Every parameter in exactly one bucket (reported once, on rank 0).
pub(super) fn buckets(plan: &Plan, out: &mut Vec<Violation>) {
    let mut homes: Vec<Vec<usize>> = vec![Vec::new(); plan.params.len()];
    for (b, bucket) in plan.buckets.iter().enumerate() {
        for &p in &bucket.params {
            if let Some(h) = homes.get_mut(p as usize) {
                h.push(b);
            }
        }
    }
    for (p, h) in homes.iter().enumerate() {
        let name = &plan.params[p].spec.name;
        let detail = match h.len() {
            1 => continue,
            0 => format!(
                "parameter `{name}` is in no bucket: its gradient is never reduced and its optimizer never sees it"
            ),
            _ => format!(
                "parameter `{name}` is in buckets {}: each micro-batch would reduce its gradient {} times",
                h.iter().map(|b| format!("b{b}")).collect::<Vec<_>>().join(", "),
                h.len()
            ),
        };
        out.push(violation(COVERAGE, 0, None, detail));
    }
}

/// Whether `rank` holds (and so must update) a piece of `param`.
fn holds(plan: &Plan, param: ParamId, rank: u32) -> bool {
    match plan.param(param).owner {
        None => true,
        Some(o) => plan.mesh.coord(rank) == o,
    }
}

/// One rank's optimizer nodes against the parameters it holds.
pub(super) fn optimizers(plan: &Plan, rank: u32, nodes: &[Node], out: &mut Vec<Violation>) {
    let mut seen: HashMap<ParamId, Vec<&Node>> = HashMap::new();
    let mut last_unpack: HashMap<ParamId, &Node> = HashMap::new();
    for n in nodes {
        match n.op {
            Op::Optimizer { param, optimizer } => {
                let placed = plan.param(param);
                let name = &placed.spec.name;
                let want = plan.optimizer_kind(param);
                if optimizer != want {
                    out.push(violation(
                        COVERAGE,
                        rank,
                        Some(n),
                        format!(
                            "{} runs {} on `{name}`, whose route {} requires {}",
                            plan.label(n),
                            kind_name(optimizer),
                            placed.spec.route,
                            kind_name(want)
                        ),
                    ));
                }
                if !holds(plan, param, rank) {
                    let owner = placed.owner.map(|o| plan.mesh.rank(o)).unwrap_or(0);
                    out.push(violation(
                        COVERAGE,
                        rank,
                        Some(n),
                        format!(
                            "{} updates `{name}` on rank {rank}, which does not hold it: only its owner, rank {owner}, updates it",
                            plan.label(n)
                        ),
                    ));
                }
                seen.entry(param).or_default().push(n);
            }
            Op::Unpack { bucket, .. } => {
                for &p in &plan.bucket(bucket).params {
                    last_unpack.insert(p, n);
                }
            }
            _ => {}
        }
    }
    for p in 0..plan.params.len() as ParamId {
        let name = &plan.param(p).spec.name;
        let ns = seen.get(&p).map(Vec::as_slice).unwrap_or(&[]);
        match ns.len() {
            0 if holds(plan, p, rank) => {
                let at = last_unpack.get(&p).copied();
                out.push(violation(
                    COVERAGE,
                    rank,
                    at,
                    format!(
                        "rank {rank} holds `{name}` but no optimizer node updates it: its {} is never consumed and the parameter never changes",
                        Buffer::Reduced { param: p }
                    ),
                ));
            }
            0 | 1 => {}
            k => out.push(violation(
                COVERAGE,
                rank,
                Some(ns[1]),
                format!(
                    "{} updates `{name}` again: {k} optimizer nodes on rank {rank} would apply the step {k} times",
                    plan.label(ns[1])
                ),
            )),
        }
    }
}

fn kind_name(k: OptimizerKind) -> &'static str {
    match k {
        OptimizerKind::Adamw => "adamw",
        OptimizerKind::Muon => "muon",
    }
}

const CLIP: &str = "clip-coverage";

/// `clip-coverage`: in a plan with the global norm ([`Plan::grad_norm`]), every rank's
/// tail runs exactly one `grad_norm`, one `norm_reduce` over its shard group and one
/// over its replicate group, and one `clip`, in that serial order and before every
/// optimizer (the norm reads every reduced gradient the rank counts, by
/// [`Plan::access`]); a plan without it has none of these nodes.
pub(super) fn clip(plan: &Plan, rank: u32, nodes: &[Node], out: &mut Vec<Violation>) {
    let norm_nodes: Vec<&Node> = nodes.iter().filter(|n| n.op.is_norm()).collect();
    if !plan.grad_norm {
        if let Some(n) = norm_nodes.first() {
            out.push(violation(
                CLIP,
                rank,
                Some(n),
                format!(
                    "{} runs in a plan without the global norm (`grad_norm` is off)",
                    plan.label(n)
                ),
            ));
        }
        return;
    }
    norm_sequence(plan, rank, &norm_nodes, out);
    let last_norm = norm_nodes.iter().map(|n| n.id).max();
    for n in nodes {
        if let Op::Optimizer { .. } = n.op {
            if last_norm.is_some_and(|l| n.id < l) {
                out.push(violation(
                    CLIP,
                    rank,
                    Some(n),
                    format!(
                        "{} runs before rank {rank}'s clip: it would step on the unclipped gradient",
                        plan.label(n)
                    ),
                ));
            }
        }
    }
}

/// The steps of the norm's sequence, in their order.
const NORM_STEPS: [&str; 4] = [
    "grad_norm",
    "norm_reduce over the shard group",
    "norm_reduce over the replicate group",
    "clip",
];

/// Where a node of the norm's sequence belongs in [`NORM_STEPS`].
fn norm_step(op: &Op) -> usize {
    use crate::mesh::Group;
    match op {
        Op::GradNorm => 0,
        Op::NormReduce { collective } => match collective.group {
            Group::Shard { .. } => 1,
            Group::Replicate { .. } => 2,
        },
        _ => 3,
    }
}

/// A rank's norm nodes (`norm_nodes`, in serial order) run each step of
/// [`NORM_STEPS`] once, in order.
fn norm_sequence(plan: &Plan, rank: u32, norm_nodes: &[&Node], out: &mut Vec<Violation>) {
    let mut count = [0usize; 4];
    let mut expect = 0;
    for n in norm_nodes {
        let s = norm_step(&n.op);
        count[s] += 1;
        if count[s] > 1 {
            out.push(violation(
                CLIP,
                rank,
                Some(n),
                format!(
                    "{} runs again: rank {rank} must run one {} per step",
                    plan.label(n),
                    NORM_STEPS[s]
                ),
            ));
        } else if s != expect {
            out.push(violation(
                CLIP,
                rank,
                Some(n),
                format!(
                    "{} runs where rank {rank} must run its {} (order: grad_norm, norm_reduce over the shard group, then over the replicate group, clip)",
                    plan.label(n),
                    NORM_STEPS[expect.min(3)]
                ),
            ));
        }
        expect = s + 1;
    }
    for (s, &c) in count.iter().enumerate() {
        if c == 0 {
            out.push(violation(
                CLIP,
                rank,
                None,
                format!(
                    "rank {rank} runs no {}: the plan clips by the global norm, so every rank must",
                    NORM_STEPS[s]
                ),
            ));
        }
    }
}
