//! One rank's issuing state: its buffers, its buffer pool, its events and its cursor in
//! the current plan. Issuing a node launches its kernels on the node's stream, records
//! and waits events as the plan says, and hands transient buffers back to the pool
//! behind a release event recorded after their last reader.

use std::collections::VecDeque;

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::Arc;

use overlap_graph::{
    BucketId, Buffer, CollectiveKind, CopySeg, Instr, Op, OptimizerKind, ParamId, Plan, Stream,
};
use overlap_ops::{Backend, CommId, EventStatus, Kernel, OpsError, Tag};

use crate::prepared::Prepared;
use crate::ExecError;

/// Pooled buffers of one length [`RankState::take`] looks at before allocating.
const POOL_PROBE: usize = 4;

/// A pooled buffer waiting for its release events.
struct Pooled<B: Backend> {
    buf: B::Buffer,
    release: Vec<B::Event>,
}

pub(crate) struct RankState<B: Backend> {
    pub rank: u32,
    /// Live buffers: persistent (parameters, optimizer state), step (accumulations,
    /// partials, reduced gradients) and transient ones in flight.
    pub buffers: HashMap<Buffer, B::Buffer>,
    /// Released transient buffers by length, oldest release first, each reusable once
    /// its release events completed.
    pool: HashMap<usize, VecDeque<Pooled<B>>>,
    /// Release events recorded so far for transient buffers not yet returned.
    pending: HashMap<Buffer, Vec<B::Event>>,
    /// Plan event id -> backend event.
    events: Vec<B::Event>,
    /// Plans prepared for this rank, most recently prepared last.
    pub prepared_cache: Vec<Arc<Prepared>>,
    /// The plan being issued and the next node.
    pub prepared: Option<Arc<Prepared>>,
    pub next_node: usize,
    /// Stage-1 buffers in flight (bucket, micro-batch), oldest first, with the release
    /// events of their send and output buffers once known.
    in_flight: VecDeque<(BucketId, u32)>,
    released: HashMap<(BucketId, u32), Vec<B::Event>>,
    /// Host-side failures seen while issuing (a failed release event), reported at the
    /// step's end with the backend's errors.
    pub issue_errors: Vec<OpsError>,
    /// Nodes issued since the last step began.
    pub issued: usize,
    /// Nodes issued as aliases (a marker instead of a copy) since the last step began.
    pub aliased: usize,
    /// Most Stage-1 buffers in flight at once since the last step began.
    pub peak_in_flight: usize,
    /// Host time spent issuing them (excluding backpressure waits) by node kind, at
    /// `Op::kind_index`: seconds and nodes.
    pub issue_by_kind: [(f64, usize); Op::KINDS.len()],
    /// Of `issue_by_kind`'s seconds, those spent inside `Backend::launch` (the backend's
    /// checks and driver calls); the rest is the executor's own (events, allocation,
    /// bookkeeping).
    pub launch_by_kind: [f64; Op::KINDS.len()],
    /// Partials and no_sync accumulations written and not yet flushed, as issued.
    pub live_partials: HashSet<Buffer>,
    /// Gradient buffers the caller owns (`grad_ready_bound`): dropped after their last
    /// reader, never pooled.
    pub borrowed: HashSet<Buffer>,
    /// The last node issued on each stream this step (at `Stream::index`).
    pub last_issued: [Option<u32>; Stream::ALL.len()],
    /// Whether [`IssueCtx::fault`] was injected already (once per executor).
    fault_fired: bool,
}

/// Settings an issuing rank needs.
pub(crate) struct IssueCtx {
    pub window: usize,
    /// Every parameter's optimizer settings, and the step's learning-rate factor.
    pub hyper: Arc<crate::HyperTable>,
    pub lr_factor: f64,
    pub step: u64,
    /// What a `grad_ready` node launches.
    pub backward: crate::Backward,
    /// The clipping threshold a `clip` node scales by (`None`: it scales nothing).
    pub max_norm: Option<f32>,
    /// When the step's time is up: host waits inside the step give up then.
    pub deadline: std::time::Instant,
    /// A fault to inject.
    pub fault: Option<crate::Fault>,
    /// Another rank's failure ends host waits at once.
    pub peer: tokio::sync::watch::Receiver<Option<crate::PeerFailure>>,
}

