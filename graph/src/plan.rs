//! The plan: a step's per-rank programs, and the tables they refer to.
//!
//! A [`Plan`] is a value: it can be printed, diffed, exported as JSON and read back, and
//! validated before anything runs. Everything a node reads or writes, and every buffer's
//! length and layout, is derived here from the plan's own tables, so an executor and the
//! validator cannot disagree about what a node touches.

use serde::{Deserialize, Serialize};

use crate::gate::Gate;
use crate::mesh::{Coord, Group, Mesh};
use crate::node::{
    BucketId, Buffer, Collective, CollectiveKind, DType, Instr, Node, Op, OptimizerKind, Pass,
    ReduceOp, Stream,
};
use crate::owner::UpdateRates;
use crate::param::{ParamId, ParamSpec, Route};
use crate::PlanError;

/// The format tag every plan JSON carries.
pub const PLAN_FORMAT: &str = "overlap-plan";
/// The plan JSON version this crate reads and writes.
pub const PLAN_VERSION: u32 = 1;

/// How reductions are computed. [`ReduceSpec::default`] is `avg` in f32; change it with
/// the `with_*` methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ReduceSpec {
    /// `avg` divides by the number of ranks reduced over; `sum` does not.
    pub op: ReduceOp,
    /// Element type on the wire.
    pub dtype: DType,
}

/// Which stream each kind of node is bound to. The default is FSDP2's binding; change a
/// kind's stream with its `with_*` method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Bindings {
    /// no_sync accumulation.
    pub accumulate: Stream,
    /// Copy-in/pack.
    pub pack: Stream,
    /// Stage 1 collectives.
    pub stage1: Stream,
    /// Fold of Stage-1 output into the partial, and of the partial into Stage-1 output.
    pub fold: Stream,
    /// Stage 2 collectives.
    pub stage2: Stream,
    /// Unpack/scale into the reduced gradients.
    pub unpack: Stream,
    /// Optimizer steps.
    pub optimizer: Stream,
    /// Post-step broadcasts.
    pub publish: Stream,
    /// The moving half of a copy-transport stage ([`Op::Exchange`]), both stages.
    #[serde(default = "exchange_default")]
    pub exchange: Stream,
    /// The arithmetic half of a copy-transport stage ([`Op::Combine`]).
    #[serde(default = "combine_default")]
    pub combine: Stream,
    /// Forward plans: the parameter gathers ([`Op::Unshard`]). The publish stream by
    /// default: it is idle until the step's tail, so the gathers have it to themselves
    /// during the micro-batches, and it already moves parameters.
    #[serde(default = "unshard_default")]
    pub unshard: Stream,
}

impl ReduceSpec {
    /// The same reduction with another [`ReduceSpec::op`] (`avg` or `sum`).
    pub fn with_op(mut self, op: ReduceOp) -> ReduceSpec {
        self.op = op;
        self
    }

    /// The same reduction with another [`ReduceSpec::dtype`] (the wire's element type).
    pub fn with_dtype(mut self, dtype: DType) -> ReduceSpec {
        self.dtype = dtype;
        self
    }
}

impl Bindings {
    /// Every kind of node on `stream` (on the compute stream: the fully serial
    /// binding, each layer's reduction after its backward, strictly in order).
    pub fn all_on(stream: Stream) -> Bindings {
        Bindings {
            accumulate: stream,
            pack: stream,
            stage1: stream,
            fold: stream,
            stage2: stream,
            unpack: stream,
            optimizer: stream,
            publish: stream,
            exchange: stream,
            combine: stream,
            unshard: stream,
        }
    }

    /// The same bindings with another [`Bindings::accumulate`] stream (no_sync
    /// accumulation).
    pub fn with_accumulate(mut self, accumulate: Stream) -> Bindings {
        self.accumulate = accumulate;
        self
    }

    /// The same bindings with another [`Bindings::pack`] stream (copy-in/pack).
    pub fn with_pack(mut self, pack: Stream) -> Bindings {
        self.pack = pack;
        self
    }

    /// The same bindings with another [`Bindings::stage1`] stream (Stage-1 collectives).
    pub fn with_stage1(mut self, stage1: Stream) -> Bindings {
        self.stage1 = stage1;
        self
    }

    /// The same bindings with another [`Bindings::fold`] stream (folds into and out of the
    /// partial).
    pub fn with_fold(mut self, fold: Stream) -> Bindings {
        self.fold = fold;
        self
    }

    /// The same bindings with another [`Bindings::stage2`] stream (Stage-2 collectives).
    pub fn with_stage2(mut self, stage2: Stream) -> Bindings {
        self.stage2 = stage2;
        self
    }

    /// The same bindings with another [`Bindings::unpack`] stream (unpack into the reduced
    /// gradients).
    pub fn with_unpack(mut self, unpack: Stream) -> Bindings {
        self.unpack = unpack;
        self
    }

    /// The same bindings with another [`Bindings::optimizer`] stream (optimizer steps).
    pub fn with_optimizer(mut self, optimizer: Stream) -> Bindings {
        self.optimizer = optimizer;
        self
    }

    /// The same bindings with another [`Bindings::publish`] stream (post-step broadcasts).
    pub fn with_publish(mut self, publish: Stream) -> Bindings {
        self.publish = publish;
        self
    }

    /// The same bindings with another [`Bindings::exchange`] stream (copy-transport
    /// exchanges and gathers).
    pub fn with_exchange(mut self, exchange: Stream) -> Bindings {
        self.exchange = exchange;
        self
    }

    /// The same bindings with another [`Bindings::combine`] stream (copy-transport
    /// combines).
    pub fn with_combine(mut self, combine: Stream) -> Bindings {
        self.combine = combine;
        self
    }

    /// The same bindings with another [`Bindings::unshard`] stream (forward plans'
    /// parameter gathers).
    pub fn with_unshard(mut self, unshard: Stream) -> Bindings {
        self.unshard = unshard;
        self
    }
}

fn unshard_default() -> Stream {
    Stream::Publish
}

fn exchange_default() -> Stream {
    Stream::Copy
}

fn combine_default() -> Stream {
    Stream::Reduce
}

/// How a stage whose group has more than one member moves its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    /// One NCCL collective per stage (reduction inside NCCL's kernels, on SMs).
    #[default]
    Nccl,
    /// An [`Op::Exchange`] that copies chunks between the members' memories (on GPUs:
    /// copy engines over NVLink, no SMs; all members on one node), then an
    /// [`Op::Combine`] that reduces them, on the stream `Bindings::combine` names.
    Copy,
}

impl Transport {
    /// The name used in configs.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Nccl => "nccl",
            Transport::Copy => "copy",
        }
    }
}

