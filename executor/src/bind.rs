//! Binding a node to its kernels: which of the rank's buffers each kernel of a node reads
//! and writes, and with which settings (a collective's communicator, an optimizer's
//! hyper-parameters, the clipping threshold), as a function of the prepared plan, the
//! rank, the node and a way to look buffers up ([`Buffers`]).
//!
//! Binding launches nothing, records nothing and changes no buffer the rank holds: the
//! issuing rank (`rank.rs`) allocates or aliases the node's outputs first, binds, then
//! launches what [`bind`] returned, in order, on the node's stream. The one thing it may
//! ask for is scratch memory (the zero-padded send of an all-gather whose shard is
//! shorter than its chunk), which only the returned kernels use.
//!
//! Invariant: a node's kernels touch only buffers the plan says the node accesses
//! ([`overlap_graph::Plan::access`]), so the validator's proofs about accesses hold for
//! what runs (the global norm the optimizers are guarded by, and scratch, aside).
//! An aliasing node (`prepared.rs`) is not bound: it launches a marker.

use std::sync::Arc;

use overlap_graph::{
    BucketId, Buffer, Collective, CollectiveKind, CopySeg, Node, Op, OptimizerKind, ParamId, Pass,
    Plan, Stream,
};
use overlap_ops::{CommId, Kernel};

use crate::prepared::Prepared;
use crate::{Backward, ExecError, HyperTable};

/// Where binding finds a rank's buffers.
pub(crate) trait Buffers {
    /// The backend's buffer handle.
    type Buf: Clone;
    /// The memory `name` has on this rank; an error when it has none.
    fn get(&self, name: &Buffer) -> Result<Self::Buf, ExecError>;
    /// Elements of `buf`.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// New memory of `len` elements that the kernels bound with it overwrite first.
    fn scratch(&self, len: usize) -> Result<Self::Buf, ExecError>;
    /// The reduced gradients of [`Prepared::norm_params`] as this step's `grad_norm` was
    /// bound to them, if it was: a clip of the same parameters scales that list.
    fn norm_list(&self) -> Option<Arc<[Self::Buf]>> {
        None
    }
}

/// The step's settings binding uses.
#[derive(Clone, Copy)]
pub(crate) struct Settings<'a> {
    /// Every parameter's optimizer settings.
    pub hyper: &'a HyperTable,
    /// The step's learning-rate factor.
    pub lr_factor: f64,
    /// The step (1-based; AdamW's bias correction).
    pub step: u64,
    /// What a `grad_ready` node launches.
    pub backward: Backward,
    /// The clipping threshold a `clip` node scales by (`None`: it scales nothing).
    pub max_norm: Option<f32>,
}

/// The kernels node `n` of `rank`'s program launches, in order, with their buffers
/// bound. Fails when a buffer the node reads or writes is missing (a bug: the plan
/// allocates before it writes) or scratch memory cannot be had; nothing was launched then.
pub(crate) fn bind<S: Buffers>(
    p: &Prepared,
    rank: u32,
    n: usize,
    set: &Settings<'_>,
    bufs: &S,
) -> Result<Kernels<S::Buf>, ExecError> {
    let plan = &*p.plan;
    let node = &plan.rank(rank).nodes[n];
    let one = |k: Kernel<S::Buf>| Ok(Kernels::One(k));
    match node.op {
        Op::GradReady { .. } => one(set.backward.kernel()),
        // Points of the trainer's own work, and a free (the memory goes back to the
        // pool behind the release event recorded after it).
        Op::Forward { .. } | Op::Backward { .. } | Op::Reshard { .. } => one(Kernel::Marker),
        Op::Unshard {
            param,
            micro_batch,
            pass,
            collective,
        } => unshard(
            plan,
            rank,
            node.stream,
            (param, micro_batch, pass),
            collective,
            bufs,
        )
        .map(Kernels::Many),
        Op::Accumulate { .. } | Op::Fold { .. } | Op::FoldPartial { .. } => {
            adds(plan, node, bufs).map(Kernels::Many)
        }
        Op::Pack {
            bucket,
            micro_batch,
            with_accum,
        } => one(pack(p, bucket, micro_batch, with_accum, bufs)?),
        Op::Stage1 { .. } | Op::Stage2 { .. } | Op::Exchange { .. } | Op::Gather { .. } => {
            one(stage(plan, rank, node, bufs)?)
        }
        Op::Combine {
            bucket,
            micro_batch,
            stage,
            collective,
        } => one(combine(
            plan,
            rank,
            (bucket, micro_batch, stage),
            collective,
            bufs,
        )?),
        Op::Unpack {
            bucket,
            micro_batch,
            accumulate,
        } => one(unpack(p, bucket, micro_batch, accumulate, bufs)?),
        Op::Optimizer { param, optimizer } => {
            one(optimizer_step(plan, param, optimizer, set, bufs)?)
        }
        op if moves_nothing(plan, &op) => one(Kernel::Marker),
        Op::GradNorm | Op::NormReduce { .. } | Op::Clip => one(norm(p, node, set, bufs)?),
        Op::Publish { param, collective } => {
            one(publish(plan, rank, node.stream, param, collective, bufs)?)
        }
    }
}

