//! The validator: proves a plan's invariants before anything runs.
//!
//! Each check names its invariant, and every violation names the rank, stream and node:
//!
//! - `well-formed`: ids in range, every node run once on the stream it is bound to,
//!   stream programs in serial order ([`Plan::check_well_formed`]).
//! - `gate-conformance`: each micro-batch runs only what its gate allows (no collective
//!   under `no_sync`, no Stage 2 or unpack with the replicate gate off, no fold into the
//!   partial with it on).
//! - `stage1-consumed-once`: every Stage-1 output is consumed exactly once, by a fold or
//!   by Stage 2 (zero times is seed bug 1 or 4, twice is bug 2).
//! - `exchange-combined-once` (copy transport): every exchange a rank receives is
//!   combined exactly once, after it, and only ranks that receive a stage's result
//!   combine it; every all-reduce combine is gathered exactly once, after it, on its
//!   exchange's stream, nothing reads the output in between, and only all-reduces are
//!   gathered.
//! - `event-order`: every wait follows, in host issue order, a record of its event.
//! - `ordered-access`: every pair of accesses to one buffer, one of them a write, runs in
//!   serial order: same stream, or ordered by an event chain (bug 3); nothing reads a
//!   buffer that nothing wrote.
//! - `partials-flushed`: no partial or no_sync accumulation is left at the end of the step.
//! - `optimizer-coverage`: every parameter is in exactly one bucket; every rank holding
//!   a piece of a parameter updates it with exactly one optimizer node of the kind its
//!   route requires, and no rank updates what it does not hold.
//! - `collective-shape`: every collective is the one its node's route requires (kind,
//!   group, size, root at the owner, the plan's reduce op and dtype).
//! - `collective-match`: on every communicator (a group bound to a stream) all members
//!   issue the same collectives in the same order with the same sizes, dtypes and roots.
//! - `no-deadlock`: executing all ranks' programs together, every stream finishes.
//! - `contributions-exactly-once`: following every buffer's `(micro-batch, source rank)`
//!   contributions across ranks (`validate/accounting.rs`), no node re-reads contributions that
//!   were handed on, and no sum counts a contribution twice.
//! - `gradient-accounting`: every stage reduces values of its level, no initialising
//!   write drops a live value, and every optimizer consumes exactly the no_sync
//!   reference (every rank's gradient of every micro-batch, once, fully reduced).
//! - `publish-coverage`: every replica of an owned parameter receives its owner's
//!   update exactly once per step, after the owner's optimizer.
//! - `clip-coverage`: in a plan with the global norm, every rank runs exactly one
//!   `grad_norm` (over every reduced gradient it counts), one `norm_reduce` over its
//!   shard group then one over its replicate group, and one `clip`, in that order and
//!   before all of its optimizers; a plan without it runs none of them.
//! - `forward-coverage` (plans with the forward's parameter gathers, like the three
//!   below; `validate/forward.rs`): every micro-batch runs the trainer's forward points
//!   ascending, then each layer's backward point and `grad_ready` descending.
//! - `read-after-unshard`: every read of a gathered parameter follows its gather, in
//!   serial order and by stream order or events.
//! - `unshard-reads-latest`: every gather reads the parameters of the latest optimizer
//!   step and publish (nothing of the step wrote them before it; a supplier holds them).
//! - `reshard-after-last-read`: nothing reads a gathered parameter after its free,
//!   which runs once, on the stream of the trainer's last use, and before the step ends.
//!
//! Host issue order is the serial node order: to issue node `n` the host issues the
//! instructions of `n`'s stream up to `Run(n)`, then the records that follow it.

mod accounting;
mod contrib;
mod coverage;
mod forward;

use std::collections::{BTreeMap, HashMap};

use crate::gate::Gate;
use crate::mesh::Group;
use crate::node::{Buffer, Collective, CollectiveKind, EventId, Instr, Node, NodeId, Op, Stream};
use crate::order::HappensBefore;
use crate::plan::Plan;
use crate::{PlanError, Violation};

/// How much of a step the plan is meant to cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A whole step: partials must be flushed and optimizers must see every micro-batch.
    Step,
    /// The micro-batches issued so far: end-of-step invariants are not checked.
    Prefix,
}