/// Where the planner places what the bindings leave open. Start from
/// [`Schedule::default`] and change it with the `with_*` methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Schedule {
    /// How stages with more than one member move their bytes.
    pub transport: Transport,
    /// Copy transport: how many later layers' `grad_ready` are issued before a bucket's
    /// combine (and what follows it). 0 issues it right after its exchange; 1 runs it
    /// after the next layer's backward, so that on the compute stream it sits between
    /// GEMMs instead of beside them. Never past the end of the micro-batch.
    pub combine_lag: u32,
    /// Copy transport, `combine_lag > 0`: lagging chains that gather (all-reduces) are
    /// issued before the micro-batch's last layer's own exchanges instead of after
    /// them, so their gathers do not wait for that layer's backward. On by default;
    /// off only to measure it (`overlap bench --no-early-tail-gathers`).
    pub early_tail_gathers: bool,
    /// Copy transport: each combine also waits for the exchanges issued before it, so
    /// it never runs beside an exchange (both move memory; beside the backward's GEMMs
    /// the two at once cost more than one after the other). With `early_tail_gathers`
    /// every lagging chain then goes out before the last layer's exchanges. Off by
    /// default: a lever (`overlap bench --combine-after-exchanges`), motivated by the
    /// one-GPU probe of `docs/performance.md` (call AD).
    pub combine_after_exchanges: bool,
}

impl Default for Schedule {
    /// NCCL collectives; with the copy transport, combines one layer behind.
    fn default() -> Self {
        Schedule {
            transport: Transport::Nccl,
            combine_lag: 1,
            early_tail_gathers: true,
            combine_after_exchanges: false,
        }
    }
}

impl Schedule {
    /// The same schedule with another [`Schedule::transport`] (NCCL collectives or the copy
    /// transport).
    pub fn with_transport(mut self, transport: Transport) -> Schedule {
        self.transport = transport;
        self
    }

    /// The same schedule with another [`Schedule::combine_lag`] (layers a copy-transport
    /// combine is held back).
    pub fn with_combine_lag(mut self, combine_lag: u32) -> Schedule {
        self.combine_lag = combine_lag;
        self
    }

    /// The same schedule with another [`Schedule::early_tail_gathers`].
    pub fn with_early_tail_gathers(mut self, early_tail_gathers: bool) -> Schedule {
        self.early_tail_gathers = early_tail_gathers;
        self
    }

    /// The same schedule with another [`Schedule::combine_after_exchanges`].
    pub fn with_combine_after_exchanges(mut self, combine_after_exchanges: bool) -> Schedule {
        self.combine_after_exchanges = combine_after_exchanges;
        self
    }
}

impl Default for Bindings {
    fn default() -> Self {
        Bindings {
            accumulate: Stream::Compute,
            pack: Stream::Reduce,
            stage1: Stream::Reduce,
            fold: Stream::Reduce,
            stage2: Stream::Replicate,
            unpack: Stream::Replicate,
            optimizer: Stream::Compute,
            publish: Stream::Publish,
            exchange: Stream::Copy,
            combine: Stream::Reduce,
            unshard: Stream::Publish,
        }
    }
}

/// Forward plans ([`PlanSpec::forward`], `[forward]`): each micro-batch gathers every
/// layer's full parameters for the trainer's forward, and again (or keeps them) for its
/// backward. Start from [`ForwardSpec::default`] and change it with the `with_*` methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ForwardSpec {
    /// How many layers ahead of the one the trainer runs the gathers are issued: 0
    /// gathers a layer right before its use; 1 (the default) gathers layer `L + 1` while
    /// the trainer runs layer `L`. The same in the backward (layers descending). At most
    /// `prefetch + 1` layers of full parameters are held per pass.
    pub prefetch: u32,
    /// Free a layer's full parameters after its forward and gather them again for its
    /// backward (FSDP2's default), or keep them from the forward through the layer's
    /// backward (`false`: one gather per layer and micro-batch, every layer's full
    /// parameters held between the forward and the backward).
    pub reshard_after_forward: bool,
}

impl Default for ForwardSpec {
    fn default() -> Self {
        ForwardSpec {
            prefetch: 1,
            reshard_after_forward: true,
        }
    }
}

impl ForwardSpec {
    /// The same forward with another [`ForwardSpec::prefetch`] (layers the gathers run
    /// ahead).
    pub fn with_prefetch(mut self, prefetch: u32) -> ForwardSpec {
        self.prefetch = prefetch;
        self
    }

    /// The same forward with another [`ForwardSpec::reshard_after_forward`].
    pub fn with_reshard_after_forward(mut self, reshard_after_forward: bool) -> ForwardSpec {
        self.reshard_after_forward = reshard_after_forward;
        self
    }

    /// The pass whose gathers the trainer's backward reads.
    pub fn backward_pass(&self) -> Pass {
        if self.reshard_after_forward {
            Pass::Backward
        } else {
            Pass::Forward
        }
    }
}

/// What the planner needs: the mesh, the parameters and the knobs. Build one with
/// [`PlanSpec::new`] and the `with_*` methods.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlanSpec {
    /// The mesh.
    pub mesh: Mesh,
    /// Parameters in a fixed order (their index is their [`ParamId`]).
    pub params: Vec<ParamSpec>,
    /// How reductions are computed.
    pub reduce: ReduceSpec,
    /// Largest bucket, in bytes of the reduce dtype; a larger parameter gets its own.
    pub bucket_cap_bytes: u64,
    /// Stream of each node kind.
    pub bindings: Bindings,
    /// Transport and placement of copy-transport combines.
    pub schedule: Schedule,
    /// Whether the step computes the global L2 norm of its reduced gradients and clips
    /// by it (the `grad_norm`, `norm_reduce` and `clip` nodes before the optimizers).
    pub grad_norm: bool,
    /// Whether each micro-batch gathers the full parameters for the trainer's forward
    /// and backward (`unshard`, `forward`, `backward`, `reshard` nodes), and how. `None`
    /// plans exactly what a spec without it always did.
    pub forward: Option<ForwardSpec>,
    /// The rates that weigh each owned parameter's optimizer update when owners are
    /// assigned ([`crate::owner`]).
    pub update_rates: UpdateRates,
}

/// The default bucket cap: 25 MiB, PyTorch DDP's and FSDP2's default.
pub const DEFAULT_BUCKET_CAP_BYTES: u64 = 25 << 20;