/// A node's kernels, in order: almost always one, which then needs no allocation.
#[derive(Debug)]
pub(crate) enum Kernels<T> {
    One(Kernel<T>),
    Many(Vec<Kernel<T>>),
}

impl<T> std::ops::Deref for Kernels<T> {
    type Target = [Kernel<T>];

    fn deref(&self) -> &[Kernel<T>] {
        match self {
            Kernels::One(k) => std::slice::from_ref(k),
            Kernels::Many(v) => v,
        }
    }
}

impl<T> IntoIterator for Kernels<T> {
    type Item = Kernel<T>;
    type IntoIter =
        std::iter::Chain<std::option::IntoIter<Kernel<T>>, std::vec::IntoIter<Kernel<T>>>;

    fn into_iter(self) -> Self::IntoIter {
        match self {
            Kernels::One(k) => Some(k).into_iter().chain(Vec::new()),
            Kernels::Many(v) => None.into_iter().chain(v),
        }
    }
}

/// Whether `op` leaves every buffer as it is: a publish or a norm's all-reduce over a
/// group of one. It binds to a marker and looks nothing up.
pub(crate) fn moves_nothing(plan: &Plan, op: &Op) -> bool {
    match op {
        Op::Publish { collective, .. } | Op::NormReduce { collective } => {
            plan.mesh.group_size(collective.group) == 1
        }
        _ => false,
    }
}

/// The local additions: a no_sync accumulation of a bucket's gradients, a fold of a
/// Stage-1 output into the bucket's partial, and a partial's fold into a Stage-1 output.
fn adds<S: Buffers>(plan: &Plan, node: &Node, bufs: &S) -> Result<Vec<Kernel<S::Buf>>, ExecError> {
    let add = |dst: Buffer, src: Buffer, accumulate: bool| {
        let src = bufs.get(&src)?;
        Ok(Kernel::Add {
            dst: bufs.get(&dst)?,
            src,
            accumulate,
        })
    };
    match node.op {
        Op::Accumulate {
            bucket,
            micro_batch,
            accumulate,
        } => plan
            .bucket(bucket)
            .params
            .iter()
            .map(|&param| {
                let grad = Buffer::Grad { param, micro_batch };
                add(Buffer::Accum { param }, grad, accumulate)
            })
            .collect(),
        Op::Fold {
            bucket,
            micro_batch,
            accumulate,
        } => {
            let out = Buffer::Stage1Out {
                bucket,
                micro_batch,
            };
            Ok(vec![add(Buffer::Partial { bucket }, out, accumulate)?])
        }
        Op::FoldPartial {
            bucket,
            micro_batch,
        } => {
            let out = Buffer::Stage1Out {
                bucket,
                micro_batch,
            };
            Ok(vec![add(out, Buffer::Partial { bucket }, true)?])
        }
        _ => Err(not_a(node, "local addition")),
    }
}

