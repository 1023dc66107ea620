//! The node vocabulary: streams, buffers, collectives and typed operations.
//!
//! A [`Node`] is one operation bound to one [`Stream`] of one rank. What it reads and
//! writes is not stored: [`crate::Plan::access`] derives it from the [`Op`] and the
//! bucket tables, so an edited plan cannot claim accesses its operation does not make.

use serde::{Deserialize, Serialize};

use crate::mesh::Group;
use crate::param::ParamId;

/// Index of a bucket in [`crate::Plan::buckets`].
pub type BucketId = u32;
/// Index of a node within one rank's program.
pub type NodeId = u32;
/// Index of an event within one rank's program.
pub type EventId = u32;

/// The streams of a rank. The priorities are FSDP2's: reduce high, the rest default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    /// The trainer's backward, `grad_ready(layer)`, no_sync accumulation, optimizer steps.
    Compute,
    /// Copy-in/pack, Stage 1, fold (high priority).
    Reduce,
    /// Stage 2, unpack/scale.
    Replicate,
    /// The post-step broadcast.
    Publish,
    /// Copy-transport exchanges: copy-engine transfers and the stream-memory waits
    /// that order them, kept off the streams that run kernels.
    Copy,
}

impl Stream {
    /// How many streams a rank has.
    pub const COUNT: usize = 5;

    /// Every stream, in index order.
    pub const ALL: [Stream; Stream::COUNT] = [
        Stream::Compute,
        Stream::Reduce,
        Stream::Replicate,
        Stream::Publish,
        Stream::Copy,
    ];

    /// Dense index `0..Stream::COUNT`.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The name used in plans, metrics and traces.
    pub fn name(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::Reduce => "reduce",
            Stream::Replicate => "replicate",
            Stream::Publish => "publish",
            Stream::Copy => "copy",
        }
    }

    /// Parses a stream name.
    pub fn parse(s: &str) -> Result<Stream, String> {
        Stream::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown stream `{s}`; expected compute, reduce, replicate, publish or copy"
                )
            })
    }

    /// Whether the stream runs at high priority.
    pub fn high_priority(self) -> bool {
        self == Stream::Reduce
    }
}

impl std::fmt::Display for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A rank-local buffer, named by what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Buffer {
    /// The trainer's full gradient of a parameter for one micro-batch.
    Grad {
        /// The parameter whose gradient it is.
        param: ParamId,
        /// The micro-batch whose backward produced it.
        micro_batch: u32,
    },
    /// The no_sync local accumulation of a parameter's full gradient.
    Accum {
        /// The parameter whose no_sync gradients it sums.
        param: ParamId,
    },
    /// A bucket's packed Stage-1 input for one micro-batch.
    Send {
        /// The bucket whose gradients are packed into it.
        bucket: BucketId,
        /// The micro-batch whose gradients it carries (with the no_sync accumulation
        /// when its `pack` has `with_accum`).
        micro_batch: u32,
    },
    /// A bucket's Stage-1 output (this rank's shard, or the owner's whole bucket).
    Stage1Out {
        /// The bucket reduced.
        bucket: BucketId,
        /// The micro-batch whose Stage 1 wrote it.
        micro_batch: u32,
    },
    /// A bucket's partial: Stage-1 outputs of replicate-gate-off micro-batches.
    Partial {
        /// The bucket whose Stage-1 outputs it sums across the step's micro-batches.
        bucket: BucketId,
    },
    /// A bucket's Stage-2 output.
    Stage2Out {
        /// The bucket reduced.
        bucket: BucketId,
        /// The gate-on micro-batch whose Stage 2 wrote it.
        micro_batch: u32,
    },
    /// Copy transport: the chunks the other members of a stage's group sent this rank,
    /// one after another in member order (`(n − 1) · count` elements), which the
    /// stage's [`Op::Combine`] reduces.
    Recv {
        /// The bucket whose chunks it receives.
        bucket: BucketId,
        /// The micro-batch whose stage the chunks belong to.
        micro_batch: u32,
        /// The stage (1: shard group, 2: replicate group) whose exchange fills it.
        stage: u8,
    },
    /// The reduced gradient of a parameter the optimizer consumes (this rank's piece).
    Reduced {
        /// The parameter whose reduced gradient it is.
        param: ParamId,
    },
    /// The parameter's values held by this rank (shard or whole).
    Param {
        /// The parameter whose values it holds.
        param: ParamId,
    },
    /// The optimizer's state for this rank's piece of the parameter.
    OptState {
        /// The parameter whose optimizer state it is (AdamW moments or Muon momentum).
        param: ParamId,
    },
    /// Forward plans: a parameter's full values on this rank, gathered by an
    /// [`Op::Unshard`] for one micro-batch's forward or backward pass and freed by its
    /// [`Op::Reshard`]. Sharded routes: the all-gather's `S · chunk` elements, the
    /// parameter first and the padding after; owned routes: `numel`.
    Full {
        /// The parameter gathered.
        param: ParamId,
        /// The micro-batch whose pass reads it.
        micro_batch: u32,
        /// The pass it serves: the forward, or the backward's own gather.
        pass: Pass,
    },
    /// One element: this rank's sum of squares of the reduced gradients it counts
    /// ([`Op::GradNorm`]), then, after the [`Op::NormReduce`]s, the world's sum: the
    /// squared global L2 norm of the step's gradient. Read by [`Op::Clip`] and by every
    /// optimizer of a plan that has it (which does nothing when it is not finite).
    Norm,
}

