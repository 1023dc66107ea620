//! The embedding API: a [`Session`] runs a trainer's gradient path.
//!
//! A trainer builds a session from a [`Config`] (or a [`PlanSpec`] in code), then per
//! micro-batch sets the gate ([`Session::begin_micro_batch`]), hands in gradients layer
//! by layer as backward produces them, highest layer first ([`Session::grad_ready`]),
//! and per step runs the optimizers and publishes ([`Session::step`]). With the
//! forward's gathers (`[forward]`) the session also hands it each layer's full
//! parameters, for the forward lowest layer first ([`Session::forward_ready`]) and
//! again for the backward ([`Session::backward_ready`]).
//! [`Session::zero_grad`] discards partials and accumulations.
//!
//! Every plan the session runs has been validated first: a plan covering the
//! micro-batches issued so far when a micro-batch begins, the whole step's plan before
//! the optimizers run.
//!
//! # Plans as micro-batches come
//!
//! The cost of a micro-batch must not grow with the micro-batches before it, so the
//! session does not plan each gate prefix. It keeps one *current* plan whose gates start
//! with the gates begun so far (the executor has it adopted):
//!
//! - a micro-batch whose gate is the current plan's next gate needs nothing: no
//!   planning, no validation, no adoption (the executor already holds the plan that
//!   covers it);
//! - otherwise a cached step plan that goes on with these gates becomes current, or the
//!   session plans the gates so far continued to twice their number (repeating their
//!   shortest period: `on` for `on,on,…`, `no_sync,on` for alternating ones), validates
//!   it as a prefix (`Mode::Prefix`) and makes it current. The guess only ever costs
//!   planning time: a wrong one is replaced at the first micro-batch it got wrong. Doubling
//!   makes a first step of `M` micro-batches of one pattern plan `O(log M)` plans of
//!   `O(M)` nodes in all;
//! - [`Session::step`] takes the validated plan of exactly the step's gates
//!   (`Mode::Step`) from a small cache (least recently used out, [`STEP_PLANS`]) or plans
//!   it, adopts it, and keeps it current: the next step, if it has the same gates, plans,
//!   validates and adopts nothing at all, whatever its number of micro-batches.
//!
//! Why running a longer plan than the micro-batches begun is the same as running the
//! exact one: the planner lowers a step in segments, one per micro-batch, each ending
//! with one event per stream it used, so the plan of gates `g` is a prefix (nodes, stream
//! programs, event ids) of the plan of every gate sequence starting with `g`
//! (`docs/plan-format.md`, the prefix property). The executor issues nodes only as the
//! trainer hands layers in, and what it prepares for a node (accesses, the issue order,
//! aliasing, allocation, the release points of transient buffers, which all belong to
//! one micro-batch) depends only on the plan up to the end of that node's micro-batch.
//! So the nodes of the micro-batches begun run exactly as in the exact prefix plan, and
//! the nodes after them never run: a `zero_grad`, an error or a step that ends sooner
//! leaves them unissued, and [`Session::step`] always switches to the step's own plan,
//! validated whole, before the optimizers. Validating the longer plan as a prefix covers
//! its first micro-batches: the prefix mode's invariants are about what each node reads,
//! writes and waits for, which only earlier nodes decide. Should the longer plan be
//! rejected, the session falls back to the exact prefix (and reports its violations).
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use overlap::{Config, Gate, Session};
//!
//! let config = Config::from_toml(r#"
//!     [mesh]
//!     shard = 2
//!     replicate = 2
//!     [[param]]
//!     name = "w"
//!     shape = [8, 6]
//!     route = "muon"
//!     layer = 0
//! "#, "inline.toml")?;
//! let mut session = Session::cpu(&config)?;
//! for gate in [Gate::ReplicateOff, Gate::On] {
//!     session.begin_micro_batch(gate).await?;
//!     for layer in session.layers() {
//!         // Backward made `layer`'s gradients: copy each rank's into `out`.
//!         session.grad_ready(layer, |_rank, _param, out| out.fill(0.5)).await?;
//!     }
//! }
//! let report = session.step().await?;
//! assert_eq!(report.step, 1);
//! # Ok::<(), overlap::Error>(())
//! # }).unwrap();
//! ```

use std::sync::Arc;

use overlap_executor::{ExecConfig, Executor, GroupRate, StepStats};
use overlap_graph::{
    Buffer, Collective, Gate, Mode, Op, ParamId, PlacedParam, Plan, PlanSpec, Planner, RankMemory,
    Rejected, Validated,
};
use overlap_ops::cpu::CpuBackend;
use overlap_ops::Backend;

use crate::config::{BackendChoice, Config};
use crate::Error;

/// What one step did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// 1-based step number.
    pub step: u64,
    /// The gate of each micro-batch.
    pub gates: Vec<Gate>,
    /// Executor figures (nodes issued, host issue time, wall time, kernel timings).
    pub stats: StepStats,
    /// Bytes Stage 2 did not move thanks to replicate-gate-off micro-batches, per rank
    /// summed over local ranks.
    pub stage2_bytes_saved: u64,
    /// Bytes Stage 2 moved, summed over local ranks.
    pub stage2_bytes: u64,
    /// The learning-rate factor the step's optimizers used: the schedule's at this
    /// step, or the one the trainer set ([`Session::set_lr_factor`]).
    pub lr_factor: f64,
    /// The learning rate in effect for each parameter group and optimizer that has
    /// parameters (base lr × `lr_scale` × `lr_factor`), the groups in order and the
    /// parameters in no group (`base`) last.
    pub lr: Vec<GroupRate>,
    /// The global L2 norm of the step's reduced gradients (before clipping), with
    /// `[clip]`.
    pub grad_norm: Option<f64>,
    /// Why the step's optimizers did nothing (`"nonfinite"`: NaN or Inf gradients and
    /// `on_nonfinite = "skip"`): parameters, optimizer state and the step counter are
    /// untouched, and `step` is the number the next step will have again.
    pub skipped: Option<&'static str>,
    /// The step plan's memory figures on each local rank ([`Plan::memory`]): peak
    /// parameter bytes (the rank's pieces plus the full parameters a forward plan
    /// gathers) and peak gradient-path bytes, along the serial order.
    pub memory: Vec<RankMemory>,
    /// Bytes of every parameter once ([`Plan::replica_bytes`]): a full replica's
    /// parameters, and its gradients, on every rank.
    pub replica_bytes: u64,
}

impl StepReport {
    /// The report of step 1 known only by its gates and executor figures: a step that
    /// was simulated, or measured outside a session (`overlap bench`), for the observe
    /// module's analysis and pictures. No optimizer, byte or memory figures.
    pub fn of_stats(gates: Vec<Gate>, stats: StepStats) -> StepReport {
        StepReport {
            step: 1,
            gates,
            stats,
            stage2_bytes_saved: 0,
            stage2_bytes: 0,
            lr_factor: 1.0,
            lr: Vec::new(),
            grad_norm: None,
            skipped: None,
            memory: Vec::new(),
            replica_bytes: 0,
        }
    }
}

