//! # overlap-executor
//!
//! Runs lowered plans on a [`Backend`]: it issues each local rank's stream programs in
//! the host issue order the plan defines (node by node, as the trainer's backward makes
//! gradients ready), maps plan events to backend events, allocates buffers and keeps
//! each one alive until the events after its last readers complete, recycles transient
//! buffers through a pool, bounds the Stage-1 buffers in flight (backpressure), and turns
//! a failure anywhere into an error value returned from the step.
//!
//! Invariant: the executor adds no ordering of its own between streams. Everything that
//! orders work is in the plan (and so was proven by the validator); the executor's own
//! events only tell the host when a buffer may be reused.
//!
//! Ranks issue concurrently on one host task (their futures are joined), so a rank
//! waiting on backpressure never stops another rank from reaching a collective.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use overlap_graph::{Buffer, Op, ParamId, Plan, Stream};
use overlap_ops::{AdamwParams, Backend, MuonParams, OpsError, Timing};

mod bind;
mod deadline;
mod fault;
mod forward;
pub mod hyper;
mod order;
mod peer;
mod prepared;
mod rank;
mod slots;

pub use deadline::StepDeadline;
pub use fault::{
    restart_count, Fault, FaultMode, FaultSpec, FAULT_OP, FAULT_VAR, RESTART_COUNT_VAR,
};
pub use forward::FullParam;
pub use hyper::{
    glob_match, GroupError, GroupRate, HyperTable, LrSchedule, ParamGroup, ScheduleKind,
};
pub use peer::{PeerAbort, PeerFailure};

use prepared::Prepared;
use rank::{IssueCtx, RankState};

/// Prepared plans kept per rank, least recently adopted evicted first. Besides this
/// bound, a step's end drops the prepared plans nobody outside the executor holds any
/// more ([`Executor::adopt`] needs the plan itself, so they could never be adopted again):
/// a session's speculative plans go as soon as it lets go of them.
const PREPARED_CACHE: usize = 16;

/// The default step timeout ([`ExecConfig::host_timeout`]).
pub const DEFAULT_STEP_TIMEOUT: Duration = Duration::from_secs(300);

/// The first step's timeout is this many times [`ExecConfig::host_timeout`].
pub const FIRST_STEP_TIMEOUT_FACTOR: u32 = 3;

/// Executor settings. Start from [`ExecConfig::default`] and change them with the
/// `with_*` methods.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ExecConfig {
    /// Stage-1 buffers (pack + collective output) allowed in flight per rank.
    pub stage1_window: usize,
    /// AdamW hyper-parameters: the base settings of the parameters on the `adamw`,
    /// `sharded_adamw` and `fsdp` routes.
    pub adamw: AdamwParams,
    /// Muon hyper-parameters: the base settings of the parameters on the `muon` route.
    pub muon: MuonParams,
    /// Parameter groups: settings that override the base ones for the parameters whose
    /// names match (first match wins; [`hyper`]). Resolved against the parameters by
    /// [`Executor::resolve_params`], or from the first plan adopted.
    pub groups: Vec<ParamGroup>,
    /// The learning-rate schedule: step `t`'s optimizers use each parameter's rate times
    /// `schedule.factor(t)`, unless the caller set a factor
    /// ([`Executor::set_lr_factor`]). The default is factor 1 at every step.
    pub schedule: LrSchedule,
    /// The step timeout: how long a step may take, from its start (the first plan
    /// adopted, [`Executor::adopt`]) until the device has finished it, before the host gives up on it
    /// (`[run] step_timeout`). The first step gets [`FIRST_STEP_TIMEOUT_FACTOR`] times
    /// as long (warm-up, JIT, NCCL's lazy connection setup). Every host wait inside a
    /// step (backpressure, the final drain) is bounded by it; when it runs out the step
    /// fails with [`ExecError::Timeout`], which names each stream still busy and the
    /// node it was running (or the last one issued on it, where the backend cannot
    /// tell), the backend aborts what it can ([`Backend::abort`]: NCCL's communicators on
    /// CUDA), and the executor refuses further work: drop it and its backend.
    pub host_timeout: Duration,
    /// A fault to inject, for tests ([`Fault`]; `OVERLAP_FAULT` in the CLI).
    pub fault: Option<Fault>,
    /// What each `grad_ready` node runs on its stream: nothing (a marker, the default),
    /// or a synthetic backward standing in for the layer's backward on backends where
    /// the trainer's backward is not on the compute stream.
    pub backward: Backward,
    /// Buffer aliasing: a node that copies a buffer unchanged (an identity pack, a
    /// collective over a group of one, a whole-buffer unpack) makes its output the same
    /// memory as its input and launches no copy, where the plan's order proves it safe
    /// (`prepared.rs` explains the rules). On by default; off runs every copy (for
    /// comparison and measurement).
    pub aliasing: bool,
    /// Global-norm clipping and non-finite gradients (`[clip]`), for plans with the
    /// global norm ([`overlap_graph::PlanSpec::grad_norm`]).
    pub clip: ClipConfig,
}

/// What a step does with its global gradient norm ([`ExecConfig::clip`]). The default
/// computes the norm without clipping and skips a non-finite step; change it with the
/// `with_*` methods.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct ClipConfig {
    /// Scale the reduced gradients by `min(1, max_norm / (norm + 1e-6))` before the
    /// optimizers; `None` computes the norm without clipping.
    pub max_norm: Option<f32>,
    /// What a step whose global norm is NaN or Inf does.
    pub on_nonfinite: OnNonFinite,
}

impl ClipConfig {
    /// The same clip settings with another [`ClipConfig::max_norm`] (`None`: no clipping).
    pub fn with_max_norm(mut self, max_norm: Option<f32>) -> Self {
        self.max_norm = max_norm;
        self
    }

    /// The same clip settings with another [`ClipConfig::on_nonfinite`] (skip or fail a
    /// non-finite step).
    pub fn with_on_nonfinite(mut self, on_nonfinite: OnNonFinite) -> Self {
        self.on_nonfinite = on_nonfinite;
        self
    }
}

/// What a step whose reduced gradients hold NaN or Inf does. Either way its optimizers
/// do nothing (parameters and optimizer state are untouched) and the step counter does
/// not advance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnNonFinite {
    /// The step is skipped and reported (`StepStats::skipped`).
    #[default]
    Skip,
    /// The step returns [`ExecError::NonFinite`].
    Error,
}

impl OnNonFinite {
    /// The config name.
    pub fn name(self) -> &'static str {
        match self {
            OnNonFinite::Skip => "skip",
            OnNonFinite::Error => "error",
        }
    }
}

/// The synthetic backward a `grad_ready` node launches ([`ExecConfig::backward`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backward {
    /// A marker: no device work (the trainer's own backward is on the stream).
    #[default]
    None,
    /// A [`Kernel::Spin`] of this many microseconds (`[run] backward_us_per_layer`).
    ///
    /// [`Kernel::Spin`]: overlap_ops::Kernel::Spin
    Spin {
        /// Microseconds per layer.
        micros: u32,
    },
    /// `count` GEMMs of `d × d · d × d` (a [`Kernel::Gemm`]; bf16 through cuBLAS on
    /// GPUs), the backward of `overlap bench`.
    ///
    /// [`Kernel::Gemm`]: overlap_ops::Kernel::Gemm
    Gemms {
        /// GEMMs per layer.
        count: u32,
        /// Their size.
        d: u32,
    },
}

