//! What every buffer holds, followed across ranks: `contributions-exactly-once`,
//! `gradient-accounting` and `publish-coverage`.
//!
//! The walk executes every rank's nodes in serial order, all ranks together: a local
//! node moves values between the rank's buffers, and a collective runs when every member
//! of its communicator has reached it, combining what each member's input holds at that
//! point. A value is a set of `(micro-batch, source rank)` contributions ([`Contribs`])
//! with the reduction level it has reached, and a buffer whose contributions were handed
//! on (a gradient packed, a partial folded into Stage 2, a Stage-1 output folded or
//! reduced, a reduced gradient consumed by an optimizer) is marked consumed until
//! something writes it afresh. The walk proves:
//!
//! - `contributions-exactly-once`: no node reads contributions that were already handed
//!   on (a duplicated pack, fold, fold_partial or accumulate; a pack re-reading a no_sync
//!   accumulation an earlier pack took), and no sum adds a contribution it already holds
//!   (on whichever rank the duplicate arises, including ranks that do not receive the
//!   collective's result);
//! - `gradient-accounting`: every collective reduces values of the level its stage
//!   expects, no initialising write drops a live value, and (in `Step` mode) every
//!   optimizer consumes exactly the no_sync reference, fully reduced;
//! - `publish-coverage` (`Step` mode): every replica of an owned parameter receives its
//!   owner's update exactly once, after the owner's optimizer ran.
//!
//! Each rank issues its collectives in serial order. Ranks whose serial orders meet
//! communicators in different orders cannot run this walk to its end; that is reported
//! as `no-deadlock`, since a host issuing in serial order can hang there too.

use std::collections::HashMap;

use super::contrib::Contribs;
use super::{violation, Mode};
use crate::mesh::Group;
use crate::node::{BucketId, Buffer, Collective, Node, NodeId, Op, Stream};
use crate::param::ParamId;
use crate::plan::Plan;
use crate::Violation;

/// At most this many accounting violations per rank.
const MAX_PER_RANK: usize = 8;

const EXACTLY_ONCE: &str = "contributions-exactly-once";
const ACCOUNTING: &str = "gradient-accounting";
const PUBLISH: &str = "publish-coverage";

/// How far a gradient has been reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Local,
    Shard,
    Full,
}

impl Level {
    fn describe(self) -> &'static str {
        match self {
            Level::Local => "unreduced",
            Level::Shard => "reduced over the shard group only",
            Level::Full => "fully reduced",
        }
    }

    /// The levels a stage reduces from and to.
    fn of_stage(stage: u8) -> (Level, Level) {
        if stage == 1 {
            (Level::Local, Level::Shard)
        } else {
            (Level::Shard, Level::Full)
        }
    }
}

/// What a gradient buffer holds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Value {
    level: Level,
    set: Contribs,
    /// Contributions the set holds more than once.
    twice: Contribs,
}

impl Value {
    fn describe(&self) -> String {
        format!(
            "{} {}",
            self.set.describe(&self.twice),
            self.level.describe()
        )
    }

    /// `a + b`: levels must agree; the result's `twice` gains what both hold.
    fn sum(a: &Value, b: &Value) -> Result<(Value, Contribs), String> {
        if a.level != b.level {
            return Err(format!("adds {} to {}", b.describe(), a.describe()));
        }
        let overlap = a.set.intersection(&b.set);
        Ok((
            Value {
                level: a.level,
                set: a.set.union(&b.set),
                twice: a.twice.union(&b.twice).union(&overlap),
            },
            overlap,
        ))
    }
}

/// A buffer's value, and the node that handed its contributions on, if one did.
#[derive(Debug, Clone)]
struct Slot {
    value: Value,
    consumed_by: Option<NodeId>,
}

/// Whether a rank's copy of an owned parameter carries this step's update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    /// The values the step started with.
    Start,
    /// Updated by the owner's optimizer (node id on the owner).
    Updated,
}

