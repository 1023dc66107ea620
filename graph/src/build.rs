//! From a [`PlanSpec`] and a gate pattern to a lowered [`Plan`].
//!
//! [`Planner::new`] does the per-model work once (owners, buckets); [`Planner::plan`]
//! builds each rank's nodes in serial order for one gate pattern and lowers them to
//! stream programs. Node order within a micro-batch follows backward: layers from the
//! highest down, and within a layer each bucket's chain (pack, Stage 1, fold or Stage 2
//! and unpack). The step's optimizer and publish nodes come last. A forward plan
//! ([`PlanSpec::forward`]) starts each micro-batch with the forward (layers ascending,
//! each layer's gathers `prefetch` layers ahead of its `forward` point) and puts each
//! layer's backward gathers and `backward` point before its `grad_ready`.

use crate::dag::{lower_rank, Segment};
use crate::gate::Gate;
use crate::mesh::{Coord, Mesh};
use crate::node::{BucketId, CollectiveKind, Node, NodeId, Op, Pass, Stream};
use crate::param::{ParamId, Route};
use crate::plan::{
    Bucket, PlacedParam, Plan, PlanSpec, RankProgram, Transport, PLAN_FORMAT, PLAN_VERSION,
};
use crate::{owner, PlanError};

/// The model-level half of planning, done once and reused for every gate pattern.
#[derive(Debug, Clone)]
pub struct Planner {
    spec: PlanSpec,
    params: Vec<PlacedParam>,
    buckets: Vec<Bucket>,
}

impl Planner {
    /// Checks the spec, assigns owners and packs buckets.
    pub fn new(spec: PlanSpec) -> Result<Planner, PlanError> {
        // The mesh, every parameter, their number and the bucket cap, before anything
        // is allocated from them.
        spec.check()?;
        let owners = owner::assign_owners(spec.mesh, &spec.params, spec.update_rates);
        let params: Vec<PlacedParam> = spec
            .params
            .iter()
            .zip(owners)
            .map(|(p, owner)| PlacedParam {
                spec: p.clone(),
                owner,
            })
            .collect();
        let buckets = make_buckets(
            &params,
            spec.mesh,
            spec.reduce.dtype.size(),
            spec.bucket_cap_bytes,
        );
        Ok(Planner {
            spec,
            params,
            buckets,
        })
    }

    /// The planner's input.
    pub fn spec(&self) -> &PlanSpec {
        &self.spec
    }

    /// Parameters with their owners.
    pub fn params(&self) -> &[PlacedParam] {
        &self.params
    }

    /// The buckets, in issue order (highest layer first).
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Builds and lowers the plan of one step with the given gate of each micro-batch.
    pub fn plan(&self, gates: &[Gate]) -> Result<Plan, PlanError> {
        self.build(gates, true)
    }

    /// The plan of the micro-batches issued so far, without the step's optimizer and
    /// publish tail: its programs are a prefix of those of every step that starts with
    /// these gates. Validate it with [`crate::Mode::Prefix`].
    pub fn plan_prefix(&self, gates: &[Gate]) -> Result<Plan, PlanError> {
        self.build(gates, false)
    }

    /// Plans `gates` (a whole step with [`crate::Mode::Step`], the micro-batches issued
    /// so far with [`crate::Mode::Prefix`]) and validates the plan in that mode: the one
    /// path from gates to a plan an executor may run.
    pub fn plan_checked(
        &self,
        gates: &[Gate],
        mode: crate::Mode,
    ) -> Result<crate::Validated, crate::Rejected> {
        let plan = match mode {
            crate::Mode::Step => self.plan(gates)?,
            crate::Mode::Prefix => self.plan_prefix(gates)?,
        };
        crate::Validated::check(plan, mode).map_err(crate::Rejected::Invalid)
    }

