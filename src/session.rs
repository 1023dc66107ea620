//! The embedding API: a [`Session`] runs a trainer's gradient path.
//!
//! A trainer builds a session from a [`Config`] (or a [`PlanSpec`] in code), then per
//! micro-batch sets the gate ([`Session::begin_micro_batch`]), hands in gradients layer
//! by layer as backward produces them, highest layer first ([`Session::grad_ready`]),
//! and per step runs the optimizers and publishes ([`Session::step`]).
//! [`Session::zero_grad`] discards partials and accumulations.
//!
//! Every plan the session runs has been validated first: the plan of the micro-batches
//! issued so far when a micro-batch begins, the whole step's plan before the optimizers
//! run. Plans are cached per gate pattern, so a steady training loop plans nothing.
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

use std::collections::HashMap;
use std::sync::Arc;

use overlap_executor::{ExecConfig, Executor, StepStats};
use overlap_graph::{
    validate, Buffer, Collective, Gate, Mode, Op, ParamId, PlacedParam, Plan, PlanSpec, Planner,
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
}

/// Stage-2 bytes of a step plan on the local ranks.
#[derive(Debug, Clone, Copy, Default)]
struct Stage2Bytes {
    moved: u64,
    saved: u64,
}

/// A running gradient path over a backend's local ranks.
pub struct Session<B: Backend = CpuBackend> {
    planner: Planner,
    executor: Executor<B>,
    layers: Vec<u32>,
    /// Gates of the step's micro-batches so far.
    gates: Vec<Gate>,
    /// Layers of the current micro-batch handed in so far.
    layers_done: usize,
    prefix_plans: HashMap<Vec<Gate>, Arc<Plan>>,
    /// Validated step plans, with the Stage-2 bytes their local ranks move and save.
    step_plans: HashMap<Vec<Gate>, (Arc<Plan>, Stage2Bytes)>,
}

impl Session<CpuBackend> {
    /// A session on the CPU backend (all ranks of the mesh as threads), parameters
    /// initialised from the config's seed.
    pub fn cpu(config: &Config) -> Result<Self, Error> {
        if config.run.backend == BackendChoice::Cuda {
            return Err(Error::Backend(
                "the config asks for backend \"cuda\"; this session runs on the CPU backend".into(),
            ));
        }
        let backend = Arc::new(CpuBackend::new(config.plan.mesh));
        let mut s = Session::new(config.plan.clone(), backend, exec_config(config))?;
        let seed = config.run.seed;
        s.init_params(|i, p| crate::synthetic::init(seed, i, p.spec.numel() as usize))?;
        Ok(s)
    }
}

/// The executor settings a config asks for.
pub fn exec_config(config: &Config) -> ExecConfig {
    ExecConfig {
        stage1_window: config.overlap.stage1_window as usize,
        adamw: config.adamw,
        muon: config.muon,
        backward: overlap_executor::Backward::spin(config.run.backward_us_per_layer),
        ..ExecConfig::default()
    }
}