/// The name of every invariant the validator checks, in the order of this module's
/// docs: every [`Violation::invariant`] is one of these (metrics label by them).
pub const INVARIANTS: [&str; 19] = [
    "well-formed",
    "gate-conformance",
    "stage1-consumed-once",
    "exchange-combined-once",
    "event-order",
    "ordered-access",
    "partials-flushed",
    "optimizer-coverage",
    "collective-shape",
    "collective-match",
    "no-deadlock",
    "contributions-exactly-once",
    "gradient-accounting",
    "publish-coverage",
    "clip-coverage",
    "forward-coverage",
    "read-after-unshard",
    "unshard-reads-latest",
    "reshard-after-last-read",
];

/// Stops collecting after this many violations.
const MAX_VIOLATIONS: usize = 64;

/// A plan the validator accepted in a mode: the only kind of plan an executor runs.
///
/// [`Validated::check`] (or [`crate::Planner::plan_checked`]) is the only way to make
/// one, so a function that takes a `Validated` needs no check of its own, and a plan
/// cannot be run without having been validated in the mode it is run in.
#[derive(Debug, Clone)]
pub struct Validated {
    plan: std::sync::Arc<Plan>,
    mode: Mode,
}

impl Validated {
    /// Validates `plan` in `mode`: the plan, or the violations found (the first 64).
    pub fn check(plan: Plan, mode: Mode) -> Result<Validated, Vec<Violation>> {
        let v = validate(&plan, mode);
        if v.is_empty() {
            Ok(Validated {
                plan: std::sync::Arc::new(plan),
                mode,
            })
        } else {
            Err(v)
        }
    }

    /// The plan, shared.
    pub fn plan(&self) -> &std::sync::Arc<Plan> {
        &self.plan
    }

    /// The mode it was validated in: a whole step, or a prefix of one.
    pub fn mode(&self) -> Mode {
        self.mode
    }
}

impl std::ops::Deref for Validated {
    type Target = Plan;

    fn deref(&self) -> &Plan {
        &self.plan
    }
}

/// Why [`crate::Planner::plan_checked`] made no plan.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Rejected {
    /// The planner's input (gates, sizes) is wrong.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The planned plan breaks invariants: a planner bug, reported as such.
    #[error("the plan breaks {} invariant(s); the first: {}", .0.len(), .0.first().map(|v| v.to_string()).unwrap_or_default())]
    Invalid(Vec<Violation>),
}

/// Validates a plan; an empty list means every invariant holds.
pub fn validate(plan: &Plan, mode: Mode) -> Vec<Violation> {
    if let Err(e) = plan.check_well_formed() {
        let (rank, stream, node) = match e {
            PlanError::Malformed {
                rank, stream, node, ..
            } => (rank, stream, node),
            _ => (0, None, None),
        };
        return vec![Violation {
            invariant: "well-formed",
            rank,
            stream,
            node,
            detail: e.to_string(),
        }];
    }
    let mut out = Vec::new();
    for rp in &plan.ranks {
        if let Err(v) = check_serial_stream_order(rp) {
            out.push(v);
        }
    }
    if !out.is_empty() {
        return out;
    }
    if mode == Mode::Step {
        coverage::buckets(plan, &mut out);
    }
    for rp in &plan.ranks {
        let rank = rp.rank;
        let accesses: Vec<_> = rp.nodes.iter().map(|n| plan.access(rank, n)).collect();
        gate_conformance(plan, rank, &rp.nodes, &mut out);
        stage1_consumed_once(plan, rank, &rp.nodes, &mut out);
        exchange_combined_once(plan, rank, &rp.nodes, &mut out);
        collective_shape(plan, rank, &rp.nodes, &mut out);
        ordered_access(plan, rp, &accesses, &mut out);
        if mode == Mode::Step {
            partials_flushed(plan, rank, &rp.nodes, &accesses, &mut out);
            coverage::optimizers(plan, rank, &rp.nodes, &mut out);
            coverage::clip(plan, rank, &rp.nodes, &mut out);
        }
        forward::check(plan, rp, &accesses, mode, &mut out);
        if out.len() >= MAX_VIOLATIONS {
            out.truncate(MAX_VIOLATIONS);
            return out;
        }
    }
    let before = out.len();
    collective_match(plan, &mut out);
    if out.len() == before {
        no_deadlock(plan, &mut out);
        // Collectives pair up only when every member issues the same calls.
        out.extend(accounting::accounting(plan, mode));
    }
    out.truncate(MAX_VIOLATIONS);
    out
}