impl Buffer {
    /// Buffers that live only within one micro-batch and are recycled through the pool.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Buffer::Grad { .. }
                | Buffer::Send { .. }
                | Buffer::Stage1Out { .. }
                | Buffer::Stage2Out { .. }
                | Buffer::Recv { .. }
                | Buffer::Full { .. }
        )
    }

    /// Buffers that hold state across steps (not written within a step before being read).
    pub fn is_persistent(&self) -> bool {
        matches!(self, Buffer::Param { .. } | Buffer::OptState { .. })
    }
}

impl std::fmt::Display for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Buffer::Grad { param, micro_batch } => write!(f, "grad[p{param},m{micro_batch}]"),
            Buffer::Accum { param } => write!(f, "accum[p{param}]"),
            Buffer::Send {
                bucket,
                micro_batch,
            } => write!(f, "send[b{bucket},m{micro_batch}]"),
            Buffer::Stage1Out {
                bucket,
                micro_batch,
            } => write!(f, "stage1_out[b{bucket},m{micro_batch}]"),
            Buffer::Partial { bucket } => write!(f, "partial[b{bucket}]"),
            Buffer::Stage2Out {
                bucket,
                micro_batch,
            } => write!(f, "stage2_out[b{bucket},m{micro_batch}]"),
            Buffer::Recv {
                bucket,
                micro_batch,
                stage,
            } => write!(f, "recv{stage}[b{bucket},m{micro_batch}]"),
            Buffer::Reduced { param } => write!(f, "reduced[p{param}]"),
            Buffer::Param { param } => write!(f, "param[p{param}]"),
            Buffer::OptState { param } => write!(f, "opt_state[p{param}]"),
            Buffer::Full {
                param,
                micro_batch,
                pass,
            } => write!(f, "full_{}[p{param},m{micro_batch}]", pass.short()),
            Buffer::Norm => f.write_str("norm"),
        }
    }
}

/// Which pass of a micro-batch a forward plan's gathered parameters serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    /// The trainer's forward of the layer.
    Forward,
    /// The trainer's backward of the layer (gathered again when the forward's were
    /// freed: `reshard_after_forward`).
    Backward,
}

impl Pass {
    /// `fwd` or `bwd`, as buffer names and labels write it.
    pub fn short(self) -> &'static str {
        match self {
            Pass::Forward => "fwd",
            Pass::Backward => "bwd",
        }
    }
}

/// The collective operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    /// Each member gets the reduction of its chunk.
    ReduceScatter,
    /// Every member gets the reduction.
    AllReduce,
    /// The root gets the reduction.
    Reduce,
    /// Every member gets the root's buffer.
    Broadcast,
    /// Every member gets the concatenation of all members' chunks.
    AllGather,
}

impl CollectiveKind {
    /// The name used in plans and metrics.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::Reduce => "reduce",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::AllGather => "all_gather",
        }
    }

    /// Whether the collective has a root.
    pub fn rooted(self) -> bool {
        matches!(self, CollectiveKind::Reduce | CollectiveKind::Broadcast)
    }
}

/// The reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ReduceOp {
    /// Sum divided by the group size.
    #[default]
    Avg,
    /// Plain sum.
    Sum,
}

/// Element type of a reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// IEEE single precision.
    #[default]
    F32,
    /// bfloat16: the buffer is rounded to bf16 before the collective and reduced in f32.
    Bf16,
}