    fn build(&self, gates: &[Gate], tail: bool) -> Result<Plan, PlanError> {
        if gates.is_empty() {
            return Err(PlanError::Input {
                key: "accumulation.micro_batches".into(),
                reason: "a step needs at least one micro-batch".into(),
            });
        }
        // A step too large to plan is refused before its nodes are allocated.
        self.check_step(gates.len())?;
        if gates.len() > u32::MAX as usize {
            return Err(PlanError::Input {
                key: "accumulation.micro_batches".into(),
                reason: "too many micro-batches".into(),
            });
        }
        let mut plan = Plan {
            format: PLAN_FORMAT.into(),
            version: PLAN_VERSION,
            mesh: self.spec.mesh,
            reduce: self.spec.reduce,
            gates: gates.to_vec(),
            params: self.params.clone(),
            buckets: self.buckets.clone(),
            ranks: Vec::new(),
            grad_norm: self.spec.grad_norm,
            forward: self.spec.forward,
        };
        let ranks: Vec<RankProgram> = self
            .spec
            .mesh
            .ranks()
            .map(|rank| {
                let (nodes, segments) = self.rank_nodes(&plan, rank, tail);
                let order = if self.spec.schedule.combine_after_exchanges {
                    combines_after_exchanges(&nodes, &segments)
                } else {
                    Vec::new()
                };
                lower_rank(&plan, rank, nodes, &segments, &order)
            })
            .collect();
        plan.ranks = ranks;
        Ok(plan)
    }

    /// A rank's nodes in serial order and their segments: one per micro-batch, then
    /// (with `tail`) the step's tail.
    fn rank_nodes(&self, plan: &Plan, rank: u32, tail: bool) -> (Vec<Node>, Vec<Segment>) {
        let mut nodes = SerialNodes::default();
        let mut segments = Vec::new();
        let mut buckets = BucketState::new(self.buckets.len());
        let layers = plan.layers_desc();
        for m in 0..plan.gates.len() as u32 {
            let start = nodes.0.len();
            self.micro_batch_nodes(plan, rank, m, &layers, &mut buckets, &mut nodes);
            segments.push(Segment {
                start,
                end: nodes.0.len(),
                tail: false,
            });
        }
        if tail {
            let start = nodes.0.len();
            self.tail_nodes(plan, rank, &mut nodes);
            segments.push(Segment {
                start,
                end: nodes.0.len(),
                tail: true,
            });
        }
        (nodes.0, segments)
    }

    /// Micro-batch `m`'s nodes: in a forward plan its forward pass first, then per layer
    /// (descending) the layer's backward and each of its buckets' chains, the lagging
    /// parts of the chains issued when they fall due.
    fn micro_batch_nodes(
        &self,
        plan: &Plan,
        rank: u32,
        m: u32,
        layers: &[u32],
        buckets: &mut BucketState,
        nodes: &mut SerialNodes,
    ) {
        let mb = Some(m);
        let gate = plan.gates[m as usize];
        let sched = self.spec.schedule;
        let mut lagging = Lagging::default();
        let last = layers.len().saturating_sub(1);
        if let Some(fw) = self.spec.forward {
            nodes.extend(mb, self.forward_pass(plan, rank, m, fw, layers));
        }
        for (li, &layer) in layers.iter().enumerate() {
            self.layer_backward(plan, rank, m, li, layers, nodes);
            if li == last && sched.early_tail_gathers {
                // The micro-batch's tail: a lagging chain that gathers (an
                // all-reduce) goes out before the last layer's exchanges, which wait
                // for its backward; behind them on the exchange stream, its gather
                // would move only after that backward, in the step's exposed tail.
                // So does every lagging chain when combines wait for the exchanges
                // before them: behind the last exchange, it would wait for it too.
                let early = lagging.take(|_, ops| {
                    sched.combine_after_exchanges
                        || ops.iter().any(|(_, op)| matches!(op, Op::Gather { .. }))
                });
                nodes.extend(mb, early);
            }
            for bucket in self.buckets.iter().filter(|x| x.layer == layer) {
                let mut chain = buckets.chain(self, plan, rank, bucket.id, m, gate);
                let split = chain
                    .iter()
                    .position(|(_, op)| matches!(op, Op::Combine { .. }))
                    .filter(|_| sched.combine_lag > 0)
                    .unwrap_or(chain.len());
                let later = chain.split_off(split);
                nodes.extend(mb, chain);
                lagging.hold(li + sched.combine_lag as usize, later);
            }
            nodes.extend(mb, lagging.take(|due, _| due <= li));
        }
        nodes.extend(mb, lagging.take(|_, _| true));
    }