impl PlanSpec {
    /// A spec with the defaults: `avg` reduction in f32, buckets of at most
    /// [`DEFAULT_BUCKET_CAP_BYTES`], FSDP2's stream bindings ([`Bindings::default`]) and
    /// NCCL collectives ([`Schedule::default`]). Change any of them with the `with_*`
    /// methods.
    ///
    /// ```
    /// use overlap_graph::{Mesh, ParamSpec, PlanSpec, Route};
    ///
    /// let spec = PlanSpec::new(
    ///     Mesh::new(2, 2)?,
    ///     vec![ParamSpec::new("w", [64, 32], Route::Muon, 0)],
    /// )
    /// .with_bucket_cap_bytes(4 << 20);
    /// assert_eq!(spec.bucket_cap_bytes, 4 << 20);
    /// # Ok::<(), overlap_graph::PlanError>(())
    /// ```
    pub fn new(mesh: Mesh, params: Vec<ParamSpec>) -> PlanSpec {
        PlanSpec {
            mesh,
            params,
            reduce: ReduceSpec::default(),
            bucket_cap_bytes: DEFAULT_BUCKET_CAP_BYTES,
            bindings: Bindings::default(),
            schedule: Schedule::default(),
            grad_norm: false,
            forward: None,
            update_rates: UpdateRates::default(),
        }
    }

    /// The same spec with another reduction (op and wire dtype).
    pub fn with_reduce(mut self, reduce: ReduceSpec) -> PlanSpec {
        self.reduce = reduce;
        self
    }

    /// The same spec with another bucket cap, in bytes of the reduce dtype.
    pub fn with_bucket_cap_bytes(mut self, bytes: u64) -> PlanSpec {
        self.bucket_cap_bytes = bytes;
        self
    }

    /// The same spec with other stream bindings.
    pub fn with_bindings(mut self, bindings: Bindings) -> PlanSpec {
        self.bindings = bindings;
        self
    }

    /// The same spec with another schedule (transport, combine placement).
    pub fn with_schedule(mut self, schedule: Schedule) -> PlanSpec {
        self.schedule = schedule;
        self
    }

    /// The same spec with (or without) the global-norm nodes ([`PlanSpec::grad_norm`]).
    pub fn with_grad_norm(mut self, on: bool) -> PlanSpec {
        self.grad_norm = on;
        self
    }

    /// The same spec with (or, `None`, without) the forward's parameter gathers
    /// ([`PlanSpec::forward`]).
    pub fn with_forward(mut self, forward: Option<ForwardSpec>) -> PlanSpec {
        self.forward = forward;
        self
    }

    /// The same spec with other rates for balancing owners by optimizer time
    /// ([`PlanSpec::update_rates`]).
    pub fn with_update_rates(mut self, rates: UpdateRates) -> PlanSpec {
        self.update_rates = rates;
        self
    }
}

/// A parameter with its owner. In JSON its fields are the parameter's own plus `owner`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "PlacedParamRepr", into = "PlacedParamRepr")]
pub struct PlacedParam {
    /// The parameter.
    pub spec: ParamSpec,
    /// The owner `(s_o, r_o)` of an owned route; absent for sharded routes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Coord>,
}

/// The flat JSON form of [`PlacedParam`] (serde's `flatten` cannot reject unknown keys).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlacedParamRepr {
    name: String,
    shape: Vec<u64>,
    route: Route,
    layer: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    owner: Option<Coord>,
}

impl From<PlacedParamRepr> for PlacedParam {
    fn from(r: PlacedParamRepr) -> Self {
        PlacedParam {
            spec: ParamSpec {
                name: r.name,
                shape: r.shape,
                route: r.route,
                layer: r.layer,
            },
            owner: r.owner,
        }
    }
}

impl From<PlacedParam> for PlacedParamRepr {
    fn from(p: PlacedParam) -> Self {
        let ParamSpec {
            name,
            shape,
            route,
            layer,
        } = p.spec;
        PlacedParamRepr {
            name,
            shape,
            route,
            layer,
            owner: p.owner,
        }
    }
}

/// Parameters of one layer, route and owner, reduced by one collective.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bucket {
    /// Index in [`Plan::buckets`].
    pub id: BucketId,
    /// The layer all its parameters belong to.
    pub layer: u32,
    /// The route all its parameters take.
    pub route: Route,
    /// The owner of an owned route's bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Coord>,
    /// Its parameters, in packing order.
    pub params: Vec<ParamId>,
}

/// One rank's step: its nodes in serial order and a program per stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankProgram {
    /// Global rank.
    pub rank: u32,
    /// Nodes in serial order; `nodes[i].id == i`.
    pub nodes: Vec<Node>,
    /// Number of events the programs use (ids `0..events`).
    pub events: u32,
    /// The instructions of each stream, in issue order.
    pub streams: Vec<StreamProgram>,
}

/// The instructions of one stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamProgram {
    /// The stream.
    pub stream: Stream,
    /// Run, record and wait instructions in order.
    pub instrs: Vec<Instr>,
}

/// A lowered, self-contained step plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Always [`PLAN_FORMAT`].
    pub format: String,
    /// Always [`PLAN_VERSION`].
    pub version: u32,
    /// The mesh.
    pub mesh: Mesh,
    /// How reductions are computed.
    pub reduce: ReduceSpec,
    /// The gate of each micro-batch of the step.
    pub gates: Vec<Gate>,
    /// Parameters with owners.
    pub params: Vec<PlacedParam>,
    /// Buckets.
    pub buckets: Vec<Bucket>,
    /// One program per rank, in rank order.
    pub ranks: Vec<RankProgram>,
    /// Whether every rank's tail computes the global gradient norm and clips by it
    /// before its optimizers (`clip-coverage`); absent in JSON when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub grad_norm: bool,
    /// Whether each micro-batch gathers the full parameters for the trainer's forward
    /// and backward, and how (`forward-coverage`); absent in JSON when not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward: Option<ForwardSpec>,
}

/// A node's buffer accesses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Access {
    /// Buffers read.
    pub reads: Vec<Buffer>,
    /// Buffers written (a read-modify-write appears in both).
    pub writes: Vec<Buffer>,
}

/// One contiguous copy of a pack or unpack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopySeg {
    /// The parameter whose data moves.
    pub param: ParamId,
    /// Offset in the source buffer.
    pub src: u64,
    /// Offset in the destination buffer.
    pub dst: u64,
    /// Elements.
    pub len: u64,
}

impl Plan {
    /// The parameter table entry.
    pub fn param(&self, p: ParamId) -> &PlacedParam {
        &self.params[p as usize]
    }

    /// The bucket table entry.
    pub fn bucket(&self, b: BucketId) -> &Bucket {
        &self.buckets[b as usize]
    }

    /// The program of a rank.
    pub fn rank(&self, rank: u32) -> &RankProgram {
        &self.ranks[rank as usize]
    }

    /// Number of micro-batches in the step.
    pub fn micro_batches(&self) -> u32 {
        self.gates.len() as u32
    }

    /// The layers that have parameters, highest (first ready in backward) first.
    pub fn layers_desc(&self) -> Vec<u32> {
        let mut ls: Vec<u32> = self.params.iter().map(|p| p.spec.layer).collect();
        ls.sort_unstable_by(|a, b| b.cmp(a));
        ls.dedup();
        ls
    }