/// The owner's broadcast of an updated parameter over its replicate group.
fn publish<S: Buffers>(
    plan: &Plan,
    rank: u32,
    stream: Stream,
    param: ParamId,
    collective: Collective,
    bufs: &S,
) -> Result<Kernel<S::Buf>, ExecError> {
    let buf = bufs.get(&Buffer::Param { param })?;
    let is_root = plan.mesh.index_in(collective.group, rank) == collective.root;
    let (send, recv) = if is_root {
        (Some(buf), None)
    } else {
        (None, Some(buf))
    };
    Ok(Kernel::Collective {
        desc: collective,
        comm: CommId::of(&collective, stream),
        send,
        recv,
    })
}

/// A forward plan's gather of one parameter's full values into [`Buffer::Full`].
fn unshard<S: Buffers>(
    plan: &Plan,
    rank: u32,
    stream: Stream,
    (param, micro_batch, pass): (ParamId, u32, Pass),
    collective: Collective,
    bufs: &S,
) -> Result<Vec<Kernel<S::Buf>>, ExecError> {
    let full = bufs.get(&Buffer::Full {
        param,
        micro_batch,
        pass,
    })?;
    let comm = CommId::of(&collective, stream);
    let supplies = plan.unshard_supplies(rank, &collective);
    let gather = |send, recv| Kernel::Collective {
        desc: collective,
        comm,
        send,
        recv,
    };
    Ok(match collective.kind {
        // The root holds the whole tensor: it sends it and keeps a copy.
        CollectiveKind::Broadcast if supplies => {
            let piece = bufs.get(&Buffer::Param { param })?;
            vec![
                gather(Some(piece.clone()), None),
                Kernel::Add {
                    dst: full,
                    src: piece,
                    accumulate: false,
                },
            ]
        }
        CollectiveKind::Broadcast => vec![gather(None, Some(full))],
        // Every member sends its chunk; a shard shorter than the chunk (the last ones)
        // goes out zero-padded from a scratch buffer.
        _ => {
            let piece = bufs.get(&Buffer::Param { param })?;
            let chunk = usize::try_from(collective.count).unwrap_or(usize::MAX);
            let local = bufs.len(&piece);
            if local == chunk {
                vec![gather(Some(piece), Some(full))]
            } else {
                let pad = bufs.scratch(chunk)?;
                let segs = if local > 0 {
                    let seg = CopySeg {
                        param,
                        src: 0,
                        dst: 0,
                        len: local as u64,
                    };
                    vec![(seg, vec![piece])]
                } else {
                    Vec::new()
                };
                vec![
                    Kernel::Pack {
                        dst: pad.clone(),
                        segs: segs.into(),
                    },
                    gather(Some(pad), Some(full)),
                ]
            }
        }
    })
}

/// A bucket's gradients (and their no_sync accumulations) into its send buffer.
fn pack<S: Buffers>(
    p: &Prepared,
    bucket: BucketId,
    micro_batch: u32,
    with_accum: bool,
    bufs: &S,
) -> Result<Kernel<S::Buf>, ExecError> {
    let segs = segments(&p.pack, bucket);
    let mut bound = Vec::with_capacity(segs.len());
    for s in segs.iter() {
        let mut srcs = vec![bufs.get(&Buffer::Grad {
            param: s.param,
            micro_batch,
        })?];
        if with_accum {
            srcs.push(bufs.get(&Buffer::Accum { param: s.param })?);
        }
        bound.push((*s, srcs));
    }
    Ok(Kernel::Pack {
        dst: bufs.get(&Buffer::Send {
            bucket,
            micro_batch,
        })?,
        segs: bound.into(),
    })
}