impl DType {
    /// Bytes per element on the wire.
    pub fn size(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }
}

/// One collective call as every member of its communicator must issue it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Collective {
    /// What it computes.
    pub kind: CollectiveKind,
    /// The group it runs on. The communicator is the group bound to the node's stream.
    pub group: Group,
    /// Elements per member of the reduced or broadcast buffer: the output chunk for
    /// reduce-scatter, the input chunk for all-gather, the whole buffer otherwise.
    pub count: u64,
    /// Element type.
    pub dtype: DType,
    /// Reduction operator (ignored by broadcast and all-gather).
    pub op: ReduceOp,
    /// Root index within the group for reduce and broadcast.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<u32>,
}

/// Chunk boundaries are multiples of this many elements (256 bytes of f32), so every
/// member's chunk of a copy-transport all-reduce starts aligned for vector loads.
pub const CHUNK_ALIGN: u64 = 64;

impl Collective {
    /// The part of the reduced buffer member `index` of a group of `size` reduces and
    /// then hands to the others in a copy-transport stage, as `(offset, len)` in
    /// elements of a stage's input and output: its own chunk for reduce-scatter
    /// (`index·count`, `count`: `count` is the chunk there); for all-reduce, chunk
    /// `index` of `⌈count / size⌉` rounded up to [`CHUNK_ALIGN`] (the last chunks may be
    /// shorter or empty); the whole buffer for reduce (only the root reduces).
    pub fn member_chunk(&self, size: u32, index: u32) -> (u64, u64) {
        match self.kind {
            CollectiveKind::ReduceScatter => {
                (self.count.saturating_mul(u64::from(index)), self.count)
            }
            CollectiveKind::AllReduce => {
                let size = u64::from(size.max(1));
                let c = self
                    .count
                    .div_ceil(size)
                    .div_ceil(CHUNK_ALIGN)
                    .saturating_mul(CHUNK_ALIGN);
                let start = c.saturating_mul(u64::from(index)).min(self.count);
                let end = start.saturating_add(c).min(self.count);
                (start, end - start)
            }
            _ => (0, self.count),
        }
    }
}

impl std::fmt::Display for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dtype = match self.dtype {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        };
        let op = match self.op {
            ReduceOp::Avg => "avg",
            ReduceOp::Sum => "sum",
        };
        write!(
            f,
            "{} of {} {dtype} ({op}) on {}",
            self.kind.name(),
            self.count,
            self.group
        )?;
        if let Some(r) = self.root {
            write!(f, " root {r}")?;
        }
        Ok(())
    }
}

/// The optimizer a parameter's route selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// Decoupled-weight-decay Adam on the rank's piece.
    Adamw,
    /// Momentum + Newton–Schulz orthogonalisation on the owner's whole matrix.
    Muon,
}