fn violation(invariant: &'static str, rank: u32, n: Option<&Node>, detail: String) -> Violation {
    Violation {
        invariant,
        rank,
        stream: n.map(|n| n.stream),
        node: n.map(|n| n.id),
        detail,
    }
}

fn check_serial_stream_order(rp: &crate::plan::RankProgram) -> Result<(), Violation> {
    for sp in &rp.streams {
        let mut last: Option<NodeId> = None;
        for ins in &sp.instrs {
            if let Instr::Run(n) = *ins {
                if last.is_some_and(|l| l > n) {
                    return Err(Violation {
                        invariant: "well-formed",
                        rank: rp.rank,
                        stream: Some(sp.stream),
                        node: Some(n),
                        detail: format!("node {n} runs after node {} on its stream; stream programs follow serial order", last.unwrap_or(0)),
                    });
                }
                last = Some(n);
            }
        }
    }
    Ok(())
}

fn gate_conformance(plan: &Plan, rank: u32, nodes: &[Node], out: &mut Vec<Violation>) {
    for n in nodes {
        let Some(m) = n.micro_batch else { continue };
        let gate = plan.gates[m as usize];
        let allowed = match (gate, n.op) {
            (_, Op::GradReady { .. }) => true,
            // The forward's gathers and points run under every gate.
            (_, op) if op.is_forward() => true,
            (Gate::NoSync, Op::Accumulate { .. }) => true,
            (Gate::NoSync, _) => false,
            (_, Op::Accumulate { .. }) => false,
            (
                Gate::ReplicateOff,
                Op::Stage2 { .. }
                | Op::Unpack { .. }
                | Op::FoldPartial { .. }
                | Op::Exchange { stage: 2, .. }
                | Op::Combine { stage: 2, .. }
                | Op::Gather { stage: 2, .. },
            ) => false,
            (Gate::On, Op::Fold { .. }) => false,
            // The norm tail belongs to no micro-batch.
            (_, op) if op.is_norm() => false,
            _ => true,
        };
        if !allowed {
            out.push(violation(
                "gate-conformance",
                rank,
                Some(n),
                format!(
                    "{} runs in micro-batch {m}, whose gate is `{gate}`",
                    plan.label(n)
                ),
            ));
        }
    }
}

fn stage1_consumed_once(plan: &Plan, rank: u32, nodes: &[Node], out: &mut Vec<Violation>) {
    let mut consumers: BTreeMap<(u32, u32), Vec<&Node>> = BTreeMap::new();
    let mut producers: BTreeMap<(u32, u32), &Node> = BTreeMap::new();
    for n in nodes {
        match n.op {
            Op::Stage1 {
                bucket,
                micro_batch,
                ..
            } if plan.holds_stage1(bucket, rank) => {
                producers.insert((bucket, micro_batch), n);
            }
            Op::Combine {
                bucket,
                micro_batch,
                stage: 1,
                ..
            } => {
                producers.insert((bucket, micro_batch), n);
            }
            Op::Fold {
                bucket,
                micro_batch,
                ..
            }
            | Op::Stage2 {
                bucket,
                micro_batch,
                ..
            }
            | Op::Exchange {
                bucket,
                micro_batch,
                stage: 2,
                ..
            } => {
                consumers.entry((bucket, micro_batch)).or_default().push(n);
            }
            _ => {}
        }
    }
    for ((b, m), p) in producers {
        let cs = consumers.get(&(b, m)).map(Vec::as_slice).unwrap_or(&[]);
        let route = plan.bucket(b).route;
        let params = plan.bucket_param_names(b);
        match cs.len() {
            1 => {}
            0 => out.push(violation(
                "stage1-consumed-once",
                rank,
                Some(p),
                format!(
                    "{} ({route}: {params}) is never consumed: no fold into the partial and no Stage 2 \
                     (micro-batch {m}'s gradient would be lost or handed on unreduced)",
                    plan.label(p)
                ),
            )),
            k => out.push(violation(
                "stage1-consumed-once",
                rank,
                Some(p),
                format!(
                    "{} ({route}: {params}) is consumed {k} times ({}); the gradient would be counted {k} times",
                    plan.label(p),
                    cs.iter().map(|c| plan.label(c)).collect::<Vec<_>>().join(", ")
                ),
            )),
        }
    }
}