impl<B: Backend> RankState<B> {
    pub fn new(rank: u32) -> Self {
        RankState {
            rank,
            buffers: HashMap::default(),
            pool: HashMap::default(),
            pending: HashMap::default(),
            events: Vec::new(),
            prepared_cache: Vec::new(),
            prepared: None,
            next_node: 0,
            in_flight: VecDeque::new(),
            released: HashMap::default(),
            issue_errors: Vec::new(),
            issued: 0,
            aliased: 0,
            issue_by_kind: Default::default(),
            launch_by_kind: Default::default(),
            peak_in_flight: 0,
            live_partials: HashSet::default(),
            borrowed: HashSet::default(),
            last_issued: Default::default(),
            fault_fired: false,
        }
    }

    /// Switches to a plan whose programs extend the current one (a longer gate prefix,
    /// or the whole step).
    pub fn adopt(&mut self, backend: &B, prepared: Arc<Prepared>) {
        let need = prepared.plan.rank(self.rank).events as usize;
        while self.events.len() < need {
            self.events.push(backend.event(self.rank));
        }
        self.prepared = Some(prepared);
    }

    /// Takes a transient buffer of `len` elements: a pooled one whose release completed,
    /// or a new one; `zero`: a new zeroed one (pooled buffers hold old values), otherwise
    /// the caller overwrites every element first and a new one is not zeroed.
    ///
    /// Only the [`POOL_PROBE`] oldest releases of the length are looked at: releases
    /// complete about in the order they were issued, and the host runs up to a step
    /// ahead of the device, so scanning every pooled buffer would query every pending
    /// release event on every take. The price: a buffer released behind a slow stream
    /// can hold up the reuse of newer completed ones, so a length's pool may grow to as
    /// many buffers as one step takes (every step ends drained, so it stops there).
    pub fn take(&mut self, backend: &B, len: usize, zero: bool) -> Result<B::Buffer, OpsError> {
        if zero {
            return backend.alloc(self.rank, len);
        }
        if let Some(list) = self.pool.get_mut(&len) {
            // Latest release first: it is the one most likely still pending, and a
            // pending event answers fastest (CUDA: 0.3 µs against 1.5 µs complete).
            let done = list.iter().take(POOL_PROBE).position(|p| {
                p.release
                    .iter()
                    .rev()
                    .all(|e| backend.status(e) != EventStatus::Pending)
            });
            if let Some(p) = done.and_then(|i| list.remove(i)) {
                return Ok(p.buf);
            }
        }
        backend.alloc_uninit(self.rank, len)
    }

    /// Buffers held in the pool (for tests and metrics).
    pub fn pooled(&self) -> usize {
        self.pool.values().map(VecDeque::len).sum()
    }

    fn buf(&self, b: &Buffer) -> Result<B::Buffer, ExecError> {
        self.buffers.get(b).cloned().ok_or_else(|| {
            ExecError::Internal(format!("rank {}: buffer {b} is not allocated", self.rank))
        })
    }

    /// Issues nodes `next_node..end` of the current plan.
    pub async fn issue_until(
        &mut self,
        backend: &B,
        end: usize,
        ctx: &IssueCtx,
    ) -> Result<(), ExecError> {
        let prepared = self
            .prepared
            .clone()
            .ok_or_else(|| ExecError::Internal("no plan adopted".into()))?;
        while self.next_node < end {
            let n = self.next_node;
            self.issue_node(backend, &prepared, n, ctx).await?;
            self.next_node += 1;
            self.issued += 1;
        }
        Ok(())
    }

    /// Issues what is left of the plan's instructions after its last node, once every
    /// node was issued: a plan adopted beyond what the step issued (a guess at more
    /// micro-batches) keeps the rest, which belongs to nodes that never ran.
    pub fn issue_trailing(&mut self, backend: &B) {
        let Some(prepared) = self.prepared.clone() else {
            return;
        };
        if self.next_node < prepared.issue_end.len() {
            return;
        }
        let start = prepared.issue_end.last().copied().unwrap_or(0);
        for &(stream, ins) in &prepared.issue[start..] {
            match ins {
                Instr::Record(e) => backend.record(self.rank, stream, &self.events[e as usize]),
                Instr::Wait(e) => backend.wait(self.rank, stream, &self.events[e as usize]),
                Instr::Run(_) => {}
            }
        }
    }