/// A bucket's Stage-2 output into its parameters' reduced gradients.
fn unpack<S: Buffers>(
    p: &Prepared,
    bucket: BucketId,
    micro_batch: u32,
    accumulate: bool,
    bufs: &S,
) -> Result<Kernel<S::Buf>, ExecError> {
    let segs = segments(&p.unpack, bucket);
    let mut bound = Vec::with_capacity(segs.len());
    for s in segs.iter() {
        bound.push((*s, bufs.get(&Buffer::Reduced { param: s.param })?));
    }
    Ok(Kernel::Unpack {
        src: bufs.get(&Buffer::Stage2Out {
            bucket,
            micro_batch,
        })?,
        segs: bound.into(),
        accumulate,
    })
}

/// A reduction stage: a collective of either stage, or the copy transport's exchange
/// and gather. Each takes the stage's input to its output where this rank
/// receives one.
fn stage<S: Buffers>(
    plan: &Plan,
    rank: u32,
    node: &Node,
    bufs: &S,
) -> Result<Kernel<S::Buf>, ExecError> {
    let comm = |c: &Collective| CommId::of(c, node.stream);
    // Where this rank receives the stage's result: `name`, or nothing.
    let recv = |holds: bool, name: Buffer| holds.then(|| bufs.get(&name)).transpose();
    Ok(match node.op {
        Op::Stage1 {
            bucket,
            micro_batch,
            collective,
        }
        | Op::Stage2 {
            bucket,
            micro_batch,
            collective,
        } => {
            let stage = node.op.stage().unwrap_or(1);
            let (src, holds) = plan.stage_input(bucket, micro_batch, stage, rank);
            Kernel::Collective {
                desc: collective,
                comm: comm(&collective),
                recv: recv(holds, Plan::stage_output(bucket, micro_batch, stage))?,
                send: Some(bufs.get(&src)?),
            }
        }
        Op::Exchange {
            bucket,
            micro_batch,
            stage,
            collective,
        } => {
            let (src, holds) = plan.stage_input(bucket, micro_batch, stage, rank);
            let received = Buffer::Recv {
                bucket,
                micro_batch,
                stage,
            };
            Kernel::Exchange {
                desc: collective,
                comm: comm(&collective),
                recv: recv(holds, received)?,
                send: Some(bufs.get(&src)?),
            }
        }
        Op::Gather {
            bucket,
            micro_batch,
            stage,
            collective,
        } => Kernel::Gather {
            desc: collective,
            comm: comm(&collective),
            buf: Some(bufs.get(&Plan::stage_output(bucket, micro_batch, stage))?),
        },
        _ => return Err(not_a(node, "reduction stage")),
    })
}

/// Copy transport, a stage's arithmetic half: this rank's own contribution and what its
/// exchange received, reduced into (its chunk of) the stage's output.
fn combine<S: Buffers>(
    plan: &Plan,
    rank: u32,
    (bucket, micro_batch, stage): (BucketId, u32, u8),
    collective: Collective,
    bufs: &S,
) -> Result<Kernel<S::Buf>, ExecError> {
    let (src, _) = plan.stage_input(bucket, micro_batch, stage, rank);
    let size = plan.mesh.group_size(collective.group);
    let index = plan.mesh.index_in(collective.group, rank).unwrap_or(0);
    let own_offset = usize::try_from(collective.member_chunk(size, index).0).unwrap_or(usize::MAX);
    Ok(Kernel::Combine {
        desc: collective,
        size,
        index,
        own: bufs.get(&src)?,
        own_offset,
        recv: bufs.get(&Buffer::Recv {
            bucket,
            micro_batch,
            stage,
        })?,
        dst: bufs.get(&Plan::stage_output(bucket, micro_batch, stage))?,
    })
}