/// What a sum adds into, for its message.
#[derive(Clone, Copy)]
enum SumInto {
    Buffer(Buffer),
    Text(&'static str),
}

/// One rank's state in the walk.
struct RankWalk {
    rank: u32,
    next: usize,
    vals: HashMap<Buffer, Slot>,
    reported: usize,
    /// Owned parameters' versions on this rank (absent: `Version::Start`).
    versions: HashMap<ParamId, Version>,
    /// Publishes of each parameter this rank received as a non-root member.
    received: HashMap<ParamId, (u32, NodeId)>,
}

struct Walk<'p> {
    plan: &'p Plan,
    mode: Mode,
    world: u32,
    ranks: Vec<RankWalk>,
    out: Vec<Violation>,
}

impl<'p> Walk<'p> {
    fn node(&self, rank: u32, id: NodeId) -> &'p Node {
        &self.plan.rank(rank).nodes[id as usize]
    }

    fn report(&mut self, invariant: &'static str, rank: u32, id: NodeId, detail: String) {
        let w = &mut self.ranks[rank as usize];
        if w.reported >= MAX_PER_RANK {
            return;
        }
        w.reported += 1;
        let n = self.node(rank, id);
        let label = self.plan.label(n);
        self.out.push(violation(
            invariant,
            rank,
            Some(n),
            format!("{label} {detail}"),
        ));
    }

    /// Describes a buffer for messages: `the partial of bucket 3 (embed)`.
    fn what(&self, b: &Buffer) -> String {
        let plan = self.plan;
        match *b {
            Buffer::Partial { bucket } => {
                format!("{b} ({})", plan.bucket_param_names(bucket))
            }
            Buffer::Accum { param } => format!(
                "the no_sync accumulation of `{}`",
                plan.param(param).spec.name
            ),
            Buffer::Reduced { param } => {
                format!("the reduced gradient of `{}`", plan.param(param).spec.name)
            }
            Buffer::Grad { param, .. } => {
                format!("{b} (the gradient of `{}`)", plan.param(param).spec.name)
            }
            _ => b.to_string(),
        }
    }

    /// Reads a buffer; a read of contributions already handed on is a violation. With
    /// `consume`, this read hands them on.
    fn read(&mut self, rank: u32, id: NodeId, b: Buffer, consume: bool) -> Option<Value> {
        let slot = self.ranks[rank as usize].vals.get(&b)?.clone();
        if let Some(by) = slot.consumed_by {
            let by = self.plan.label(self.node(rank, by));
            let what = self.what(&b);
            self.report(
                EXACTLY_ONCE,
                rank,
                id,
                format!(
                    "reads {what}, whose contributions {} {by} already handed on: they would be counted again",
                    slot.value.set.describe(&slot.value.twice)
                ),
            );
        }
        if consume {
            if let Some(s) = self.ranks[rank as usize].vals.get_mut(&b) {
                s.consumed_by = Some(id);
            }
        }
        Some(slot.value)
    }

    /// The live (not yet handed on) value of a buffer, if any.
    fn live(&self, rank: u32, b: &Buffer) -> Option<&Value> {
        self.ranks[rank as usize]
            .vals
            .get(b)
            .filter(|s| s.consumed_by.is_none() && !s.value.set.is_empty())
            .map(|s| &s.value)
    }

    fn write(&mut self, rank: u32, b: Buffer, value: Value) {
        self.ranks[rank as usize].vals.insert(
            b,
            Slot {
                value,
                consumed_by: None,
            },
        );
    }

    /// `acc + v`, reporting a level mismatch or a contribution counted twice (`into`
    /// names the sum in that message; it is only described when there is one).
    fn sum(&mut self, rank: u32, id: NodeId, acc: &Value, v: &Value, into: SumInto) -> Value {
        match Value::sum(acc, v) {
            Ok((sum, overlap)) => {
                if !overlap.is_empty() {
                    let into = match into {
                        SumInto::Buffer(b) => self.what(&b),
                        SumInto::Text(t) => t.to_string(),
                    };
                    self.report(
                        EXACTLY_ONCE,
                        rank,
                        id,
                        format!(
                            "adds {} to {into}, which already holds them: they would be counted twice",
                            overlap.describe(&Contribs::empty(self.world))
                        ),
                    );
                }
                sum
            }
            Err(e) => {
                self.report(ACCOUNTING, rank, id, e);
                v.clone()
            }
        }
    }

    /// `dst (+)= v`: adding reads `dst`; initialising must not drop a live value.
    fn store(&mut self, rank: u32, id: NodeId, dst: Buffer, v: Value, accumulate: bool) {
        let next = if accumulate {
            match self.read(rank, id, dst, false) {
                Some(old) => self.sum(rank, id, &old, &v, SumInto::Buffer(dst)),
                None => v,
            }
        } else {
            if let Some(old) = self.live(rank, &dst) {
                let what = self.what(&dst);
                let detail = format!(
                    "overwrites the live {} {} instead of adding to it",
                    what.trim_start_matches("the "),
                    old.describe()
                );
                self.report(ACCOUNTING, rank, id, detail);
            }
            v
        };
        self.write(rank, dst, next);
    }

    /// Runs a local node of `rank`: moves values between the rank's buffers.
    fn local(&mut self, rank: u32, n: &'p Node) {
        let plan = self.plan;
        let id = n.id;
        match n.op {
            Op::GradReady { layer } => self.grad_ready(rank, n.micro_batch.unwrap_or(0), layer),
            Op::Accumulate {
                bucket,
                micro_batch,
                accumulate,
            } => self.accumulate(rank, id, bucket, micro_batch, accumulate),
            Op::Pack {
                bucket,
                micro_batch,
                with_accum,
            } => self.pack(rank, id, bucket, micro_batch, with_accum),
            Op::Fold {
                bucket,
                micro_batch,
                accumulate,
            } => self.fold(rank, id, bucket, micro_batch, accumulate),
            Op::FoldPartial {
                bucket,
                micro_batch,
            } => self.fold_partial(rank, id, bucket, micro_batch),
            Op::Combine {
                bucket,
                micro_batch,
                stage,
                ..
            } => self.combine(rank, id, bucket, micro_batch, stage),
            Op::Unpack {
                bucket,
                micro_batch,
                accumulate,
            } => self.unpack(rank, id, bucket, micro_batch, accumulate),
            Op::Optimizer { param, .. } => self.optimizer(rank, id, param),
            // The norm and the clip read the reduced gradients without handing them on;
            // a clip scales them without changing whose contributions they hold.
            Op::GradNorm | Op::Clip => {
                let params = if n.op == Op::GradNorm {
                    plan.norm_params(rank)
                } else {
                    plan.held_params(rank)
                };
                for param in params {
                    self.read(rank, id, Buffer::Reduced { param }, false);
                }
            }
            // The forward's gathers move parameters, not gradients (`validate/forward.rs`
            // checks them).
            Op::Forward { .. } | Op::Backward { .. } | Op::Reshard { .. } => {}
            // Collectives are run by `collective` when every member reached them.
            Op::NormReduce { .. }
            | Op::Unshard { .. }
            | Op::Stage1 { .. }
            | Op::Stage2 { .. }
            | Op::Exchange { .. }
            | Op::Gather { .. }
            | Op::Publish { .. } => {}
        }
    }

    /// `grad_ready`: each parameter of `layer` gets this rank's gradient of micro-batch
    /// `mb`, unreduced.
    fn grad_ready(&mut self, rank: u32, mb: u32, layer: u32) {
        for (i, _) in self
            .plan
            .params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.spec.layer == layer)
        {
            let grad = Buffer::Grad {
                param: i as ParamId,
                micro_batch: mb,
            };
            let value = Value {
                level: Level::Local,
                set: Contribs::one(self.world, mb, rank),
                twice: Contribs::empty(self.world),
            };
            self.write(rank, grad, value);
        }
    }

    /// `accumulate` (no_sync): hands each gradient of the bucket on to (or into) its
    /// no_sync accumulation.
    fn accumulate(
        &mut self,
        rank: u32,
        id: NodeId,
        bucket: BucketId,
        micro_batch: u32,
        accumulate: bool,
    ) {
        for &p in &self.plan.bucket(bucket).params {
            let grad = Buffer::Grad {
                param: p,
                micro_batch,
            };
            if let Some(g) = self.read(rank, id, grad, true) {
                self.store(rank, id, Buffer::Accum { param: p }, g, accumulate);
            }
        }
    }

    /// `pack`: the send buffer gets the bucket's gradients (plus, `with_accum`, their
    /// no_sync accumulations), which must all carry the same contributions.
    fn pack(
        &mut self,
        rank: u32,
        id: NodeId,
        bucket: BucketId,
        micro_batch: u32,
        with_accum: bool,
    ) {
        let mut packed: Option<Value> = None;
        for &p in &self.plan.bucket(bucket).params {
            let Some(t) = self.packed_gradient(rank, id, p, micro_batch, with_accum) else {
                continue;
            };
            match &packed {
                Some(b) if *b != t => {
                    let detail = format!(
                        "packs parameters carrying different gradients ({} and {})",
                        b.describe(),
                        t.describe()
                    );
                    self.report(ACCOUNTING, rank, id, detail);
                }
                Some(_) => {}
                None => packed = Some(t),
            }
        }
        if let Some(t) = packed {
            let send = Buffer::Send {
                bucket,
                micro_batch,
            };
            self.write(rank, send, t);
        }
    }

    /// What a pack takes of one parameter: its gradient, plus (`with_accum`) its no_sync
    /// accumulation; without, a live accumulation left behind is a violation.
    fn packed_gradient(
        &mut self,
        rank: u32,
        id: NodeId,
        p: ParamId,
        micro_batch: u32,
        with_accum: bool,
    ) -> Option<Value> {
        let grad = Buffer::Grad {
            param: p,
            micro_batch,
        };
        let g = self.read(rank, id, grad, true)?;
        let accum = Buffer::Accum { param: p };
        if with_accum {
            return Some(match self.read(rank, id, accum, true) {
                Some(a) => self.sum(rank, id, &a, &g, SumInto::Buffer(accum)),
                None => g,
            });
        }
        if let Some(a) = self.live(rank, &accum) {
            let detail = format!(
                "leaves the no_sync accumulation {} of `{}` behind",
                a.describe(),
                self.plan.param(p).spec.name
            );
            self.report(ACCOUNTING, rank, id, detail);
        }
        Some(g)
    }

    /// `fold` (replicate gate off): hands Stage 1's output on to (or into) the partial.
    fn fold(
        &mut self,
        rank: u32,
        id: NodeId,
        bucket: BucketId,
        micro_batch: u32,
        accumulate: bool,
    ) {
        let s1 = Buffer::Stage1Out {
            bucket,
            micro_batch,
        };
        if let Some(v) = self.read(rank, id, s1, true) {
            self.store(rank, id, Buffer::Partial { bucket }, v, accumulate);
        }
    }

    /// `fold_partial`: hands the partial on into Stage 1's output, before Stage 2.
    fn fold_partial(&mut self, rank: u32, id: NodeId, bucket: BucketId, micro_batch: u32) {
        let partial = Buffer::Partial { bucket };
        if let Some(p) = self.read(rank, id, partial, true) {
            let s1 = Buffer::Stage1Out {
                bucket,
                micro_batch,
            };
            self.store(rank, id, s1, p, true);
        }
    }

    /// `combine` (copy transport): the stage's output is the sum of the rank's own input
    /// and the chunks its exchange received, both of the level the stage reduces from.
    fn combine(&mut self, rank: u32, id: NodeId, bucket: BucketId, micro_batch: u32, stage: u8) {
        let (src, holds) = self.plan.stage_input(bucket, micro_batch, stage, rank);
        if !holds {
            return; // `exchange-combined-once` reports it.
        }
        let (from, to) = Level::of_stage(stage);
        let recv = Buffer::Recv {
            bucket,
            micro_batch,
            stage,
        };
        let own = self.read(rank, id, src, true);
        let others = self.read(rank, id, recv, true);
        let mut sum: Option<Value> = None;
        for v in [own, others].into_iter().flatten() {
            if v.level != from {
                let detail = format!("reduces {}, which is not {}", v.describe(), from.describe());
                self.report(ACCOUNTING, rank, id, detail);
            }
            sum = Some(match sum {
                Some(acc) => self.sum(rank, id, &acc, &v, SumInto::Text("the chunks it combines")),
                None => v,
            });
        }
        if let Some(v) = sum {
            let out = Plan::stage_output(bucket, micro_batch, stage);
            self.write(rank, out, Value { level: to, ..v });
        }
    }

    /// `unpack`: hands Stage 2's output on to (or into) each parameter's reduced gradient.
    fn unpack(
        &mut self,
        rank: u32,
        id: NodeId,
        bucket: BucketId,
        micro_batch: u32,
        accumulate: bool,
    ) {
        let s2 = Buffer::Stage2Out {
            bucket,
            micro_batch,
        };
        if let Some(v) = self.read(rank, id, s2, true) {
            for &p in &self.plan.bucket(bucket).params {
                let reduced = Buffer::Reduced { param: p };
                self.store(rank, id, reduced, v.clone(), accumulate);
            }
        }
    }

    /// `optimizer`: consumes the reduced gradient (in `Step` mode it must be the no_sync
    /// reference) and, for an owned parameter, marks the rank's copy updated.
    fn optimizer(&mut self, rank: u32, id: NodeId, param: ParamId) {
        let reduced = Buffer::Reduced { param };
        let got = self.read(rank, id, reduced, true);
        if self.plan.param(param).owner.is_some() {
            self.ranks[rank as usize]
                .versions
                .insert(param, Version::Updated);
        }
        if self.mode == Mode::Step {
            self.check_consumed(rank, id, param, got);
        }
    }

    /// An optimizer must consume the no_sync reference: every rank's gradient of every
    /// micro-batch, once, fully reduced.
    fn check_consumed(&mut self, rank: u32, id: NodeId, param: ParamId, got: Option<Value>) {
        let name = &self.plan.param(param).spec.name;
        let want = Value {
            level: Level::Full,
            set: Contribs::reference(self.world, self.plan.micro_batches()),
            twice: Contribs::empty(self.world),
        };
        let detail = match got {
            Some(v) if v == want => return,
            Some(v) => {
                let missing = want.set.minus(&v.set);
                let missing = if missing.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; it misses {}",
                        missing.describe(&Contribs::empty(self.world))
                    )
                };
                format!(
                    "consumes {} for `{name}`; it must hold every micro-batch of the step once, fully reduced ({}){missing}",
                    v.describe(),
                    want.describe()
                )
            }
            None => format!("consumes no reduced gradient for `{name}`"),
        };
        self.report(ACCOUNTING, rank, id, detail);
    }

    /// Runs a collective every member has reached: `members` are (rank, node) pairs.
    fn collective(&mut self, members: &[(u32, NodeId)]) {
        let (r0, n0) = members[0];
        match self.node(r0, n0).op {
            Op::Stage1 {
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
                ..
            } => self.reduction(members, bucket, micro_batch),
            Op::Publish { param, collective } => self.publish(members, param, &collective),
            // A gather completes the replicas of an all-reduce's output, whose value the
            // combine already holds (`exchange-combined-once` proves every chunk moves).
            _ => {}
        }
    }

    /// A stage's collective, or its exchange, over `members`: each member's input is
    /// read (and checked to be of the stage's level), and every member that receives
    /// the result gets the sum of what the members sent (an exchange's receive buffer
    /// holds the others' only: its own chunk stays home for the combine).
    fn reduction(&mut self, members: &[(u32, NodeId)], bucket: BucketId, micro_batch: u32) {
        let plan = self.plan;
        let (r0, n0) = members[0];
        let first = self.node(r0, n0);
        let stage = first.op.stage().unwrap_or(1);
        let exchange = matches!(first.op, Op::Exchange { .. });
        let (from, to) = Level::of_stage(stage);
        let inputs = self.stage_inputs(members, (bucket, micro_batch, stage), exchange, from);
        for &(r, id) in members {
            let (_, holds) = plan.stage_input(bucket, micro_batch, stage, r);
            if !holds {
                continue;
            }
            let sent = inputs.iter().filter(|(q, _)| !(exchange && *q == r));
            let Some(v) = self.sum_sent(r, id, sent, from) else {
                continue;
            };
            if exchange {
                let recv = Buffer::Recv {
                    bucket,
                    micro_batch,
                    stage,
                };
                self.write(r, recv, v);
            } else {
                let out = Plan::stage_output(bucket, micro_batch, stage);
                self.write(r, out, Value { level: to, ..v });
            }
        }
    }

    /// Each member's input at its call to a stage (`(bucket, micro_batch, stage)`),
    /// reported where it is not of level `from` or where Stage 2 runs while the bucket's
    /// partial is unfolded. An exchange only sends: its combine hands the input on.
    fn stage_inputs(
        &mut self,
        members: &[(u32, NodeId)],
        (bucket, micro_batch, stage): (BucketId, u32, u8),
        exchange: bool,
        from: Level,
    ) -> Vec<(u32, Option<Value>)> {
        let mut inputs = Vec::with_capacity(members.len());
        for &(r, id) in members {
            if stage == 2 {
                if let Some(p) = self.live(r, &Buffer::Partial { bucket }) {
                    let detail = format!(
                        "runs Stage 2 while the partial {} is still unfolded",
                        p.describe()
                    );
                    self.report(ACCOUNTING, r, id, detail);
                }
            }
            let (src, _) = self.plan.stage_input(bucket, micro_batch, stage, r);
            let v = self.read(r, id, src, !exchange);
            if let Some(v) = &v {
                if v.level != from {
                    let detail =
                        format!("reduces {}, which is not {}", v.describe(), from.describe());
                    self.report(ACCOUNTING, r, id, detail);
                }
            }
            inputs.push((r, v));
        }
        inputs
    }

    /// The sum, at level `from`, of what the members `sent` to rank `r` (node `id`),
    /// reporting contributions counted twice; `None` when nothing was sent.
    fn sum_sent<'v>(
        &mut self,
        r: u32,
        id: NodeId,
        sent: impl Iterator<Item = &'v (u32, Option<Value>)>,
        from: Level,
    ) -> Option<Value> {
        let mut sum: Option<Value> = None;
        for (_, v) in sent {
            let Some(v) = v else { continue };
            let v = Value {
                level: from,
                ..v.clone()
            };
            sum = Some(match sum {
                Some(acc) => self.sum(
                    r,
                    id,
                    &acc,
                    &v,
                    SumInto::Text("what the other members sent"),
                ),
                None => v,
            });
        }
        sum
    }

    /// A publish over `members`: the owner's (the root's) copy of `param`, which its
    /// optimizer must have updated, reaches every other member once.
    fn publish(&mut self, members: &[(u32, NodeId)], param: ParamId, collective: &Collective) {
        let plan = self.plan;
        let root = collective.root.unwrap_or(0);
        let Some(&(root_rank, root_node)) = members
            .iter()
            .find(|(r, _)| plan.mesh.index_in(collective.group, *r) == Some(root))
        else {
            return;
        };
        if plan.param(param).owner.is_none() {
            let detail = format!(
                "publishes `{}`, whose route {} has no owner: every rank updates its own shard",
                plan.param(param).spec.name,
                plan.param(param).spec.route
            );
            self.report(PUBLISH, root_rank, root_node, detail);
            return;
        }
        let version = self.version(root_rank, param);
        if version != Version::Updated {
            let detail = format!(
                "broadcasts `{}` before any optimizer updated it on rank {root_rank}: the replicas would keep the step's old values",
                plan.param(param).spec.name
            );
            self.report(PUBLISH, root_rank, root_node, detail);
        }
        for &(r, id) in members {
            if r == root_rank {
                continue;
            }
            let w = &mut self.ranks[r as usize];
            w.versions.insert(param, version);
            let e = w.received.entry(param).or_insert((0, id));
            e.0 += 1;
            e.1 = id;
        }
    }

    fn version(&self, rank: u32, param: ParamId) -> Version {
        self.ranks[rank as usize]
            .versions
            .get(&param)
            .copied()
            .unwrap_or(Version::Start)
    }

    /// `publish-coverage` at the end of the step: every replica of an owned parameter
    /// holds its owner's update, received once.
    fn publish_coverage(&mut self) {
        let plan = self.plan;
        for (i, p) in plan.params.iter().enumerate() {
            let Some(o) = p.owner else { continue };
            let param = i as ParamId;
            let owner = plan.mesh.rank(o);
            for r in plan.mesh.ranks() {
                if r == owner || plan.mesh.coord(r).shard != o.shard {
                    continue;
                }
                let (count, last) = self.ranks[r as usize]
                    .received
                    .get(&param)
                    .copied()
                    .unwrap_or((0, 0));
                let name = &p.spec.name;
                if count == 0 {
                    if self.ranks[r as usize].reported < MAX_PER_RANK {
                        self.ranks[r as usize].reported += 1;
                        self.out.push(violation(
                            PUBLISH,
                            r,
                            None,
                            format!(
                                "rank {r} holds `{name}` but no publish from its owner (rank {owner}) reaches it in this step: it would keep the old values"
                            ),
                        ));
                    }
                } else if count > 1 {
                    let detail = format!("is the {count}th publish of `{name}` rank {r} receives in this step; each replica receives the owner's update once");
                    self.report(PUBLISH, r, last, detail);
                } else if self.version(r, param) != Version::Updated {
                    let detail = format!(
                        "leaves rank {r} with a `{name}` its owner (rank {owner}) had not updated yet"
                    );
                    self.report(PUBLISH, r, last, detail);
                }
            }
        }
    }
}