    async fn issue_node(
        &mut self,
        backend: &B,
        p: &Prepared,
        n: usize,
        ctx: &IssueCtx,
    ) -> Result<(), ExecError> {
        let node = &p.plan.rank(self.rank).nodes[n];
        if let Op::Pack {
            bucket,
            micro_batch,
            ..
        } = node.op
        {
            self.backpressure(backend, ctx.window, ctx.deadline, &ctx.peer)
                .await?;
            self.in_flight.push_back((bucket, micro_batch));
            self.peak_in_flight = self.peak_in_flight.max(self.in_flight.len());
        }
        let t0 = std::time::Instant::now();
        for &(stream, ins) in &p.issue[p.group(n)] {
            match ins {
                Instr::Wait(e) => backend.wait(self.rank, stream, &self.events[e as usize]),
                Instr::Record(e) => backend.record(self.rank, stream, &self.events[e as usize]),
                Instr::Run(id) => {
                    debug_assert_eq!(id as usize, n);
                    self.run(backend, p, n, ctx)?;
                }
            }
        }
        let took = t0.elapsed();
        let k = &mut self.issue_by_kind[node.op.kind_index()];
        k.0 += took.as_secs_f64();
        k.1 += 1;
        Ok(())
    }

    /// FSDP2-style backpressure: before packing another bucket, wait (on the host,
    /// without blocking a thread) until fewer than `window` Stage-1 buffers are in flight.
    ///
    /// Gives up at the step's deadline with a (bare) [`ExecError::Timeout`], which the
    /// executor turns into the full report.
    async fn backpressure(
        &mut self,
        backend: &B,
        window: usize,
        deadline: std::time::Instant,
        peer: &tokio::sync::watch::Receiver<Option<crate::PeerFailure>>,
    ) -> Result<(), ExecError> {
        let deadline = tokio::time::Instant::from_std(deadline);
        while self.in_flight.len() >= window.max(1) {
            let Some(key) = self.in_flight.pop_front() else {
                break;
            };
            for ev in self.released.remove(&key).unwrap_or_default() {
                let waited = tokio::select! {
                    biased;
                    f = crate::peer::failed(Some(peer.clone())) => {
                        return Err(ExecError::PeerFailed { rank: f.rank, reason: f.reason });
                    }
                    r = tokio::time::timeout_at(deadline, backend.host_wait(&ev)) => r,
                };
                match waited {
                    Ok(Ok(())) => {}
                    // The failure is the backend's to report; keep issuing so every
                    // rank reaches the same collectives and nothing hangs.
                    Ok(Err(e)) => self.issue_errors.push(e),
                    Err(_) => {
                        return Err(ExecError::Timeout {
                            seconds: 0.0,
                            step: 0,
                            stalled: Vec::new(),
                        })
                    }
                }
            }
        }
        Ok(())
    }