    /// The backward of layer `layers[li]` in micro-batch `m`: in a forward plan the
    /// backward gathers due there (`prefetch` layers ahead) and the trainer's `backward`
    /// point, then `grad_ready`, then (forward plan) the frees of the layer's gathers.
    fn layer_backward(
        &self,
        plan: &Plan,
        rank: u32,
        m: u32,
        li: usize,
        layers: &[u32],
        nodes: &mut SerialNodes,
    ) {
        let (mb, layer) = (Some(m), layers[li]);
        if let Some(fw) = self.spec.forward {
            // The layer's backward gathers (`prefetch` layers ahead), then the
            // trainer's backward of the layer.
            if fw.reshard_after_forward {
                let k = fw.prefetch as usize;
                let due = if li == 0 { 0..=k } else { li + k..=li + k };
                for &l in due.filter_map(|i| layers.get(i)) {
                    nodes.extend(mb, self.unshards(plan, rank, l, m, Pass::Backward));
                }
            }
            nodes.push(mb, Stream::Compute, Op::Backward { layer });
        }
        nodes.push(mb, Stream::Compute, Op::GradReady { layer });
        if let Some(fw) = self.spec.forward {
            // The backward is over when its gradients are ready.
            for op in self.reshards(plan, layer, m, fw.backward_pass()) {
                nodes.push(mb, Stream::Compute, op);
            }
        }
    }

    /// The step's tail on a rank: with the global norm, its `grad_norm`, the two
    /// `norm_reduce`s and the `clip`; then the optimizer of every parameter the rank
    /// updates, and after all of them the publish of every owned parameter of the
    /// rank's shard column. The optimizers come first, back to back on their stream,
    /// so that a backend can issue them together (the CUDA backend holds them and
    /// issues one flush: `ops/src/cuda/defer.rs`) before the first publish waits for
    /// one of them; each publish still waits for its own parameter's update only.
    fn tail_nodes(&self, plan: &Plan, rank: u32, nodes: &mut SerialNodes) {
        let b = &self.spec.bindings;
        let me = self.spec.mesh.coord(rank);
        if self.spec.grad_norm {
            // The global norm before any optimizer: the local sum of squares, summed over
            // the shard group then the replicate group (the world), then the clip.
            nodes.push(None, b.optimizer, Op::GradNorm);
            for (stream, shard) in [(b.stage1, true), (b.stage2, false)] {
                let collective = plan.norm_collective(rank, shard);
                nodes.push(None, stream, Op::NormReduce { collective });
            }
            nodes.push(None, b.optimizer, Op::Clip);
        }
        for (i, p) in self.params.iter().enumerate() {
            let param = i as ParamId;
            if p.owner.map_or(true, |o| o == me) {
                let optimizer = plan.optimizer_kind(param);
                nodes.push(None, b.optimizer, Op::Optimizer { param, optimizer });
            }
        }
        for (i, p) in self.params.iter().enumerate() {
            let param = i as ParamId;
            if p.owner.is_some_and(|o| o.shard == me.shard) {
                if let Some(collective) = plan.publish_collective(param) {
                    nodes.push(None, b.publish, Op::Publish { param, collective });
                }
            }
        }
    }
}

/// A rank's nodes in serial order, each numbered by its place.
#[derive(Default)]
struct SerialNodes(Vec<Node>);

impl SerialNodes {
    /// Appends a node of micro-batch `mb` (`None`: the step's tail) bound to `stream`.
    fn push(&mut self, mb: Option<u32>, stream: Stream, op: Op) {
        let id = self.0.len() as u32;
        self.0.push(Node {
            id,
            micro_batch: mb,
            stream,
            op,
        });
    }

    /// Appends nodes of micro-batch `mb`, in order.
    fn extend(&mut self, mb: Option<u32>, ops: impl IntoIterator<Item = (Stream, Op)>) {
        for (stream, op) in ops {
            self.push(mb, stream, op);
        }
    }
}

/// Per bucket, along the step: whether a no_sync accumulation, a partial and a reduced
/// gradient have started (the next node adds to it instead of initialising it).
struct BucketState {
    accum: Vec<bool>,
    partial: Vec<bool>,
    reduced: Vec<bool>,
}

impl BucketState {
    /// The state at the start of the step: nothing started.
    fn new(buckets: usize) -> BucketState {
        BucketState {
            accum: vec![false; buckets],
            partial: vec![false; buckets],
            reduced: vec![false; buckets],
        }
    }

