//! One rank's issuing state: its buffers, its buffer pool, its events and its cursor in
//! the current plan. Issuing a node launches its kernels on the node's stream, records
//! and waits events as the plan says, and hands transient buffers back to the pool
//! behind a release event recorded after their last reader.

use std::collections::VecDeque;

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::Arc;

use overlap_graph::{Access, BucketId, Buffer, CopySeg, Instr, Op, ParamId, Plan, Stream};
use overlap_ops::{
    Backend, CommId, EventStatus, Kernel, OpsError, OptimizerRow, OptimizerStep, Tag, Update,
};

use crate::bind::{Buffers, Settings};
use crate::prepared::Prepared;
use crate::slots::BufferMap;
use crate::ExecError;

/// Pooled buffers of one length [`RankState::take`] looks at before allocating.
const POOL_PROBE: usize = 4;

/// A node bound to its kernels: its tag and what it launches, in order.
type Bound<B> = (Tag, crate::bind::Kernels<<B as Backend>::Buffer>);

/// A row's kernels, in order, each under its node's tag.
type Launches<B> = Vec<(Tag, Kernel<<B as Backend>::Buffer>)>;

/// A pooled buffer waiting for its release events (shared by every buffer a row
/// released behind its one event).
struct Pooled<B: Backend> {
    buf: B::Buffer,
    release: Arc<[B::Event]>,
}

pub(crate) struct RankState<B: Backend> {
    pub rank: u32,
    /// Live buffers: persistent (parameters, optimizer state), step (accumulations,
    /// partials, reduced gradients) and transient ones in flight.
    pub buffers: BufferMap<B::Buffer>,
    /// Released transient buffers by length, oldest release first, each reusable once
    /// its release events completed.
    pool: HashMap<usize, VecDeque<Pooled<B>>>,
    /// Release events recorded so far for transient buffers not yet returned.
    pending: HashMap<Buffer, Vec<B::Event>>,
    /// Plan event id -> backend event.
    events: Vec<B::Event>,
    /// Plan event id -> the point of the issue order where it was last recorded: events
    /// recorded together at the end of a row share one, and a wait for one of them
    /// stands for a wait for all ([`RankState::issue_row`]).
    points: Vec<u64>,
    /// The next point.
    next_point: u64,
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
    /// Host seconds of the step's instructions after its last node
    /// ([`Self::issue_trailing`]).
    pub trailing_seconds: f64,
    /// Partials and no_sync accumulations written and not yet flushed, as issued.
    pub live_partials: HashSet<Buffer>,
    /// Gradient buffers the caller owns (`grad_ready_bound`): dropped after their last
    /// reader, never pooled.
    pub borrowed: HashSet<Buffer>,
    /// The last node issued on each stream this step (at `Stream::index`).
    pub last_issued: [Option<u32>; Stream::ALL.len()],
    /// Whether [`IssueCtx::fault`] was injected already (once per executor).
    fault_fired: bool,
    /// The reduced gradients this step's `grad_norm` was bound to, which a clip of the
    /// same list scales (one list for both; forgotten when the step begins).
    norm_list: Option<Arc<[B::Buffer]>>,
    /// Rows of optimizers as last bound, by their plan (its address, which the kept
    /// row's hold on it keeps unique) and first node: handed to the backend again
    /// while their settings and buffers are the ones in use ([`Self::bind_optimizers`]).
    /// Only rows of plans still in [`Self::prepared_cache`] stay.
    kept: HashMap<(usize, usize), KeptRow<B>>,
    /// Rows of optimizers bound (not handed in again as kept), over the rank's life.
    pub rows_bound: u64,
}

/// A row of optimizers as bound ([`RankState::bind_optimizers`]), with the plan and
/// the settings it was bound under (held, so that neither can be another one at the
/// same address).
struct KeptRow<B: Backend> {
    prepared: Arc<Prepared>,
    hyper: Arc<crate::HyperTable>,
    steps: Arc<[OptimizerStep<B::Buffer>]>,
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

impl IssueCtx {
    /// What binding a node to its kernels needs of these settings.
    fn settings(&self) -> Settings<'_> {
        Settings {
            hyper: &self.hyper,
            lr_factor: self.lr_factor,
            step: self.step,
            backward: self.backward,
            max_norm: self.max_norm,
        }
    }
}