/// One parameter's optimizer step; with the global norm, a step whose gradients are not
/// finite is skipped ([`Kernel::IfFinite`]).
fn optimizer_step<S: Buffers>(
    plan: &Plan,
    param: ParamId,
    optimizer: OptimizerKind,
    set: &Settings<'_>,
    bufs: &S,
) -> Result<Kernel<S::Buf>, ExecError> {
    let pb = bufs.get(&Buffer::Param { param })?;
    let grad = bufs.get(&Buffer::Reduced { param })?;
    let state = bufs.get(&Buffer::OptState { param })?;
    let kernel = match optimizer {
        OptimizerKind::Adamw => Kernel::Adamw {
            param: pb,
            grad,
            state,
            hp: set.hyper.adamw(param, set.lr_factor),
            step: set.step,
        },
        OptimizerKind::Muon => {
            let (rows, cols) = plan.param(param).spec.matrix_dims();
            Kernel::Muon {
                param: pb,
                grad,
                momentum: state,
                rows: rows as usize,
                cols: cols as usize,
                hp: set.hyper.muon(param, set.lr_factor),
            }
        }
    };
    Ok(if plan.grad_norm {
        Kernel::IfFinite {
            norm: bufs.get(&Buffer::Norm)?,
            kernel: Box::new(kernel),
        }
    } else {
        kernel
    })
}

/// The global norm's nodes: this rank's sum of squares, its all-reduce, and the clip.
fn norm<S: Buffers>(
    p: &Prepared,
    node: &Node,
    set: &Settings<'_>,
    bufs: &S,
) -> Result<Kernel<S::Buf>, ExecError> {
    let reduced = |params: &[ParamId]| -> Result<Vec<S::Buf>, ExecError> {
        let mut out = Vec::with_capacity(params.len());
        for &param in params {
            out.push(bufs.get(&Buffer::Reduced { param })?);
        }
        Ok(out)
    };
    Ok(match node.op {
        Op::GradNorm => {
            let srcs = reduced(&p.norm_params)?;
            Kernel::SumSquares {
                dst: bufs.get(&Buffer::Norm)?,
                srcs: srcs.into(),
            }
        }
        Op::NormReduce { collective } => {
            let norm = bufs.get(&Buffer::Norm)?;
            Kernel::Collective {
                desc: collective,
                comm: CommId::of(&collective, node.stream),
                send: Some(norm.clone()),
                recv: Some(norm),
            }
        }
        Op::Clip => match set.max_norm {
            Some(max_norm) => {
                let list = match bufs.norm_list() {
                    Some(list) if p.clip_is_norm => list,
                    _ => reduced(&p.held_params)?.into(),
                };
                Kernel::Clip {
                    norm: bufs.get(&Buffer::Norm)?,
                    bufs: list,
                    max_norm,
                }
            }
            // The norm without clipping (`[clip] on_nonfinite` alone).
            None => Kernel::Marker,
        },
        _ => return Err(not_a(node, "global-norm node")),
    })
}

/// A node handed to the wrong binder (a bug in [`bind`]'s dispatch).
pub(crate) fn not_a(node: &Node, what: &str) -> ExecError {
    ExecError::Internal(format!(
        "node {} ({}) is not a {what}",
        node.id,
        node.op.kind()
    ))
}