    /// Injects `ctx.fault` before node `n`'s kernel on its stream, if it names this rank,
    /// this node's kind and this step, the first time only (`fault.rs`).
    fn inject(
        &mut self,
        backend: &B,
        plan: &Plan,
        (n, kind, stream): (u32, &'static str, Stream),
        ctx: &IssueCtx,
    ) {
        let Some(fault) = ctx.fault else {
            return;
        };
        if self.fault_fired || !fault.hits(self.rank, kind, ctx.step) {
            return;
        }
        self.fault_fired = true;
        let tag = Tag {
            node: n,
            op: crate::FAULT_OP,
            micro_batch: u32::MAX,
        };
        let kernel = match fault.mode {
            crate::FaultMode::Hang => Kernel::Spin { micros: u32::MAX },
            crate::FaultMode::Nan => match self.nan_write(backend, plan) {
                Ok(k) => k,
                Err(e) => {
                    self.issue_errors.push(e);
                    return;
                }
            },
            crate::FaultMode::Fail => {
                // An add of 2 elements into 1 fails its checks on every backend.
                match (backend.alloc(self.rank, 1), backend.alloc(self.rank, 2)) {
                    (Ok(dst), Ok(src)) => Kernel::Add {
                        dst,
                        src,
                        accumulate: false,
                    },
                    (Err(e), _) | (_, Err(e)) => {
                        self.issue_errors.push(e);
                        return;
                    }
                }
            }
        };
        backend.launch(self.rank, stream, tag, kernel);
    }

    /// The kernel of a [`crate::FaultMode::Nan`] fault: a one-element unpack of NaN into
    /// element 0 of the first non-empty reduced gradient this rank counts in the global
    /// norm ([`Plan::norm_params`]). Launched just before the rank's `grad_norm` node,
    /// after the waits that order it after every write of that gradient.
    fn nan_write(&self, backend: &B, plan: &Plan) -> Result<Kernel<B::Buffer>, OpsError> {
        let target = plan.norm_params(self.rank).into_iter().find_map(|param| {
            let buf = self.buffers.get(&Buffer::Reduced { param })?;
            (backend.len(buf) > 0).then(|| (param, buf.clone()))
        });
        let Some((param, dst)) = target else {
            return Err(OpsError::Backend(format!(
                "{}: mode=nan found no gradient element rank {} counts in the global norm (put it on another rank)",
                crate::FAULT_VAR,
                self.rank
            )));
        };
        let src = backend.alloc(self.rank, 1)?;
        backend.upload(&src, &[f32::NAN])?;
        let seg = CopySeg {
            param,
            src: 0,
            dst: 0,
            len: 1,
        };
        Ok(Kernel::Unpack {
            src,
            segs: Arc::from(vec![(seg, dst)]),
            accumulate: false,
        })
    }

    fn run(
        &mut self,
        backend: &B,
        p: &Prepared,
        n: usize,
        ctx: &IssueCtx,
    ) -> Result<(), ExecError> {
        let plan = &p.plan;
        let node = &plan.rank(self.rank).nodes[n];
        let access = &p.access[n];
        // An aliasing node's output is its input's memory (prepared.rs).
        let aliased = p.alias[n];
        if let Some((a, b)) = aliased {
            let buf = self.buf(&a)?;
            self.buffers.insert(b, buf);
        }
        // Allocate the new memory the node writes first.
        for &(w, how) in &p.allocs[n] {
            if self.buffers.contains_key(&w) {
                continue;
            }
            let len = match (w, node.op) {
                // Received in place, the exchange's receive buffer is only its
                // combine's key: one element instead of `(n − 1)` chunks.
                (Buffer::Recv { .. }, Op::Exchange { collective, .. })
                    if backend.receives_in_place(CommId::of(&collective, node.stream)) =>
                {
                    1
                }
                _ => plan.buffer_len(self.rank, &w) as usize,
            };
            let buf = match w {
                Buffer::Param { .. } => {
                    return Err(ExecError::Internal(format!(
                        "rank {}: {w} was never initialised",
                        self.rank
                    )));
                }
                _ if how.pooled => self.take(backend, len, how.zero)?,
                _ if how.zero => backend.alloc(self.rank, len)?,
                _ => backend.alloc_uninit(self.rank, len)?,
            };
            self.buffers.insert(w, buf);
        }
        // Track partials and accumulations: a read flushes, a write (re)fills.
        for r in &access.reads {
            self.live_partials.remove(r);
        }
        for w in access
            .writes
            .iter()
            .filter(|b| matches!(b, Buffer::Partial { .. } | Buffer::Accum { .. }))
        {
            self.live_partials.insert(*w);
        }
        let tag = Tag {
            node: n as u32,
            op: node.op.kind(),
            micro_batch: node.micro_batch.unwrap_or(u32::MAX),
        };
        let stream = node.stream;
        self.last_issued[stream.index()] = Some(n as u32);
        self.inject(backend, plan, (n as u32, node.op.kind(), stream), ctx);
        // Time inside the backend, for `launch_by_kind`.
        let spent = std::cell::Cell::new(0.0f64);
        let launch = |k: Kernel<B::Buffer>| {
            let t0 = std::time::Instant::now();
            backend.launch(self.rank, stream, tag, k);
            spent.set(spent.get() + t0.elapsed().as_secs_f64());
        };
        let kind = node.op.kind_index();
        if aliased.is_some() {
            self.aliased += 1;
            launch(Kernel::Marker);
            self.launch_by_kind[kind] += spent.get();
            self.release_after(backend, p, n, stream);
            return Ok(());
        }
        match node.op {
            Op::GradReady { .. } => launch(ctx.backward.kernel()),
            // Points of the trainer's own work, and a free (the memory goes back to the
            // pool behind the release event recorded after it).
            Op::Forward { .. } | Op::Backward { .. } | Op::Reshard { .. } => launch(Kernel::Marker),
            Op::Unshard {
                param,
                micro_batch,
                pass,
                collective,
            } => {
                let full = self.buf(&Buffer::Full {
                    param,
                    micro_batch,
                    pass,
                })?;
                let comm = CommId::of(&collective, stream);
                let supplies = plan.unshard_supplies(self.rank, &collective);
                match collective.kind {
                    // The root holds the whole tensor: it sends it and keeps a copy.
                    CollectiveKind::Broadcast if supplies => {
                        let piece = self.buf(&Buffer::Param { param })?;
                        launch(Kernel::Collective {
                            desc: collective,
                            comm,
                            send: Some(piece.clone()),
                            recv: None,
                        });
                        launch(Kernel::Add {
                            dst: full,
                            src: piece,
                            accumulate: false,
                        });
                    }
                    CollectiveKind::Broadcast => launch(Kernel::Collective {
                        desc: collective,
                        comm,
                        send: None,
                        recv: Some(full),
                    }),
                    // Every member sends its chunk; a shard shorter than the chunk (the
                    // last ones) goes out zero-padded from a scratch buffer.
                    _ => {
                        let piece = self.buf(&Buffer::Param { param })?;
                        let chunk = usize::try_from(collective.count).unwrap_or(usize::MAX);
                        let local = backend.len(&piece);
                        let send = if local == chunk {
                            piece
                        } else {
                            let pad = backend.alloc_uninit(self.rank, chunk)?;
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
                            launch(Kernel::Pack {
                                dst: pad.clone(),
                                segs: segs.into(),
                            });
                            pad
                        };
                        launch(Kernel::Collective {
                            desc: collective,
                            comm,
                            send: Some(send),
                            recv: Some(full),
                        });
                    }
                }
            }
            Op::Accumulate {
                bucket,
                micro_batch,
                accumulate,
            } => {
                for &param in &plan.bucket(bucket).params {
                    let src = self.buf(&Buffer::Grad { param, micro_batch })?;
                    let dst = self.buf(&Buffer::Accum { param })?;
                    launch(Kernel::Add {
                        dst,
                        src,
                        accumulate,
                    });
                }
            }
            Op::Pack {
                bucket,
                micro_batch,
                with_accum,
            } => {
                let segs = segments(&p.pack, bucket);
                let mut bound = Vec::with_capacity(segs.len());
                for s in segs.iter() {
                    let mut srcs = vec![self.buf(&Buffer::Grad {
                        param: s.param,
                        micro_batch,
                    })?];
                    if with_accum {
                        srcs.push(self.buf(&Buffer::Accum { param: s.param })?);
                    }
                    bound.push((*s, srcs));
                }
                launch(Kernel::Pack {
                    dst: self.buf(&Buffer::Send {
                        bucket,
                        micro_batch,
                    })?,
                    segs: bound.into(),
                });
            }
            // A collective of either stage: its input to the stage's output, where this
            // rank receives one.
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
                let (src, holds) = plan.stage_input(bucket, micro_batch, stage, self.rank);
                let recv = if holds {
                    Some(self.buf(&Plan::stage_output(bucket, micro_batch, stage))?)
                } else {
                    None
                };
                launch(Kernel::Collective {
                    desc: collective,
                    comm: CommId::of(&collective, stream),
                    send: Some(self.buf(&src)?),
                    recv,
                });
            }
            Op::Fold {
                bucket,
                micro_batch,
                accumulate,
            } => {
                let src = self.buf(&Buffer::Stage1Out {
                    bucket,
                    micro_batch,
                })?;
                launch(Kernel::Add {
                    dst: self.buf(&Buffer::Partial { bucket })?,
                    src,
                    accumulate,
                });
            }
            Op::FoldPartial {
                bucket,
                micro_batch,
            } => {
                let src = self.buf(&Buffer::Partial { bucket })?;
                launch(Kernel::Add {
                    dst: self.buf(&Buffer::Stage1Out {
                        bucket,
                        micro_batch,
                    })?,
                    src,
                    accumulate: true,
                });
            }
            Op::Exchange {
                bucket,
                micro_batch,
                stage,
                collective,
            } => {
                let (src, holds) = plan.stage_input(bucket, micro_batch, stage, self.rank);
                let recv = if holds {
                    Some(self.buf(&Buffer::Recv {
                        bucket,
                        micro_batch,
                        stage,
                    })?)
                } else {
                    None
                };
                launch(Kernel::Exchange {
                    desc: collective,
                    comm: CommId::of(&collective, stream),
                    send: Some(self.buf(&src)?),
                    recv,
                });
            }
            Op::Combine {
                bucket,
                micro_batch,
                stage,
                collective,
            } => {
                let (src, _) = plan.stage_input(bucket, micro_batch, stage, self.rank);
                let size = plan.mesh.group_size(collective.group);
                let index = plan.mesh.index_in(collective.group, self.rank).unwrap_or(0);
                let own_offset =
                    usize::try_from(collective.member_chunk(size, index).0).unwrap_or(usize::MAX);
                let dst = Plan::stage_output(bucket, micro_batch, stage);
                launch(Kernel::Combine {
                    desc: collective,
                    size,
                    index,
                    own: self.buf(&src)?,
                    own_offset,
                    recv: self.buf(&Buffer::Recv {
                        bucket,
                        micro_batch,
                        stage,
                    })?,
                    dst: self.buf(&dst)?,
                });
            }
            Op::Gather {
                bucket,
                micro_batch,
                stage,
                collective,
            } => {
                launch(Kernel::Gather {
                    desc: collective,
                    comm: CommId::of(&collective, stream),
                    buf: Some(self.buf(&Plan::stage_output(bucket, micro_batch, stage))?),
                });
            }
            Op::Unpack {
                bucket,
                micro_batch,
                accumulate,
            } => {
                let segs = segments(&p.unpack, bucket);
                let mut bound = Vec::with_capacity(segs.len());
                for s in segs.iter() {
                    bound.push((*s, self.buf(&Buffer::Reduced { param: s.param })?));
                }
                launch(Kernel::Unpack {
                    src: self.buf(&Buffer::Stage2Out {
                        bucket,
                        micro_batch,
                    })?,
                    segs: bound.into(),
                    accumulate,
                });
            }
            Op::Optimizer { param, optimizer } => {
                let pb = self.buf(&Buffer::Param { param })?;
                let grad = self.buf(&Buffer::Reduced { param })?;
                let state = self.buf(&Buffer::OptState { param })?;
                let kernel = match optimizer {
                    OptimizerKind::Adamw => Kernel::Adamw {
                        param: pb,
                        grad,
                        state,
                        hp: ctx.hyper.adamw(param, ctx.lr_factor),
                        step: ctx.step,
                    },
                    OptimizerKind::Muon => {
                        let (rows, cols) = plan.param(param).spec.matrix_dims();
                        Kernel::Muon {
                            param: pb,
                            grad,
                            momentum: state,
                            rows: rows as usize,
                            cols: cols as usize,
                            hp: ctx.hyper.muon(param, ctx.lr_factor),
                        }
                    }
                };
                // With the global norm, a step whose gradients are not finite is skipped.
                if plan.grad_norm {
                    launch(Kernel::IfFinite {
                        norm: self.buf(&Buffer::Norm)?,
                        kernel: Box::new(kernel),
                    });
                } else {
                    launch(kernel);
                }
            }
            Op::GradNorm => {
                let srcs = plan
                    .norm_params(self.rank)
                    .into_iter()
                    .map(|param| self.buf(&Buffer::Reduced { param }))
                    .collect::<Result<Vec<_>, _>>()?;
                launch(Kernel::SumSquares {
                    dst: self.buf(&Buffer::Norm)?,
                    srcs: srcs.into(),
                });
            }
            Op::NormReduce { collective } => {
                let norm = self.buf(&Buffer::Norm)?;
                launch(Kernel::Collective {
                    desc: collective,
                    comm: CommId::of(&collective, stream),
                    send: Some(norm.clone()),
                    recv: Some(norm),
                });
            }
            Op::Clip => match ctx.max_norm {
                Some(max_norm) => {
                    let bufs = plan
                        .held_params(self.rank)
                        .into_iter()
                        .map(|param| self.buf(&Buffer::Reduced { param }))
                        .collect::<Result<Vec<_>, _>>()?;
                    launch(Kernel::Clip {
                        norm: self.buf(&Buffer::Norm)?,
                        bufs: bufs.into(),
                        max_norm,
                    });
                }
                // The norm without clipping (`[clip] on_nonfinite` alone).
                None => launch(Kernel::Marker),
            },
            Op::Publish { param, collective } => {
                let buf = self.buf(&Buffer::Param { param })?;
                let is_root = plan.mesh.index_in(collective.group, self.rank) == collective.root;
                let (send, recv) = if is_root {
                    (Some(buf), None)
                } else {
                    (None, Some(buf))
                };
                launch(Kernel::Collective {
                    desc: collective,
                    comm: CommId::of(&collective, stream),
                    send,
                    recv,
                });
            }
        }
        self.launch_by_kind[kind] += spent.get();
        self.release_after(backend, p, n, stream);
        Ok(())
    }