/// Runs the walk; returns its violations (and a `no-deadlock` one when the ranks'
/// serial orders cannot be executed together).
pub(super) fn accounting(plan: &Plan, mode: Mode) -> Vec<Violation> {
    let mut walk = Walk::new(plan, mode);
    walk.run();
    if walk.report_deadlock() {
        return walk.out;
    }
    if mode == Mode::Step {
        walk.publish_coverage();
    }
    walk.out
}

impl<'p> Walk<'p> {
    /// Every rank at its first node, holding nothing.
    fn new(plan: &'p Plan, mode: Mode) -> Walk<'p> {
        Walk {
            plan,
            mode,
            world: plan.mesh.world(),
            ranks: plan
                .ranks
                .iter()
                .map(|rp| RankWalk {
                    rank: rp.rank,
                    next: 0,
                    vals: HashMap::new(),
                    reported: 0,
                    versions: HashMap::new(),
                    received: HashMap::new(),
                })
                .collect(),
            out: Vec::new(),
        }
    }

    /// Executes every rank's nodes in serial order, as far as they go: a rank runs its
    /// local nodes and stops at a collective until every member of its communicator has
    /// reached the same call, which then runs and lets them all go on.
    fn run(&mut self) {
        let plan = self.plan;
        // Calls each rank completed per communicator, and who waits at each call.
        let mut calls: HashMap<(u32, Group, Stream), u32> = HashMap::new();
        let mut waiting: HashMap<(Group, Stream, u32), Vec<(u32, NodeId)>> = HashMap::new();
        let mut ready: Vec<u32> = (0..self.world).rev().collect();
        while let Some(g) = ready.pop() {
            loop {
                let nodes = &plan.rank(g).nodes;
                let Some(n) = nodes.get(self.ranks[g as usize].next) else {
                    break;
                };
                let Some(c) = n.op.collective() else {
                    self.local(g, n);
                    self.ranks[g as usize].next += 1;
                    continue;
                };
                let k = calls.get(&(g, c.group, n.stream)).copied().unwrap_or(0);
                let key = (c.group, n.stream, k);
                let at = waiting.entry(key).or_default();
                if !at.iter().any(|(r, _)| *r == g) {
                    at.push((g, n.id));
                }
                if at.len() < plan.mesh.group_size(c.group) as usize {
                    break;
                }
                let mut members = waiting.remove(&key).unwrap_or_default();
                members.sort_unstable();
                self.collective(&members);
                for (r, _) in members {
                    self.ranks[r as usize].next += 1;
                    *calls.entry((r, c.group, n.stream)).or_insert(0) += 1;
                    if r != g {
                        ready.push(r);
                    }
                }
            }
        }
    }

    /// After [`Walk::run`]: reports `no-deadlock` when some rank could not reach its
    /// end, naming where each such rank stopped; whether it did.
    fn report_deadlock(&mut self) -> bool {
        let plan = self.plan;
        let stuck: Vec<u32> = self
            .ranks
            .iter()
            .filter(|w| w.next < plan.rank(w.rank).nodes.len())
            .map(|w| w.rank)
            .collect();
        let Some(&r) = stuck.first() else {
            return false;
        };
        let n = &plan.rank(r).nodes[self.ranks[r as usize].next];
        let blocked: Vec<String> = stuck
            .iter()
            .map(|&q| {
                let m = &plan.rank(q).nodes[self.ranks[q as usize].next];
                format!("rank {q} at {}", plan.label(m))
            })
            .collect();
        self.out.push(violation(
            "no-deadlock",
            r,
            Some(n),
            format!(
                "issuing every rank's nodes in serial order, no rank can go on ({}): the ranks meet their communicators in different orders, and a host that issues in serial order would hang",
                blocked.join(", ")
            ),
        ));
        true
    }
}