    /// Elements of a bucket's Stage-1 output (and partial, and Stage-2 output) per rank.
    pub fn stage1_elems(&self, b: BucketId) -> u64 {
        let s = self.mesh.shard;
        self.bucket(b)
            .params
            .iter()
            .map(|&p| self.param(p).spec.chunk(s))
            .sum()
    }

    /// Elements of a bucket's packed Stage-1 input.
    pub fn send_elems(&self, b: BucketId) -> u64 {
        let bucket = self.bucket(b);
        if bucket.route.is_sharded() {
            self.stage1_elems(b) * u64::from(self.mesh.shard)
        } else {
            self.stage1_elems(b)
        }
    }

    /// Elements of a parameter held by a rank: its shard for sharded routes, the whole
    /// tensor for owned routes (on the owner's shard column).
    pub fn local_elems(&self, p: ParamId, rank: u32) -> u64 {
        let spec = &self.param(p).spec;
        let r = spec.shard_range(self.mesh.shard, self.mesh.coord(rank).shard);
        r.end - r.start
    }

    /// Length in elements of a buffer on a rank.
    pub fn buffer_len(&self, rank: u32, buf: &Buffer) -> u64 {
        match *buf {
            Buffer::Grad { param, .. } | Buffer::Accum { param } => self.param(param).spec.numel(),
            Buffer::Send { bucket, .. } => self.send_elems(bucket),
            Buffer::Stage1Out { bucket, .. }
            | Buffer::Partial { bucket }
            | Buffer::Stage2Out { bucket, .. } => self.stage1_elems(bucket),
            Buffer::Recv { bucket, stage, .. } => {
                // The others' chunks of what this rank reduces (all-reduce: its own
                // chunk of the buffer, reduce-scatter and reduce: the whole count).
                let c = self.stage_collective(bucket, rank, stage);
                let size = self.mesh.group_size(c.group);
                let index = self.mesh.index_in(c.group, rank).unwrap_or(0);
                u64::from(size.saturating_sub(1)).saturating_mul(c.member_chunk(size, index).1)
            }
            Buffer::Reduced { param } | Buffer::Param { param } => self.local_elems(param, rank),
            Buffer::OptState { param } => match self.optimizer_kind(param) {
                OptimizerKind::Adamw => 2 * self.local_elems(param, rank),
                OptimizerKind::Muon => self.local_elems(param, rank),
            },
            Buffer::Full { param, .. } => self.full_elems(param),
            Buffer::Norm => 1,
        }
    }

    /// Elements of a parameter's [`Buffer::Full`]: what its gather writes (sharded
    /// routes: every member's padded chunk, `S · chunk`; owned routes: `numel`).
    pub fn full_elems(&self, p: ParamId) -> u64 {
        let spec = &self.param(p).spec;
        if spec.route.is_sharded() {
            spec.chunk(self.mesh.shard)
                .saturating_mul(u64::from(self.mesh.shard))
        } else {
            spec.numel()
        }
    }