impl<B: Backend> Session<B> {
    /// A session over `backend` with the plan spec built in code. Parameters start at
    /// zero until [`Session::init_params`] sets them.
    pub fn new(spec: PlanSpec, backend: Arc<B>, exec: ExecConfig) -> Result<Self, Error> {
        let planner = Planner::new(spec)?;
        let mut layers: Vec<u32> = planner.params().iter().map(|p| p.spec.layer).collect();
        layers.sort_unstable_by(|a, b| b.cmp(a));
        layers.dedup();
        let mut s = Session {
            planner,
            executor: Executor::new(backend, exec),
            layers,
            gates: Vec::new(),
            layers_done: 0,
            prefix_plans: HashMap::new(),
            step_plans: HashMap::new(),
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

    /// The planner (parameters with owners, buckets, the spec).
    pub fn planner(&self) -> &Planner {
        &self.planner
    }

    /// The executor.
    pub fn executor(&self) -> &Executor<B> {
        &self.executor
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
        self.cached_step_plan(gates).map(|(plan, _)| plan)
    }

    fn cached_step_plan(&mut self, gates: &[Gate]) -> Result<(Arc<Plan>, Stage2Bytes), Error> {
        if let Some(p) = self.step_plans.get(gates) {
            return Ok(p.clone());
        }
        if let Some(params) = unflushed(&self.planner, gates) {
            crate::observe::metrics::record_unflushed();
            return Err(Error::Unflushed {
                gates: Gate::pattern_label(gates),
                params,
            });
        }
        let plan = self.planner.plan(gates)?;
        let v = validate(&plan, Mode::Step);
        if !v.is_empty() {
            crate::observe::metrics::record_rejection(&v);
            return Err(Error::Invalid(v));
        }
        let stage2 = self.stage2_bytes(&plan);
        let entry = (Arc::new(plan), stage2);
        self.step_plans.insert(gates.to_vec(), entry.clone());
        Ok(entry)
    }

    fn prefix_plan(&mut self, gates: &[Gate]) -> Result<Arc<Plan>, Error> {
        if let Some(p) = self.prefix_plans.get(gates) {
            return Ok(p.clone());
        }
        let plan = self.planner.plan_prefix(gates)?;
        let v = validate(&plan, Mode::Prefix);
        if !v.is_empty() {
            crate::observe::metrics::record_rejection(&v);
            return Err(Error::Invalid(v));
        }
        let plan = Arc::new(plan);
        self.prefix_plans.insert(gates.to_vec(), plan.clone());
        Ok(plan)
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
        self.check_micro_batch_complete("begin_micro_batch")?;
        let mut gates = self.gates.clone();
        gates.push(gate);
        let plan = self.prefix_plan(&gates)?;
        self.executor.adopt(&plan);
        self.gates = gates;
        self.layers_done = 0;
        Ok(())
    }

    /// Hands in the gradients of `layer` for the current micro-batch: `fill(rank, param,
    /// out)` writes rank `rank`'s gradient of `param` into `out` (its full shape, row
    /// major). Layers come from the highest down ([`Session::layers`]).
    pub async fn grad_ready(
        &mut self,
        layer: u32,
        fill: impl FnMut(u32, ParamId, &mut [f32]),
    ) -> Result<(), Error> {
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
        self.executor.grad_ready(m as u32, layer, fill).await?;
        self.layers_done += 1;
        Ok(())
    }

    /// Ends the step: validates the whole step's plan, runs the optimizers and the
    /// publishes, and waits for the device. A step whose last micro-batches left partials
    /// or no_sync accumulations is an [`Error::Unflushed`] naming the parameters; the
    /// micro-batches stay pending until a gate-on micro-batch or [`Session::zero_grad`].
    pub async fn step(&mut self) -> Result<StepReport, Error> {
        if self.gates.is_empty() {
            return Err(Error::Usage("step() without any micro-batch".into()));
        }
        self.check_micro_batch_complete("step()")?;
        let gates = self.gates.clone();
        let (plan, stage2) = self.cached_step_plan(&gates)?;
        self.executor.adopt(&plan);
        self.gates.clear();
        self.layers_done = 0;
        let stats = self.executor.finish_step().await?;
        let report = StepReport {
            step: self.executor.steps_done(),
            gates,
            stats,
            stage2_bytes: stage2.moved,
            stage2_bytes_saved: stage2.saved,
        };
        crate::observe::metrics::record_step(&report, &plan, || self.executor.local_ranks());
        Ok(report)
    }

    /// Discards the step in progress: partials, no_sync accumulations and gradients
    /// handed in so far.
    pub async fn zero_grad(&mut self) -> Result<(), Error> {
        self.gates.clear();
        self.layers_done = 0;
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

    /// The reduced gradient a rank's optimizer consumed for a parameter in the last step.
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
