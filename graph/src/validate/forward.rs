//! The forward's parameter gathers (plans with [`Plan::forward`]): `forward-coverage`,
//! `read-after-unshard`, `unshard-reads-latest` and `reshard-after-last-read`.
//!
//! A forward plan gathers each layer's full parameters ([`Op::Unshard`] into a
//! [`Buffer::Full`] per parameter, micro-batch and pass) before the trainer's `forward`
//! and `backward` points read them, and frees them ([`Op::Reshard`]) after. Per rank:
//!
//! - `forward-coverage`: every micro-batch runs the trainer's points in the flow the
//!   session drives: a `forward` per layer, ascending, then per layer descending a
//!   `backward` and its `grad_ready`;
//! - `read-after-unshard`: every read of a gathered parameter has an unshard of it
//!   before it in serial order, ordered before the read by stream order or events;
//! - `unshard-reads-latest`: every unshard gathers the parameters of the latest
//!   optimizer step and publish: no write of the parameter (this step's optimizer or
//!   publish) precedes it on a rank that supplies values, and a supplier holds what it
//!   sends (every rank its shard of a sharded route; for an owned route the owner's
//!   shard column, which the last step's optimizer and publish left up to date). The
//!   executor finishes a step (its optimizers and publishes) before the next step's
//!   first node, so the first gathers of step `t + 1` read step `t`'s update;
//! - `reshard-after-last-read`: nothing reads a gathered parameter after its reshard;
//!   a reshard frees a live gather once, on the stream of the trainer's point that last
//!   read it (or ordered after a later point of that stream: the trainer's own kernels
//!   follow the point on its stream and the plan does not see them), and, in `Step`
//!   mode, every gather is freed by the step's end. That the reshard waits for every
//!   reader is `ordered-access`'s (a reshard writes the buffer).

use std::collections::HashMap;

use super::{violation, Mode};
use crate::node::{Buffer, CollectiveKind, Node, NodeId, Op};
use crate::order::HappensBefore;
use crate::plan::{Access, Plan, RankProgram};
use crate::Violation;

const COVERAGE: &str = "forward-coverage";
const READ: &str = "read-after-unshard";
const LATEST: &str = "unshard-reads-latest";
const FREE: &str = "reshard-after-last-read";

/// Runs the four checks on one rank of a forward plan (nothing for other plans).
pub(super) fn check(
    plan: &Plan,
    rp: &RankProgram,
    acc: &[Access],
    mode: Mode,
    out: &mut Vec<Violation>,
) {
    if plan.forward.is_none() {
        return;
    }
    coverage(plan, rp, out);
    latest(plan, rp, acc, out);
    let (order, _) = HappensBefore::of(rp);
    lifetimes(plan, rp, acc, &order, mode, out);
}

/// The trainer's points a micro-batch must run, in order.
fn expected_points(plan: &Plan) -> Vec<Op> {
    let desc = plan.layers_desc();
    let mut want: Vec<Op> = desc
        .iter()
        .rev()
        .map(|&layer| Op::Forward { layer })
        .collect();
    for &layer in &desc {
        want.push(Op::Backward { layer });
        want.push(Op::GradReady { layer });
    }
    want
}

fn coverage(plan: &Plan, rp: &RankProgram, out: &mut Vec<Violation>) {
    let want = expected_points(plan);
    let describe = |op: &Op| {
        let kind = op.kind();
        format!("{kind} L{}", op.point_layer().unwrap_or(0))
    };
    for m in 0..plan.micro_batches() {
        let got: Vec<&Node> = rp
            .nodes
            .iter()
            .filter(|n| n.op.is_point() && n.micro_batch == Some(m))
            .collect();
        let at = (0..want.len().max(got.len()))
            .find(|&i| got.get(i).map(|n| n.op) != want.get(i).copied());
        let Some(i) = at else { continue };
        let detail = match (got.get(i), want.get(i)) {
            (Some(n), Some(w)) => format!(
                "{} runs where micro-batch {m} needs {} (the trainer's flow: forward of every layer ascending, then per layer descending backward and grad_ready)",
                plan.label(n),
                describe(w)
            ),
            (Some(n), None) => format!(
                "{} runs after micro-batch {m}'s last grad_ready: every point of the trainer runs once per micro-batch",
                plan.label(n)
            ),
            (None, Some(w)) => format!(
                "micro-batch {m} runs no {} (the trainer's flow: forward of every layer ascending, then per layer descending backward and grad_ready)",
                describe(w)
            ),
            (None, None) => continue,
        };
        out.push(violation(COVERAGE, rp.rank, got.get(i).copied(), detail));
    }
}