/// Stage-2 bytes of a step plan on the local ranks.
#[derive(Debug, Clone, Copy, Default)]
struct Stage2Bytes {
    moved: u64,
    saved: u64,
}

/// Validated step plans kept per session, least recently used dropped first: the gate
/// patterns a training loop alternates between.
pub const STEP_PLANS: usize = 8;

/// A validated plan of a whole step, with the Stage-2 bytes its local ranks move and
/// save and their memory figures.
#[derive(Clone)]
struct StepPlan {
    plan: Validated,
    stage2: Stage2Bytes,
    memory: Arc<Vec<RankMemory>>,
}

/// What a session's plan caches hold and have done ([`Session::plan_cache`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlanCache {
    /// Plans planned and validated so far ([`Session::plans_built`]).
    pub built: u64,
    /// Plans the executor prepared (bound to buffers and streams) so far.
    pub prepared: u64,
    /// Prepared plans held for reuse, summed over the local ranks.
    pub held: usize,
    /// Transient buffers each local rank holds for reuse: `(rank, count)`.
    pub pooled_buffers: Vec<(u32, usize)>,
}

/// A running gradient path over a backend's local ranks.
///
/// - **Runtime:** the methods are `async`; any tokio runtime drives them, a
///   current-thread one included (the backend runs its streams on its own threads).
/// - **When to call what:** per micro-batch [`Session::begin_micro_batch`], then
///   [`Session::grad_ready`] for every layer of [`Session::layers`] in that order (with
///   the forward's gathers, [`Session::has_forward`]: first [`Session::forward_ready`]
///   for every layer of [`Session::forward_layers`], and [`Session::backward_ready`]
///   before each layer's `grad_ready`); per step [`Session::step`]; [`Session::zero_grad`] at any point to drop the step in
///   progress. A GPU trainer uses the `_device` forms of the same calls
///   ([`Session::forward_ready_device`], [`Session::backward_ready_device`],
///   [`Session::grad_ready_device`]): buffers stay on the device, and events order the
///   trainer's own stream with the plan. [`Session::init_params`], [`Session::param_values`],
///   [`Session::reduced_grad`], [`Session::save`], [`Session::load`] and
///   [`Session::set_lr_factor`] between steps. Anything else is an [`Error::Usage`].
/// - **Scaling:** the optimizers consume each rank's gradients summed over the step's
///   micro-batches and averaged over all ranks (`avg`; `sum` skips the division). If the
///   loss is a mean over the step's samples, divide each micro-batch's loss by the number
///   of micro-batches before backward, as with PyTorch's gradient accumulation.
pub struct Session<B: Backend = CpuBackend> {
    planner: Planner,
    executor: Executor<B>,
    layers: Vec<u32>,
    /// Gates of the step's micro-batches so far.
    gates: Vec<Gate>,
    /// Layers of the current micro-batch handed in so far.
    layers_done: usize,
    /// Forward plans: layers of the current micro-batch whose forward began, and
    /// whether the backward of the next layer to hand in began.
    forward_done: usize,
    backward_open: bool,
    /// A validated plan whose gates start with `gates` (module docs): the last step's
    /// plan between steps, adopted by the executor during a step.
    current: Option<Validated>,
    /// Validated step plans, most recently used last (at most [`STEP_PLANS`]).
    step_plans: Vec<StepPlan>,
    /// Plans planned and validated so far.
    plans_built: u64,
    /// The step [`Session::reduce`] reduced, waiting for [`Session::step`]: its gates and
    /// plan.
    reduced: Option<(Vec<Gate>, StepPlan)>,
    /// Checkpoint saves: the job they save with and the one in flight.
    saves: crate::checkpoint::Saves,
}

impl Session<CpuBackend> {
    /// A session on the CPU backend (all ranks of the mesh as threads), parameters
    /// initialised from the config's seed. A mesh above the backend's rank limit, or a
    /// run the machine's memory cannot hold ([`crate::resources::check_cpu`]), is an
    /// error before any thread starts.
    pub fn cpu(config: &Config) -> Result<Self, Error> {
        if config.run.backend == BackendChoice::Cuda {
            return Err(Error::Backend(
                "the config asks for backend \"cuda\"; this session runs on the CPU backend".into(),
            ));
        }
        // The rank limit, the step's size and the memory it needs, before any thread.
        crate::resources::check_cpu(config, 1)?;
        let backend = Arc::new(CpuBackend::new(config.plan.mesh));
        let mut s = Session::new(config.plan.clone(), backend, exec_config(config)?)?;
        let seed = config.run.seed;
        s.init_params(|i, p| crate::synthetic::init(seed, i, p.spec.numel() as usize))?;
        Ok(s)
    }
}

/// The executor settings a config asks for. No fault: a session injects one only when
/// handed it ([`Session::inject_faults`]). A `Result` so that a check added later is not
/// a breaking change; it fails on nothing today.
pub fn exec_config(config: &Config) -> Result<ExecConfig, Error> {
    Ok(ExecConfig::default()
        .with_stage1_window(config.overlap.stage1_window as usize)
        .with_adamw(config.adamw)
        .with_muon(config.muon)
        .with_groups(config.groups.clone())
        .with_schedule(config.schedule)
        .with_backward(overlap_executor::Backward::spin(
            config.run.backward_us_per_layer,
        ))
        .with_clip(config.clip.unwrap_or_default())
        .with_host_timeout(std::time::Duration::from_secs(u64::from(
            config.run.step_timeout_s,
        ))))
}

impl<B: Backend> Session<B> {
    /// A session over `backend` with the plan spec built in code. Parameters start at
    /// zero until [`Session::init_params`] sets them. `exec`'s parameter groups are
    /// resolved here, once: a group with a setting out of range, or that gets no
    /// parameter (its pattern matches none, or only parameters an earlier group took), is
    /// an [`Error::Usage`] naming the group. So is a clipping threshold
    /// (`exec.clip.max_norm`) for a spec without the global-norm nodes
    /// ([`PlanSpec::with_grad_norm`]), which would never clip.
    pub fn new(spec: PlanSpec, backend: Arc<B>, exec: ExecConfig) -> Result<Self, Error> {
        if exec.clip.max_norm.is_some() && !spec.grad_norm {
            return Err(Error::Usage(
                "ExecConfig::clip.max_norm is set, but the plan spec has no global-norm nodes, so \
                 nothing would clip: build the spec with PlanSpec::with_grad_norm(true) (a \
                 config's [clip] sets both)"
                    .into(),
            ));
        }
        let planner = Planner::new(spec)?;
        let mut layers: Vec<u32> = planner.params().iter().map(|p| p.spec.layer).collect();
        layers.sort_unstable_by(|a, b| b.cmp(a));
        layers.dedup();
        let mut executor = Executor::new(backend, exec);
        executor
            .resolve_params(planner.params().iter().map(|p| &p.spec))
            .map_err(|e| Error::Usage(e.to_string()))?;
        let mut s = Session {
            planner,
            executor,
            layers,
            gates: Vec::new(),
            layers_done: 0,
            forward_done: 0,
            backward_open: false,
            reduced: None,
            current: None,
            step_plans: Vec::new(),
            plans_built: 0,
            saves: Default::default(),
        };
        s.init_params(|_, p| vec![0.0; p.spec.numel() as usize])?;
        Ok(s)
    }