    /// Bucket `id`'s chain in micro-batch `m` under `gate`: a no_sync `accumulate`; or
    /// its pack and Stage 1, then where the rank holds Stage 1's output either a fold
    /// into the partial (replicate gate off) or the partial's fold, Stage 2 and unpack.
    fn chain(
        &mut self,
        planner: &Planner,
        plan: &Plan,
        rank: u32,
        id: BucketId,
        m: u32,
        gate: Gate,
    ) -> Vec<(Stream, Op)> {
        let b = &planner.spec.bindings;
        let i = id as usize;
        if gate == Gate::NoSync {
            let accumulate = std::mem::replace(&mut self.accum[i], true);
            let op = Op::Accumulate {
                bucket: id,
                micro_batch: m,
                accumulate,
            };
            return vec![(b.accumulate, op)];
        }
        let with_accum = std::mem::replace(&mut self.accum[i], false);
        let pack = Op::Pack {
            bucket: id,
            micro_batch: m,
            with_accum,
        };
        let mut chain = vec![(b.pack, pack)];
        planner.stage(plan, rank, id, m, 1, &mut chain);
        if !plan.holds_stage1(id, rank) {
            return chain;
        }
        if gate == Gate::ReplicateOff {
            let accumulate = std::mem::replace(&mut self.partial[i], true);
            let fold = Op::Fold {
                bucket: id,
                micro_batch: m,
                accumulate,
            };
            chain.push((b.fold, fold));
            return chain;
        }
        if std::mem::replace(&mut self.partial[i], false) {
            let fold = Op::FoldPartial {
                bucket: id,
                micro_batch: m,
            };
            chain.push((b.fold, fold));
        }
        planner.stage(plan, rank, id, m, 2, &mut chain);
        if plan.holds_stage2(id, rank) {
            let accumulate = std::mem::replace(&mut self.reduced[i], true);
            let unpack = Op::Unpack {
                bucket: id,
                micro_batch: m,
                accumulate,
            };
            chain.push((b.unpack, unpack));
        }
        chain
    }
}

/// Copy transport: the parts of bucket chains from their first combine on, held back
/// until `combine_lag` more layers have been issued, each with the layer index it is
/// due at.
#[derive(Default)]
struct Lagging(Vec<(usize, Vec<(Stream, Op)>)>);

impl Lagging {
    /// Holds a chain's lagging part until layer index `due` (an empty part is dropped).
    fn hold(&mut self, due: usize, ops: Vec<(Stream, Op)>) {
        if !ops.is_empty() {
            self.0.push((due, ops));
        }
    }

    /// Takes out, in the order held, the nodes of the parts `pick` selects (by their due
    /// layer index and nodes), keeping the others.
    fn take(&mut self, mut pick: impl FnMut(usize, &[(Stream, Op)]) -> bool) -> Vec<(Stream, Op)> {
        let (out, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.0)
            .into_iter()
            .partition(|(due, ops)| pick(*due, ops));
        self.0 = keep;
        out.into_iter().flat_map(|(_, ops)| ops).collect()
    }
}

impl Planner {
    /// A forward plan's forward pass of micro-batch `m`: layers ascending, each one's
    /// `forward` point after its gathers; a layer's gathers go out `prefetch` layers
    /// ahead, right after the freeing of the layer before (so at most `prefetch + 1`
    /// layers are held), and with `reshard_after_forward` each layer is freed after the
    /// trainer's forward of it (the next point issues it). `layers` is descending.
    fn forward_pass(
        &self,
        plan: &Plan,
        rank: u32,
        m: u32,
        fw: crate::plan::ForwardSpec,
        layers: &[u32],
    ) -> Vec<(Stream, Op)> {
        let asc: Vec<u32> = layers.iter().rev().copied().collect();
        let k = fw.prefetch as usize;
        let mut out = Vec::new();
        for (i, &layer) in asc.iter().enumerate() {
            if i > 0 && fw.reshard_after_forward {
                out.extend(
                    self.reshards(plan, asc[i - 1], m, Pass::Forward)
                        .into_iter()
                        .map(|op| (Stream::Compute, op)),
                );
            }
            let due = if i == 0 { 0..=k } else { i + k..=i + k };
            for &l in due.filter_map(|j| asc.get(j)) {
                out.extend(self.unshards(plan, rank, l, m, Pass::Forward));
            }
            out.push((Stream::Compute, Op::Forward { layer }));
        }
        if fw.reshard_after_forward {
            if let Some(&top) = asc.last() {
                out.extend(
                    self.reshards(plan, top, m, Pass::Forward)
                        .into_iter()
                        .map(|op| (Stream::Compute, op)),
                );
            }
        }
        out
    }