/// A typed operation. Flags say whether the node accumulates into its destination or
/// initialises it; they are part of the plan so the validator can check the accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Op {
    /// The trainer's backward produced the gradients of `layer` (writes their `grad` buffers).
    GradReady {
        /// The layer whose backward finished (the trainer's `grad_ready(layer)`).
        layer: u32,
    },
    /// no_sync: `accum (+)= grad` for every parameter of the bucket.
    Accumulate {
        /// The bucket whose parameters it works on.
        bucket: BucketId,
        /// The no_sync micro-batch whose gradients are added.
        micro_batch: u32,
        /// Add into the accumulation (`+=`); `false`: the step's first no_sync
        /// micro-batch initialises it (`=`).
        accumulate: bool,
    },
    /// Copy the bucket's gradients (plus their no_sync accumulation) into the send buffer,
    /// in the Stage-1 layout.
    Pack {
        /// The bucket whose parameters it works on.
        bucket: BucketId,
        /// The micro-batch whose gradients are packed.
        micro_batch: u32,
        /// Also add the no_sync accumulation of the earlier micro-batches (which this
        /// pack consumes).
        with_accum: bool,
    },
    /// Stage 1 on the shard group: reduce-scatter or reduce to the owner's shard index.
    Stage1 {
        /// The bucket whose parameters it works on.
        bucket: BucketId,
        /// The micro-batch whose packed gradients are reduced.
        micro_batch: u32,
        /// The call on the shard group: a reduce-scatter (sharded routes) or a reduce
        /// rooted at the owner's shard index (owned routes).
        collective: Collective,
    },
    /// Replicate gate off: `partial (+)= stage1_out`.
    Fold {
        /// The bucket whose parameters it works on.
        bucket: BucketId,
        /// The replicate-gate-off micro-batch whose Stage-1 output is folded.
        micro_batch: u32,
        /// Add into the partial (`+=`); `false`: the step's first fold initialises it.
        accumulate: bool,
    },
    /// Gate on: `stage1_out += partial`; the partial is released.
    FoldPartial {
        /// The bucket whose parameters it works on.
        bucket: BucketId,
        /// The gate-on micro-batch whose Stage-1 output takes in the partial.
        micro_batch: u32,
    },
    /// Stage 2 on the replicate group: all-reduce, or reduce to the owner's replicate index.
    Stage2 {
        /// The bucket whose parameters it works on.
        bucket: BucketId,
        /// The gate-on micro-batch whose Stage-1 output is reduced.
        micro_batch: u32,
        /// The call on the replicate group: an all-reduce (sharded routes) or a reduce
        /// rooted at the owner's replicate index (owned routes).
        collective: Collective,
    },
    /// Copy transport, the moving half of a stage (`stage` 1 or 2): every member copies
    /// the chunks the others need into their [`Buffer::Recv`], without arithmetic (on
    /// GPUs: copy engines over NVLink, no SMs). `collective` is the reduction the stage
    /// performs; every member of its group issues the same exchanges in the same order.
    Exchange {
        /// The bucket whose parameters it works on.
        bucket: BucketId,
        /// The micro-batch whose stage input is exchanged.
        micro_batch: u32,
        /// The stage (1: shard group, 2: replicate group) whose chunks move.
        stage: u8,
        /// The reduction the stage performs, whose chunks it moves.
        collective: Collective,
    },
    /// Copy transport, the arithmetic half of a stage: the rank's own contribution plus
    /// its [`Buffer::Recv`], reduced by `collective`'s operator into the stage's output
    /// (Stage-1 or Stage-2 output; for an all-reduce, only the rank's own chunk of it,
    /// [`Collective::member_chunk`]). Local: it may be bound to any stream and issued
    /// later than its exchange (`[overlap] combine_lag`).
    Combine {
        /// The bucket whose parameters it works on.
        bucket: BucketId,
        /// The micro-batch whose stage it completes.
        micro_batch: u32,
        /// The stage (1 or 2) whose received chunks it reduces.
        stage: u8,
        /// The reduction the stage performs: its operator, dtype and chunks.
        collective: Collective,
    },
    /// Copy transport, the last third of an all-reduce stage: after its combine, every
    /// member copies its reduced chunk of the stage's output into the others' (on GPUs:
    /// copy engines, no SMs), so every replica ends with the whole result. Cross-rank,
    /// on the exchange's stream (its communicator), in the same order on every member.
    Gather {
        /// The bucket whose parameters it works on.
        bucket: BucketId,
        /// The micro-batch whose stage output is gathered.
        micro_batch: u32,
        /// The stage whose all-reduced output it completes on every member.
        stage: u8,
        /// The stage's all-reduce, whose member chunks it hands around.
        collective: Collective,
    },
    /// Scatter the Stage-2 output into each parameter's reduced gradient (`(+)=`).
    Unpack {
        /// The bucket whose parameters it works on.
        bucket: BucketId,
        /// The gate-on micro-batch whose Stage-2 output is unpacked.
        micro_batch: u32,
        /// Add into the reduced gradients (`+=`); `false`: the step's first unpack of
        /// the bucket initialises them.
        accumulate: bool,
    },
    /// Forward plans: gathers parameter `param`'s full values on this rank into
    /// [`Buffer::Full`] for micro-batch `micro_batch`'s `pass`: an all-gather of every
    /// member's shard over the shard group (`fsdp`, `sharded_adamw`), or a broadcast
    /// over the shard group from the owner's shard index, whose rank holds the whole
    /// tensor (the owner, or a replica the last publish updated) (`muon`, `adamw`).
    /// Reads the rank's `param` where it supplies values (every member of an
    /// all-gather, the broadcast's root).
    Unshard {
        /// The parameter gathered.
        param: ParamId,
        /// The micro-batch whose pass reads the full values.
        micro_batch: u32,
        /// The pass the full values serve.
        pass: Pass,
        /// The all-gather (sharded routes) or broadcast from the owner's shard index
        /// (owned routes), over the rank's shard group.
        collective: Collective,
    },
    /// Forward plans: the trainer's forward of `layer` starts (reads the layer's
    /// forward [`Buffer::Full`]s). Like `grad_ready`, a point of the trainer's own work:
    /// its waits order the trainer's kernels after the gathers.
    Forward {
        /// The layer whose forward starts.
        layer: u32,
    },
    /// Forward plans: the trainer's backward of `layer` starts (reads the full
    /// parameters it needs: the backward's gathers, or the forward's when they were
    /// kept, `reshard_after_forward = false`). Its `grad_ready` ends it.
    Backward {
        /// The layer whose backward starts.
        layer: u32,
    },
    /// Forward plans: frees a [`Buffer::Full`] once the trainer's pass that read it is
    /// over (bound to the trainer's stream, after the point that read it).
    Reshard {
        /// The parameter whose full values are freed.
        param: ParamId,
        /// The micro-batch whose pass read them.
        micro_batch: u32,
        /// The pass whose gathered copy is freed.
        pass: Pass,
    },
    /// Global-norm clipping, first of the step's tail: `norm = Σ x²` over the reduced
    /// gradients this rank counts ([`crate::Plan::norm_params`]: every element of every
    /// parameter once in the world, padding excluded).
    GradNorm,
    /// Sums the one-element norm buffer over `collective.group` (an all-reduce of one
    /// f32, `sum`): over the shard group, then over the replicate group, which together
    /// sum it over the world with the communicators every plan already has.
    NormReduce {
        /// The one-f32 `sum` all-reduce, over the shard group or the replicate group.
        collective: Collective,
    },
    /// Scales every reduced gradient this rank holds by
    /// `min(1, max_norm / (√norm + 1e-6))` (torch's `clip_grad_norm_`); the threshold is
    /// the executor's (`[clip] max_norm`), none leaves the gradients as they are.
    Clip,
    /// The optimizer step of one parameter's piece on this rank.
    Optimizer {
        /// The parameter stepped.
        param: ParamId,
        /// The optimizer its route selects.
        optimizer: OptimizerKind,
    },
    /// The owner broadcasts the updated parameter over its replicate group.
    Publish {
        /// The parameter whose updated values are sent.
        param: ParamId,
        /// The broadcast over the owner's replicate group, rooted at the owner's
        /// replicate index.
        collective: Collective,
    },
}