    /// Sets every parameter from its full tensor: `init(id, param)` returns all of its
    /// elements; each local rank keeps its piece.
    pub fn init_params(
        &mut self,
        mut init: impl FnMut(ParamId, &PlacedParam) -> Vec<f32>,
    ) -> Result<(), Error> {
        if self.executor.in_step() {
            return Err(Error::Usage(
                "init_params during a step; call it before the first micro-batch or after step()"
                    .into(),
            ));
        }
        let mesh = self.planner.spec().mesh;
        let params = self.planner.params().to_vec();
        for (i, p) in params.iter().enumerate() {
            let full = init(i as ParamId, p);
            if full.len() as u64 != p.spec.numel() {
                return Err(Error::Usage(format!(
                    "init_params: `{}` has {} elements, the initialiser returned {}",
                    p.spec.name,
                    p.spec.numel(),
                    full.len()
                )));
            }
            for rank in self.executor.local_ranks() {
                let c = mesh.coord(rank);
                if p.owner.is_some_and(|o| o.shard != c.shard) {
                    continue;
                }
                let r = p.spec.shard_range(mesh.shard, c.shard);
                self.executor.init_param(
                    rank,
                    i as ParamId,
                    &full[r.start as usize..r.end as usize],
                )?;
            }
        }
        Ok(())
    }

    /// Steps completed (restored by [`Session::load`]): the next step is number
    /// `steps_done() + 1`.
    pub fn steps_done(&self) -> u64 {
        self.executor.steps_done()
    }

    /// Saves a checkpoint under the root `dir`: parameters, optimizer state and the step
    /// counter, one safetensors file per rank and a manifest, in `dir/step-NNNNNN/`, then
    /// points `dir/latest` at it (`docs/checkpoints.md`). Atomic: a crash mid-save leaves
    /// `latest` naming the previous complete checkpoint. Returns the checkpoint's
    /// directory once it is written: [`Session::save_in_background`], then
    /// [`Session::wait_for_saves`]. Call between steps. A session that drives only some
    /// ranks of its mesh (a process of a multi-process job) writes its own ranks' files
    /// and needs a [`SaveJob`](crate::checkpoint::SaveJob) first
    /// ([`Session::set_save_job`]); the process holding rank 0 waits for every rank's
    /// files and commits the checkpoint, the others return once their own files are
    /// written (the directory appears when rank 0's process has committed it).
    pub fn save(&self, dir: impl AsRef<std::path::Path>) -> Result<std::path::PathBuf, Error> {
        self.save_and_wait(dir.as_ref(), None)
    }

    /// [`Session::save`], recording the seed of the run's synthetic gradients in the
    /// manifest's RNG state (`overlap run`).
    pub fn save_with_seed(
        &self,
        dir: impl AsRef<std::path::Path>,
        seed: u64,
    ) -> Result<std::path::PathBuf, Error> {
        self.save_and_wait(dir.as_ref(), Some(seed))
    }

    fn save_and_wait(
        &self,
        dir: &std::path::Path,
        seed: Option<u64>,
    ) -> Result<std::path::PathBuf, Error> {
        let ticket = self.start_save(dir, seed)?;
        let saved = self.saves.wait()?;
        Ok(saved.map_or(ticket.path, |s| s.path))
    }

    fn start_save(
        &self,
        dir: &std::path::Path,
        seed: Option<u64>,
    ) -> Result<crate::checkpoint::SaveTicket, Error> {
        crate::checkpoint::save_in_background(&self.planner, &self.executor, &self.saves, dir, seed)
    }

    /// Starts saving a checkpoint under the root `dir`, as [`Session::save`] does, and
    /// returns once the local ranks' parameters and optimizer state are copied to the
    /// host (on CUDA, a device-to-host copy): a background thread writes the files and
    /// commits the checkpoint while the next steps run. A save still in flight is waited
    /// for first, and its failure is returned here (nothing new is started then). The
    /// ticket says what the save cost the training loop ([`SaveTicket::stall`]: the
    /// copy plus that wait); [`Session::poll_save`] or [`Session::wait_for_saves`] tell
    /// when it is written. The host copy holds the pieces this process writes until
    /// then. Dropping the session waits for the save (and logs a failure). Call between
    /// steps.
    ///
    /// [`SaveTicket::stall`]: crate::checkpoint::SaveTicket::stall
    pub fn save_in_background(
        &self,
        dir: impl AsRef<std::path::Path>,
    ) -> Result<crate::checkpoint::SaveTicket, Error> {
        self.start_save(dir.as_ref(), None)
    }

    /// [`Session::save_in_background`], recording the seed of the run's synthetic
    /// gradients in the manifest's RNG state (`overlap run`).
    pub fn save_in_background_with_seed(
        &self,
        dir: impl AsRef<std::path::Path>,
        seed: u64,
    ) -> Result<crate::checkpoint::SaveTicket, Error> {
        self.start_save(dir.as_ref(), Some(seed))
    }

    /// Waits for the save in flight, if any: what it saved, or why it failed. `None`
    /// when no save was in flight.
    pub fn wait_for_saves(&self) -> Result<Option<crate::checkpoint::Saved>, Error> {
        self.saves.wait()
    }

    /// The save in flight, if it has finished: what it saved, or why it failed (each
    /// once). `None` while it is still writing, or when there is none. Never blocks.
    pub fn poll_save(&self) -> Result<Option<crate::checkpoint::Saved>, Error> {
        self.saves.poll()
    }

    /// Sets the job this session saves checkpoints with: in a multi-process job every
    /// process gives its session the same [`SaveJob`](crate::checkpoint::SaveJob) (an id
    /// rank 0 drew with `SaveJob::fresh` and sent to the others), which names the save's
    /// partial directory. A session that drives every rank of its mesh needs none.
    pub fn set_save_job(&mut self, job: crate::checkpoint::SaveJob) {
        self.saves.set_job(job);
    }

    /// Why [`Session::save`] would be refused, if it would: a session that drives only
    /// some ranks of its mesh without a [`SaveJob`](crate::checkpoint::SaveJob).
    pub fn check_can_save(&self) -> Result<(), Error> {
        crate::checkpoint::check_can_save(&self.planner, &self.executor, &self.saves)
            .map(drop)
            .map_err(|reason| Error::Usage(format!("cannot save a checkpoint: {reason}")))
    }