    /// Records a release event after node `n` for every transient buffer it is a final
    /// accessor of; the last one returns the buffer to the pool behind those events.
    fn release_after(&mut self, backend: &B, p: &Prepared, n: usize, stream: Stream) {
        if p.finals[n].is_empty() {
            return;
        }
        let ev = backend.event(self.rank);
        backend.record(self.rank, stream, &ev);
        for &(root, last) in &p.finals[n] {
            self.pending.entry(root).or_default().push(ev.clone());
            if !last {
                continue;
            }
            let release = self.pending.remove(&root).unwrap_or_default();
            // Every name of the memory goes; the memory itself once.
            let mut mem = None;
            let mut borrowed = false;
            for b in p.names_of(&root) {
                borrowed |= self.borrowed.remove(b);
                if let Some(buf) = self.buffers.remove(b) {
                    mem.get_or_insert(buf);
                }
                if let Some(key) = stage1_key(b) {
                    // Only while the pack is still counted in flight: a key backpressure
                    // already let go of (a combine deferred past it) would stay here
                    // until the step's end, one per deferred chain.
                    if self.in_flight.contains(&key) {
                        self.released
                            .entry(key)
                            .or_default()
                            .extend(release.iter().cloned());
                    }
                }
            }
            if let Some(buf) = mem.filter(|_| !borrowed) {
                self.pool
                    .entry(backend.len(&buf))
                    .or_default()
                    .push_back(Pooled { buf, release });
            }
        }
    }