impl Backward {
    /// A spin of `micros` µs, or none for 0 (how `[run] backward_us_per_layer` maps).
    pub fn spin(micros: u32) -> Backward {
        if micros == 0 {
            Backward::None
        } else {
            Backward::Spin { micros }
        }
    }

    /// The kernel a `grad_ready` node launches under this model.
    pub fn kernel<B>(self) -> overlap_ops::Kernel<B> {
        use overlap_ops::Kernel;
        match self {
            Backward::None | Backward::Spin { micros: 0 } | Backward::Gemms { count: 0, .. } => {
                Kernel::Marker
            }
            Backward::Spin { micros } => Kernel::Spin { micros },
            Backward::Gemms { count, d } => Kernel::Gemm {
                m: d,
                n: d,
                k: d,
                count,
            },
        }
    }
}

impl Default for ExecConfig {
    fn default() -> Self {
        ExecConfig {
            stage1_window: 8,
            adamw: AdamwParams::default(),
            muon: MuonParams::default(),
            groups: Vec::new(),
            schedule: LrSchedule::default(),
            host_timeout: DEFAULT_STEP_TIMEOUT,
            fault: None,
            backward: Backward::None,
            aliasing: true,
            clip: ClipConfig::default(),
        }
    }
}

impl ExecConfig {
    /// The same config with another [`ExecConfig::stage1_window`] (Stage-1 buffers in
    /// flight per rank).
    pub fn with_stage1_window(mut self, stage1_window: usize) -> Self {
        self.stage1_window = stage1_window;
        self
    }

    /// The same config with another [`ExecConfig::adamw`] (the base AdamW settings).
    pub fn with_adamw(mut self, adamw: AdamwParams) -> Self {
        self.adamw = adamw;
        self
    }

    /// The same config with another [`ExecConfig::muon`] (the base Muon settings).
    pub fn with_muon(mut self, muon: MuonParams) -> Self {
        self.muon = muon;
        self
    }

    /// The same config with another [`ExecConfig::groups`] (per-parameter overrides).
    pub fn with_groups(mut self, groups: Vec<ParamGroup>) -> Self {
        self.groups = groups;
        self
    }

    /// The same config with another [`ExecConfig::schedule`] (the learning-rate schedule).
    pub fn with_schedule(mut self, schedule: LrSchedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// The same config with another [`ExecConfig::host_timeout`] (the step timeout).
    pub fn with_host_timeout(mut self, host_timeout: Duration) -> Self {
        self.host_timeout = host_timeout;
        self
    }

    /// The same config with another [`ExecConfig::fault`] (a fault to inject, for tests).
    pub fn with_fault(mut self, fault: Option<Fault>) -> Self {
        self.fault = fault;
        self
    }

    /// The same config with another [`ExecConfig::backward`] (what each `grad_ready` runs).
    pub fn with_backward(mut self, backward: Backward) -> Self {
        self.backward = backward;
        self
    }

    /// The same config with another [`ExecConfig::aliasing`] (buffer aliasing on or off).
    pub fn with_aliasing(mut self, aliasing: bool) -> Self {
        self.aliasing = aliasing;
        self
    }

    /// The same config with another [`ExecConfig::clip`] (global-norm clipping).
    pub fn with_clip(mut self, clip: ClipConfig) -> Self {
        self.clip = clip;
        self
    }
}

/// A node that failed, as the step reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeFailure {
    /// Global rank.
    pub rank: u32,
    /// The node's stream.
    pub stream: Stream,
    /// The node id in the rank's program.
    pub node: u32,
    /// A readable label of the node (`stage1 b3 m0 (reduce_scatter on ...)`).
    pub label: String,
    /// What went wrong.
    pub error: OpsError,
}

impl std::fmt::Display for NodeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} stream {} node {} ({}): {}",
            self.rank, self.stream, self.node, self.label, self.error
        )
    }
}

/// A stream a timed-out step was still waiting on.
#[derive(Debug, Clone, PartialEq)]
pub struct Stalled {
    /// Global rank.
    pub rank: u32,
    /// The stream.
    pub stream: Stream,
    /// The node it was running (`running`), else the last node issued on it this step.
    pub node: Option<u32>,
    /// A readable label of that node.
    pub label: String,
    /// Whether the backend says the stream is running `node` now (the CPU backend
    /// knows; on CUDA `node` is the last one issued, which may be queued behind the
    /// one that hangs).
    pub running: bool,
}

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} stream {}", self.rank, self.stream)?;
        match (self.node, self.running) {
            (Some(n), true) => write!(f, " running node {n} ({})", self.label),
            (Some(n), false) => write!(f, " (last issued node {n}: {})", self.label),
            (None, _) => write!(f, " ({})", self.label),
        }
    }
}

/// A readable label of node `node` of rank `r`'s adopted plan.
fn node_label<B: Backend>(r: &RankState<B>, node: u32) -> String {
    r.prepared
        .as_ref()
        .and_then(|p| {
            p.plan
                .rank(r.rank)
                .nodes
                .get(node as usize)
                .map(|n| p.plan.label(n))
        })
        .unwrap_or_else(|| "unknown node".into())
}

/// Errors of the executor.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// Nodes failed; their dependents were cancelled and the step's state discarded.
    #[error("step failed: {}", .failures.iter().map(|f| f.to_string()).collect::<Vec<_>>().join("; "))]
    Step {
        /// Root causes (not cancellations), in the order they happened.
        failures: Vec<NodeFailure>,
    },
    /// The caller used the API out of order (wrong layer, no plan, ...).
    #[error("{0}")]
    Usage(String),
    /// A backend operation the host called directly failed.
    #[error(transparent)]
    Ops(#[from] OpsError),
    /// The step did not finish within its timeout ([`ExecConfig::host_timeout`]).
    #[error("step {step} timed out after {seconds:.1} s; still busy: {}", .stalled.iter().map(|s| s.to_string()).collect::<Vec<_>>().join("; "))]
    Timeout {
        /// The step's timeout, in seconds.
        seconds: f64,
        /// The step (from 1).
        step: u64,
        /// The local streams still busy, in rank and stream order.
        stalled: Vec<Stalled>,
    },
    /// A bug in overlap itself.
    #[error("internal error: {0}")]
    Internal(String),
    /// Another rank of the job failed ([`PeerAbort`]): this rank stopped waiting for
    /// it.
    #[error("rank {rank} of the job failed: {reason}")]
    PeerFailed {
        /// The rank that failed.
        rank: u32,
        /// Its error, or how its connection ended.
        reason: String,
    },
    /// The step's reduced gradients hold NaN or Inf and `[clip] on_nonfinite = "error"`:
    /// nothing was updated.
    #[error("step {step}: the reduced gradients are not finite (global norm {norm}); nothing was updated ([clip] on_nonfinite = \"error\")")]
    NonFinite {
        /// The step that was refused (1-based).
        step: u64,
        /// The global norm (NaN or Inf).
        norm: f64,
    },
}