    /// Loads a checkpoint: `dir` is a checkpoint root (its `latest` is followed) or one
    /// checkpoint directory. A save in flight is waited for first (its failure is
    /// returned). Every file is verified first (size, sha256, tensors, the model's
    /// parameters, full coverage); a refused checkpoint is an [`Error::Checkpoint`]
    /// naming the file and what is wrong, and leaves the session as it was. Then each
    /// local rank gets its piece of the parameters and optimizer state under this
    /// session's mesh (which may differ from the saved one), and the step counter is
    /// restored. What unfinished saves left in a root is never read
    /// ([`Loaded::unfinished`](crate::Loaded::unfinished) lists it). Call between steps.
    pub fn load(&mut self, dir: impl AsRef<std::path::Path>) -> Result<crate::Loaded, Error> {
        if self.executor.in_step() {
            return Err(Error::Usage(
                "load during a step; call it before the first micro-batch or after step()".into(),
            ));
        }
        self.saves.wait()?;
        let restored = crate::checkpoint::read(dir.as_ref(), &self.planner)?;
        crate::checkpoint::install(&self.planner, &mut self.executor, restored)
    }

    /// Injects `faults` from the next step and save on, replacing any injected before
    /// ([`crate::faults`]; [`Faults::from_env`](crate::faults::Faults::from_env) reads
    /// `OVERLAP_FAULT` and `OVERLAP_CHECKPOINT_FAULT`). For tests of failure handling:
    /// a step fault fails, hangs or poisons the node it names, a save fault stops or
    /// fails the save at its phase.
    pub fn inject_faults(&mut self, faults: crate::faults::Faults) {
        self.executor.set_fault(faults.step);
        self.saves.set_fault(faults.save);
    }

    /// The signal through which a multi-process job reports another rank's failure
    /// (`overlap_dist::rendezvous::Rendezvous::watch` triggers it): this
    /// session's waits then end at once with [`ExecError::PeerFailed`](overlap_executor::ExecError::PeerFailed).
    pub fn peer_abort(&self) -> overlap_executor::PeerAbort {
        self.executor.peer_abort()
    }

    /// The deadline of the step in progress (`[run] step_timeout`), readable from any
    /// thread: a watchdog thread can end a process whose host is stuck inside a device
    /// call past it, which the session's own deadline cannot interrupt.
    pub fn step_deadline(&self) -> overlap_executor::StepDeadline {
        self.executor.step_deadline()
    }