    /// The gathers of a layer's parameters for one pass of micro-batch `m`.
    fn unshards(
        &self,
        plan: &Plan,
        rank: u32,
        layer: u32,
        m: u32,
        pass: Pass,
    ) -> Vec<(Stream, Op)> {
        plan.layer_params(layer)
            .map(|param| {
                (
                    self.spec.bindings.unshard,
                    Op::Unshard {
                        param,
                        micro_batch: m,
                        pass,
                        collective: plan.unshard_collective(param, rank),
                    },
                )
            })
            .collect()
    }

    /// The frees of a layer's gathered parameters of one pass (on the trainer's stream,
    /// after the point that read them: only stream order puts them after the trainer's
    /// own kernels, which the plan does not see).
    fn reshards(&self, plan: &Plan, layer: u32, m: u32, pass: Pass) -> Vec<Op> {
        plan.layer_params(layer)
            .map(|param| Op::Reshard {
                param,
                micro_batch: m,
                pass,
            })
            .collect()
    }

    /// Appends the nodes of one stage of a bucket: one collective, or with the copy
    /// transport over a group of more than one member, an exchange and (on the ranks
    /// that receive the result) a combine, and for an all-reduce a gather after it.
    fn stage(
        &self,
        plan: &Plan,
        rank: u32,
        bucket: BucketId,
        m: u32,
        stage: u8,
        chain: &mut Vec<(Stream, Op)>,
    ) {
        let b = &self.spec.bindings;
        let collective = plan.stage_collective(bucket, rank, stage);
        let stream = if stage == 1 { b.stage1 } else { b.stage2 };
        let copy = self.spec.schedule.transport == Transport::Copy
            && plan.mesh.group_size(collective.group) > 1;
        if !copy {
            chain.push((
                stream,
                if stage == 1 {
                    Op::Stage1 {
                        bucket,
                        micro_batch: m,
                        collective,
                    }
                } else {
                    Op::Stage2 {
                        bucket,
                        micro_batch: m,
                        collective,
                    }
                },
            ));
            return;
        }
        chain.push((
            b.exchange,
            Op::Exchange {
                bucket,
                micro_batch: m,
                stage,
                collective,
            },
        ));
        if plan.stage_input(bucket, m, stage, rank).1 {
            chain.push((
                b.combine,
                Op::Combine {
                    bucket,
                    micro_batch: m,
                    stage,
                    collective,
                },
            ));
            // An all-reduce moves like reduce-scatter then all-gather: each member
            // combines its own chunk only, then hands it to the others (on the
            // exchange's communicator).
            if collective.kind == CollectiveKind::AllReduce {
                chain.push((
                    b.exchange,
                    Op::Gather {
                        bucket,
                        micro_batch: m,
                        stage,
                        collective,
                    },
                ));
            }
        }
    }
}

/// Packs parameters of one (layer, route, owner) into buckets of at most `cap` bytes on
/// the wire (a parameter larger than the cap gets a bucket of its own). Buckets are
/// numbered in issue order: highest layer first, then route, owner and parameter order.
fn make_buckets(params: &[PlacedParam], mesh: Mesh, dtype_bytes: u64, cap: u64) -> Vec<Bucket> {
    let mut keys: Vec<(std::cmp::Reverse<u32>, Route, Option<Coord>)> = params
        .iter()
        .map(|p| (std::cmp::Reverse(p.spec.layer), p.spec.route, p.owner))
        .collect();
    keys.sort();
    keys.dedup();
    let mut buckets: Vec<Bucket> = Vec::new();
    for (layer, route, owner) in keys {
        let mut cur: Option<(Bucket, u64)> = None;
        for (i, p) in params.iter().enumerate() {
            if p.spec.layer != layer.0 || p.spec.route != route || p.owner != owner {
                continue;
            }
            let bytes = p.spec.chunk(mesh.shard)
                * if route.is_sharded() {
                    u64::from(mesh.shard)
                } else {
                    1
                }
                * dtype_bytes;
            match &mut cur {
                Some((b, used)) if *used + bytes <= cap => {
                    b.params.push(i as ParamId);
                    *used += bytes;
                }
                _ => {
                    if let Some((b, _)) = cur.take() {
                        buckets.push(b);
                    }
                    let id = buckets.len() as BucketId;
                    cur = Some((
                        Bucket {
                            id,
                            layer: layer.0,
                            route,
                            owner,
                            params: vec![i as ParamId],
                        },
                        bytes,
                    ));
                }
            }
        }
        if let Some((b, _)) = cur {
            buckets.push(b);
        }
    }
    buckets
}