impl Op {
    /// Short kind name: `grad_ready`, `stage1`, `fold`, ...; the `op` label of metrics.
    pub fn kind(&self) -> &'static str {
        Op::KINDS[self.kind_index()]
    }

    /// Every kind name, at [`Op::kind_index`].
    pub const KINDS: [&'static str; 20] = [
        "grad_ready",
        "accumulate",
        "pack",
        "stage1",
        "fold",
        "fold_partial",
        "stage2",
        "exchange",
        "combine",
        "gather",
        "unpack",
        "optimizer",
        "publish",
        "grad_norm",
        "norm_reduce",
        "clip",
        "unshard",
        "forward",
        "backward",
        "reshard",
    ];

    /// Dense index of the kind in [`Op::KINDS`], for per-kind tables.
    pub fn kind_index(&self) -> usize {
        match self {
            Op::GradReady { .. } => 0,
            Op::Accumulate { .. } => 1,
            Op::Pack { .. } => 2,
            Op::Stage1 { .. } => 3,
            Op::Fold { .. } => 4,
            Op::FoldPartial { .. } => 5,
            Op::Stage2 { .. } => 6,
            Op::Exchange { .. } => 7,
            Op::Combine { .. } => 8,
            Op::Gather { .. } => 9,
            Op::Unpack { .. } => 10,
            Op::Optimizer { .. } => 11,
            Op::Publish { .. } => 12,
            Op::GradNorm => 13,
            Op::NormReduce { .. } => 14,
            Op::Clip => 15,
            Op::Unshard { .. } => 16,
            Op::Forward { .. } => 17,
            Op::Backward { .. } => 18,
            Op::Reshard { .. } => 19,
        }
    }

    /// The collective this node issues, if any: the call every member of its group
    /// must make in the same order (an [`Op::Exchange`] or [`Op::Gather`] is one; an
    /// [`Op::Combine`], which is local, is not).
    pub fn collective(&self) -> Option<&Collective> {
        match self {
            Op::Stage1 { collective, .. }
            | Op::Stage2 { collective, .. }
            | Op::Exchange { collective, .. }
            | Op::Gather { collective, .. }
            | Op::Publish { collective, .. }
            | Op::Unshard { collective, .. }
            | Op::NormReduce { collective } => Some(collective),
            _ => None,
        }
    }

    /// Whether the node belongs to the global-norm tail (norm, its all-reduces, clip).
    pub fn is_norm(&self) -> bool {
        matches!(self, Op::GradNorm | Op::NormReduce { .. } | Op::Clip)
    }

    /// Whether the node belongs to a forward plan's parameter gathering: an unshard, a
    /// reshard, or a trainer's forward or backward point.
    pub fn is_forward(&self) -> bool {
        matches!(
            self,
            Op::Unshard { .. } | Op::Forward { .. } | Op::Backward { .. } | Op::Reshard { .. }
        )
    }

    /// Whether the node is a point of the trainer's own work (`grad_ready`, `forward`,
    /// `backward`): the executor issues the nodes up to it when the trainer reaches it.
    pub fn is_point(&self) -> bool {
        matches!(
            self,
            Op::GradReady { .. } | Op::Forward { .. } | Op::Backward { .. }
        )
    }

    /// The layer a trainer's point names.
    pub fn point_layer(&self) -> Option<u32> {
        match *self {
            Op::GradReady { layer } | Op::Forward { layer } | Op::Backward { layer } => Some(layer),
            _ => None,
        }
    }

    /// The parameter a node names (optimizer, publish, unshard, reshard).
    pub fn param(&self) -> Option<ParamId> {
        match *self {
            Op::Optimizer { param, .. }
            | Op::Publish { param, .. }
            | Op::Unshard { param, .. }
            | Op::Reshard { param, .. } => Some(param),
            _ => None,
        }
    }

    /// The collective the node's fields name: [`Op::collective`] plus the reduction an
    /// [`Op::Combine`] completes.
    pub fn named_collective(&self) -> Option<&Collective> {
        match self {
            Op::Combine { collective, .. } => Some(collective),
            _ => self.collective(),
        }
    }

    /// The reduction stage (1 or 2) a stage node belongs to.
    pub fn stage(&self) -> Option<u8> {
        match *self {
            Op::Stage1 { .. } => Some(1),
            Op::Stage2 { .. } => Some(2),
            Op::Exchange { stage, .. } | Op::Combine { stage, .. } | Op::Gather { stage, .. } => {
                Some(stage)
            }
            _ => None,
        }
    }

    /// The micro-batch named by the operation, if it names one.
    pub fn micro_batch(&self) -> Option<u32> {
        match *self {
            Op::Accumulate { micro_batch, .. }
            | Op::Pack { micro_batch, .. }
            | Op::Stage1 { micro_batch, .. }
            | Op::Fold { micro_batch, .. }
            | Op::FoldPartial { micro_batch, .. }
            | Op::Stage2 { micro_batch, .. }
            | Op::Exchange { micro_batch, .. }
            | Op::Combine { micro_batch, .. }
            | Op::Gather { micro_batch, .. }
            | Op::Unpack { micro_batch, .. }
            | Op::Unshard { micro_batch, .. }
            | Op::Reshard { micro_batch, .. } => Some(micro_batch),
            _ => None,
        }
    }

    /// The bucket the node works on, if any.
    pub fn bucket(&self) -> Option<BucketId> {
        match *self {
            Op::Accumulate { bucket, .. }
            | Op::Pack { bucket, .. }
            | Op::Stage1 { bucket, .. }
            | Op::Fold { bucket, .. }
            | Op::FoldPartial { bucket, .. }
            | Op::Stage2 { bucket, .. }
            | Op::Exchange { bucket, .. }
            | Op::Combine { bucket, .. }
            | Op::Gather { bucket, .. }
            | Op::Unpack { bucket, .. } => Some(bucket),
            _ => None,
        }
    }
}

/// One operation of one rank's program.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    /// Position in the rank's serial order (the order whose results the plan must equal).
    pub id: NodeId,
    /// The micro-batch the node belongs to, or `None` for the step's optimizer/publish tail.
    pub micro_batch: Option<u32>,
    /// The stream the node is bound to.
    pub stream: Stream,
    /// What it does.
    pub op: Op,
}

/// One instruction of a stream program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Instr {
    /// Run a node.
    Run(NodeId),
    /// Record an event after everything issued before it on this stream.
    Record(EventId),
    /// Make later work on this stream wait for an event's record.
    Wait(EventId),
}