    /// The planner. Deprecated: it exposes the session's internals; what programs read
    /// through it has accessors of its own ([`Session::params`], [`Session::spec`],
    /// [`Session::buckets`]). Kept for one release so that programs migrate.
    #[deprecated(
        since = "0.1.0",
        note = "use Session::params, Session::spec or Session::buckets"
    )]
    pub fn planner(&self) -> &Planner {
        &self.planner
    }

    /// The executor. Deprecated: it exposes the session's internals; use
    /// [`Session::backend`], [`Session::read_buffer`], [`Session::steps_done`] and
    /// [`Session::plan_cache`]. Kept for one release so that programs migrate.
    #[deprecated(
        since = "0.1.0",
        note = "use Session::backend, read_buffer, steps_done or plan_cache"
    )]
    pub fn executor(&self) -> &Executor<B> {
        &self.executor
    }

    /// Every parameter's resolved optimizer settings. Deprecated: use
    /// [`Session::param_group`]. Kept for one release so that programs migrate.
    #[deprecated(since = "0.1.0", note = "use Session::param_group")]
    pub fn hyper(&self) -> &overlap_executor::HyperTable {
        self.executor.hyper()
    }

    /// The parameters in plan order (a parameter's [`ParamId`] is its index), each with
    /// its spec, route, owner and layout on the mesh.
    pub fn params(&self) -> &[PlacedParam] {
        self.planner.params()
    }

    /// The plan spec the session was built from: mesh, reduction, buckets, parameters.
    pub fn spec(&self) -> &PlanSpec {
        self.planner.spec()
    }

    /// The buckets of the gradient path, in issue order (highest layer first).
    pub fn buckets(&self) -> &[overlap_graph::Bucket] {
        self.planner.buckets()
    }

    /// The backend the session runs on (a GPU trainer records its own work on the
    /// backend's streams, or turns its timings on).
    pub fn backend(&self) -> &Arc<B> {
        self.executor.backend()
    }

    /// A plan buffer's values on local rank `rank`, read from the backend: a parameter's
    /// shard, its optimizer state, a reduced gradient ([`overlap_graph::Buffer`] names them).
    /// `None` where the rank holds no such buffer. Call between steps.
    pub fn read_buffer(&self, rank: u32, buffer: Buffer) -> Result<Option<Vec<f32>>, Error> {
        Ok(self.executor.read(rank, buffer)?)
    }

    /// The parameter group (its index in `[[optimizer.group]]` or
    /// [`ExecConfig::groups`]) whose settings `param` uses; `None` for the base settings.
    pub fn param_group(&self, param: ParamId) -> Option<usize> {
        self.executor.hyper().group_of(param)
    }

    /// What the session's plan caches hold and have done: plans built, plans the
    /// executor prepared, the prepared plans it holds and the transient buffers each
    /// local rank keeps for reuse. A loop that repeats its gate pattern makes the first
    /// two stop growing after its first step.
    pub fn plan_cache(&self) -> PlanCache {
        PlanCache {
            built: self.plans_built,
            prepared: self.executor.plans_prepared(),
            held: self.executor.prepared_plans(),
            pooled_buffers: self.executor.pooled_buffers(),
        }
    }

    /// Sets the learning-rate factor from the next step on, replacing the configured
    /// schedule (`[schedule]`, [`ExecConfig::schedule`]) until
    /// [`Session::follow_schedule`]: each parameter's optimizer then uses its base rate
    /// (`[optimizer.adamw] lr` or `[optimizer.muon] lr`) × its group's `lr_scale` ×
    /// `factor`. A trainer with its own schedule calls this before every step with
    /// `its_lr(step) / base_lr`. Call it between steps; `factor` must be finite and
    /// `>= 0`.
    pub fn set_lr_factor(&mut self, factor: f64) -> Result<(), Error> {
        self.executor
            .set_lr_factor(Some(factor))
            .map_err(|e| Error::Usage(e.to_string()))
    }

    /// Returns to the configured schedule after [`Session::set_lr_factor`] (from the next
    /// step on). Call it between steps.
    pub fn follow_schedule(&mut self) -> Result<(), Error> {
        self.executor
            .set_lr_factor(None)
            .map_err(|e| Error::Usage(e.to_string()))
    }

    /// The learning-rate factor of the next step (of the step in progress, during one).
    pub fn lr_factor(&self) -> f64 {
        self.executor.lr_factor()
    }

    /// Layers in the order backward makes them ready (highest first).
    pub fn layers(&self) -> Vec<u32> {
        self.layers.clone()
    }

    /// Global ranks this session drives.
    pub fn local_ranks(&self) -> Vec<u32> {
        self.executor.local_ranks()
    }

    /// The parameter id of a name.
    pub fn param_id(&self, name: &str) -> Option<ParamId> {
        self.planner
            .params()
            .iter()
            .position(|p| p.spec.name == name)
            .map(|i| i as ParamId)
    }

    /// The validated plan of a whole step with these gates (cached).
    pub fn step_plan(&mut self, gates: &[Gate]) -> Result<Arc<Plan>, Error> {
        self.cached_step_plan(gates).map(|p| p.plan.plan().clone())
    }

    /// Plans this session has planned and validated so far (step plans and the plans it
    /// runs micro-batches on). A training loop that repeats its gate pattern builds none
    /// after its first step, whatever its number of micro-batches; the first step of a
    /// pattern of `M` micro-batches builds `O(log M)`.
    pub fn plans_built(&self) -> u64 {
        self.plans_built
    }

    fn cached_step_plan(&mut self, gates: &[Gate]) -> Result<StepPlan, Error> {
        if let Some(i) = self.step_plans.iter().rposition(|p| p.plan.gates == gates) {
            let p = self.step_plans.remove(i);
            self.step_plans.push(p.clone());
            return Ok(p);
        }
        if let Some(params) = unflushed(&self.planner, gates) {
            crate::observe::metrics::record_unflushed();
            return Err(Error::Unflushed {
                gates: Gate::pattern_label(gates),
                params,
            });
        }
        let plan = self.build(gates, Mode::Step)?;
        let entry = StepPlan {
            stage2: self.stage2_bytes(&plan),
            memory: Arc::new(
                self.executor
                    .local_ranks()
                    .into_iter()
                    .map(|r| plan.memory(r))
                    .collect(),
            ),
            plan,
        };
        if self.step_plans.len() >= STEP_PLANS {
            self.step_plans.remove(0);
        }
        self.step_plans.push(entry.clone());
        Ok(entry)
    }

    /// Plans and validates `gates` as a whole step or as a prefix; a rejection is
    /// counted in the metrics and returned.
    fn build(&mut self, gates: &[Gate], mode: Mode) -> Result<Validated, Error> {
        self.plans_built += 1;
        self.planner.plan_checked(gates, mode).map_err(|e| {
            if let Rejected::Invalid(v) = &e {
                crate::observe::metrics::record_rejection(v);
            }
            Error::from(e)
        })
    }

    /// A validated plan whose gates start with the step's gates so far and then `gate`
    /// (module docs): a cached step plan that goes on that way, else the gates continued
    /// to twice their number, else (if that guess is rejected) exactly these gates.
    fn plan_ahead(&mut self, gate: Gate) -> Result<Validated, Error> {
        let k = self.gates.len();
        let extends =
            |p: &Plan| p.gates.len() > k && p.gates[k] == gate && p.gates[..k] == self.gates[..];
        if let Some(i) = self.step_plans.iter().rposition(|p| extends(&p.plan)) {
            let p = self.step_plans.remove(i);
            self.step_plans.push(p.clone());
            return Ok(p.plan);
        }
        let mut exact = self.gates.clone();
        exact.push(gate);
        let ahead = continued(&exact, 2 * exact.len());
        self.plans_built += 1;
        match self.planner.plan_checked(&ahead, Mode::Prefix) {
            Ok(plan) => Ok(plan),
            Err(_) => self.build(&exact, Mode::Prefix),
        }
    }

    fn check_not_reduced(&self, what: &str) -> Result<(), Error> {
        if self.reduced.is_some() {
            return Err(Error::Usage(format!(
                "{what} after reduce(): the reduced step waits for step() (or zero_grad())"
            )));
        }
        Ok(())
    }

    fn check_micro_batch_complete(&self, what: &str) -> Result<(), Error> {
        if !self.gates.is_empty() && self.layers_done < self.layers.len() {
            let missing: Vec<String> = self.layers[self.layers_done..]
                .iter()
                .map(|l| l.to_string())
                .collect();
            return Err(Error::Usage(format!(
                "{what} while micro-batch {} still waits for grad_ready of layers {}",
                self.gates.len() - 1,
                missing.join(", ")
            )));
        }
        Ok(())
    }

    /// Starts a micro-batch with its gate (FSDP2's `set_requires_gradient_sync` and
    /// `set_requires_all_reduce`, as one value).
    pub async fn begin_micro_batch(&mut self, gate: Gate) -> Result<(), Error> {
        self.check_not_reduced("begin_micro_batch")?;
        self.check_micro_batch_complete("begin_micro_batch")?;
        let k = self.gates.len();
        let covered = self
            .current
            .as_ref()
            .is_some_and(|p| p.gates.get(k) == Some(&gate));
        if !covered {
            self.current = Some(self.plan_ahead(gate)?);
        }
        // The first micro-batch of a step adopts the current plan (a lookup when the
        // executor prepared it before); later ones only when it changed.
        if k == 0 || !covered {
            if let Some(plan) = &self.current {
                self.executor.adopt(plan);
            }
        }
        self.gates.push(gate);
        self.layers_done = 0;
        self.forward_done = 0;
        self.backward_open = false;
        Ok(())
    }

    /// Hands in the gradients of `layer` for the current micro-batch: `fill(rank, param,
    /// out)` writes rank `rank`'s gradient of `param` into `out` (its full shape, row
    /// major). Layers come from the highest down ([`Session::layers`]). On CUDA this
    /// uploads from the host; a trainer whose backward runs on the GPU hands its
    /// gradients in where they are, with [`Session::grad_ready_device`].
    pub async fn grad_ready(
        &mut self,
        layer: u32,
        fill: impl FnMut(u32, ParamId, &mut [f32]),
    ) -> Result<(), Error> {
        let m = self.check_grad_ready(layer)?;
        self.executor.grad_ready(m as u32, layer, fill).await?;
        self.grad_handed_in();
        Ok(())
    }

    /// Hands in the gradients of `layer` for the current micro-batch where the
    /// trainer's backward wrote them, on the device: `bind(rank, param)` returns the
    /// buffer holding rank `rank`'s gradient of `param` (its full shape, row major,
    /// exactly `numel` elements). Nothing is uploaded, copied or synchronised: the plan
    /// reads the buffers in place.
    ///
    /// Ordering: `after` holds, per local rank, an event recorded on the trainer's own
    /// stream after the kernels that wrote the gradients (on CUDA
    /// `CudaBackend::record_on`); the plan's compute stream waits on
    /// it, on the device, before the layer's nodes. A trainer that ran its backward on
    /// the plan's compute stream (`CudaBackend::raw_stream`) passes
    /// none.
    ///
    /// Lifetime: the buffers stay the trainer's (allocate them with
    /// [`Backend::alloc`], or bind memory the backend lent before); the plan only reads
    /// them and never pools or reuses them. Do not write them again, nor drop the last
    /// handle, until this step's [`Session::step`] (or [`Session::reduce`]) returned:
    /// a micro-batch's gradients are read by its reduce-scatter, fold or accumulation,
    /// which may run as late as the step's tail. A trainer with `M` micro-batches per
    /// step keeps `M` sets of gradient buffers (or hands in each micro-batch's into a
    /// fresh set).
    pub async fn grad_ready_device(
        &mut self,
        layer: u32,
        after: &[(u32, B::Event)],
        mut bind: impl FnMut(u32, ParamId) -> B::Buffer,
    ) -> Result<(), Error> {
        let m = self.check_grad_ready(layer)?;
        self.executor.follow(after)?;
        self.executor
            .grad_ready_bound(m as u32, layer, |rank, param| Ok(bind(rank, param)))
            .await?;
        self.grad_handed_in();
        Ok(())
    }

    /// Checks that `layer`'s gradients are next in the current micro-batch (and, on a
    /// forward plan, that its backward point was reached): the micro-batch's index.
    fn check_grad_ready(&self, layer: u32) -> Result<usize, Error> {
        self.check_not_reduced("grad_ready")?;
        let Some(m) = self.gates.len().checked_sub(1) else {
            return Err(Error::Usage("grad_ready before begin_micro_batch".into()));
        };
        match self.layers.get(self.layers_done) {
            Some(&want) if want == layer => {}
            Some(&want) => {
                return Err(Error::Usage(format!(
                    "grad_ready(layer {layer}) in micro-batch {m}: layer {want} is next (layers come from the highest down: {:?})",
                    self.layers
                )))
            }
            None => return Err(Error::Usage(format!("grad_ready(layer {layer}): every layer of micro-batch {m} was already handed in"))),
        }
        if self.has_forward() && !self.backward_open {
            return Err(Error::Usage(format!(
                "grad_ready(layer {layer}) in micro-batch {m} before backward_ready(layer {layer}): the plan gathers the parameters the layer's backward reads ({})",
                self.forward_flow(m)
            )));
        }
        Ok(m)
    }

    /// A layer's gradients were handed in.
    fn grad_handed_in(&mut self) {
        self.layers_done += 1;
        self.backward_open = false;
    }

    /// Whether the session's plans gather the full parameters for the forward
    /// ([`PlanSpec::forward`], `[forward]`): then each micro-batch runs
    /// [`Session::forward_ready`] for every layer ascending, then per layer descending
    /// [`Session::backward_ready`] and [`Session::grad_ready`].
    pub fn has_forward(&self) -> bool {
        self.planner.spec().forward.is_some()
    }

    /// Layers in the order the forward runs them (lowest first): the order of
    /// [`Session::forward_ready`].
    pub fn forward_layers(&self) -> Vec<u32> {
        self.layers.iter().rev().copied().collect()
    }

    /// The order of calls in a micro-batch of a forward plan, and where micro-batch `m`
    /// stands, for errors.
    fn forward_flow(&self, m: usize) -> String {
        let n = self.layers.len();
        let at = if self.forward_done < n {
            format!(
                "forward_ready(layer {}) is next",
                self.forward_layers()[self.forward_done]
            )
        } else if self.layers_done < n {
            let l = self.layers[self.layers_done];
            if self.backward_open {
                format!("grad_ready(layer {l}) is next")
            } else {
                format!("backward_ready(layer {l}) is next")
            }
        } else {
            "every layer was handed in".into()
        };
        format!(
            "per micro-batch: forward_ready of every layer ascending {:?}, then per layer descending backward_ready and grad_ready; in micro-batch {m}, {at}",
            self.forward_layers()
        )
    }

    /// Forward plans: the trainer's forward of `layer` in the current micro-batch
    /// starts. Gathers the layer's full parameters on every local rank (the plan's
    /// `unshard` nodes, issued `prefetch` layers ahead, so usually complete already),
    /// frees the layer before's when the plan reshards after the forward, waits until the
    /// gathers are complete, and calls `f(rank, param, full)` once per local rank and
    /// parameter of the layer, `full` being the whole parameter (row major, `numel`
    /// elements) exactly as the latest optimizer step and publish left it.
    ///
    /// Layers come from the lowest up ([`Session::forward_layers`]), after
    /// [`Session::begin_micro_batch`]. `full` is a host copy that lives for the call
    /// (on the CPU backend, read from the gathered buffer; on CUDA a download): copy what
    /// the forward needs to keep. The gathered buffer itself is freed at the next call.
    pub async fn forward_ready(
        &mut self,
        layer: u32,
        mut f: impl FnMut(u32, ParamId, &[f32]),
    ) -> Result<(), Error> {
        let full = self.forward_point(layer, &[]).await?;
        self.hand_full(full, &mut f)
    }

    /// [`Session::forward_ready`] with the gathered parameters left on the device:
    /// `f(rank, param, full)` gets the gathered buffer itself (its first `numel`
    /// elements are the parameter, row major; sharded routes pad it to a multiple of
    /// the shard group). Nothing is downloaded. The gathers have completed when `f` is
    /// called, so any stream may read the buffer at once.
    ///
    /// Lifetime: the buffer holds the parameter until the trainer's next call (the
    /// next `forward_ready*`, `backward_ready*` or `grad_ready*`), which issues its free
    /// on the plan's compute stream; a later gather may then overwrite it. The trainer's
    /// reads must be ordered before that free: issue them on the plan's compute stream
    /// (`CudaBackend::raw_stream`), or hand an event recorded after
    /// them on the trainer's stream to the next call's `after` (as
    /// [`Session::grad_ready_device`] describes; `after` here orders this call's frees
    /// of the layer before).
    pub async fn forward_ready_device(
        &mut self,
        layer: u32,
        after: &[(u32, B::Event)],
        mut f: impl FnMut(u32, ParamId, &B::Buffer),
    ) -> Result<(), Error> {
        let full = self.forward_point(layer, after).await?;
        full.iter()
            .for_each(|(rank, param, buf)| f(*rank, *param, buf));
        Ok(())
    }

    /// Checks and runs a forward point: the gathered buffers of `layer`.
    async fn forward_point(
        &mut self,
        layer: u32,
        after: &[(u32, B::Event)],
    ) -> Result<Vec<overlap_executor::FullParam<B>>, Error> {
        self.check_not_reduced("forward_ready")?;
        let m = self.check_forward("forward_ready", layer)?;
        let want = self.forward_layers().get(self.forward_done).copied();
        if want != Some(layer) || self.layers_done > 0 {
            return Err(Error::Usage(format!(
                "forward_ready(layer {layer}) out of order: {}",
                self.forward_flow(m)
            )));
        }
        self.executor.follow(after)?;
        let full = self.executor.forward_ready(m as u32, layer).await?;
        self.forward_done += 1;
        Ok(full)
    }

    /// Forward plans: the trainer's backward of `layer` in the current micro-batch
    /// starts, after the forward of every layer: hands the full parameters the backward
    /// reads as [`Session::forward_ready`] does (gathered again, or kept from the
    /// forward with `reshard_after_forward = false`). Then the layer's
    /// [`Session::grad_ready`] hands in its gradients and ends its backward. Layers come
    /// from the highest down ([`Session::layers`]).
    pub async fn backward_ready(
        &mut self,
        layer: u32,
        mut f: impl FnMut(u32, ParamId, &[f32]),
    ) -> Result<(), Error> {
        let full = self.backward_point(layer, &[]).await?;
        self.hand_full(full, &mut f)
    }

    /// [`Session::backward_ready`] with the gathered parameters left on the device, as
    /// [`Session::forward_ready_device`] hands them. They hold their values until the
    /// layer's `grad_ready*` call, whose `after` must cover the trainer's reads when
    /// they ran on a stream of its own.
    pub async fn backward_ready_device(
        &mut self,
        layer: u32,
        after: &[(u32, B::Event)],
        mut f: impl FnMut(u32, ParamId, &B::Buffer),
    ) -> Result<(), Error> {
        let full = self.backward_point(layer, after).await?;
        full.iter()
            .for_each(|(rank, param, buf)| f(*rank, *param, buf));
        Ok(())
    }

    /// Checks and runs a backward point: the gathered buffers of `layer`.
    async fn backward_point(
        &mut self,
        layer: u32,
        after: &[(u32, B::Event)],
    ) -> Result<Vec<overlap_executor::FullParam<B>>, Error> {
        self.check_not_reduced("backward_ready")?;
        let m = self.check_forward("backward_ready", layer)?;
        let want = self.layers.get(self.layers_done).copied();
        if self.forward_done < self.layers.len() || self.backward_open || want != Some(layer) {
            return Err(Error::Usage(format!(
                "backward_ready(layer {layer}) out of order: {}",
                self.forward_flow(m)
            )));
        }
        self.executor.follow(after)?;
        let full = self.executor.backward_ready(m as u32, layer).await?;
        self.backward_open = true;
        Ok(full)
    }

    /// The current micro-batch, for a forward call on a forward plan.
    fn check_forward(&self, what: &str, layer: u32) -> Result<usize, Error> {
        if !self.has_forward() {
            return Err(Error::Usage(format!(
                "{what}(layer {layer}): the session gathers no parameters for the forward; build it with PlanSpec::with_forward (a config's [forward])"
            )));
        }
        self.gates
            .len()
            .checked_sub(1)
            .ok_or_else(|| Error::Usage(format!("{what} before begin_micro_batch")))
    }

    /// Hands each gathered buffer's parameter to `f` as a host slice.
    fn hand_full(
        &self,
        full: Vec<overlap_executor::FullParam<B>>,
        f: &mut impl FnMut(u32, ParamId, &[f32]),
    ) -> Result<(), Error> {
        let backend = self.executor.backend();
        for (rank, param, buf) in full {
            let values = backend
                .download(&buf)
                .map_err(overlap_executor::ExecError::from)?;
            let numel = self.planner.params()[param as usize].spec.numel() as usize;
            let whole = values.get(..numel).ok_or_else(|| {
                Error::Usage(format!(
                    "internal: the gathered buffer of parameter {param} on rank {rank} has {} elements, fewer than its {numel}",
                    values.len()
                ))
            })?;
            f(rank, param, whole);
        }
        Ok(())
    }

    /// Validates the whole step's plan and has the executor adopt it: the gates and plan
    /// of the step that [`Session::step`] or [`Session::reduce`] runs.
    fn adopt_step(&mut self, what: &str) -> Result<(Vec<Gate>, StepPlan), Error> {
        if self.gates.is_empty() {
            return Err(Error::Usage(format!("{what} without any micro-batch")));
        }
        self.check_micro_batch_complete(what)?;
        let gates = std::mem::take(&mut self.gates);
        let step_plan = match self.cached_step_plan(&gates) {
            Ok(p) => p,
            Err(e) => {
                self.gates = gates;
                return Err(e);
            }
        };
        self.executor.adopt(&step_plan.plan);
        self.current = Some(step_plan.plan.clone());
        self.layers_done = 0;
        self.forward_done = 0;
        self.backward_open = false;
        Ok((gates, step_plan))
    }

    /// The first phase of a two-phase step: validates the step's plan, runs every
    /// reduction of every micro-batch handed in, and waits for the device, so that
    /// [`Session::reduced_grad`] reads each parameter's reduced gradient (the no_sync
    /// reference, before any clipping) before [`Session::step`] runs the global norm,
    /// the clip, the optimizers and the publishes. Between the two, only reads
    /// ([`Session::reduced_grad`], [`Session::param_values`]) and
    /// [`Session::zero_grad`] (which drops the step) are allowed.
    ///
    /// It costs one wait for the device that a plain [`Session::step`] does not (the
    /// optimizers of a plain step start as soon as the host issues them); a failure of
    /// the reductions ends the step here, as [`Session::step`]'s would.
    pub async fn reduce(&mut self) -> Result<(), Error> {
        self.check_not_reduced("reduce()")?;
        let (gates, step_plan) = self.adopt_step("reduce()")?;
        self.executor.reduce_step().await?;
        self.reduced = Some((gates, step_plan));
        Ok(())
    }

    /// Ends the step: validates the whole step's plan, runs the optimizers and the
    /// publishes, and waits for the device. A step whose last micro-batches left partials
    /// or no_sync accumulations is an [`Error::Unflushed`] naming the parameters; the
    /// micro-batches stay pending until a gate-on micro-batch or [`Session::zero_grad`].
    /// After [`Session::reduce`], it runs the rest of the reduced step.
    pub async fn step(&mut self) -> Result<StepReport, Error> {
        let (
            gates,
            StepPlan {
                plan,
                stage2,
                memory,
            },
        ) = match self.reduced.take() {
            Some(reduced) => reduced,
            None => self.adopt_step("step()")?,
        };
        let lr_factor = self.executor.lr_factor();
        let stats = match self.executor.finish_step().await {
            Ok(s) => s,
            Err(e) => {
                if matches!(e, overlap_executor::ExecError::NonFinite { .. }) {
                    crate::observe::metrics::record_refused_nonfinite();
                }
                return Err(e.into());
            }
        };
        let report = StepReport {
            step: self.executor.steps_done() + u64::from(stats.skipped.is_some()),
            grad_norm: stats.grad_norm,
            skipped: stats.skipped,
            gates,
            stats,
            stage2_bytes: stage2.moved,
            stage2_bytes_saved: stage2.saved,
            lr_factor,
            lr: self.executor.hyper().rates(lr_factor),
            memory: memory.to_vec(),
            replica_bytes: plan.replica_bytes(),
        };
        crate::observe::metrics::record_step(&report, &plan, || self.executor.local_ranks());
        Ok(report)
    }

    /// Discards the step in progress: partials, no_sync accumulations and gradients
    /// handed in so far.
    pub async fn zero_grad(&mut self) -> Result<(), Error> {
        self.gates.clear();
        self.reduced = None;
        self.layers_done = 0;
        self.forward_done = 0;
        self.backward_open = false;
        self.executor.discard().await?;
        Ok(())
    }

    /// The gates of the micro-batches begun in this step so far.
    pub fn pending_gates(&self) -> &[Gate] {
        &self.gates
    }

    /// A rank's piece of a parameter (its shard, or the whole tensor on the owner's shard
    /// column); `None` where the rank holds none of it.
    pub fn param_values(&self, rank: u32, param: ParamId) -> Result<Option<Vec<f32>>, Error> {
        Ok(self.executor.read(rank, Buffer::Param { param })?)
    }

    /// A parameter's whole tensor (row major, `numel` elements), put together from the
    /// pieces the local ranks hold: each shard of a sharded route from a rank of its
    /// shard index, an owned route's tensor from its owner's shard column. Between steps
    /// this is what the last step's optimizers and publishes left, the same on every
    /// replica.
    ///
    /// It needs local ranks that cover the parameter: the CPU backend's in-process mesh
    /// always does, as does a job of one rank. A rank of a multi-process job holds only
    /// its pieces: there the forward's gathers (`[forward]`, [`Session::forward_ready`])
    /// hand each layer's full parameters, and asking here is an [`Error::Usage`] naming
    /// the elements no local rank holds. Each piece is read from one replica.
    pub fn full_param(&self, param: ParamId) -> Result<Vec<f32>, Error> {
        let mesh = self.planner.spec().mesh;
        let p = self.planner.params().get(param as usize).ok_or_else(|| {
            Error::Usage(format!(
                "full_param({param}): the session has {} parameters",
                self.planner.params().len()
            ))
        })?;
        let numel = p.spec.numel() as usize;
        let mut full = vec![0.0f32; numel];
        let mut seen = vec![false; numel];
        for rank in self.executor.local_ranks() {
            let c = mesh.coord(rank);
            if p.owner.is_some_and(|o| o.shard != c.shard) {
                continue;
            }
            let range = p.spec.shard_range(mesh.shard, c.shard);
            let range = range.start as usize..range.end as usize;
            // One replica of each piece is enough: the publishes keep them equal.
            if seen[range.clone()].iter().all(|&x| x) {
                continue;
            }
            let Some(piece) = self.param_values(rank, param)? else {
                continue;
            };
            if piece.len() != range.len() {
                return Err(Error::Usage(format!(
                    "internal: rank {rank} holds {} elements of `{}`, its piece has {}",
                    piece.len(),
                    p.spec.name,
                    range.len()
                )));
            }
            full[range.clone()].copy_from_slice(&piece);
            seen[range].fill(true);
        }
        if let Some(i) = seen.iter().position(|&x| !x) {
            let missing = seen.iter().filter(|&&x| !x).count();
            return Err(Error::Usage(format!(
                "full_param(`{}`): no local rank holds element {i} ({missing} of {numel} missing); \
                 a rank of a multi-process job holds only its pieces: read full parameters \
                 from the forward's gathers ([forward], forward_ready)",
                p.spec.name
            )));
        }
        Ok(full)
    }

    /// The reduced gradient of a parameter on a rank (its shard, or the whole tensor on
    /// the owner): after [`Session::reduce`], what the optimizer is about to consume
    /// (before clipping); after a step, what the last step's optimizer consumed (after
    /// clipping). `None` where the rank holds none of it.
    pub fn reduced_grad(&self, rank: u32, param: ParamId) -> Result<Option<Vec<f32>>, Error> {
        Ok(self.executor.read(rank, Buffer::Reduced { param })?)
    }

    /// Partials and no_sync accumulations alive on the local ranks (zero between steps).
    pub fn partials_held(&self) -> usize {
        self.executor.step_buffers_held()
    }

    /// What a step plan's Stage 2 moves on the local ranks, and what its replicate-gate-off
    /// folds save it from moving (computed once per plan, with the plan cache).
    fn stage2_bytes(&self, plan: &Plan) -> Stage2Bytes {
        let dtype = plan.reduce.dtype.size();
        let mut b = Stage2Bytes::default();
        for rank in self.executor.local_ranks() {
            for n in &plan.rank(rank).nodes {
                match n.op {
                    Op::Stage2 { collective, .. } => b.moved += collective.count * dtype,
                    // The copy transport moves the f32 buffers as they are: what this
                    // rank receives (its chunk from every peer, then every peer's chunk).
                    Op::Exchange {
                        stage: 2,
                        collective,
                        ..
                    }
                    | Op::Gather {
                        stage: 2,
                        collective,
                        ..
                    } => b.moved += copy_received(plan, rank, &n.op, &collective) * 4,
                    Op::Fold { bucket, .. } => b.saved += plan.stage1_elems(bucket) * dtype,
                    _ => {}
                }
            }
        }
        b
    }
}