/// Counts one more use of what `key` opened; false when nothing did.
fn tally<K: Ord, V>(open: &mut BTreeMap<K, (V, u32)>, key: K) -> bool {
    match open.get_mut(&key) {
        Some((_, k)) => {
            *k += 1;
            true
        }
        None => false,
    }
}

/// `exchange-combined-once` on one rank: its copy-transport stages followed in serial
/// order.
fn exchange_combined_once(plan: &Plan, rank: u32, nodes: &[Node], out: &mut Vec<Violation>) {
    let mut walk = CopyStages {
        plan,
        rank,
        open: BTreeMap::new(),
        reduced: BTreeMap::new(),
        partial: BTreeMap::new(),
        out,
    };
    for n in nodes {
        walk.check_reads_before_gather(n);
        match n.op {
            Op::Gather {
                bucket,
                micro_batch,
                stage,
                collective,
            } => walk.gather(n, (bucket, micro_batch, stage), collective),
            Op::Exchange {
                bucket,
                micro_batch,
                stage,
                ..
            } => walk.exchange(n, (bucket, micro_batch, stage)),
            Op::Combine {
                bucket,
                micro_batch,
                stage,
                collective,
            } => walk.combine(n, (bucket, micro_batch, stage), collective),
            _ => {}
        }
    }
    walk.finish();
}

/// A copy-transport stage: (bucket, micro-batch, stage).
type StageKey = (u32, u32, u8);