fn latest(plan: &Plan, rp: &RankProgram, acc: &[Access], out: &mut Vec<Violation>) {
    let rank = rp.rank;
    let me = plan.mesh.coord(rank);
    // The last node of this step that wrote each parameter on this rank.
    let mut written: HashMap<u32, NodeId> = HashMap::new();
    for n in &rp.nodes {
        if let Op::Unshard {
            param,
            micro_batch,
            collective,
            ..
        } = n.op
        {
            if plan.unshard_supplies(rank, &collective) {
                let name = &plan.param(param).spec.name;
                if let Some(&w) = written.get(&param) {
                    out.push(violation(
                        LATEST,
                        rank,
                        Some(n),
                        format!(
                            "{} reads `{name}` after {} (node {w}) of this step wrote it: micro-batch {micro_batch}'s forward and backward must see the parameters of the latest completed optimizer step and publish, which every holder has at the step's start",
                            plan.label(n),
                            plan.label(&rp.nodes[w as usize])
                        ),
                    ));
                }
                let holds = match (plan.param(param).owner, collective.kind) {
                    (None, CollectiveKind::AllGather) => None,
                    (None, _) => Some(format!(
                        "rank {rank} holds only its shard of `{name}`, not the whole tensor a {} sends",
                        collective.kind.name()
                    )),
                    (Some(o), CollectiveKind::Broadcast) if o.shard == me.shard => None,
                    (Some(o), _) => Some(format!(
                        "rank {rank} (shard index {}) supplies `{name}`, which only the owner's shard column (shard index {}) holds: the latest optimizer step and publish left no copy here, so it would send stale values",
                        me.shard, o.shard
                    )),
                };
                if let Some(why) = holds {
                    out.push(violation(
                        LATEST,
                        rank,
                        Some(n),
                        format!("{}: {why}", plan.label(n)),
                    ));
                }
            }
        }
        for w in &acc[n.id as usize].writes {
            if let Buffer::Param { param } = *w {
                written.insert(param, n.id);
            }
        }
    }
}

/// What a gathered buffer holds at a point of the serial order.
#[derive(Clone, Copy)]
enum State {
    /// Gathered by this unshard; the last point that read it since.
    Live(NodeId, Option<NodeId>),
    /// Freed by this reshard.
    Freed(NodeId),
}

/// `read-after-unshard` and `reshard-after-last-read` along the rank's serial order:
/// every read of a gathered buffer finds it live and ordered after its gather, every
/// free finds it live and comes after the trainer's work that last read it, and (in
/// `Step` mode) nothing is left live at the step's end.
fn lifetimes(
    plan: &Plan,
    rp: &RankProgram,
    acc: &[Access],
    order: &HappensBefore,
    mode: Mode,
    out: &mut Vec<Violation>,
) {
    let mut walk = Lifetimes {
        plan,
        rp,
        order,
        state: HashMap::new(),
        out,
    };
    for n in &rp.nodes {
        let a = &acc[n.id as usize];
        for r in a.reads.iter().filter(|b| matches!(b, Buffer::Full { .. })) {
            walk.read(n, r);
        }
        for w in a.writes.iter().filter(|b| matches!(b, Buffer::Full { .. })) {
            match n.op {
                Op::Unshard { .. } => {
                    walk.state.insert(*w, State::Live(n.id, None));
                }
                _ => walk.free(n, w),
            }
        }
    }
    if mode == Mode::Step {
        walk.report_leaks();
    }
}