/// A rank's buffers as binding looks them up; scratch memory comes from the backend.
struct RankBuffers<'a, B: Backend> {
    rank: u32,
    buffers: &'a BufferMap<B::Buffer>,
    backend: &'a B,
    /// The gradients this step's `grad_norm` was bound to ([`RankState::norm_list`]).
    norm_list: Option<&'a Arc<[B::Buffer]>>,
}

impl<B: Backend> Buffers for RankBuffers<'_, B> {
    type Buf = B::Buffer;

    fn get(&self, name: &Buffer) -> Result<B::Buffer, ExecError> {
        buffer(self.rank, self.buffers, name)
    }

    fn len(&self, buf: &B::Buffer) -> usize {
        self.backend.len(buf)
    }

    fn norm_list(&self) -> Option<Arc<[B::Buffer]>> {
        self.norm_list.cloned()
    }

    fn scratch(&self, len: usize) -> Result<B::Buffer, ExecError> {
        Ok(self.backend.alloc_uninit(self.rank, len)?)
    }
}

/// The memory `name` has on `rank`; an internal error when it has none.
fn buffer<T: Clone>(rank: u32, buffers: &BufferMap<T>, name: &Buffer) -> Result<T, ExecError> {
    buffers
        .get(name)
        .cloned()
        .ok_or_else(|| ExecError::Internal(format!("rank {rank}: buffer {name} is not allocated")))
}

impl<B: Backend> RankState<B> {
    pub(crate) fn new(rank: u32) -> Self {
        RankState {
            rank,
            buffers: BufferMap::default(),
            pool: HashMap::default(),
            pending: HashMap::default(),
            events: Vec::new(),
            points: Vec::new(),
            next_point: 0,
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
            trailing_seconds: 0.0,
            peak_in_flight: 0,
            live_partials: HashSet::default(),
            borrowed: HashSet::default(),
            last_issued: Default::default(),
            fault_fired: false,
            norm_list: None,
            kept: HashMap::default(),
            rows_bound: 0,
        }
    }