    /// The parameters of a layer, in id order.
    pub fn layer_params(&self, layer: u32) -> impl Iterator<Item = ParamId> + '_ {
        self.params
            .iter()
            .enumerate()
            .filter(move |(_, p)| p.spec.layer == layer)
            .map(|(i, _)| i as ParamId)
    }

    /// The gather of a parameter's full values on a rank, for a forward plan's
    /// [`Op::Unshard`]: over the rank's shard group, an all-gather of every member's
    /// chunk (sharded routes) or a broadcast of the whole tensor from the owner's shard
    /// index (owned routes); f32, `sum` (which neither reduces).
    pub fn unshard_collective(&self, p: ParamId, rank: u32) -> Collective {
        let placed = self.param(p);
        let group = self.mesh.shard_group(rank);
        match placed.owner {
            None => Collective {
                kind: CollectiveKind::AllGather,
                group,
                count: placed.spec.chunk(self.mesh.shard),
                dtype: DType::F32,
                op: ReduceOp::Sum,
                root: None,
            },
            Some(o) => Collective {
                kind: CollectiveKind::Broadcast,
                group,
                count: placed.spec.numel(),
                dtype: DType::F32,
                op: ReduceOp::Sum,
                root: Some(o.shard),
            },
        }
    }

    /// Whether a rank supplies values to an unshard's collective (and so reads its
    /// `param`): every member of an all-gather, the root of a broadcast.
    pub fn unshard_supplies(&self, rank: u32, c: &Collective) -> bool {
        c.kind != CollectiveKind::Broadcast
            || self.mesh.index_in(c.group, rank) == Some(c.root.unwrap_or(0))
    }

    /// Whether a rank holds a parameter's reduced gradient at the step's end (and runs
    /// its optimizer): every rank for sharded routes, the owner for owned ones.
    pub fn holds_reduced(&self, p: ParamId, rank: u32) -> bool {
        match self.param(p).owner {
            None => true,
            Some(o) => self.mesh.rank(o) == rank,
        }
    }

    /// The parameters whose reduced gradient a rank counts in the global norm, so that
    /// every element counts once in the world: for sharded routes the rank's shard on
    /// replicate index 0 only (every replica holds the same reduced shard after Stage
    /// 2; the shard excludes the padding), for owned routes the owner.
    pub fn norm_params(&self, rank: u32) -> Vec<ParamId> {
        let me = self.mesh.coord(rank);
        (0..self.params.len() as ParamId)
            .filter(|&p| match self.param(p).owner {
                None => me.replicate == 0,
                Some(o) => o == me,
            })
            .collect()
    }

    /// The parameters whose reduced gradient a rank holds (and clips).
    pub fn held_params(&self, rank: u32) -> Vec<ParamId> {
        (0..self.params.len() as ParamId)
            .filter(|&p| self.holds_reduced(p, rank))
            .collect()
    }

    /// The all-reduce of the norm over a rank's shard group (`shard`) or replicate group.
    pub fn norm_collective(&self, rank: u32, shard: bool) -> Collective {
        Collective {
            kind: CollectiveKind::AllReduce,
            group: if shard {
                self.mesh.shard_group(rank)
            } else {
                self.mesh.replicate_group(rank)
            },
            count: 1,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            root: None,
        }
    }

    /// The optimizer a parameter's route selects.
    pub fn optimizer_kind(&self, p: ParamId) -> OptimizerKind {
        match self.param(p).spec.route {
            Route::Muon => OptimizerKind::Muon,
            _ => OptimizerKind::Adamw,
        }
    }

    /// The copies that pack a bucket's gradients into its send buffer (the same on every
    /// rank). Sharded routes lay out chunk `j` of every parameter at `j·C`; bytes of the
    /// send buffer not covered by a copy are padding and must be zero.
    pub fn pack_segments(&self, b: BucketId) -> Vec<CopySeg> {
        let bucket = self.bucket(b);
        let s = self.mesh.shard;
        let mut segs = Vec::new();
        if bucket.route.is_sharded() {
            let c = self.stage1_elems(b);
            for j in 0..s {
                let mut off = u64::from(j) * c;
                for &p in &bucket.params {
                    let spec = &self.param(p).spec;
                    let r = spec.shard_range(s, j);
                    if r.end > r.start {
                        segs.push(CopySeg {
                            param: p,
                            src: r.start,
                            dst: off,
                            len: r.end - r.start,
                        });
                    }
                    off += spec.chunk(s);
                }
            }
        } else {
            let mut off = 0;
            for &p in &bucket.params {
                let n = self.param(p).spec.numel();
                segs.push(CopySeg {
                    param: p,
                    src: 0,
                    dst: off,
                    len: n,
                });
                off += n;
            }
        }
        segs
    }

    /// The copies that unpack a bucket's Stage-2 output into each parameter's reduced
    /// gradient on a rank (padding is dropped).
    pub fn unpack_segments(&self, b: BucketId, rank: u32) -> Vec<CopySeg> {
        let s = self.mesh.shard;
        let mut off = 0;
        let mut segs = Vec::new();
        for &p in &self.bucket(b).params {
            let len = self.local_elems(p, rank);
            if len > 0 {
                segs.push(CopySeg {
                    param: p,
                    src: off,
                    dst: 0,
                    len,
                });
            }
            off += self.param(p).spec.chunk(s);
        }
        segs
    }

    /// Whether a rank holds a bucket's Stage-1 output: every rank for sharded routes, the
    /// owner's shard column for owned routes.
    pub fn holds_stage1(&self, b: BucketId, rank: u32) -> bool {
        match self.bucket(b).owner {
            None => true,
            Some(o) => self.mesh.coord(rank).shard == o.shard,
        }
    }

    /// Whether a rank holds a bucket's Stage-2 output (and so runs its unpack).
    pub fn holds_stage2(&self, b: BucketId, rank: u32) -> bool {
        match self.bucket(b).owner {
            None => true,
            Some(o) => self.mesh.coord(rank) == o,
        }
    }

    /// What a node reads and writes on a rank. `GradReady` writes the gradients of its
    /// layer; a collective's output exists only on the ranks that receive it.
    pub fn access(&self, rank: u32, node: &Node) -> Access {
        match node.op {
            Op::GradReady { .. } | Op::Accumulate { .. } | Op::Pack { .. } => {
                self.gradient_access(node)
            }
            Op::Stage1 { .. }
            | Op::Stage2 { .. }
            | Op::Exchange { .. }
            | Op::Combine { .. }
            | Op::Gather { .. } => self.stage_access(rank, node),
            Op::Fold { .. } | Op::FoldPartial { .. } | Op::Unpack { .. } => self.fold_access(node),
            Op::Optimizer { .. }
            | Op::Publish { .. }
            | Op::GradNorm
            | Op::NormReduce { .. }
            | Op::Clip => self.step_tail_access(rank, node),
            Op::Unshard { .. } | Op::Forward { .. } | Op::Backward { .. } | Op::Reshard { .. } => {
                self.gathered_access(rank, node)
            }
        }
    }

    /// [`Plan::access`] of the nodes that take in gradients: `grad_ready`, `accumulate`
    /// and `pack`.
    fn gradient_access(&self, node: &Node) -> Access {
        let mut a = Access::default();
        let params_of = |b: BucketId| self.bucket(b).params.iter().copied();
        match node.op {
            Op::GradReady { layer } => {
                let mb = node.micro_batch.unwrap_or(0);
                for (i, p) in self.params.iter().enumerate() {
                    if p.spec.layer == layer {
                        a.writes.push(Buffer::Grad {
                            param: i as ParamId,
                            micro_batch: mb,
                        });
                    }
                }
            }
            Op::Accumulate {
                bucket,
                micro_batch,
                accumulate,
            } => {
                for p in params_of(bucket) {
                    a.reads.push(Buffer::Grad {
                        param: p,
                        micro_batch,
                    });
                    if accumulate {
                        a.reads.push(Buffer::Accum { param: p });
                    }
                    a.writes.push(Buffer::Accum { param: p });
                }
            }
            Op::Pack {
                bucket,
                micro_batch,
                with_accum,
            } => {
                for p in params_of(bucket) {
                    a.reads.push(Buffer::Grad {
                        param: p,
                        micro_batch,
                    });
                    if with_accum {
                        a.reads.push(Buffer::Accum { param: p });
                    }
                }
                a.writes.push(Buffer::Send {
                    bucket,
                    micro_batch,
                });
            }
            op => unreachable!("{} does not take in gradients", op.kind()),
        }
        a
    }

    /// [`Plan::access`] of the nodes of a stage: a collective (`stage1`, `stage2`), or
    /// the copy transport's `exchange`, `combine` and `gather`.
    fn stage_access(&self, rank: u32, node: &Node) -> Access {
        let mut a = Access::default();
        match node.op {
            Op::Stage1 {
                bucket,
                micro_batch,
                ..
            }
            | Op::Stage2 {
                bucket,
                micro_batch,
                ..
            } => {
                let stage = node.op.stage().unwrap_or(1);
                let (src, holds) = self.stage_input(bucket, micro_batch, stage, rank);
                a.reads.push(src);
                if holds {
                    a.writes
                        .push(Plan::stage_output(bucket, micro_batch, stage));
                }
            }
            Op::Exchange {
                bucket,
                micro_batch,
                stage,
                ..
            } => {
                let (src, holds) = self.stage_input(bucket, micro_batch, stage, rank);
                a.reads.push(src);
                if holds {
                    a.writes.push(Buffer::Recv {
                        bucket,
                        micro_batch,
                        stage,
                    });
                }
            }
            Op::Combine {
                bucket,
                micro_batch,
                stage,
                ..
            } => {
                let (src, _) = self.stage_input(bucket, micro_batch, stage, rank);
                a.reads.push(src);
                a.reads.push(Buffer::Recv {
                    bucket,
                    micro_batch,
                    stage,
                });
                a.writes
                    .push(Plan::stage_output(bucket, micro_batch, stage));
            }
            // Reads its own chunk of the stage's output, writes the others' chunks.
            Op::Gather {
                bucket,
                micro_batch,
                stage,
                ..
            } => {
                let out = Plan::stage_output(bucket, micro_batch, stage);
                a.reads.push(out);
                a.writes.push(out);
            }
            op => unreachable!("{} is not a stage's node", op.kind()),
        }
        a
    }

    /// [`Plan::access`] of the local arithmetic on a stage's output: `fold` into the
    /// partial, `fold_partial` back into Stage 1's output, and `unpack` into the reduced
    /// gradients.
    fn fold_access(&self, node: &Node) -> Access {
        let mut a = Access::default();
        match node.op {
            Op::Fold {
                bucket,
                micro_batch,
                accumulate,
            } => {
                a.reads.push(Buffer::Stage1Out {
                    bucket,
                    micro_batch,
                });
                if accumulate {
                    a.reads.push(Buffer::Partial { bucket });
                }
                a.writes.push(Buffer::Partial { bucket });
            }
            Op::FoldPartial {
                bucket,
                micro_batch,
            } => {
                a.reads.push(Buffer::Partial { bucket });
                a.reads.push(Buffer::Stage1Out {
                    bucket,
                    micro_batch,
                });
                a.writes.push(Buffer::Stage1Out {
                    bucket,
                    micro_batch,
                });
            }
            Op::Unpack {
                bucket,
                micro_batch,
                accumulate,
            } => {
                a.reads.push(Buffer::Stage2Out {
                    bucket,
                    micro_batch,
                });
                for &p in &self.bucket(bucket).params {
                    if accumulate {
                        a.reads.push(Buffer::Reduced { param: p });
                    }
                    a.writes.push(Buffer::Reduced { param: p });
                }
            }
            op => unreachable!("{} is not a fold or an unpack", op.kind()),
        }
        a
    }

    /// [`Plan::access`] of the step's tail: the global norm (`grad_norm`, `norm_reduce`,
    /// `clip`), `optimizer` and `publish`.
    fn step_tail_access(&self, rank: u32, node: &Node) -> Access {
        let mut a = Access::default();
        match node.op {
            Op::Optimizer { param, .. } => {
                if self.grad_norm {
                    // Skips the update when the global norm is not finite.
                    a.reads.push(Buffer::Norm);
                }
                a.reads.extend([
                    Buffer::Reduced { param },
                    Buffer::Param { param },
                    Buffer::OptState { param },
                ]);
                a.writes
                    .extend([Buffer::Param { param }, Buffer::OptState { param }]);
            }
            Op::Publish { param, collective } => {
                let root = collective.root.unwrap_or(0);
                if self.mesh.index_in(collective.group, rank) == Some(root) {
                    a.reads.push(Buffer::Param { param });
                } else {
                    a.writes.push(Buffer::Param { param });
                }
            }
            Op::GradNorm => {
                a.reads.extend(
                    self.norm_params(rank)
                        .into_iter()
                        .map(|param| Buffer::Reduced { param }),
                );
                a.writes.push(Buffer::Norm);
            }
            Op::NormReduce { .. } => {
                a.reads.push(Buffer::Norm);
                a.writes.push(Buffer::Norm);
            }
            Op::Clip => {
                a.reads.push(Buffer::Norm);
                for param in self.held_params(rank) {
                    a.reads.push(Buffer::Reduced { param });
                    a.writes.push(Buffer::Reduced { param });
                }
            }
            op => unreachable!("{} is not in the step's tail", op.kind()),
        }
        a
    }

    /// [`Plan::access`] of a forward plan's gathered parameters: `unshard`, the trainer's
    /// `forward` and `backward` points that read them, and `reshard`.
    fn gathered_access(&self, rank: u32, node: &Node) -> Access {
        let mut a = Access::default();
        match node.op {
            Op::Unshard {
                param,
                micro_batch,
                pass,
                collective,
            } => {
                if self.unshard_supplies(rank, &collective) {
                    a.reads.push(Buffer::Param { param });
                }
                a.writes.push(Buffer::Full {
                    param,
                    micro_batch,
                    pass,
                });
            }
            Op::Forward { layer } | Op::Backward { layer } => {
                let micro_batch = node.micro_batch.unwrap_or(0);
                let pass = match node.op {
                    Op::Forward { .. } => Pass::Forward,
                    _ => self.forward.unwrap_or_default().backward_pass(),
                };
                a.reads
                    .extend(self.layer_params(layer).map(|param| Buffer::Full {
                        param,
                        micro_batch,
                        pass,
                    }));
            }
            // Freeing is a write: it must wait for every reader.
            Op::Reshard {
                param,
                micro_batch,
                pass,
            } => a.writes.push(Buffer::Full {
                param,
                micro_batch,
                pass,
            }),
            op => unreachable!("{} does not touch gathered parameters", op.kind()),
        }
        a
    }

    /// The input of a bucket's stage (the send buffer for Stage 1, the Stage-1 output
    /// for Stage 2) and whether the rank receives the stage's result.
    pub fn stage_input(
        &self,
        b: BucketId,
        micro_batch: u32,
        stage: u8,
        rank: u32,
    ) -> (Buffer, bool) {
        if stage == 1 {
            (
                Buffer::Send {
                    bucket: b,
                    micro_batch,
                },
                self.holds_stage1(b, rank),
            )
        } else {
            (
                Buffer::Stage1Out {
                    bucket: b,
                    micro_batch,
                },
                self.holds_stage2(b, rank),
            )
        }
    }

    /// The output of a bucket's stage: its Stage-1 or Stage-2 output buffer.
    pub fn stage_output(b: BucketId, micro_batch: u32, stage: u8) -> Buffer {
        if stage == 1 {
            Buffer::Stage1Out {
                bucket: b,
                micro_batch,
            }
        } else {
            Buffer::Stage2Out {
                bucket: b,
                micro_batch,
            }
        }
    }

    /// The collective a bucket's Stage 1 (`stage == 1`) or Stage 2 (`stage == 2`) must
    /// issue on a rank: reduce-scatter / all-reduce for sharded routes, reduce to the
    /// owner's shard index / replicate index for owned ones, over the rank's shard /
    /// replicate group, with the plan's reduce op and dtype.
    pub fn stage_collective(&self, b: BucketId, rank: u32, stage: u8) -> Collective {
        let me = self.mesh.coord(rank);
        let owner = self.bucket(b).owner;
        let (group, kind, root) = match (stage, owner) {
            (1, None) => (
                Group::Shard {
                    replicate: me.replicate,
                },
                CollectiveKind::ReduceScatter,
                None,
            ),
            (1, Some(o)) => (
                Group::Shard {
                    replicate: me.replicate,
                },
                CollectiveKind::Reduce,
                Some(o.shard),
            ),
            (_, None) => (
                Group::Replicate { shard: me.shard },
                CollectiveKind::AllReduce,
                None,
            ),
            (_, Some(o)) => (
                Group::Replicate { shard: me.shard },
                CollectiveKind::Reduce,
                Some(o.replicate),
            ),
        };
        Collective {
            kind,
            group,
            count: self.stage1_elems(b),
            dtype: self.reduce.dtype,
            op: self.reduce.op,
            root,
        }
    }

    /// The broadcast that publishes an owned parameter: from its owner over the owner's
    /// replicate group, in f32. `None` for sharded routes.
    pub fn publish_collective(&self, p: ParamId) -> Option<Collective> {
        let placed = self.param(p);
        let o = placed.owner?;
        Some(Collective {
            kind: CollectiveKind::Broadcast,
            group: Group::Replicate { shard: o.shard },
            count: placed.spec.numel(),
            dtype: DType::F32,
            op: ReduceOp::Sum,
            root: Some(o.replicate),
        })
    }

    /// The collective a node must issue on a rank, if its operation issues one.
    pub fn expected_collective(&self, rank: u32, node: &Node) -> Option<Collective> {
        match node.op {
            Op::Stage1 { bucket, .. }
            | Op::Stage2 { bucket, .. }
            | Op::Exchange { bucket, .. }
            | Op::Combine { bucket, .. }
            | Op::Gather { bucket, .. } => {
                Some(self.stage_collective(bucket, rank, node.op.stage()?))
            }
            Op::Publish { param, .. } => self.publish_collective(param),
            Op::Unshard { param, .. } => Some(self.unshard_collective(param, rank)),
            Op::NormReduce { collective } => {
                Some(self.norm_collective(rank, matches!(collective.group, Group::Shard { .. })))
            }
            _ => None,
        }
    }

    /// A short human label of a node: `stage1 b3 m0 (reduce_scatter)`.
    pub fn label(&self, node: &Node) -> String {
        let mb = node
            .micro_batch
            .map(|m| format!(" m{m}"))
            .unwrap_or_default();
        match node.op {
            Op::GradReady { layer } => format!("grad_ready L{layer}{mb}"),
            Op::Optimizer {
                param,
                optimizer: kind,
            } => {
                format!(
                    "optimizer {} ({})",
                    self.param(param).spec.name,
                    if kind == OptimizerKind::Muon {
                        "muon"
                    } else {
                        "adamw"
                    }
                )
            }
            Op::Publish { param, .. } => format!("publish {}", self.param(param).spec.name),
            Op::GradNorm => "grad_norm".into(),
            Op::Clip => "clip".into(),
            Op::NormReduce { collective } => format!("norm_reduce on {}", collective.group),
            Op::Forward { layer } => format!("forward L{layer}{mb}"),
            Op::Backward { layer } => format!("backward L{layer}{mb}"),
            Op::Unshard {
                param,
                pass,
                collective,
                ..
            } => format!(
                "unshard {}{mb} {} ({} on {})",
                self.param(param).spec.name,
                pass.short(),
                collective.kind.name(),
                collective.group
            ),
            Op::Reshard { param, pass, .. } => format!(
                "reshard {}{mb} {}",
                self.param(param).spec.name,
                pass.short()
            ),
            op => {
                let b = op.bucket().unwrap_or(0);
                match op.named_collective() {
                    Some(c) => format!("{} b{b}{mb} ({} on {})", op.kind(), c.kind.name(), c.group),
                    None => format!("{} b{b}{mb}", op.kind()),
                }
            }
        }
    }

    /// The names of the parameters of a bucket, comma-separated.
    pub fn bucket_param_names(&self, b: BucketId) -> String {
        self.bucket(b)
            .params
            .iter()
            .map(|&p| self.param(p).spec.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Writes the plan as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a plan always serialises")
    }

    /// Reads a plan from JSON and checks that it is well formed (ids in range, the
    /// format tag and version); the invariants are [`crate::validate()`]'s job.
    pub fn from_json(text: &str) -> Result<Plan, PlanError> {
        let plan: Plan = serde_json::from_str(text).map_err(|e| {
            PlanError::Json(format!("line {}, column {}: {e}", e.line(), e.column()))
        })?;
        plan.check_well_formed()?;
        Ok(plan)
    }

    /// Structural checks that make every other method safe to call.
    pub fn check_well_formed(&self) -> Result<(), PlanError> {
        self.check_header()?;
        self.check_params()?;
        self.check_buckets()?;
        if self.ranks.len() as u64 != u64::from(self.mesh.world()) {
            return bad_input(
                "ranks".into(),
                format!(
                    "mesh {} has {} ranks, the plan has {} programs",
                    self.mesh,
                    self.mesh.world(),
                    self.ranks.len()
                ),
            );
        }
        for (ri, rp) in self.ranks.iter().enumerate() {
            self.check_rank(ri, rp)?;
        }
        Ok(())
    }

    /// The format tag, the version, the mesh, and at least one micro-batch.
    fn check_header(&self) -> Result<(), PlanError> {
        if self.format != PLAN_FORMAT {
            return bad_input(
                "format".into(),
                format!("expected \"{PLAN_FORMAT}\", got {:?}", self.format),
            );
        }
        if self.version != PLAN_VERSION {
            return bad_input(
                "version".into(),
                format!(
                    "this build reads version {PLAN_VERSION}, got {}",
                    self.version
                ),
            );
        }
        self.mesh.check()?;
        if self.gates.is_empty() {
            return bad_input(
                "gates".into(),
                "a step needs at least one micro-batch".into(),
            );
        }
        Ok(())
    }

    /// Every parameter's spec, and an owner inside the mesh exactly for owned routes.
    fn check_params(&self) -> Result<(), PlanError> {
        for (i, p) in self.params.iter().enumerate() {
            p.spec.check()?;
            match (p.spec.route.is_owned(), p.owner) {
                (true, None) => {
                    return bad_input(
                        format!("params[{i}].owner"),
                        format!("owned route {} needs an owner", p.spec.route),
                    )
                }
                (false, Some(_)) => {
                    return bad_input(
                        format!("params[{i}].owner"),
                        format!("sharded route {} has no owner", p.spec.route),
                    )
                }
                (_, Some(o))
                    if o.shard >= self.mesh.shard || o.replicate >= self.mesh.replicate =>
                {
                    return bad_input(
                        format!("params[{i}].owner"),
                        format!(
                            "owner ({}, {}) is outside mesh {}",
                            o.shard, o.replicate, self.mesh
                        ),
                    )
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Bucket ids in order; every bucket's parameters exist and share its layer, route
    /// and owner.
    fn check_buckets(&self) -> Result<(), PlanError> {
        let np = self.params.len() as u64;
        for (i, b) in self.buckets.iter().enumerate() {
            if b.id as usize != i {
                return bad_input(
                    format!("buckets[{i}].id"),
                    format!("expected {i}, got {}", b.id),
                );
            }
            if b.params.is_empty() {
                return bad_input(
                    format!("buckets[{i}].params"),
                    "a bucket needs at least one parameter".into(),
                );
            }
            for &p in &b.params {
                if u64::from(p) >= np {
                    return bad_input(
                        format!("buckets[{i}].params"),
                        format!("parameter {p} does not exist ({np} parameters)"),
                    );
                }
                let spec = &self.param(p);
                if spec.spec.route != b.route || spec.spec.layer != b.layer || spec.owner != b.owner
                {
                    return bad_input(
                        format!("buckets[{i}].params"),
                        format!(
                            "parameter `{}` does not share the bucket's layer, route and owner",
                            spec.spec.name
                        ),
                    );
                }
            }
        }
        Ok(())
    }

    /// Rank `ri`'s program: its rank number, every node, then its stream programs.
    fn check_rank(&self, ri: usize, rp: &RankProgram) -> Result<(), PlanError> {
        if rp.rank as usize != ri {
            return malformed(
                ri,
                None,
                None,
                "rank".into(),
                format!("expected {ri}, got {}", rp.rank),
            );
        }
        for (ni, n) in rp.nodes.iter().enumerate() {
            if let Err((field, reason)) = self.check_node(ni, n) {
                let path = format!("nodes[{ni}].{field}");
                return malformed(ri, Some(n.stream), Some(ni as u32), path, reason);
            }
        }
        check_stream_programs(ri, rp)
    }

    /// Node `ni` of a rank: its id, micro-batch, stage and the ids it names (bucket,
    /// parameter, group, root) in range. An error names the field and why.
    fn check_node(&self, ni: usize, n: &Node) -> Result<(), (&'static str, String)> {
        let (np, nb) = (self.params.len() as u64, self.buckets.len() as u64);
        if n.id as usize != ni {
            return Err(("id", format!("expected {ni}, got {}", n.id)));
        }
        if let Some(m) = n.micro_batch {
            if m >= self.micro_batches() {
                let reason = format!(
                    "{m} is past the step's {} micro-batches",
                    self.micro_batches()
                );
                return Err(("micro_batch", reason));
            }
        }
        if n.op.micro_batch().is_some_and(|m| Some(m) != n.micro_batch) {
            let reason = "differs from the micro-batch its operation names".into();
            return Err(("micro_batch", reason));
        }
        if (matches!(n.op, Op::Optimizer { .. } | Op::Publish { .. }) || n.op.is_norm())
            != n.micro_batch.is_none()
        {
            let reason = "optimizer, publish and norm (grad_norm, norm_reduce, clip) nodes, and only they, belong to the step (null)".into();
            return Err(("micro_batch", reason));
        }
        if let Op::Exchange { stage, .. } | Op::Combine { stage, .. } | Op::Gather { stage, .. } =
            n.op
        {
            if stage != 1 && stage != 2 {
                return Err(("stage", format!("stage {stage} does not exist (1 or 2)")));
            }
        }
        if let Some(b) = n.op.bucket() {
            if u64::from(b) >= nb {
                return Err((
                    "bucket",
                    format!("bucket {b} does not exist ({nb} buckets)"),
                ));
            }
        }
        if n.op.is_forward() && self.forward.is_none() {
            let reason = format!("{} node in a plan without `forward`", n.op.kind());
            return Err(("op", reason));
        }
        if let Some(param) = n.op.param() {
            if u64::from(param) >= np {
                let reason = format!("parameter {param} does not exist ({np} parameters)");
                return Err(("param", reason));
            }
        }
        if let Some(c) = n.op.named_collective() {
            if !self.mesh.has_group(c.group) {
                let reason = format!("{} is not a group of mesh {}", c.group, self.mesh);
                return Err(("collective.group", reason));
            }
            if let Some(root) = c.root {
                if root >= self.mesh.group_size(c.group) {
                    let reason = format!("root {root} is outside {}", c.group);
                    return Err(("collective.root", reason));
                }
            }
        }
        Ok(())
    }
}

/// A [`PlanError::Input`] at `key`.
fn bad_input(key: String, reason: String) -> Result<(), PlanError> {
    Err(PlanError::Input { key, reason })
}

/// A [`PlanError::Malformed`] at `ranks[rank].path`, naming the stream and node if known.
fn malformed(
    rank: usize,
    stream: Option<Stream>,
    node: Option<u32>,
    path: String,
    reason: String,
) -> Result<(), PlanError> {
    Err(PlanError::Malformed {
        path: format!("ranks[{rank}].{path}"),
        reason,
        rank: rank as u32,
        stream,
        node,
    })
}

/// Rank `ri`'s stream programs: an event count its instructions could record, each stream
/// once, every `Run` of an existing node on its own stream, every node run exactly once,
/// every event in range.
fn check_stream_programs(ri: usize, rp: &RankProgram) -> Result<(), PlanError> {
    // Executors allocate an entry per event up front: more events than the
    // rank's instructions could ever record is a malformed count, not a plan.
    let instrs: u64 = rp.streams.iter().map(|sp| sp.instrs.len() as u64).sum();
    if u64::from(rp.events) > instrs {
        return malformed(
            ri,
            None,
            None,
            "events".into(),
            format!(
                "{} events, more than the rank's {instrs} instructions can record",
                rp.events
            ),
        );
    }
    let mal = |stream: Option<Stream>, node: Option<u32>, path: String, reason: String| {
        malformed(ri, stream, node, path, reason)
    };
    let mut seen = vec![false; rp.nodes.len()];
    let mut streams_seen = [false; Stream::COUNT];
    for (si, sp) in rp.streams.iter().enumerate() {
        if std::mem::replace(&mut streams_seen[sp.stream.index()], true) {
            return mal(
                Some(sp.stream),
                None,
                format!("streams[{si}]"),
                format!("stream {} appears twice", sp.stream),
            );
        }
        for (ii, ins) in sp.instrs.iter().enumerate() {
            let here = || format!("streams[{si}].instrs[{ii}]");
            let st = Some(sp.stream);
            match *ins {
                Instr::Run(n) => {
                    let Some(node) = rp.nodes.get(n as usize) else {
                        return mal(st, None, here(), format!("node {n} does not exist"));
                    };
                    if node.stream != sp.stream {
                        return mal(
                            st,
                            Some(n),
                            here(),
                            format!(
                                "node {n} is bound to stream {} but listed on {}",
                                node.stream, sp.stream
                            ),
                        );
                    }
                    if std::mem::replace(&mut seen[n as usize], true) {
                        return mal(st, Some(n), here(), format!("node {n} runs twice"));
                    }
                }
                Instr::Record(e) | Instr::Wait(e) if e >= rp.events => {
                    return mal(
                        st,
                        None,
                        here(),
                        format!("event {e} is past the program's {} events", rp.events),
                    );
                }
                _ => {}
            }
        }
    }
    if let Some(n) = seen.iter().position(|s| !s) {
        return mal(
            rp.nodes.get(n).map(|x| x.stream),
            Some(n as u32),
            format!("nodes[{n}]"),
            "the node is never run by any stream".into(),
        );
    }
    Ok(())
}