/// The walk of [`lifetimes`]: what each gathered buffer holds so far.
struct Lifetimes<'a> {
    plan: &'a Plan,
    rp: &'a RankProgram,
    order: &'a HappensBefore,
    state: HashMap<Buffer, State>,
    out: &'a mut Vec<Violation>,
}

impl<'a> Lifetimes<'a> {
    fn node(&self, id: NodeId) -> &'a Node {
        &self.rp.nodes[id as usize]
    }

    fn report(&mut self, invariant: &'static str, n: &Node, detail: String) {
        self.out
            .push(violation(invariant, self.rp.rank, Some(n), detail));
    }

    /// Node `n` reads the gathered buffer `r`.
    fn read(&mut self, n: &Node, r: &Buffer) {
        let plan = self.plan;
        match self.state.get(r).copied() {
            None => self.report(
                READ,
                n,
                format!(
                    "{} reads {r}, which no unshard gathered before it",
                    plan.label(n)
                ),
            ),
            Some(State::Freed(f)) => self.report(
                FREE,
                n,
                format!(
                    "{} reads {r} after {} (node {f}) freed it",
                    plan.label(n),
                    plan.label(self.node(f))
                ),
            ),
            Some(State::Live(u, _)) => {
                if !self.order.before(u, n.id) {
                    self.report(
                        READ,
                        n,
                        format!(
                            "{} reads {r} gathered by {} (node {u}, stream {}) without an event chain ordering it after the gather",
                            plan.label(n),
                            plan.label(self.node(u)),
                            self.node(u).stream
                        ),
                    );
                }
                self.state.insert(*r, State::Live(u, Some(n.id)));
            }
        }
    }

    /// Node `n` (a reshard, or anything else that writes it) frees the gathered `w`.
    fn free(&mut self, n: &Node, w: &Buffer) {
        let plan = self.plan;
        match self.state.get(w).copied() {
            None => self.report(
                FREE,
                n,
                format!("{} frees {w}, which no unshard gathered", plan.label(n)),
            ),
            Some(State::Freed(f)) => self.report(
                FREE,
                n,
                format!(
                    "{} frees {w} again: {} (node {f}) freed it already",
                    plan.label(n),
                    plan.label(self.node(f))
                ),
            ),
            Some(State::Live(_, Some(p))) if !after_trainer(self.rp, self.order, p, n) => {
                self.report(
                    FREE,
                    n,
                    format!(
                        "{} frees {w} on stream {}, but {} (node {p}) read it on stream {}: the trainer's own kernels follow that point on its stream, so only a free on it (or ordered after a later point of it) comes after them",
                        plan.label(n),
                        n.stream,
                        plan.label(self.node(p)),
                        self.node(p).stream
                    ),
                )
            }
            Some(State::Live(..)) => {}
        }
        self.state.insert(*w, State::Freed(n.id));
    }

    /// At the step's end: every buffer still live is a gather never freed.
    fn report_leaks(&mut self) {
        let mut leaked: Vec<(NodeId, Buffer)> = self
            .state
            .iter()
            .filter_map(|(b, s)| match *s {
                State::Live(u, _) => Some((u, *b)),
                State::Freed(_) => None,
            })
            .collect();
        leaked.sort_unstable();
        for (u, b) in leaked {
            let gather = self.node(u);
            let detail = format!(
                "{b}, gathered by {}, is never freed in this step: the full parameters would outlive their pass",
                self.plan.label(gather)
            );
            self.report(FREE, gather, detail);
        }
    }
}

/// Whether a free `r` comes after the trainer's work that follows point `p`: on `p`'s
/// stream after it, or ordered after a later point of that stream.
fn after_trainer(rp: &RankProgram, order: &HappensBefore, p: NodeId, r: &Node) -> bool {
    let stream = rp.nodes[p as usize].stream;
    if r.stream == stream && p < r.id {
        return true;
    }
    rp.nodes[p as usize + 1..r.id as usize]
        .iter()
        .any(|q| q.op.is_point() && q.stream == stream && order.before(q.id, r.id))
}