/// `Schedule::combine_after_exchanges`: each combine after the latest exchange issued
/// before it in its micro-batch (and so, on the exchanges' stream, after every earlier
/// one), so that a combine never shares memory bandwidth with an exchange beside the
/// backward. Acyclic with in-place receives: an exchange only waits for the
/// acknowledgements of combines issued before it.
fn combines_after_exchanges(nodes: &[Node], segments: &[Segment]) -> Vec<(NodeId, NodeId)> {
    let mut order = Vec::new();
    for seg in segments {
        let mut latest = None;
        for n in &nodes[seg.start..seg.end] {
            match n.op {
                Op::Exchange { .. } => latest = Some(n.id),
                Op::Combine { .. } => order.extend(latest.map(|e| (e, n.id))),
                _ => {}
            }
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::param::ParamSpec;
    use crate::plan::{Bindings, ReduceSpec};

    fn spec(mesh: Mesh, cap: u64) -> PlanSpec {
        let p = |name: &str, shape: Vec<u64>, route, layer| ParamSpec {
            name: name.into(),
            shape,
            route,
            layer,
        };
        PlanSpec {
            mesh,
            params: vec![
                p("a", vec![10], Route::Fsdp, 1),
                p("b", vec![7], Route::Fsdp, 1),
                p("c", vec![5, 3], Route::Muon, 1),
                p("d", vec![9], Route::ShardedAdamw, 0),
            ],
            reduce: ReduceSpec::default(),
            bucket_cap_bytes: cap,
            bindings: Bindings::default(),
            schedule: Default::default(),
            grad_norm: false,
            forward: None,
            update_rates: Default::default(),
        }
    }

    #[test]
    fn buckets_group_layer_route_owner_and_respect_the_cap() {
        let big = Planner::new(spec(Mesh::new(2, 1).unwrap(), 1 << 20)).unwrap();
        assert_eq!(big.buckets().len(), 3);
        assert_eq!(big.buckets()[0].params, vec![0, 1]);
        assert_eq!(big.buckets()[0].layer, 1);
        let small = Planner::new(spec(Mesh::new(2, 1).unwrap(), 40)).unwrap();
        assert_eq!(small.buckets().len(), 4);
    }

    #[test]
    fn gate_off_micro_batch_omits_stage2() {
        let planner = Planner::new(spec(Mesh::new(2, 2).unwrap(), 1 << 20)).unwrap();
        let plan = planner.plan(&[Gate::ReplicateOff, Gate::On]).unwrap();
        for rp in &plan.ranks {
            let stage2_in = |m| {
                rp.nodes
                    .iter()
                    .any(|n| n.micro_batch == Some(m) && matches!(n.op, Op::Stage2 { .. }))
            };
            assert!(!stage2_in(0));
            assert!(stage2_in(1));
            assert!(rp
                .nodes
                .iter()
                .any(|n| n.micro_batch == Some(0) && matches!(n.op, Op::Fold { .. })));
        }
    }

    #[test]
    fn no_sync_micro_batch_issues_no_collectives() {
        let planner = Planner::new(spec(Mesh::new(2, 2).unwrap(), 1 << 20)).unwrap();
        let plan = planner.plan(&[Gate::NoSync, Gate::On]).unwrap();
        for rp in &plan.ranks {
            assert!(rp
                .nodes
                .iter()
                .filter(|n| n.micro_batch == Some(0))
                .all(|n| n.op.collective().is_none()));
            assert!(rp.nodes.iter().any(|n| matches!(
                n.op,
                Op::Pack {
                    with_accum: true,
                    ..
                }
            )));
        }
    }
}