    /// Switches to a plan whose programs extend the current one (a longer gate prefix,
    /// or the whole step).
    pub(crate) fn adopt(&mut self, backend: &B, prepared: Arc<Prepared>) {
        let need = prepared.plan.rank(self.rank).events as usize;
        while self.events.len() < need {
            self.events.push(backend.event(self.rank));
            self.points.push(u64::MAX);
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
    pub(crate) fn take(
        &mut self,
        backend: &B,
        len: usize,
        zero: bool,
    ) -> Result<B::Buffer, OpsError> {
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

    /// A new point of the issue order ([`RankState::points`]).
    fn point(&mut self) -> u64 {
        self.next_point += 1;
        self.next_point
    }

    /// Buffers held in the pool (for tests and metrics).
    pub(crate) fn pooled(&self) -> usize {
        self.pool.values().map(VecDeque::len).sum()
    }

    fn buf(&self, b: &Buffer) -> Result<B::Buffer, ExecError> {
        buffer(self.rank, &self.buffers, b)
    }

    /// Issues nodes `next_node..end` of the current plan.
    pub(crate) async fn issue_until(
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
            let m = prepared.runs[n].min(end);
            if m > n + 1 {
                self.issue_row(backend, &prepared, n..m, ctx)?;
            } else {
                self.issue_node(backend, &prepared, n, ctx).await?;
            }
            self.issued += m.max(n + 1) - n;
            self.next_node = m.max(n + 1);
        }
        Ok(())
    }

    /// Issues nodes `row` (optimizers, or publishes, on one stream: `prepared.rs`'s
    /// runs) as one unit: every wait, then each node's kernels in order, then every
    /// record, and one release event after the row. The row's host time is shared
    /// evenly among its nodes in `issue_by_kind`.
    fn issue_row(
        &mut self,
        backend: &B,
        p: &Prepared,
        row: std::ops::Range<usize>,
        ctx: &IssueCtx,
    ) -> Result<(), ExecError> {
        let t0 = std::time::Instant::now();
        let first = p.group(row.start).start;
        let instrs = &p.issue[first..p.issue_end[row.end - 1]];
        let stream = p.plan.rank(self.rank).nodes[row.start].stream;
        // A wait for an event recorded at the same point as the one waited for just
        // before adds nothing (a publish row waits for the optimizer row's records, all
        // made at one point).
        let mut last = u64::MAX;
        for &(s, ins) in instrs {
            if let Instr::Wait(e) = ins {
                let point = self.points[e as usize];
                if point == u64::MAX || point != last {
                    backend.wait(self.rank, s, &self.events[e as usize]);
                }
                last = point;
            }
        }
        let kind = p.plan.rank(self.rank).nodes[row.start].op.kind_index();
        let launches = self.bind_row(backend, p, row.clone(), ctx)?;
        let t = std::time::Instant::now();
        backend.launch_row(self.rank, stream, launches);
        let launched = t.elapsed().as_secs_f64();
        let point = self.point();
        for &(s, ins) in instrs {
            if let Instr::Record(e) = ins {
                backend.record(self.rank, s, &self.events[e as usize]);
                self.points[e as usize] = point;
            }
        }
        self.last_issued[stream.index()] = Some(row.end as u32 - 1);
        if row.clone().any(|n| !p.finals[n].is_empty()) {
            let ev = backend.event(self.rank);
            backend.record(self.rank, stream, &ev);
            let ev: Arc<[B::Event]> = Arc::from([ev]);
            for n in row.clone() {
                self.release_behind(backend, p, n, &ev);
            }
        }
        self.launch_by_kind[kind] += launched;
        let k = &mut self.issue_by_kind[kind];
        k.0 += t0.elapsed().as_secs_f64();
        k.1 += row.len();
        Ok(())
    }

    /// The kernels of `row`, in order, each under its node's tag: a no-op node is its
    /// marker, a node that binds to nothing too (left out where the backend does nothing
    /// with markers); an injected fault goes before its node.
    /// Every node is bound before any fault is injected, so a binding that fails leaves
    /// the fault to fire later.
    fn bind_row(
        &mut self,
        backend: &B,
        p: &Prepared,
        row: std::ops::Range<usize>,
        ctx: &IssueCtx,
    ) -> Result<Launches<B>, ExecError> {
        if ctx.fault.is_none() && p.optimizers[row.start] {
            return self.bind_optimizers(backend, p, row, ctx);
        }
        let mut launches = Vec::with_capacity(row.len());
        if ctx.fault.is_none() {
            // The steady case, each node's kernels straight into the row; its markers
            // only where the backend does something with them.
            let markers = backend.needs_markers(self.rank);
            for n in row {
                if p.noop[n] {
                    if markers {
                        launches.push((p.tags[n], Kernel::Marker));
                    }
                    continue;
                }
                let (tag, kernels) = self.prepare_node(backend, p, n, ctx)?;
                if kernels.is_empty() && markers {
                    launches.push((tag, Kernel::Marker));
                }
                launches.extend(kernels.into_iter().map(|k| (tag, k)));
            }
            return Ok(launches);
        }
        let mut bound = Vec::with_capacity(row.len());
        for n in row.clone() {
            bound.push(if p.noop[n] {
                (p.tags[n], crate::bind::Kernels::Many(Vec::new()))
            } else {
                self.prepare_node(backend, p, n, ctx)?
            });
        }
        for (n, (tag, kernels)) in row.zip(bound) {
            launches.extend(self.inject(backend, &p.plan, (n as u32, tag.op), ctx));
            if kernels.is_empty() {
                launches.push((tag, Kernel::Marker));
            }
            launches.extend(kernels.into_iter().map(|k| (tag, k)));
        }
        Ok(launches)
    }

    /// A row of optimizer nodes as one [`Kernel::Optimizers`] under its first node's
    /// tag (each step under its own). What stays from step to step (each node's
    /// parameter, state and settings) is bound once and kept while the plan and the
    /// settings are the ones in use and each kept buffer is still the one its name
    /// holds ([`Backend::same_buffer`]); what moves (the reduced gradients, which a
    /// step allocates anew, and the global norm) is looked up every step.
    ///
    /// Why: binding a node clones its buffers, the guard and the settings into a
    /// kernel, and each clone is an atomic on a handle the backend last touched;
    /// a kept row leaves one clone a node (docs/performance.md, "The optimizer row
    /// kept").
    fn bind_optimizers(
        &mut self,
        backend: &B,
        p: &Prepared,
        row: std::ops::Range<usize>,
        ctx: &IssueCtx,
    ) -> Result<Launches<B>, ExecError> {
        for n in row.clone() {
            self.give_memory(backend, p, n)?;
        }
        let key = (std::ptr::from_ref(p) as usize, row.start);
        let still = self
            .kept
            .get(&key)
            .is_some_and(|k| self.still_bound(backend, p, k, row.clone(), ctx));
        if !still {
            let kept = self.bound_row(p, row.clone(), ctx)?;
            self.prune_rows();
            self.kept.insert(key, kept);
            self.rows_bound += 1;
        }
        let nodes = &p.plan.rank(self.rank).nodes;
        let mut grads = Vec::with_capacity(row.len());
        for n in row.clone() {
            let Op::Optimizer { param, .. } = nodes[n].op else {
                return Err(crate::bind::not_a(&nodes[n], "optimizer"));
            };
            grads.push(self.buf(&Buffer::Reduced { param })?);
        }
        let guard = if p.plan.grad_norm {
            Some(self.buf(&Buffer::Norm)?)
        } else {
            None
        };
        let kernel = Kernel::Optimizers(OptimizerRow {
            steps: Arc::clone(&self.kept[&key].steps),
            grads,
            guard,
            step: ctx.step,
            lr_factor: ctx.lr_factor,
        });
        Ok(vec![(p.tags[row.start], kernel)])
    }

    /// Forgets the kept rows of plans no longer cached (with their hold on the plan
    /// and the buffers).
    pub(crate) fn prune_rows(&mut self) {
        let cache = &self.prepared_cache;
        self.kept
            .retain(|_, k| cache.iter().any(|c| Arc::ptr_eq(c, &k.prepared)));
    }

    /// Forgets the kept rows (their buffers go with them): a parameter or a state was
    /// replaced or dropped.
    pub(crate) fn forget_rows(&mut self) {
        self.kept.clear();
    }

    /// Whether `k` is `row` as it would be bound now: the same plan and settings, and
    /// every kept buffer still the one its name holds.
    fn still_bound(
        &self,
        backend: &B,
        p: &Prepared,
        k: &KeptRow<B>,
        row: std::ops::Range<usize>,
        ctx: &IssueCtx,
    ) -> bool {
        let same = |name: &Buffer, kept: &B::Buffer| {
            self.buffers
                .get(name)
                .is_some_and(|b| backend.same_buffer(b, kept))
        };
        let nodes = &p.plan.rank(self.rank).nodes;
        std::ptr::eq(&*k.prepared, p)
            && Arc::ptr_eq(&k.hyper, &ctx.hyper)
            && k.steps.len() == row.len()
            && row.zip(k.steps.iter()).all(|(n, s)| match nodes[n].op {
                Op::Optimizer { param, .. } => {
                    same(&Buffer::Param { param }, &s.param)
                        && same(&Buffer::OptState { param }, &s.state)
                }
                _ => false,
            })
    }

    /// `row` bound: each node's parameter and state and its update at learning-rate
    /// factor 1.
    fn bound_row(
        &self,
        p: &Prepared,
        row: std::ops::Range<usize>,
        ctx: &IssueCtx,
    ) -> Result<KeptRow<B>, ExecError> {
        let plan = &p.plan;
        let nodes = &plan.rank(self.rank).nodes;
        let mut steps = Vec::with_capacity(row.len());
        for n in row {
            let Op::Optimizer { param, optimizer } = nodes[n].op else {
                return Err(crate::bind::not_a(&nodes[n], "optimizer"));
            };
            let lr = ctx.hyper.lr(param, optimizer, 1.0);
            let update = match optimizer {
                overlap_graph::OptimizerKind::Adamw => Update::Adamw {
                    hp: ctx.hyper.adamw(param, 1.0),
                    lr,
                },
                overlap_graph::OptimizerKind::Muon => {
                    let (rows, cols) = plan.param(param).spec.matrix_dims();
                    Update::Muon {
                        rows: rows as usize,
                        cols: cols as usize,
                        hp: ctx.hyper.muon(param, 1.0),
                        lr,
                    }
                }
            };
            steps.push(OptimizerStep {
                tag: p.tags[n],
                param: self.buf(&Buffer::Param { param })?,
                state: self.buf(&Buffer::OptState { param })?,
                update,
            });
        }
        let prepared = self
            .prepared
            .clone()
            .filter(|a| std::ptr::eq(&**a, p))
            .ok_or_else(|| ExecError::Internal("a row bound outside its plan".into()))?;
        Ok(KeptRow {
            prepared,
            hyper: Arc::clone(&ctx.hyper),
            steps: steps.into(),
        })
    }

    /// Issues what is left of the plan's instructions after its last node, once every
    /// node was issued: a plan adopted beyond what the step issued (a guess at more
    /// micro-batches) keeps the rest, which belongs to nodes that never ran.
    pub(crate) fn issue_trailing(&mut self, backend: &B) {
        let Some(prepared) = self.prepared.clone() else {
            return;
        };
        if self.next_node < prepared.issue_end.len() {
            return;
        }
        let t0 = std::time::Instant::now();
        let start = prepared.issue_end.last().copied().unwrap_or(0);
        for &(stream, ins) in &prepared.issue[start..] {
            match ins {
                Instr::Record(e) => {
                    backend.record(self.rank, stream, &self.events[e as usize]);
                    self.points[e as usize] = self.point();
                }
                Instr::Wait(e) => backend.wait(self.rank, stream, &self.events[e as usize]),
                Instr::Run(_) => {}
            }
        }
        self.trailing_seconds += t0.elapsed().as_secs_f64();
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
                Instr::Record(e) => {
                    backend.record(self.rank, stream, &self.events[e as usize]);
                    self.points[e as usize] = self.point();
                }
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
        (n, kind): (u32, &'static str),
        ctx: &IssueCtx,
    ) -> Option<(Tag, Kernel<B::Buffer>)> {
        let fault = ctx.fault?;
        if self.fault_fired || !fault.hits(self.rank, kind, ctx.step) {
            return None;
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
                    return None;
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
                        return None;
                    }
                }
            }
        };
        Some((tag, kernel))
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

    /// Issues node `n`'s kernels on its stream, in the node's phases: its outputs get
    /// memory (an alias of its input, or a new or pooled buffer), partials are tracked,
    /// the node is bound to its kernels (`bind.rs`; an aliasing node launches a marker),
    /// they are launched and timed, and the buffers whose last reader it is are released.
    fn run(
        &mut self,
        backend: &B,
        p: &Prepared,
        n: usize,
        ctx: &IssueCtx,
    ) -> Result<(), ExecError> {
        let node = &p.plan.rank(self.rank).nodes[n];
        let stream = node.stream;
        self.last_issued[stream.index()] = Some(n as u32);
        if let Some((tag, k)) = self.inject(backend, &p.plan, (n as u32, node.op.kind()), ctx) {
            backend.launch(self.rank, stream, tag, k);
        }
        let (tag, kernels) = self.prepare_node(backend, p, n, ctx)?;
        self.launch_timed(backend, stream, tag, node.op.kind_index(), kernels);
        self.release_after(backend, p, n, stream);
        Ok(())
    }

    /// Node `n` up to its launch: its outputs get memory, partials are tracked, and it
    /// is bound to its kernels (an aliasing node to a marker). Returns its tag and
    /// kernels.
    fn prepare_node(
        &mut self,
        backend: &B,
        p: &Prepared,
        n: usize,
        ctx: &IssueCtx,
    ) -> Result<Bound<B>, ExecError> {
        self.give_memory(backend, p, n)?;
        let kernels = if p.alias[n].is_some() {
            self.aliased += 1;
            crate::bind::Kernels::One(Kernel::Marker)
        } else {
            let bufs = RankBuffers {
                rank: self.rank,
                buffers: &self.buffers,
                backend,
                norm_list: self.norm_list.as_ref(),
            };
            crate::bind::bind(p, self.rank, n, &ctx.settings(), &bufs)?
        };
        if let crate::bind::Kernels::One(Kernel::SumSquares { srcs, .. }) = &kernels {
            self.norm_list = Some(Arc::clone(srcs));
        }
        Ok((p.tags[n], kernels))
    }

    /// Node `n`'s memory before its binding: its outputs allocated or aliased, its
    /// partials tracked (each only where `prepared.rs` says the node has any).
    fn give_memory(&mut self, backend: &B, p: &Prepared, n: usize) -> Result<(), ExecError> {
        if !p.plain[n] {
            self.alias_or_allocate(backend, p, n)?;
        }
        if p.partials[n] {
            self.track_partials(&p.access[n]);
        }
        Ok(())
    }

    /// Gives node `n`'s outputs their memory: an aliasing node's output is its input's
    /// memory (`prepared.rs`); the new memory it writes first is allocated, from the pool
    /// or the backend, zeroed where its first access does not write all of it.
    fn alias_or_allocate(&mut self, backend: &B, p: &Prepared, n: usize) -> Result<(), ExecError> {
        if let Some((a, b)) = p.alias[n] {
            let buf = self.buf(&a)?;
            self.buffers.insert(b, buf);
        }
        let plan = &p.plan;
        let node = &plan.rank(self.rank).nodes[n];
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
        Ok(())
    }

    /// Tracks partials and no_sync accumulations: a read flushes, a write (re)fills.
    fn track_partials(&mut self, access: &Access) {
        let partial = |b: &&Buffer| matches!(b, Buffer::Partial { .. } | Buffer::Accum { .. });
        for r in access.reads.iter().filter(partial) {
            self.live_partials.remove(r);
        }
        for w in access.writes.iter().filter(partial) {
            self.live_partials.insert(*w);
        }
    }

    /// Launches `kernels` in order on `stream`, adding the time spent inside the backend
    /// to `launch_by_kind` at `kind`.
    fn launch_timed(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        kind: usize,
        kernels: crate::bind::Kernels<B::Buffer>,
    ) {
        let mut spent = 0.0f64;
        for k in kernels {
            let t0 = std::time::Instant::now();
            backend.launch(self.rank, stream, tag, k);
            spent += t0.elapsed().as_secs_f64();
        }
        self.launch_by_kind[kind] += spent;
    }

    /// Records a release event after node `n` for every transient buffer it is a final
    /// accessor of; the last one returns the buffer to the pool behind those events.
    fn release_after(&mut self, backend: &B, p: &Prepared, n: usize, stream: Stream) {
        if p.finals[n].is_empty() {
            return;
        }
        let ev = backend.event(self.rank);
        backend.record(self.rank, stream, &ev);
        self.release_behind(backend, p, n, &Arc::from([ev]));
    }

    /// Releases node `n`'s final accesses behind `ev`, one event recorded after it.
    fn release_behind(&mut self, backend: &B, p: &Prepared, n: usize, ev: &Arc<[B::Event]>) {
        for &(root, last) in &p.finals[n] {
            if !last {
                self.pending
                    .entry(root)
                    .or_default()
                    .extend(ev.iter().cloned());
                continue;
            }
            let release = match self.pending.remove(&root) {
                Some(mut earlier) => {
                    earlier.extend(ev.iter().cloned());
                    Arc::from(earlier)
                }
                None => Arc::clone(ev),
            };
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
    pub(crate) fn end_step(&mut self, keep_reduced: bool) {
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
    pub(crate) fn begin_step(&mut self) {
        self.buffers.retain(|b, _| b.is_persistent());
        self.norm_list = None;
        self.issued = 0;
        self.aliased = 0;
        self.issue_by_kind = Default::default();
        self.launch_by_kind = Default::default();
        self.trailing_seconds = 0.0;
        self.peak_in_flight = 0;
        self.issue_errors.clear();
        self.last_issued = Default::default();
    }

    /// Whether a parameter's values are held on this rank.
    pub(crate) fn holds_param(&self, param: ParamId) -> bool {
        self.buffers.contains_key(&Buffer::Param { param })
    }
}

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