/// One rank's exchanges, combines and gathers seen so far, for `exchange-combined-once`.
struct CopyStages<'a, 'o> {
    plan: &'a Plan,
    rank: u32,
    /// Each stage's exchange seen so far, and how often it was combined.
    open: BTreeMap<StageKey, (&'a Node, u32)>,
    /// The same for all-reduce combines, and how often each was gathered.
    reduced: BTreeMap<StageKey, (&'a Node, u32)>,
    /// All-reduce outputs combined but not yet gathered: only this rank's chunk is there.
    partial: BTreeMap<Buffer, &'a Node>,
    out: &'o mut Vec<Violation>,
}

impl<'a> CopyStages<'a, '_> {
    /// Reports a violation of `exchange-combined-once` at node `n`.
    fn flag(&mut self, n: &Node, detail: String) {
        self.out.push(violation(
            "exchange-combined-once",
            self.rank,
            Some(n),
            detail,
        ));
    }

    /// Nothing but its gather reads an all-reduce's output between its combine and the
    /// gather: only this rank's chunk is reduced there yet.
    fn check_reads_before_gather(&mut self, n: &Node) {
        if self.partial.is_empty() || matches!(n.op, Op::Gather { .. }) {
            return;
        }
        for b in self.plan.access(self.rank, n).reads {
            if let Some(c) = self.partial.get(&b) {
                let detail = format!(
                    "{} reads {} between {} and its gather: only this rank's chunk is reduced there yet",
                    self.plan.label(n),
                    b,
                    self.plan.label(c)
                );
                self.flag(n, detail);
            }
        }
    }

    /// A gather: on its exchange's stream, of an all-reduce, after a combine reduced the
    /// chunk it hands out.
    fn gather(&mut self, n: &'a Node, key: StageKey, collective: Collective) {
        let plan = self.plan;
        let (bucket, micro_batch, stage) = key;
        self.partial
            .remove(&Plan::stage_output(bucket, micro_batch, stage));
        // A gather moves on its exchange's communicator (the copy rings are there).
        if let Some(&(x, _)) = self.open.get(&key) {
            if x.stream != n.stream {
                let detail = format!(
                    "{} runs on the {} stream, but its exchange {} on {}: a gather moves on its exchange's communicator",
                    plan.label(n),
                    n.stream,
                    plan.label(x),
                    x.stream
                );
                self.flag(n, detail);
            }
        }
        if collective.kind != CollectiveKind::AllReduce {
            let detail = format!(
                "{} gathers the result of a {}; only an all-reduce's chunks are gathered",
                plan.label(n),
                collective.kind.name()
            );
            self.flag(n, detail);
            return;
        }
        if !tally(&mut self.reduced, key) {
            let detail = format!(
                "{} hands out a chunk no earlier combine reduced",
                plan.label(n)
            );
            self.flag(n, detail);
        }
    }

    /// An exchange on a rank that receives the stage's result opens the stage, once.
    fn exchange(&mut self, n: &'a Node, key: StageKey) {
        let (bucket, micro_batch, stage) = key;
        let (_, holds) = self.plan.stage_input(bucket, micro_batch, stage, self.rank);
        if holds {
            if let Some((prev, _)) = self.open.insert(key, (n, 0)) {
                let detail = format!(
                    "{} exchanges again what {} already exchanged",
                    self.plan.label(n),
                    self.plan.label(prev)
                );
                self.flag(n, detail);
            }
        }
    }

    /// A combine: on a rank that receives the stage's result, after its exchange; an
    /// all-reduce's combine opens its gather.
    fn combine(&mut self, n: &'a Node, key: StageKey, collective: Collective) {
        let (bucket, micro_batch, stage) = key;
        let (_, holds) = self.plan.stage_input(bucket, micro_batch, stage, self.rank);
        if !holds {
            let detail = format!(
                "{} runs on rank {}, which does not receive the stage's result",
                self.plan.label(n),
                self.rank
            );
            self.flag(n, detail);
            return;
        }
        if !tally(&mut self.open, key) {
            let detail = format!(
                "{} combines chunks no earlier exchange received",
                self.plan.label(n)
            );
            self.flag(n, detail);
        }
        if collective.kind == CollectiveKind::AllReduce {
            self.reduced.insert(key, (n, 0));
            self.partial
                .insert(Plan::stage_output(bucket, micro_batch, stage), n);
        }
    }

    /// At the end of the rank: every exchange combined exactly once, every all-reduce
    /// combine gathered exactly once.
    fn finish(mut self) {
        for (x, k) in std::mem::take(&mut self.open).into_values() {
            if k != 1 {
                let what = if k == 0 {
                    "is never combined: the chunks it received would be lost".to_string()
                } else {
                    format!("is combined {k} times: its chunks would be counted {k} times")
                };
                let detail = format!("{} {what}", self.plan.label(x));
                self.flag(x, detail);
            }
        }
        for (c, k) in std::mem::take(&mut self.reduced).into_values() {
            if k != 1 {
                let what = if k == 0 {
                    "is never gathered: the other replicas would miss the chunk it reduced"
                        .to_string()
                } else {
                    format!("is gathered {k} times")
                };
                let detail = format!("{} {what}", self.plan.label(c));
                self.flag(c, detail);
            }
        }
    }
}

pub use crate::order::issue_order;

fn ordered_access(
    plan: &Plan,
    rp: &crate::plan::RankProgram,
    acc: &[crate::plan::Access],
    out: &mut Vec<Violation>,
) {
    let (order, unmatched) = HappensBefore::of(rp);
    for (stream, e) in unmatched {
        out.push(Violation {
            invariant: "event-order",
            rank: rp.rank,
            stream: Some(stream),
            node: None,
            detail: format!(
                "wait on event {e} is issued before any record of it; on a GPU it would not wait at all"
            ),
        });
    }
    let hb = |u: NodeId, v: NodeId| {
        rp.nodes[u as usize].stream == rp.nodes[v as usize].stream || order.before(u, v)
    };
    let mut last_write: HashMap<Buffer, NodeId> = HashMap::new();
    let mut readers: HashMap<Buffer, Vec<NodeId>> = HashMap::new();
    let rank = rp.rank;
    for n in &rp.nodes {
        let a = &acc[n.id as usize];
        let report = |other: NodeId, buf: &Buffer, what: &str| {
            let o = &rp.nodes[other as usize];
            violation(
                "ordered-access",
                rank,
                Some(n),
                format!(
                    "{} {what} {buf} of {} (node {}, stream {}) without an event chain ordering them",
                    plan.label(n),
                    plan.label(o),
                    o.id,
                    o.stream
                ),
            )
        };
        for r in &a.reads {
            match last_write.get(r) {
                Some(&w) if !hb(w, n.id) => out.push(report(w, r, "reads the write to")),
                Some(_) => {}
                None if !r.is_persistent() => out.push(violation(
                    "ordered-access",
                    rank,
                    Some(n),
                    format!(
                        "{} reads {r}, which nothing wrote earlier in the step",
                        plan.label(n)
                    ),
                )),
                None => {}
            }
        }
        for w in &a.writes {
            if let Some(rs) = readers.get(w) {
                for &r in rs {
                    if r != n.id && !hb(r, n.id) {
                        out.push(report(r, w, "overwrites, before it finished reading,"));
                    }
                }
            }
            if let Some(&pw) = last_write.get(w) {
                if pw != n.id && !hb(pw, n.id) {
                    out.push(report(pw, w, "races the write to"));
                }
            }
        }
        for r in &a.reads {
            readers.entry(*r).or_default().push(n.id);
        }
        for w in &a.writes {
            last_write.insert(*w, n.id);
            readers.insert(*w, Vec::new());
        }
    }
}

fn partials_flushed(
    plan: &Plan,
    rank: u32,
    nodes: &[Node],
    acc: &[crate::plan::Access],
    out: &mut Vec<Violation>,
) {
    // The last access of each partial / accumulation must be a flush (a read that moves
    // it on); a write as last access means it was left behind.
    let mut last: BTreeMap<Buffer, (NodeId, bool)> = BTreeMap::new();
    for n in nodes {
        let a = &acc[n.id as usize];
        for b in a
            .reads
            .iter()
            .filter(|b| matches!(b, Buffer::Partial { .. } | Buffer::Accum { .. }))
        {
            last.insert(*b, (n.id, false));
        }
        for b in a
            .writes
            .iter()
            .filter(|b| matches!(b, Buffer::Partial { .. } | Buffer::Accum { .. }))
        {
            last.insert(*b, (n.id, true));
        }
    }
    for (buf, (node, written)) in last {
        if !written {
            continue;
        }
        let n = &nodes[node as usize];
        let what = match buf {
            Buffer::Partial { bucket } => format!(
                "the partial of bucket {bucket} ({})",
                plan.bucket_param_names(bucket)
            ),
            Buffer::Accum { param } => format!(
                "the no_sync accumulation of `{}`",
                plan.param(param).spec.name
            ),
            _ => buf.to_string(),
        };
        out.push(violation(
            "partials-flushed",
            rank,
            Some(n),
            format!(
                "{what}, last written by {}, is never flushed by a gate-on Stage 2 in this step",
                plan.label(n)
            ),
        ));
    }
}

/// A communicator: a group bound to a stream.
type Comm = (Group, Stream);
/// The collectives one rank issues on one communicator, in order.
type Calls = Vec<(NodeId, Subject, Collective)>;
/// What a call is, for comparing members' sequences.
type Call = (Subject, Collective);

/// What a call reduces: the node kind, bucket and micro-batch, or the published parameter.
/// Two members whose calls match in shape but not in this would silently mix the
/// gradients of different buckets.
type Subject = (&'static str, Option<u32>, Option<u32>, Option<u32>);

fn subject(op: &Op) -> Subject {
    let param = match *op {
        Op::Publish { param, .. } | Op::Unshard { param, .. } => Some(param),
        _ => None,
    };
    (op.kind(), op.bucket(), op.micro_batch(), param)
}

fn describe_call(plan: &Plan, call: Option<&(NodeId, Subject, Collective)>) -> String {
    match call {
        Some((_, (kind, bucket, mb, param), c)) => {
            let what = match (bucket, param) {
                (Some(b), _) => format!(
                    "{kind} b{b}{}",
                    mb.map(|m| format!(" m{m}")).unwrap_or_default()
                ),
                (_, Some(p)) => format!(
                    "{kind} {}{}",
                    plan.param(*p).spec.name,
                    mb.map(|m| format!(" m{m}")).unwrap_or_default()
                ),
                _ => (*kind).to_string(),
            };
            format!("{what}: {c}")
        }
        None => "nothing".into(),
    }
}

fn collective_shape(plan: &Plan, rank: u32, nodes: &[Node], out: &mut Vec<Violation>) {
    for n in nodes {
        let (Some(got), Some(want)) = (n.op.named_collective(), plan.expected_collective(rank, n))
        else {
            continue;
        };
        if *got != want {
            out.push(violation(
                "collective-shape",
                rank,
                Some(n),
                format!("{} issues {got}, but its route needs {want}", plan.label(n)),
            ));
        }
    }
}

fn collective_match(plan: &Plan, out: &mut Vec<Violation>) {
    for ((group, stream), mut members) in call_sequences(plan, out) {
        // Members that issue nothing on this communicator have an empty sequence.
        for r in plan.mesh.members(group) {
            if !members.iter().any(|m| m.0 == r) {
                members.push((r, Vec::new()));
            }
        }
        members.sort_by_key(|m| m.0);
        let longest = members.iter().map(|m| m.1.len()).max().unwrap_or(0);
        let Some(k) = (0..longest).find(|&k| {
            members
                .iter()
                .any(|m| call_at(&m.1, k) != call_at(&members[0].1, k))
        }) else {
            continue;
        };
        let (intended, who) = intended_call(plan, &members, k);
        let (agree_rank, agree_seq) = members
            .iter()
            .find(|m| call_at(&m.1, k) == intended)
            .map(|m| (m.0, &m.1))
            .unwrap_or((members[0].0, &members[0].1));
        for (r, s) in members.iter().filter(|m| call_at(&m.1, k) != intended) {
            let node = s.get(k).or(agree_seq.get(k)).map(|x| x.0);
            out.push(Violation {
                invariant: "collective-match",
                rank: *r,
                stream: Some(stream),
                node,
                detail: format!(
                    "collective #{k} on {group} (stream {stream}): rank {r} issues {}, rank {agree_rank} ({who}) {}; \
                     real hardware would hang or mix different buffers",
                    describe_call(plan, s.get(k)),
                    describe_call(plan, agree_seq.get(k)),
                ),
            });
        }
        return;
    }
}

/// Each rank's collectives per communicator, in serial order; a collective on a group
/// the rank is not a member of is reported (and left out).
fn call_sequences(plan: &Plan, out: &mut Vec<Violation>) -> BTreeMap<Comm, Vec<(u32, Calls)>> {
    let mut seqs: BTreeMap<Comm, Vec<(u32, Calls)>> = BTreeMap::new();
    for rp in &plan.ranks {
        let mut per: HashMap<Comm, Calls> = HashMap::new();
        for n in &rp.nodes {
            if let Some(c) = n.op.collective() {
                if plan.mesh.index_in(c.group, rp.rank).is_none() {
                    out.push(violation(
                        "collective-match",
                        rp.rank,
                        Some(n),
                        format!(
                            "{} runs on {}, which rank {} is not a member of",
                            plan.label(n),
                            c.group,
                            rp.rank
                        ),
                    ));
                    continue;
                }
                per.entry((c.group, n.stream))
                    .or_default()
                    .push((n.id, subject(&n.op), *c));
            }
        }
        for (comm, seq) in per {
            seqs.entry(comm).or_default().push((rp.rank, seq));
        }
    }
    seqs
}

/// Call `k` of a sequence, as members compare it (`None` past its end).
fn call_at(seq: &Calls, k: usize) -> Option<Call> {
    seq.get(k).map(|(_, s, c)| (*s, *c))
}

/// The intended call at slot `k` of the members' sequences, and why it is: the one
/// most members issue; on a tie (always possible in a two-member group), the one the
/// route requires; then the lowest rank's. Every member issuing something else is
/// blamed.
fn intended_call(plan: &Plan, members: &[(u32, Calls)], k: usize) -> (Option<Call>, &'static str) {
    // (call, how many members issue it, whether it is the one the route requires)
    let mut votes: Vec<(Option<Call>, usize, bool)> = Vec::new();
    for (r, seq) in members {
        let v = call_at(seq, k);
        let required = seq.get(k).is_some_and(|(n, _, c)| {
            plan.expected_collective(*r, &plan.rank(*r).nodes[*n as usize])
                .as_ref()
                == Some(c)
        });
        match votes.iter_mut().find(|x| x.0 == v) {
            Some(x) => {
                x.1 += 1;
                x.2 |= required;
            }
            None => votes.push((v, 1, required)),
        }
    }
    let top = votes.iter().map(|x| x.1).max().unwrap_or(0);
    let intended = votes
        .iter()
        .filter(|x| x.1 == top)
        .find(|x| x.2)
        .or_else(|| votes.iter().find(|x| x.1 == top))
        .map(|x| x.0)
        .unwrap_or(None);
    let who = if top * 2 > members.len() {
        "the majority"
    } else {
        "the call its route requires"
    };
    (intended, who)
}

fn no_deadlock(plan: &Plan, out: &mut Vec<Violation>) {
    let mut lanes = lanes(plan);
    run_lanes(plan, &mut lanes);
    let Some(l) = lanes.iter().find(|l| l.ip < l.instrs.len()) else {
        return;
    };
    let (ins, _) = l.instrs[l.ip];
    let node = match ins {
        Instr::Run(n) => Some(&plan.rank(l.rank).nodes[n as usize]),
        _ => None,
    };
    let what = match (ins, node) {
        (Instr::Wait(e), _) => format!("waits on event {e}, whose record never executes"),
        (_, Some(n)) => format!(
            "{} never completes: not every member of its communicator reaches it",
            plan.label(n)
        ),
        _ => "is blocked".into(),
    };
    out.push(Violation {
        invariant: "no-deadlock",
        rank: l.rank,
        stream: Some(l.stream),
        node: node.map(|n| n.id),
        detail: format!(
            "executing all ranks together, stream {} of rank {} {what}",
            l.stream, l.rank
        ),
    });
}

/// One stream of one rank in [`no_deadlock`]'s execution: its instructions in issue
/// order, each wait bound to the record instance issued before it.
struct Lane {
    rank: u32,
    stream: Stream,
    instrs: Vec<(Instr, u32)>, // (instruction, record instance for waits)
    ip: usize,
}

/// Every rank's streams as lanes: the issue order binds each wait to the record
/// issued before it.
fn lanes(plan: &Plan) -> Vec<Lane> {
    let mut lanes: Vec<Lane> = Vec::new();
    for rp in &plan.ranks {
        let mut issued: HashMap<EventId, u32> = HashMap::new();
        let mut per: HashMap<Stream, Vec<(Instr, u32)>> = HashMap::new();
        for (s, ins) in issue_order(rp) {
            let inst = match ins {
                Instr::Record(e) => {
                    let c = issued.entry(e).or_insert(0);
                    *c += 1;
                    *c
                }
                Instr::Wait(e) => issued.get(&e).copied().unwrap_or(0),
                Instr::Run(_) => 0,
            };
            per.entry(s).or_default().push((ins, inst));
        }
        for sp in &rp.streams {
            lanes.push(Lane {
                rank: rp.rank,
                stream: sp.stream,
                instrs: per.remove(&sp.stream).unwrap_or_default(),
                ip: 0,
            });
        }
    }
    lanes
}

/// Executes all lanes together as far as they go: a record fires its event, a wait
/// goes on once its record instance has fired, and a collective once every member of
/// its communicator has reached the same call. A lane that cannot go on stops at the
/// instruction it is blocked on (`ip`).
fn run_lanes(plan: &Plan, lanes: &mut [Lane]) {
    let mut fired: HashMap<(u32, EventId), u32> = HashMap::new();
    let mut event_waiters: HashMap<(u32, EventId), Vec<usize>> = HashMap::new();
    // Collective arrivals per (communicator, call index).
    let mut passed: HashMap<(usize, Group), u32> = HashMap::new();
    let mut arrivals: HashMap<(Comm, u32), Vec<usize>> = HashMap::new();
    let mut ready: Vec<usize> = (0..lanes.len()).collect();
    while let Some(li) = ready.pop() {
        loop {
            let lane = &lanes[li];
            let Some(&(ins, inst)) = lane.instrs.get(lane.ip) else {
                break;
            };
            let rank = lane.rank;
            match ins {
                Instr::Record(e) => {
                    *fired.entry((rank, e)).or_insert(0) += 1;
                    if let Some(ws) = event_waiters.remove(&(rank, e)) {
                        ready.extend(ws);
                    }
                    lanes[li].ip += 1;
                }
                Instr::Wait(e) => {
                    if fired.get(&(rank, e)).copied().unwrap_or(0) >= inst {
                        lanes[li].ip += 1;
                    } else {
                        event_waiters.entry((rank, e)).or_default().push(li);
                        break;
                    }
                }
                Instr::Run(id) => {
                    let node = &plan.rank(rank).nodes[id as usize];
                    let Some(c) = node.op.collective() else {
                        lanes[li].ip += 1;
                        continue;
                    };
                    let comm = (c.group, node.stream);
                    let call = passed.get(&(li, c.group)).copied().unwrap_or(0);
                    let arrived = arrivals.entry((comm, call)).or_default();
                    if !arrived.contains(&li) {
                        arrived.push(li);
                    }
                    if arrived.len() as u32 != plan.mesh.group_size(c.group) {
                        break;
                    }
                    let all = arrivals.remove(&(comm, call)).unwrap_or_default();
                    for l in all {
                        lanes[l].ip += 1;
                        *passed.entry((l, c.group)).or_insert(0) += 1;
                        if l != li {
                            ready.push(l);
                        }
                    }
                }
            }
        }
    }
}