/// A bucket's pack or unpack copies (none when the plan has no such node for it).
fn segments(
    table: &rustc_hash::FxHashMap<BucketId, Arc<[CopySeg]>>,
    bucket: BucketId,
) -> Arc<[CopySeg]> {
    table
        .get(&bucket)
        .cloned()
        .unwrap_or_else(|| Arc::from(Vec::new()))
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use overlap_graph::{
        ForwardSpec, Gate, Mesh, ParamSpec, PlanSpec, Planner, Route, Schedule, Transport,
    };
    use overlap_ops::{AdamwParams, MuonParams};
    use rustc_hash::FxHashSet as HashSet;

    use super::*;

    /// A buffer as the fake store hands it out: the name it was looked up by (`None`
    /// for scratch) and its length.
    #[derive(Debug, Clone, PartialEq)]
    struct Fake {
        name: Option<Buffer>,
        len: usize,
    }

    /// Every name the plan gives a rank exists, as long as the plan says; remembers the
    /// names looked up.
    struct Store<'a> {
        plan: &'a Plan,
        rank: u32,
        missing: Option<Buffer>,
        looked_up: RefCell<Vec<Buffer>>,
    }

    impl<'a> Store<'a> {
        fn new(plan: &'a Plan, rank: u32) -> Self {
            Store {
                plan,
                rank,
                missing: None,
                looked_up: RefCell::new(Vec::new()),
            }
        }
    }

    impl Buffers for Store<'_> {
        type Buf = Fake;

        fn get(&self, name: &Buffer) -> Result<Fake, ExecError> {
            if self.missing == Some(*name) {
                return Err(ExecError::Internal(format!("{name} is not allocated")));
            }
            self.looked_up.borrow_mut().push(*name);
            Ok(Fake {
                name: Some(*name),
                len: self.plan.buffer_len(self.rank, name) as usize,
            })
        }

        fn len(&self, buf: &Fake) -> usize {
            buf.len
        }

        fn scratch(&self, len: usize) -> Result<Fake, ExecError> {
            Ok(Fake { name: None, len })
        }
    }

    fn settings(hyper: &HyperTable) -> Settings<'_> {
        Settings {
            hyper,
            lr_factor: 0.5,
            step: 3,
            backward: Backward::Spin { micros: 7 },
            max_norm: Some(1.0),
        }
    }

    /// Every route, a parameter whose last shard is shorter than its chunk (`odd` on a
    /// shard group of 2), two layers.
    fn spec(mesh: Mesh, transport: Transport, grad_norm: bool) -> PlanSpec {
        let p =
            |name: &str, shape: Vec<u64>, route, layer| ParamSpec::new(name, shape, route, layer);
        let params = vec![
            p("w", vec![4, 6], Route::Muon, 1),
            p("bias", vec![7], Route::Adamw, 1),
            p("odd", vec![9], Route::Fsdp, 0),
            p("emb", vec![10, 3], Route::ShardedAdamw, 0),
        ];
        PlanSpec::new(mesh, params)
            .with_schedule(Schedule::default().with_transport(transport))
            .with_grad_norm(grad_norm)
            .with_forward(Some(ForwardSpec::default()))
    }

    fn plan(mesh: Mesh, transport: Transport, grad_norm: bool) -> Arc<Plan> {
        let gates = [Gate::NoSync, Gate::ReplicateOff, Gate::On];
        let planner = Planner::new(spec(mesh, transport, grad_norm)).unwrap();
        Arc::new(planner.plan(&gates).unwrap())
    }

    /// The trainer's points launch no kernel that touches a plan buffer.
    fn is_point(op: &Op) -> bool {
        matches!(
            op,
            Op::GradReady { .. } | Op::Forward { .. } | Op::Backward { .. } | Op::Reshard { .. }
        )
    }

    /// Every kind of node binds, on every rank, of plans that together hold every kind;
    /// and a node's kernels touch exactly the buffers the plan says it accesses (the
    /// trainer's points touch none).
    #[test]
    fn bind_covers_every_op_kind_and_touches_what_the_node_accesses() {
        let hyper = HyperTable::base(AdamwParams::default(), MuonParams::default());
        let mut kinds = HashSet::default();
        for transport in [Transport::Nccl, Transport::Copy] {
            let plan = plan(Mesh::new(2, 2).unwrap(), transport, true);
            for rank in plan.mesh.ranks() {
                let p = Prepared::new(plan.clone(), rank, false);
                for (n, node) in plan.rank(rank).nodes.iter().enumerate() {
                    let store = Store::new(&plan, rank);
                    let kernels = bind(&p, rank, n, &settings(&hyper), &store)
                        .unwrap_or_else(|e| panic!("{}: {e}", plan.label(node)));
                    assert!(!kernels.is_empty(), "{}", plan.label(node));
                    kinds.insert(node.op.kind());
                    let touched: HashSet<Buffer> =
                        store.looked_up.into_inner().into_iter().collect();
                    let access = &p.access[n];
                    let accessed: HashSet<Buffer> =
                        access.reads.iter().chain(&access.writes).copied().collect();
                    if is_point(&node.op) {
                        assert!(touched.is_empty(), "{}", plan.label(node));
                    } else {
                        assert_eq!(touched, accessed, "{}", plan.label(node));
                    }
                }
            }
        }
        let mut missing: Vec<_> = Op::KINDS.iter().filter(|k| !kinds.contains(*k)).collect();
        missing.sort();
        assert!(missing.is_empty(), "kinds never bound: {missing:?}");
    }

    /// A publish, or a norm's all-reduce, over a group of one moves nothing: it binds
    /// to a marker and looks no buffer up; over a group of two it is a collective.
    #[test]
    fn collectives_over_a_group_of_one_bind_to_markers() {
        let hyper = HyperTable::base(AdamwParams::default(), MuonParams::default());
        let plan = plan(Mesh::new(2, 1).unwrap(), Transport::Nccl, true);
        let mut seen = HashSet::default();
        for rank in plan.mesh.ranks() {
            let p = Prepared::new(plan.clone(), rank, false);
            for (n, node) in plan.rank(rank).nodes.iter().enumerate() {
                let (Op::Publish { collective, .. } | Op::NormReduce { collective }) = node.op
                else {
                    continue;
                };
                let store = Store::new(&plan, rank);
                let kernels = bind(&p, rank, n, &settings(&hyper), &store).unwrap();
                let one = plan.mesh.group_size(collective.group) == 1;
                seen.insert((node.op.kind(), one));
                match &kernels[..] {
                    [Kernel::Marker] => assert!(one, "{}", plan.label(node)),
                    [Kernel::Collective { .. }] => assert!(!one, "{}", plan.label(node)),
                    other => panic!("{}: {} kernels", plan.label(node), other.len()),
                }
                assert_eq!(store.looked_up.into_inner().is_empty(), one);
            }
        }
        for want in [
            ("publish", true),
            ("norm_reduce", true),
            ("norm_reduce", false),
        ] {
            assert!(seen.contains(&want), "{want:?} not in {seen:?}");
        }
    }

    /// The node at the first position where `pick` holds, on `rank`.
    fn find(plan: &Plan, rank: u32, pick: impl Fn(&Op) -> bool) -> usize {
        plan.rank(rank)
            .nodes
            .iter()
            .position(|n| pick(&n.op))
            .expect("the plan has such a node")
    }

    /// An all-gather member whose shard is shorter than the chunk sends it zero-padded
    /// from scratch memory; one whose shard fills the chunk sends the shard itself.
    #[test]
    fn a_shard_shorter_than_its_chunk_is_gathered_from_padded_scratch() {
        let hyper = HyperTable::base(AdamwParams::default(), MuonParams::default());
        let plan = plan(Mesh::new(2, 1).unwrap(), Transport::Nccl, false);
        let odd = plan
            .params
            .iter()
            .position(|p| p.spec.name == "odd")
            .unwrap() as ParamId;
        let is_odd_unshard = |op: &Op| matches!(op, Op::Unshard { param, .. } if *param == odd);
        for (rank, padded) in [(0, false), (1, true)] {
            let p = Prepared::new(plan.clone(), rank, false);
            let n = find(&plan, rank, is_odd_unshard);
            let store = Store::new(&plan, rank);
            let kernels = bind(&p, rank, n, &settings(&hyper), &store).unwrap();
            let shard = Some(Buffer::Param { param: odd });
            match (padded, &kernels[..]) {
                (false, [Kernel::Collective { send, recv, .. }]) => {
                    assert_eq!(send.as_ref().map(|b| b.name), Some(shard));
                    assert!(recv.is_some());
                }
                (true, [Kernel::Pack { dst, segs }, Kernel::Collective { send, .. }]) => {
                    assert_eq!((dst.name, dst.len), (None, 5));
                    assert_eq!(send.as_ref(), Some(dst));
                    assert_eq!(segs.len(), 1);
                    assert_eq!(segs[0].0.len, 4);
                    assert_eq!(segs[0].1[0].name, shard);
                }
                (_, other) => panic!("rank {rank}: {other:?}"),
            }
        }
    }

    /// With the global norm every optimizer is guarded by it; without, it runs bare,
    /// with the step's number and learning-rate factor.
    #[test]
    fn optimizers_are_guarded_by_the_norm_only_with_the_global_norm() {
        let hyper = HyperTable::base(AdamwParams::default(), MuonParams::default());
        for grad_norm in [false, true] {
            let plan = plan(Mesh::new(1, 1).unwrap(), Transport::Nccl, grad_norm);
            let p = Prepared::new(plan.clone(), 0, false);
            let n = find(&plan, 0, |op| {
                matches!(
                    op,
                    Op::Optimizer {
                        optimizer: OptimizerKind::Adamw,
                        ..
                    }
                )
            });
            let store = Store::new(&plan, 0);
            let kernels = bind(&p, 0, n, &settings(&hyper), &store).unwrap();
            let inner = match (grad_norm, &kernels[..]) {
                (true, [Kernel::IfFinite { norm, kernel }]) => {
                    assert_eq!(norm.name, Some(Buffer::Norm));
                    &**kernel
                }
                (false, [k]) => k,
                other => panic!("{other:?}"),
            };
            let Kernel::Adamw { hp, step, .. } = inner else {
                panic!("{inner:?}");
            };
            assert_eq!(*step, 3);
            assert_eq!(hp.lr, AdamwParams::default().lr * 0.5);
        }
    }

    /// `grad_ready` runs the backward model; `clip` without a threshold only marks.
    #[test]
    fn settings_choose_the_backward_and_the_clip() {
        let hyper = HyperTable::base(AdamwParams::default(), MuonParams::default());
        let plan = plan(Mesh::new(1, 1).unwrap(), Transport::Nccl, true);
        let p = Prepared::new(plan.clone(), 0, false);
        let store = Store::new(&plan, 0);
        let grad_ready = find(&plan, 0, |op| matches!(op, Op::GradReady { .. }));
        let k = bind(&p, 0, grad_ready, &settings(&hyper), &store).unwrap();
        assert!(matches!(k[..], [Kernel::Spin { micros: 7 }]), "{k:?}");
        let clip = find(&plan, 0, |op| matches!(op, Op::Clip));
        let k = bind(&p, 0, clip, &settings(&hyper), &store).unwrap();
        assert!(
            matches!(k[..], [Kernel::Clip { max_norm, .. }] if max_norm == 1.0),
            "{k:?}"
        );
        let unclipped = Settings {
            max_norm: None,
            ..settings(&hyper)
        };
        let k = bind(&p, 0, clip, &unclipped, &store).unwrap();
        assert!(matches!(k[..], [Kernel::Marker]), "{k:?}");
    }

    /// A buffer the node needs and the rank lacks fails the binding with the error the
    /// store gave, naming the buffer.
    #[test]
    fn a_missing_buffer_fails_the_binding() {
        let hyper = HyperTable::base(AdamwParams::default(), MuonParams::default());
        let plan = plan(Mesh::new(2, 1).unwrap(), Transport::Nccl, false);
        let p = Prepared::new(plan.clone(), 0, false);
        let n = find(&plan, 0, |op| matches!(op, Op::Pack { .. }));
        let Op::Pack {
            bucket,
            micro_batch,
            ..
        } = plan.rank(0).nodes[n].op
        else {
            unreachable!()
        };
        let send = Buffer::Send {
            bucket,
            micro_batch,
        };
        let store = Store {
            missing: Some(send),
            ..Store::new(&plan, 0)
        };
        let err = bind(&p, 0, n, &settings(&hyper), &store).unwrap_err();
        assert!(
            matches!(&err, ExecError::Internal(m) if m.contains(&send.to_string())),
            "{err}"
        );
    }
}