/// What one step cost.
#[derive(Debug, Clone, Default)]
pub struct StepStats {
    /// Nodes issued across local ranks.
    pub nodes: usize,
    /// Host time spent issuing them (adopting the step's plans, launches, records,
    /// waits, buffer bookkeeping; not gradient uploads nor backpressure waits), in
    /// seconds, summed over local ranks.
    pub issue_seconds: f64,
    /// `issue_seconds` by node kind (`Op::kind`): `(kind, seconds, nodes)`, summed over
    /// local ranks (plan adoption is in `issue_seconds` only).
    pub issue_by_kind: Vec<(&'static str, f64, usize)>,
    /// Of `issue_by_kind`'s seconds, those spent inside [`Backend::launch`] (its checks
    /// and driver calls), by node kind, summed over local ranks: the rest of a node's
    /// host time is the executor's (events, buffers, bookkeeping).
    pub launch_by_kind: Vec<(&'static str, f64)>,
    /// Host time of the instructions after the step's last node, in seconds, summed
    /// over local ranks: the waits that close the streams, where the executor's order
    /// put the waits of no-op nodes (`ARCHITECTURE.md`, the `executor/` section), and so, on the
    /// CUDA backend, where the held optimizer tail is flushed. In `issue_seconds`.
    pub trailing_seconds: f64,
    /// Wall time from the first issue to the end of the step, in seconds.
    pub wall_seconds: f64,
    /// Kernel timings of the step.
    pub timings: Vec<Timing>,
    /// The step's global L2 gradient norm, when its plan computes it.
    pub grad_norm: Option<f64>,
    /// Why the step's optimizers did nothing (`nonfinite`: NaN or Inf gradients), if
    /// they did nothing.
    pub skipped: Option<&'static str>,
    /// Most Stage-1 buffers any local rank had in flight at once (at most the window).
    pub stage1_in_flight_peak: usize,
    /// Nodes that ran as aliases (no copy: [`ExecConfig::aliasing`]), over local ranks.
    pub aliased_nodes: usize,
    /// Partials and no_sync accumulations still unflushed when the step's last node was
    /// issued, over local ranks (a valid plan leaves none).
    pub partials_left: usize,
}

/// Issues plans on a backend for its local ranks and owns their buffers.
pub struct Executor<B: Backend> {
    backend: Arc<B>,
    cfg: ExecConfig,
    ranks: Vec<RankState<B>>,
    steps_done: u64,
    step_start: Option<Instant>,
    /// Host time spent adopting plans in this step (preparing the ones not cached yet).
    adopt_time: Duration,
    /// Plans prepared so far (each once for all local ranks).
    prepares: u64,
    staging: Vec<f32>,
    /// Every parameter's optimizer settings; the base ones until the groups are resolved.
    hyper: Arc<HyperTable>,
    /// Whether `hyper` holds the groups (always, when there are none).
    resolved: bool,
    /// Why the groups could not be resolved from the adopted plan's parameters: every
    /// later hand-in and step fails with it, before issuing anything.
    group_error: Option<String>,
    /// Set when a step timed out: the device may still be running it, so nothing more
    /// is issued.
    broken: Option<String>,
    /// The learning-rate factor the caller set, replacing the schedule's.
    lr_override: Option<f64>,
    /// Another rank's failure, reported by whoever watches the job.
    peer_abort: PeerAbort,
    /// The step in progress's deadline, for watchdogs on other threads.
    deadline: StepDeadline,
}

impl<B: Backend> Executor<B> {
    /// An executor over a backend's local ranks.
    pub fn new(backend: Arc<B>, cfg: ExecConfig) -> Self {
        let ranks = backend
            .local_ranks()
            .into_iter()
            .map(RankState::new)
            .collect();
        Executor {
            backend,
            ranks,
            steps_done: 0,
            step_start: None,
            adopt_time: Duration::ZERO,
            prepares: 0,
            staging: Vec::new(),
            hyper: Arc::new(HyperTable::base(cfg.adamw, cfg.muon)),
            resolved: cfg.groups.is_empty(),
            group_error: None,
            broken: None,
            lr_override: None,
            peer_abort: PeerAbort::new(),
            deadline: StepDeadline::new(),
            cfg,
        }
    }

    /// Resolves [`ExecConfig::groups`] for these parameters (in parameter-id order, as in
    /// the plans this executor will run): each parameter gets the first group whose
    /// pattern matches its name. A group with a setting out of range, or that gets no
    /// parameter, is an error ([`GroupError`] in words). Without this call the first
    /// plan adopted resolves them, and such an error fails the step.
    pub fn resolve_params<'a>(
        &mut self,
        params: impl IntoIterator<Item = &'a overlap_graph::ParamSpec>,
    ) -> Result<&HyperTable, ExecError> {
        let table = HyperTable::resolve(self.cfg.adamw, self.cfg.muon, &self.cfg.groups, params)
            .map_err(|e| ExecError::Usage(e.to_string()))?;
        self.hyper = Arc::new(table);
        self.resolved = true;
        self.group_error = None;
        Ok(&self.hyper)
    }

    /// Every parameter's optimizer settings before the learning-rate factor.
    pub fn hyper(&self) -> &HyperTable {
        &self.hyper
    }

    /// Sets the learning-rate factor of the steps to come, replacing the schedule's
    /// (`None`: follow [`ExecConfig::schedule`] again). Each parameter's rate is its base
    /// rate × its group's `lr_scale` × this factor. Call between steps: the optimizers
    /// of a step all use one factor.
    pub fn set_lr_factor(&mut self, factor: Option<f64>) -> Result<(), ExecError> {
        if self.in_step() {
            return Err(ExecError::Usage(
                "set_lr_factor during a step; call it between steps (it applies to the next step)"
                    .into(),
            ));
        }
        if let Some(f) = factor {
            if !(f.is_finite() && f >= 0.0) {
                return Err(ExecError::Usage(format!(
                    "learning-rate factor must be a finite number >= 0, got {f}"
                )));
            }
        }
        self.lr_override = factor;
        Ok(())
    }

    /// The learning-rate factor of the step in progress, or of the next one between
    /// steps: the factor set by [`Executor::set_lr_factor`], else the schedule's at that
    /// step's number.
    pub fn lr_factor(&self) -> f64 {
        self.lr_override
            .unwrap_or_else(|| self.cfg.schedule.factor(self.steps_done + 1))
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The settings.
    pub fn config(&self) -> &ExecConfig {
        &self.cfg
    }

    /// Global ranks this executor drives.
    pub fn local_ranks(&self) -> Vec<u32> {
        self.ranks.iter().map(|r| r.rank).collect()
    }

    /// Completed steps.
    pub fn steps_done(&self) -> u64 {
        self.steps_done
    }

    /// Whether any node of the current step has been issued.
    pub fn in_step(&self) -> bool {
        self.step_start.is_some()
    }

    fn rank_mut(&mut self, rank: u32) -> Result<&mut RankState<B>, ExecError> {
        self.ranks
            .iter_mut()
            .find(|r| r.rank == rank)
            .ok_or_else(|| ExecError::Usage(format!("rank {rank} is not driven by this executor")))
    }

    /// Sets a parameter's values on a rank (its shard, or the whole tensor on the owner's
    /// shard column). Call before the first step.
    pub fn init_param(
        &mut self,
        rank: u32,
        param: ParamId,
        values: &[f32],
    ) -> Result<(), ExecError> {
        self.write(rank, Buffer::Param { param }, values)
    }

    /// Sets a persistent buffer of a rank ([`Buffer::Param`] or [`Buffer::OptState`]) to
    /// `values`, replacing what it held: the mirror of [`Executor::read`], for restoring a
    /// checkpoint. The length must be the plan's ([`Plan::buffer_len`]: an optimizer state
    /// of AdamW is `m` then `v`, each as long as the rank's piece; Muon's is the momentum
    /// of the whole matrix); the optimizer's kernel checks it. Optimizer state written
    /// before the first step is used as it is instead of the zeros it would start from.
    /// Call between steps.
    pub fn write(&mut self, rank: u32, buffer: Buffer, values: &[f32]) -> Result<(), ExecError> {
        self.check_persistent("write", &buffer)?;
        let backend = self.backend.clone();
        let r = self.rank_mut(rank)?;
        let buf = backend.alloc(rank, values.len())?;
        backend.upload(&buf, values)?;
        // The replaced buffer goes now, not when a kept row would be bound again.
        r.forget_rows();
        r.buffers.insert(buffer, buf);
        Ok(())
    }

    /// Drops a persistent buffer of a rank: an optimizer state starts again from zeros at
    /// the next step (a parameter must be written again before one). Call between steps.
    pub fn clear(&mut self, rank: u32, buffer: Buffer) -> Result<(), ExecError> {
        self.check_persistent("clear", &buffer)?;
        let r = self.rank_mut(rank)?;
        r.forget_rows();
        r.buffers.remove(&buffer);
        Ok(())
    }

    fn check_persistent(&self, what: &str, buffer: &Buffer) -> Result<(), ExecError> {
        if !buffer.is_persistent() {
            return Err(ExecError::Usage(format!(
                "{what}({buffer}): only parameters and optimizer state can be set from outside"
            )));
        }
        if self.in_step() {
            return Err(ExecError::Usage(format!(
                "{what}({buffer}) during a step; call it before the first micro-batch or after step()"
            )));
        }
        Ok(())
    }

    /// Sets the completed-step counter (restoring a checkpoint): the next step is step
    /// `steps + 1`, which is what AdamW's bias correction uses. Call between steps.
    pub fn set_steps_done(&mut self, steps: u64) -> Result<(), ExecError> {
        if self.in_step() {
            return Err(ExecError::Usage(
                "set_steps_done during a step; call it before the first micro-batch or after step()"
                    .into(),
            ));
        }
        self.steps_done = steps;
        Ok(())
    }

    /// Reads a buffer of a rank (a parameter, its optimizer state once a step ran or
    /// [`Executor::write`] set it, or a reduced gradient of the last step). Call between
    /// steps.
    pub fn read(&self, rank: u32, buffer: Buffer) -> Result<Option<Vec<f32>>, ExecError> {
        let r = self.ranks.iter().find(|r| r.rank == rank).ok_or_else(|| {
            ExecError::Usage(format!("rank {rank} is not driven by this executor"))
        })?;
        match r.buffers.get(&buffer) {
            Some(b) => Ok(Some(self.backend.download(b)?)),
            None => Ok(None),
        }
    }

    /// Switches every rank to `plan`, whose programs must extend what was issued so far
    /// (the plan of a longer gate prefix, or of the whole step). The plan may go on past
    /// what this step will issue (a caller's guess at the micro-batches to come): what a
    /// rank prepares for a node depends only on the plan up to the end of that node's
    /// micro-batch (`prepared.rs`), and nothing past the last node issued is ever issued.
    /// Adopting the plan already adopted costs nothing; one prepared before (and still
    /// cached) costs a lookup. Only a plan the validator accepted can be adopted
    /// ([`overlap_graph::Validated`]).
    pub fn adopt(&mut self, plan: &overlap_graph::Validated) {
        let plan = plan.plan();
        let t0 = Instant::now();
        if !self.resolved {
            let specs: Vec<&overlap_graph::ParamSpec> =
                plan.params.iter().map(|p| &p.spec).collect();
            if let Err(e) = self.resolve_params(specs) {
                self.group_error = Some(e.to_string());
            }
            self.resolved = true;
        }
        if self.step_start.is_none() {
            self.step_start = Some(t0);
            self.deadline.set(Some(t0 + self.step_timeout()));
            self.adopt_time = Duration::ZERO;
            for r in &mut self.ranks {
                r.begin_step();
            }
        }
        let mut prepared_one = false;
        for r in &mut self.ranks {
            let same = r
                .prepared
                .as_ref()
                .is_some_and(|p| Arc::ptr_eq(&p.plan, plan));
            if same {
                continue;
            }
            // Preparing a plan walks all of it (issue order, release points, aliasing):
            // do it once per plan, not once per step. Most recently adopted last.
            let prepared = match r
                .prepared_cache
                .iter()
                .position(|p| Arc::ptr_eq(&p.plan, plan))
            {
                Some(i) => {
                    let p = r.prepared_cache.remove(i);
                    r.prepared_cache.push(p.clone());
                    p
                }
                None => {
                    prepared_one = true;
                    let p = Arc::new(Prepared::new(plan.clone(), r.rank, self.cfg.aliasing));
                    if r.prepared_cache.len() >= PREPARED_CACHE {
                        r.prepared_cache.remove(0);
                    }
                    r.prepared_cache.push(p.clone());
                    p
                }
            };
            r.adopt(&self.backend, prepared);
        }
        self.prepares += u64::from(prepared_one);
        self.adopt_time += t0.elapsed();
    }

    /// Drops the prepared plans that only this executor still holds: no caller can adopt
    /// them again (adopting needs the plan), so keeping them would only hold memory. Call
    /// between steps, when no rank has a plan adopted.
    fn prune_prepared(&mut self) {
        let ranks = &self.ranks;
        // Each local rank's prepared copy holds one reference to the plan; more than
        // that are the caller's.
        let copies = |plan: &Arc<Plan>| {
            ranks
                .iter()
                .filter(|r| r.prepared_cache.iter().any(|p| Arc::ptr_eq(&p.plan, plan)))
                .count()
        };
        let dead: Vec<*const Plan> = ranks
            .iter()
            .flat_map(|r| &r.prepared_cache)
            .filter(|p| Arc::strong_count(&p.plan) <= copies(&p.plan))
            .map(|p| Arc::as_ptr(&p.plan))
            .collect();
        if dead.is_empty() {
            return;
        }
        for r in &mut self.ranks {
            r.prepared_cache
                .retain(|p| !dead.contains(&Arc::as_ptr(&p.plan)));
            r.prune_rows();
        }
    }

    fn ctx(&mut self) -> Result<IssueCtx, ExecError> {
        if let Some(e) = &self.group_error {
            return Err(ExecError::Usage(e.clone()));
        }
        if let Some(e) = &self.broken {
            return Err(ExecError::Usage(e.clone()));
        }
        if let Some(f) = self.peer_abort.failure() {
            return Err(self.peer_failed(f));
        }
        let limit = self.step_timeout();
        Ok(IssueCtx {
            window: self.cfg.stage1_window,
            hyper: self.hyper.clone(),
            lr_factor: self.lr_factor(),
            step: self.steps_done + 1,
            backward: self.cfg.backward,
            max_norm: self.cfg.clip.max_norm,
            deadline: self.step_start.unwrap_or_else(Instant::now) + limit,
            fault: self.cfg.fault,
            peer: self.peer_abort.subscribe(),
        })
    }

    /// The timeout of the step in progress (or the next one): [`ExecConfig::host_timeout`],
    /// times [`FIRST_STEP_TIMEOUT_FACTOR`] for the first step.
    pub fn step_timeout(&self) -> Duration {
        if self.steps_done == 0 {
            self.cfg
                .host_timeout
                .saturating_mul(FIRST_STEP_TIMEOUT_FACTOR)
        } else {
            self.cfg.host_timeout
        }
    }

    /// The error of a step that timed out, naming every local stream still busy (the
    /// node the backend says it runs, else the last node issued on it), or, where
    /// `pending` says which streams the host was waiting on and the backend cannot tell
    /// what runs, those streams' last issued nodes. Marks the executor unusable.
    fn timed_out(&mut self, pending: &[(u32, Stream)]) -> ExecError {
        let step = self.steps_done + 1;
        let seconds = self.step_timeout().as_secs_f64();
        let mut stalled = self.running_now();
        if stalled.is_empty() {
            for r in &self.ranks {
                for s in Stream::ALL {
                    let waited = pending.is_empty() || pending.contains(&(r.rank, s));
                    if !waited {
                        continue;
                    }
                    let node = r.last_issued[s.index()];
                    stalled.push(Stalled {
                        rank: r.rank,
                        stream: s,
                        node,
                        label: node
                            .map(|n| node_label(r, n))
                            .unwrap_or_else(|| "no node issued this step".into()),
                        running: false,
                    });
                }
            }
        }
        let err = ExecError::Timeout {
            seconds,
            step,
            stalled,
        };
        self.backend.abort(&err.to_string());
        self.broken = Some(format!(
            "the executor cannot be used after a timed-out step (the device may still run it): {err}"
        ));
        err
    }

    /// Every local stream the backend says runs a kernel now, with that kernel's node
    /// (an injected hang named as such); empty where the backend cannot tell.
    fn running_now(&self) -> Vec<Stalled> {
        let mut stalled = Vec::new();
        for r in &self.ranks {
            for s in Stream::ALL {
                if let Some(tag) = self.backend.running(r.rank, s) {
                    let mut l = node_label(r, tag.node);
                    if tag.op == FAULT_OP {
                        l.push_str(&format!(", a hang injected by {FAULT_VAR}"));
                    }
                    stalled.push(Stalled {
                        rank: r.rank,
                        stream: s,
                        node: Some(tag.node),
                        label: l,
                        running: true,
                    });
                }
            }
        }
        stalled
    }

    /// The backend's root causes of the step in progress as node failures (an
    /// injected failure named as such).
    fn root_causes(&self) -> Vec<NodeFailure> {
        let mut failures = Vec::new();
        for (rank, stream, tag, error) in self.backend.errors() {
            let label = self
                .ranks
                .iter()
                .find(|r| r.rank == rank)
                .and_then(|r| r.prepared.as_ref())
                .and_then(|p| {
                    p.plan
                        .rank(rank)
                        .nodes
                        .get(tag.node as usize)
                        .map(|n| p.plan.label(n))
                })
                .unwrap_or_else(|| tag.op.to_string());
            let label = if tag.op == FAULT_OP {
                format!("{label}, a failure injected by {FAULT_VAR}")
            } else {
                label
            };
            failures.push(NodeFailure {
                rank,
                stream,
                node: tag.node,
                label,
                error,
            });
        }
        failures
    }

    /// Another rank failed: gives up on the work in flight (the backend's communicators
    /// are aborted, so that collectives waiting for that rank end) and refuses further
    /// work, as after a timeout. When this rank failed too, its own root causes are the
    /// error (the news from the other rank may be an echo of them); otherwise the other
    /// rank's failure, with what this rank's streams were still running (a hang here
    /// may be why the other rank timed out).
    fn peer_failed(&mut self, f: PeerFailure) -> ExecError {
        let failures = self.root_causes();
        let busy = self.running_now();
        if self.broken.is_none() {
            self.backend
                .abort(&format!("rank {} of the job failed: {}", f.rank, f.reason));
            self.broken = Some(format!(
                "the executor cannot be used after rank {} of the job failed: {}",
                f.rank, f.reason
            ));
        }
        if !failures.is_empty() {
            return ExecError::Step { failures };
        }
        let reason = if busy.is_empty() {
            f.reason
        } else {
            let busy: Vec<String> = busy.iter().map(Stalled::to_string).collect();
            format!(
                "{}; this rank was still busy: {}",
                f.reason,
                busy.join("; ")
            )
        };
        ExecError::PeerFailed {
            rank: f.rank,
            reason,
        }
    }

    /// The deadline of the step in progress, shared with other threads (a watchdog for a
    /// host stuck inside a device call, where this executor's own deadline cannot act).
    pub fn step_deadline(&self) -> StepDeadline {
        self.deadline.clone()
    }

    /// Replaces [`ExecConfig::fault`] from the next step on (`None`: no fault).
    pub fn set_fault(&mut self, fault: Option<Fault>) {
        self.cfg.fault = fault;
    }

    /// The signal through which whoever watches the job (the rendezvous connection of
    /// a multi-process job) reports another rank's failure: from then on this
    /// executor's waits end at once with [`ExecError::PeerFailed`].
    pub fn peer_abort(&self) -> PeerAbort {
        self.peer_abort.clone()
    }

    /// Turns a rank's timeout inside an issue into the full report.
    fn check_issued(&mut self, results: Vec<Result<(), ExecError>>) -> Result<(), ExecError> {
        if results
            .iter()
            .any(|r| matches!(r, Err(ExecError::Timeout { .. })))
        {
            return Err(self.timed_out(&[]));
        }
        if let Some(f) = self.peer_abort.failure() {
            if results
                .iter()
                .any(|r| matches!(r, Err(ExecError::PeerFailed { .. })))
            {
                return Err(self.peer_failed(f));
            }
        }
        results.into_iter().collect()
    }

    /// The trainer's backward made `layer`'s gradients of `micro_batch` ready: `fill`
    /// writes each (rank, parameter) gradient into the slice it is given; then the
    /// layer's nodes are issued on every local rank.
    pub async fn grad_ready(
        &mut self,
        micro_batch: u32,
        layer: u32,
        mut fill: impl FnMut(u32, ParamId, &mut [f32]),
    ) -> Result<(), ExecError> {
        self.hand_in(micro_batch, layer, |backend, r, staging, param, numel| {
            staging.clear();
            staging.resize(numel, 0.0);
            fill(r.rank, param, staging);
            // The upload overwrites every element.
            let buf = r.take(backend, numel, false)?;
            backend.upload(&buf, staging)?;
            Ok(buf)
        })
        .await
    }

    /// Like [`Executor::grad_ready`], with gradients already on the device: `bind(rank,
    /// param)` returns the caller's buffer holding that gradient (its full shape), used
    /// in place with no upload, as a trainer's autograd hands over its gradient tensors.
    /// The buffer stays the caller's: the executor only reads it, never pools or reuses
    /// it, and the caller must not change it until the step has finished.
    pub async fn grad_ready_bound(
        &mut self,
        micro_batch: u32,
        layer: u32,
        mut bind: impl FnMut(u32, ParamId) -> Result<B::Buffer, ExecError>,
    ) -> Result<(), ExecError> {
        self.hand_in(micro_batch, layer, |backend, r, _, param, numel| {
            let buf = bind(r.rank, param)?;
            if backend.len(&buf) != numel {
                return Err(ExecError::Usage(format!(
                    "grad_ready_bound: the buffer of parameter {param} on rank {} has {} elements, the parameter {numel}",
                    r.rank,
                    backend.len(&buf)
                )));
            }
            r.borrowed.insert(Buffer::Grad { param, micro_batch });
            Ok(buf)
        })
        .await
    }

    /// Orders the plan after work of the trainer that the plan cannot see: for each
    /// `(rank, event)`, the rank's compute stream (where the trainer's `grad_ready`,
    /// `forward` and `backward` points stand) waits on `event` before anything issued
    /// after this call. A trainer that writes gradients, or reads gathered parameters,
    /// on a stream of its own records an event there and hands it in with its next call;
    /// one that works on the compute stream itself needs none. Only the device waits:
    /// the host goes on at once.
    pub fn follow(&self, after: &[(u32, B::Event)]) -> Result<(), ExecError> {
        for (rank, event) in after {
            if !self.ranks.iter().any(|r| r.rank == *rank) {
                return Err(ExecError::Usage(format!(
                    "an event for rank {rank}, which this executor does not drive (its ranks: {:?})",
                    self.local_ranks()
                )));
            }
            self.backend.wait(*rank, Stream::Compute, event);
        }
        Ok(())
    }

    /// Checks that `layer` of `micro_batch` is next on every rank, binds each of its
    /// parameters' gradient buffer with `put`, and issues the layer's nodes.
    async fn hand_in(
        &mut self,
        micro_batch: u32,
        layer: u32,
        mut put: impl FnMut(
            &B,
            &mut RankState<B>,
            &mut Vec<f32>,
            ParamId,
            usize,
        ) -> Result<B::Buffer, ExecError>,
    ) -> Result<(), ExecError> {
        let ctx = self.ctx()?;
        let backend = self.backend.clone();
        let mut ends = Vec::with_capacity(self.ranks.len());
        for r in &mut self.ranks {
            let p = r
                .prepared
                .clone()
                .ok_or_else(|| ExecError::Usage("grad_ready before a micro-batch began".into()))?;
            let nodes = &p.plan.rank(r.rank).nodes;
            // Forward plans: what lies before the point (the backward's free and
            // gathers) goes out with it.
            let at = forward::next_point(nodes, r.next_node).unwrap_or(nodes.len());
            let here = nodes.get(at);
            match here {
                Some(n)
                    if n.op == Op::GradReady { layer } && n.micro_batch == Some(micro_batch) => {}
                other => {
                    let next = other
                        .map(|n| p.plan.label(n))
                        .unwrap_or_else(|| "the end of the plan".into());
                    return Err(ExecError::Usage(format!(
                        "grad_ready(layer {layer}) of micro-batch {micro_batch} on rank {}: the plan expects {next} next (layers are handed in from the highest down, each once per micro-batch)",
                        r.rank
                    )));
                }
            }
            let end = (at + 1..nodes.len())
                .find(|&i| nodes[i].op.is_point() || nodes[i].micro_batch != Some(micro_batch))
                .unwrap_or(nodes.len());
            ends.push(end);
            for (i, param) in p.plan.params.iter().enumerate() {
                if param.spec.layer != layer {
                    continue;
                }
                let numel = param.spec.numel() as usize;
                let buf = put(&backend, r, &mut self.staging, i as ParamId, numel)?;
                r.buffers.insert(
                    Buffer::Grad {
                        param: i as ParamId,
                        micro_batch,
                    },
                    buf,
                );
            }
        }
        self.issue_until(ends, &ctx).await
    }

    /// Issues every local rank's nodes up to (not including) its `ends` entry, the ranks'
    /// issuing futures joined, and turns a rank's timeout or peer failure inside into
    /// the full report.
    pub(crate) async fn issue_until(
        &mut self,
        ends: Vec<usize>,
        ctx: &IssueCtx,
    ) -> Result<(), ExecError> {
        let backend = self.backend.clone();
        let results = join_all(
            self.ranks
                .iter_mut()
                .zip(ends)
                .map(|(r, end)| r.issue_until(&backend, end, ctx)),
        )
        .await;
        self.check_issued(results)
    }

    /// Ends a step whose nodes failed: the backend forgets the failures, every rank
    /// drops the step's buffers, and the error names the root causes.
    fn failed_step(&mut self, failures: Vec<NodeFailure>) -> ExecError {
        self.backend.reset();
        for r in &mut self.ranks {
            r.end_step(false);
        }
        self.prune_prepared();
        ExecError::Step { failures }
    }

    /// Issues the step's plan up to its optimizer and publish tail (every reduction of
    /// every micro-batch, nothing of the global norm, the clip, the optimizers or the
    /// publishes) and waits for the device, so that the reduced gradients can be read
    /// ([`Executor::read`] of `Buffer::Reduced`) before [`Executor::finish_step`] updates
    /// the parameters. Costs one wait for the device. The failures of the issued nodes
    /// end the step as [`Executor::finish_step`]'s do.
    pub async fn reduce_step(&mut self) -> Result<(), ExecError> {
        let ctx = self.ctx()?;
        let ends: Vec<usize> = self
            .ranks
            .iter()
            .map(|r| {
                r.prepared.as_ref().map_or(0, |p| {
                    let nodes = &p.plan.rank(r.rank).nodes;
                    nodes
                        .iter()
                        .position(|n| n.micro_batch.is_none())
                        .unwrap_or(nodes.len())
                })
            })
            .collect();
        self.issue_until(ends, &ctx).await?;
        let failures = self.drain().await?;
        if !failures.is_empty() {
            self.step_start = None;
            self.deadline.set(None);
            return Err(self.failed_step(failures));
        }
        Ok(())
    }

    /// Issues the rest of the step's plan (its optimizer and publish tail), waits for the
    /// device, and returns the step's figures, or the failures of its nodes.
    pub async fn finish_step(&mut self) -> Result<StepStats, ExecError> {
        let backend = self.backend.clone();
        let ctx = self.ctx()?;
        let ends: Vec<usize> = self
            .ranks
            .iter()
            .map(|r| {
                r.prepared
                    .as_ref()
                    .map(|p| p.plan.rank(r.rank).nodes.len())
                    .unwrap_or(0)
            })
            .collect();
        let issued = self.issue_until(ends, &ctx).await;
        for r in &mut self.ranks {
            r.issue_trailing(&backend);
        }
        issued?;
        let failures = self.drain().await?;
        let nodes = self.ranks.iter().map(|r| r.issued).sum();
        let partials_left = self.step_buffers_held();
        let wall = self
            .step_start
            .take()
            .map(|s| s.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        self.deadline.set(None);
        let timings = self.backend.take_timings();
        if !failures.is_empty() {
            return Err(self.failed_step(failures));
        }
        let grad_norm = self.grad_norm()?;
        let nonfinite = grad_norm.is_some_and(|n| !n.is_finite());
        let step = self.steps_done + 1;
        if !nonfinite {
            self.steps_done += 1;
        }
        for r in &mut self.ranks {
            r.end_step(true);
        }
        self.prune_prepared();
        if nonfinite && self.cfg.clip.on_nonfinite == OnNonFinite::Error {
            return Err(ExecError::NonFinite {
                step,
                norm: grad_norm.unwrap_or(f64::NAN),
            });
        }
        Ok(StepStats {
            nodes,
            wall_seconds: wall,
            timings,
            partials_left,
            grad_norm,
            skipped: nonfinite.then_some("nonfinite"),
            ..self.issue_stats()
        })
    }

    /// The step's global norm, when its plan computes it: every rank holds the same
    /// after the norm all-reduces; one download of one float per step, after the device
    /// finished (no extra sync).
    fn grad_norm(&self) -> Result<Option<f64>, ExecError> {
        let Some(r) = self.ranks.iter().find(|r| {
            r.prepared
                .as_ref()
                .is_some_and(|p| p.plan.grad_norm && r.buffers.contains_key(&Buffer::Norm))
        }) else {
            return Ok(None);
        };
        let sq = self.backend.download(&r.buffers[&Buffer::Norm])?;
        Ok(sq.first().map(|&x| f64::from(x).sqrt()))
    }

    /// The step's issue figures, summed over local ranks: host time by node kind (and
    /// of it, inside the backend's launch), aliased nodes, the Stage-1 window's peak.
    /// The other fields are left at their defaults.
    fn issue_stats(&self) -> StepStats {
        let stage1_in_flight_peak = self
            .ranks
            .iter()
            .map(|r| r.peak_in_flight)
            .max()
            .unwrap_or(0);
        let aliased_nodes = self.ranks.iter().map(|r| r.aliased).sum();
        let issue_by_kind = Op::KINDS
            .iter()
            .enumerate()
            .map(|(i, &kind)| {
                let (secs, n) = self.ranks.iter().fold((0.0, 0), |(s, n), r| {
                    (s + r.issue_by_kind[i].0, n + r.issue_by_kind[i].1)
                });
                (kind, secs, n)
            })
            .filter(|k| k.2 > 0)
            .collect::<Vec<_>>();
        let launch_by_kind = issue_by_kind
            .iter()
            .map(|&(kind, _, _)| {
                let i = Op::KINDS.iter().position(|&k| k == kind).unwrap_or(0);
                (kind, self.ranks.iter().map(|r| r.launch_by_kind[i]).sum())
            })
            .collect();
        let trailing_seconds = self.ranks.iter().map(|r| r.trailing_seconds).sum();
        let issue_seconds = self.adopt_time.as_secs_f64()
            + trailing_seconds
            + issue_by_kind.iter().map(|k| k.1).sum::<f64>();
        StepStats {
            trailing_seconds,
            aliased_nodes,
            issue_seconds,
            issue_by_kind,
            launch_by_kind,
            stage1_in_flight_peak,
            ..StepStats::default()
        }
    }

    /// Discards the step in progress (`zero_grad`): waits for what was issued, then drops
    /// partials, accumulations and reduced gradients. Failures of the discarded work are
    /// returned; the executor is usable again either way.
    pub async fn discard(&mut self) -> Result<(), ExecError> {
        if let Some(e) = &self.broken {
            return Err(ExecError::Usage(e.clone()));
        }
        self.deadline.set(None);
        if self.step_start.take().is_none() {
            for r in &mut self.ranks {
                r.end_step(false);
                r.begin_step();
            }
            self.prune_prepared();
            return Ok(());
        }
        for r in &mut self.ranks {
            r.issue_trailing(&self.backend);
        }
        let failures = self.drain().await?;
        self.backend.take_timings();
        self.backend.reset();
        for r in &mut self.ranks {
            r.end_step(false);
            r.begin_step();
        }
        self.prune_prepared();
        if failures.is_empty() {
            Ok(())
        } else {
            Err(ExecError::Step { failures })
        }
    }

    /// Waits until every stream of every local rank has executed what was issued, and
    /// collects root-cause failures.
    async fn drain(&mut self) -> Result<Vec<NodeFailure>, ExecError> {
        let backend = self.backend.clone();
        let mut waits = Vec::new();
        for r in &self.ranks {
            for s in Stream::ALL {
                let ev = backend.event(r.rank);
                backend.record(r.rank, s, &ev);
                waits.push((r.rank, s, ev));
            }
        }
        let deadline = self.step_start.unwrap_or_else(Instant::now) + self.step_timeout();
        let deadline = tokio::time::Instant::from_std(deadline);
        for (_, _, ev) in &waits {
            let waited = tokio::select! {
                biased;
                f = peer::failed(Some(self.peer_abort.subscribe())) => Err(Some(f)),
                r = tokio::time::timeout_at(deadline, backend.host_wait(ev)) => r.map(drop).map_err(|_| None),
            };
            if let Err(Some(f)) = waited {
                return Err(self.peer_failed(f));
            }
            if waited.is_err() {
                let pending: Vec<(u32, Stream)> = waits
                    .iter()
                    .filter(|(_, _, ev)| backend.status(ev) == overlap_ops::EventStatus::Pending)
                    .map(|&(rank, s, _)| (rank, s))
                    .collect();
                return Err(self.timed_out(&pending));
            }
        }
        let mut failures = self.root_causes();
        if failures.is_empty() {
            for r in &mut self.ranks {
                if let Some(e) = r.issue_errors.drain(..).next() {
                    failures.push(NodeFailure {
                        rank: r.rank,
                        stream: Stream::Reduce,
                        node: 0,
                        label: "backpressure wait".into(),
                        error: e,
                    });
                }
            }
        }
        Ok(failures)
    }

    /// Plans prepared so far, each counted once for all local ranks (a cached plan
    /// adopted again is not prepared again).
    pub fn plans_prepared(&self) -> u64 {
        self.prepares
    }

    /// Rows of optimizers bound so far, over every local rank. A row is bound once and
    /// handed to the backend again step after step while its plan, the optimizer
    /// settings and its parameters and states stay the ones in use; a new plan, new
    /// settings, [`Self::write`] or [`Self::clear`] make the next step bind it again.
    pub fn optimizer_rows_bound(&self) -> u64 {
        self.ranks.iter().map(|r| r.rows_bound).sum()
    }

    /// Plans prepared and cached per local rank (those the caller still holds, up to a
    /// small bound).
    pub fn prepared_plans(&self) -> usize {
        self.ranks
            .iter()
            .map(|r| r.prepared_cache.len())
            .max()
            .unwrap_or(0)
    }

    /// Partials and no_sync accumulations currently unflushed on the local ranks.
    pub fn step_buffers_held(&self) -> usize {
        self.ranks.iter().map(|r| r.live_partials.len()).sum()
    }

    /// Pooled transient buffers per local rank (they stay bounded across steps).
    pub fn pooled_buffers(&self) -> Vec<(u32, usize)> {
        self.ranks.iter().map(|r| (r.rank, r.pooled())).collect()
    }

    /// Whether a rank holds a parameter's values.
    pub fn holds_param(&self, rank: u32, param: ParamId) -> bool {
        self.ranks
            .iter()
            .any(|r| r.rank == rank && r.holds_param(param))
    }
}

/// One piece of transient memory holding a Stage-1 buffer going free in the executor:
/// what its backpressure waits for ([`stage1_releases`] derives these from the executor's
/// own release rules).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage1Release {
    /// The bucket whose pack opened the Stage-1 buffer.
    pub bucket: overlap_graph::BucketId,
    /// The buffer's micro-batch.
    pub micro_batch: u32,
    /// The node whose issue records the release (the memory's last final accessor in
    /// serial order): a backpressure wait before a later pack waits for it, one before an
    /// earlier pack does not know of it yet and waits for nothing.
    pub after: overlap_graph::NodeId,
    /// The nodes whose completion frees the memory (its final accessors: the last write
    /// and every read after it).
    pub nodes: Vec<overlap_graph::NodeId>,
}

/// Which of a rank's nodes the executor runs as aliases of their input (a marker, no
/// copy) when it issues `plan` with [`ExecConfig::aliasing`] on: what a cost model of the
/// plan needs to know (`overlap simulate`; the rules are `prepared.rs`'s).
pub fn aliased_nodes(plan: &Arc<Plan>, rank: u32) -> Vec<bool> {
    Prepared::new(plan.clone(), rank, true)
        .alias
        .iter()
        .map(Option::is_some)
        .collect()
}

/// What frees each Stage-1 buffer of a rank when the executor issues `plan` with
/// [`ExecConfig::aliasing`] set to `aliasing`: for every piece of transient memory that
/// holds a Stage-1 buffer's send, output or receive names, the node whose issue records
/// its release (the memory's last final accessor in serial order) and the final
/// accessors whose completion frees it. That is what [`ExecConfig::stage1_window`]'s
/// backpressure waits for before a later pack, as a cost model of the plan needs it
/// (`overlap simulate`; the rules are `rank.rs`'s `release_after` and `backpressure`).
pub fn stage1_releases(plan: &Arc<Plan>, rank: u32, aliasing: bool) -> Vec<Stage1Release> {
    let p = Prepared::new(plan.clone(), rank, aliasing);
    // Every final accessor of each piece of memory, in serial order: the executor
    // records a release event after each and waits for all of them.
    let mut finals: rustc_hash::FxHashMap<Buffer, Vec<u32>> = Default::default();
    for (n, list) in p.finals.iter().enumerate() {
        for &(root, _) in list {
            finals.entry(root).or_default().push(n as u32);
        }
    }
    let mut out = Vec::new();
    for (n, list) in p.finals.iter().enumerate() {
        for &(root, last) in list {
            if !last {
                continue;
            }
            let mut keys: Vec<(u32, u32)> = Vec::new();
            for key in p.names_of(&root).iter().filter_map(rank::stage1_key) {
                if !keys.contains(&key) {
                    keys.push(key);
                }
            }
            for (bucket, micro_batch) in keys {
                out.push(Stage1Release {
                    bucket,
                    micro_batch,
                    after: n as u32,
                    nodes: finals.get(&root).cloned().unwrap_or_default(),
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use overlap_graph::{Gate, Mesh, ParamSpec, PlanSpec, Planner, Route, Schedule, Transport};

    /// Mesh 2x1, three `fsdp` layers, two micro-batches.
    fn plan(transport: Transport) -> Arc<Plan> {
        let params = (0..3)
            .map(|l| ParamSpec::new(format!("l{l}.w"), vec![64, 48], Route::Fsdp, l))
            .collect();
        let spec = PlanSpec::new(Mesh::new(2, 1).unwrap(), params)
            .with_schedule(Schedule::default().with_transport(transport));
        Arc::new(
            Planner::new(spec)
                .unwrap()
                .plan(&[Gate::ReplicateOff, Gate::On])
                .unwrap(),
        )
    }

    /// Every pack's Stage-1 buffer is released after its Stage 1 (the collective, or the
    /// exchange and its combine), by nodes that touch it, announced by the last of them.
    #[test]
    fn stage1_releases_free_every_buffer_after_its_stage1() {
        for transport in [Transport::Nccl, Transport::Copy] {
            let plan = plan(transport);
            for aliasing in [false, true] {
                let nodes = &plan.ranks[0].nodes;
                let releases = stage1_releases(&plan, 0, aliasing);
                let packs: Vec<_> = nodes
                    .iter()
                    .filter(|n| matches!(n.op, Op::Pack { .. }))
                    .collect();
                assert!(packs.len() >= 6, "{transport:?}");
                for pack in packs {
                    let key = (pack.op.bucket(), pack.op.micro_batch());
                    let mine: Vec<_> = releases
                        .iter()
                        .filter(|r| (Some(r.bucket), Some(r.micro_batch)) == key)
                        .collect();
                    assert!(!mine.is_empty(), "{transport:?}: {key:?} never released");
                    for r in &mine {
                        assert!(r.after >= pack.id && r.nodes.contains(&r.after), "{r:?}");
                        assert_eq!(r.nodes.iter().max(), Some(&r.after), "{r:?}");
                    }
                    let stage1 = nodes
                        .iter()
                        .find(|n| {
                            (n.op.bucket(), n.op.micro_batch()) == key
                                && matches!(n.op, Op::Stage1 { .. } | Op::Combine { .. })
                        })
                        .unwrap();
                    assert!(
                        mine.iter().any(|r| r.nodes.contains(&stage1.id)),
                        "{transport:?}: {key:?} released before {}",
                        plan.label(stage1)
                    );
                }
            }
        }
    }
}