    /// Forgets the step's state: accumulations, partials, in-flight bookkeeping. Reduced
    /// gradients are kept until the next step starts (so they can be inspected).
    pub fn end_step(&mut self, keep_reduced: bool) {
        self.buffers.retain(|b, _| {
            b.is_persistent()
                || (keep_reduced && matches!(b, Buffer::Reduced { .. } | Buffer::Norm))
        });
        self.pending.clear();
        self.live_partials.clear();
        self.borrowed.clear();
        self.in_flight.clear();
        self.released.clear();
        self.prepared = None;
        self.next_node = 0;
    }

    /// Drops reduced gradients kept from the previous step.
    pub fn begin_step(&mut self) {
        self.buffers.retain(|b, _| b.is_persistent());
        self.issued = 0;
        self.aliased = 0;
        self.issue_by_kind = Default::default();
        self.launch_by_kind = Default::default();
        self.peak_in_flight = 0;
        self.issue_errors.clear();
        self.last_issued = Default::default();
    }

    /// Whether a parameter's values are held on this rank.
    pub fn holds_param(&self, param: ParamId) -> bool {
        self.buffers.contains_key(&Buffer::Param { param })
    }
}

/// A bucket's pack or unpack copies (none when the plan has no such node for it).
/// The Stage-1 buffer (bucket, micro-batch) a name belongs to: its send, output or
/// receive. `stage1_window`'s backpressure counts these in flight and waits for their
/// memory's release (here, and as `overlap_executor::stage1_releases` tells a cost model).
pub(crate) fn stage1_key(b: &Buffer) -> Option<(BucketId, u32)> {
    match *b {
        Buffer::Send {
            bucket,
            micro_batch,
        }
        | Buffer::Stage1Out {
            bucket,
            micro_batch,
        }
        | Buffer::Recv {
            bucket,
            micro_batch,
            ..
        } => Some((bucket, micro_batch)),
        _ => None,
    }
}

fn segments(table: &HashMap<BucketId, Arc<[CopySeg]>>, bucket: BucketId) -> Arc<[CopySeg]> {
    table
        .get(&bucket)
        .cloned()
        .unwrap_or_else(|| Arc::from(Vec::new()))
}