/// `gates` continued to `len` entries by repeating its shortest period (the smallest
/// `p` with `gates[i] == gates[i - p]` for every `i ≥ p`): the guess at the micro-batches
/// to come.
fn continued(gates: &[Gate], len: usize) -> Vec<Gate> {
    // The longest proper border of each prefix (Knuth–Morris–Pratt's failure function).
    let mut border = vec![0usize; gates.len()];
    let mut b = 0;
    for i in 1..gates.len() {
        while b > 0 && gates[i] != gates[b] {
            b = border[b - 1];
        }
        if gates[i] == gates[b] {
            b += 1;
        }
        border[i] = b;
    }
    let period = gates.len() - border.last().copied().unwrap_or(0);
    let mut out = gates.to_vec();
    while out.len() < len && period > 0 {
        out.push(out[out.len() - period]);
    }
    out
}

/// Elements a rank receives in one copy-transport exchange or gather of `c`, as the
/// backends count them ([`overlap_ops::copy_roles`]).
fn copy_received(plan: &Plan, rank: u32, op: &Op, c: &Collective) -> u64 {
    let size = plan.mesh.group_size(c.group);
    let index = plan.mesh.index_in(c.group, rank).unwrap_or(0);
    let gather = matches!(op, Op::Gather { .. });
    overlap_ops::copy_roles(c, size, index, gather).map_or(0, |(_, received)| received as u64)
}

/// The parameters a step with these gates would leave unflushed, if any: every
/// micro-batch after the last gate-on one leaves a partial or an accumulation.
pub fn unflushed(planner: &Planner, gates: &[Gate]) -> Option<Vec<String>> {
    if gates.last() == Some(&Gate::On) {
        return None;
    }
    Some(
        planner
            .params()
            .iter()
            .map(|p| p.spec.name.clone())
            .collect(),
    )
}
