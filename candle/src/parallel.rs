//! [`DataParallel`]: a candle model's `Var`s as the parameters of an `overlap` session.
//!
//! It owns the session and the mapping between the model's `Var`s and the session's
//! parameter ids, hands each micro-batch's gradients to the session layer by layer in
//! the order the plan needs, and after each step leaves the updated parameters in the
//! `Var`s, where the model reads them.
//!
//! The invariant it keeps: the session sees every local rank's gradient of every
//! parameter exactly once per micro-batch (a parameter the rank's loss did not reach
//! contributes zeros), in the session's layer order; a micro-batch or step begun is
//! finished before anything else starts (errors name the call that is next), and every
//! copy the crate makes is counted in [`Copies`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Storage, Tensor, Var};
use candle_nn::VarMap;
use overlap::{
    AdamwParams, Backend, Config, CpuBackend, Gate, ParamId, ParamSpec, Session, StepReport,
};

use crate::{Error, Rules};

/// One of the model's parameters.
pub(crate) struct Param {
    pub(crate) name: String,
    pub(crate) var: Var,
    pub(crate) layer: u32,
}

/// Copies the crate made, over one step. A copy is one pass over a tensor's bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copies {
    /// Gradient tensors copied from candle's memory into the session's buffers: one per
    /// local rank, parameter and micro-batch.
    pub grads: u64,
    /// Bytes of those.
    pub grad_bytes: u64,
    /// Parameter copies: after a step, each parameter read from the ranks' pieces,
    /// assembled and written into its `Var` (three each); with `[forward]`, each
    /// gathered parameter turned into a tensor and written into its `Var` (two each).
    pub params: u64,
    /// Bytes of those.
    pub param_bytes: u64,
    /// Activations copied by the segmented backward: each segment's input made a
    /// `Var` of its own, so that its gradient exists (one per local rank and segment
    /// boundary).
    pub activations: u64,
}

impl Copies {
    /// Gradient and parameter copies: what moving data between candle and the session
    /// costs (on the CPU backend both are host memory).
    pub fn host(&self) -> u64 {
        self.grads + self.params
    }
}

/// Converts candle-nn's AdamW settings into the session's. The update is the same
/// (decoupled weight decay `p ← p·(1 − lr·wd)`, bias-corrected moments, `eps` added
/// to `sqrt(v̂)`); `overlap` keeps them in `f32` and computes each element in `f64`,
/// where candle computes in `f32`, so the two agree to float rounding.
pub fn adamw_from_candle(p: &candle_nn::ParamsAdamW) -> AdamwParams {
    AdamwParams::default()
        .with_lr(p.lr as f32)
        .with_beta1(p.beta1 as f32)
        .with_beta2(p.beta2 as f32)
        .with_eps(p.eps as f32)
        .with_weight_decay(p.weight_decay as f32)
}

/// Every `Var` of a `VarMap` with its name.
pub fn named_vars(vars: &VarMap) -> Vec<(String, Var)> {
    let data = vars.data().lock().unwrap_or_else(|e| e.into_inner());
    data.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
}

/// What a [`DataParallel`] is built from: the model's `Var`s, the `overlap` config, the
/// naming rules and, optionally, candle-nn's AdamW settings.
pub struct Builder {
    vars: Vec<(String, Var)>,
    config: Option<(String, String)>,
    rules: Rules,
    adamw: Option<AdamwParams>,
}

impl Builder {
    /// The `overlap` config as TOML text (`source` names it in errors): `[mesh]`,
    /// `[accumulation]`, `[buckets]`, `[[optimizer.group]]`, `[schedule]`, `[clip]`,
    /// `[forward]`, `[run]` as in `docs/config.md`, without `[model]` or `[[param]]`
    /// (the parameters are the model's).
    pub fn config_toml(mut self, text: impl Into<String>, source: impl Into<String>) -> Self {
        self.config = Some((text.into(), source.into()));
        self
    }

    /// The `overlap` config read from a file.
    pub fn config_file(self, path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let text =
            overlap::resources::read_text_bounded(path, overlap::resources::MAX_CONFIG_BYTES)
                .map_err(|e| Error::Usage(format!("cannot read config {}: {e}", path.display())))?;
        Ok(self.config_toml(text, path.display().to_string()))
    }

    /// The rules that give each parameter its layer and route (default [`Rules::new`]).
    pub fn rules(mut self, rules: Rules) -> Self {
        self.rules = rules;
        self
    }

    /// candle-nn's AdamW settings, in place of the config's `[optimizer.adamw]`.
    pub fn adamw(mut self, params: &candle_nn::ParamsAdamW) -> Self {
        self.adamw = Some(adamw_from_candle(params));
        self
    }

    /// The parameters in the session's order, with their specs: ascending layer, then
    /// name (byte order). Ids are positions in this order.
    fn params(&self) -> Result<(Vec<Param>, Vec<ParamSpec>), Error> {
        let mut vars: Vec<(String, Var, Vec<usize>)> = self
            .vars
            .iter()
            .map(|(n, v)| (n.clone(), v.clone(), v.dims().to_vec()))
            .collect();
        let assigned = self
            .rules
            .assign(vars.iter().map(|(n, _, s)| (n.as_str(), s.as_slice())))?;
        let mut placed: Vec<_> = vars.drain(..).zip(assigned).collect();
        placed.sort_by(|a, b| (a.1.layer, &a.0 .0).cmp(&(b.1.layer, &b.0 .0)));
        let mut params = Vec::new();
        let mut specs = Vec::new();
        for ((name, var, shape), a) in placed {
            if var.dtype() != DType::F32 {
                return Err(Error::Param {
                    name,
                    reason: format!(
                        "dtype {:?}; the session trains f32 parameters (keep the master weights in f32 and cast in the forward)",
                        var.dtype()
                    ),
                });
            }
            if !matches!(var.device(), Device::Cpu) {
                return Err(Error::Param {
                    name,
                    reason: "not on the CPU device; this build of overlap-candle takes CPU tensors (docs/candle.md, GPUs)".into(),
                });
            }
            let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
            specs.push(ParamSpec::new(name.clone(), shape, a.route, a.layer));
            params.push(Param {
                name,
                var,
                layer: a.layer,
            });
        }
        Ok((params, specs))
    }

    /// The checked config, with the model's parameters.
    pub fn checked_config(&self) -> Result<Config, Error> {
        let (_, specs) = self.params()?;
        self.config_of(specs)
    }

    fn config_of(&self, specs: Vec<ParamSpec>) -> Result<Config, Error> {
        let Some((text, source)) = &self.config else {
            return Err(Error::Usage(
                "no config: give the overlap config with Builder::config_toml or Builder::config_file".into(),
            ));
        };
        let mut config = Config::from_toml_with_params(text, source, specs)?;
        if let Some(adamw) = self.adamw {
            config.adamw = adamw;
        }
        Ok(config)
    }

    /// Builds on the CPU backend: every rank of the mesh in this process, each rank's
    /// gradients computed by this process's candle model from that rank's data.
    pub fn cpu(self) -> Result<DataParallel<CpuBackend>, Error> {
        let (params, specs) = self.params()?;
        let config = self.config_of(specs)?;
        if config.run.backend == overlap::config::BackendChoice::Cuda {
            return Err(Error::Usage(format!(
                "{}: [run] backend = \"cuda\", but this build runs on the CPU backend",
                config.source
            )));
        }
        overlap::resources::check_cpu(&config, 1)?;
        let backend = Arc::new(CpuBackend::new(config.plan.mesh));
        DataParallel::with_backend(params, &config, backend)
    }

    /// Builds on any backend whose buffers take host uploads.
    pub fn build<B: Backend>(self, backend: Arc<B>) -> Result<DataParallel<B>, Error> {
        let (params, specs) = self.params()?;
        let config = self.config_of(specs)?;
        DataParallel::with_backend(params, &config, backend)
    }
}

/// A candle model trained data-parallel (FSDP / HSDP) by an `overlap` session.
///
/// Per step, for each of the config's micro-batches, either
/// - the simple path: [`DataParallel::begin_micro_batch`], the trainer's forward on each
///   local rank's data, then [`DataParallel::backward`] with each rank's loss (or
///   [`DataParallel::grads`] with each rank's `GradStore`); the reductions of this
///   micro-batch run while the trainer computes the next one; or
/// - the segmented path: [`DataParallel::micro_batch`] with a [`crate::Segmented`]
///   model, whose backward hands each block's gradients to the session before the
///   backward of the block below starts, so the reductions run during the backward;
///
/// then [`DataParallel::step`], after which the `Var`s hold the updated parameters.
///
/// The methods block: the session runs on a runtime of the `DataParallel`'s own (the
/// backend's streams run on threads of their own). Call them from ordinary code, not
/// from inside an async task.
pub struct DataParallel<B: Backend = CpuBackend> {
    pub(crate) session: Session<B>,
    pub(crate) backend: Arc<B>,
    pub(crate) params: Vec<Param>,
    /// Each layer with its parameter ids, in the session's hand-in order (highest
    /// first).
    pub(crate) layers: Vec<(u32, Vec<ParamId>)>,
    gates: Vec<Gate>,
    pub(crate) ranks: Vec<u32>,
    pub(crate) runtime: tokio::runtime::Runtime,
    /// Micro-batches begun in this step.
    begun: usize,
    /// Whether the micro-batch begun last still waits for its gradients.
    open: bool,
    /// Per local rank, whether its gradients of the open micro-batch were copied.
    copied: Vec<bool>,
    /// Gradient buffers of each micro-batch index, by (rank, parameter), reused every
    /// step: the session reads them until the step ends.
    grad_bufs: Vec<HashMap<(u32, ParamId), B::Buffer>>,
    /// A buffer of no elements, bound should the session ask for a gradient this crate
    /// did not hand in (it then names the parameter).
    empty: B::Buffer,
    pub(crate) step_copies: Copies,
    last_copies: Copies,
    /// Seconds spent handing gradients in (copies and session calls) in this step, and
    /// in the last completed one.
    hand_in: f64,
    last_hand_in: f64,
}

impl DataParallel<CpuBackend> {
    /// A builder over a `VarMap`'s variables.
    pub fn builder(vars: &VarMap) -> Builder {
        DataParallel::builder_from_vars(named_vars(vars))
    }

    /// A builder over named variables (for models built without a `VarMap`).
    pub fn builder_from_vars(vars: Vec<(String, Var)>) -> Builder {
        Builder {
            vars,
            config: None,
            rules: Rules::new(),
            adamw: None,
        }
    }
}

impl<B: Backend> DataParallel<B> {
    fn with_backend(params: Vec<Param>, config: &Config, backend: Arc<B>) -> Result<Self, Error> {
        let exec = overlap::session::exec_config(config)?;
        let mut session = Session::new(config.plan.clone(), backend.clone(), exec)?;
        // The session starts from the model's current values.
        let mut first = None;
        session.init_params(|id, p| {
            let var = &params[id as usize].var;
            match var
                .as_tensor()
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
            {
                Ok(v) => v,
                Err(e) => {
                    first.get_or_insert(Error::from(e));
                    vec![0.0; p.spec.numel() as usize]
                }
            }
        })?;
        if let Some(e) = first {
            return Err(e);
        }
        let layers = session
            .layers()
            .into_iter()
            .map(|l| {
                let ids = (0..params.len() as ParamId)
                    .filter(|&id| params[id as usize].layer == l)
                    .collect();
                (l, ids)
            })
            .collect();
        let ranks = session.local_ranks();
        let copied = vec![false; ranks.len()];
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Usage(format!("cannot start the session's runtime: {e}")))?;
        let empty = backend
            .alloc(ranks.first().copied().unwrap_or(0), 0)
            .map_err(overlap::executor::ExecError::from)
            .map_err(overlap::Error::from)?;
        Ok(DataParallel {
            session,
            backend,
            params,
            layers,
            gates: config.gates.clone(),
            grad_bufs: vec![HashMap::new(); config.gates.len()],
            ranks,
            runtime,
            begun: 0,
            open: false,
            copied,
            empty,
            step_copies: Copies::default(),
            last_copies: Copies::default(),
            hand_in: 0.0,
            last_hand_in: 0.0,
        })
    }

    /// The ranks this process computes gradients for: every rank of the mesh on the CPU
    /// backend, this process's rank in a multi-process job.
    pub fn local_ranks(&self) -> &[u32] {
        &self.ranks
    }

    /// Micro-batches per step (`[accumulation]`).
    pub fn micro_batches(&self) -> usize {
        self.gates.len()
    }

    /// The parameter names in id order (ascending layer, then name).
    pub fn param_names(&self) -> Vec<&str> {
        self.params.iter().map(|p| p.name.as_str()).collect()
    }

    /// The layer each parameter is in, in id order.
    pub fn param_layers(&self) -> Vec<u32> {
        self.params.iter().map(|p| p.layer).collect()
    }

    /// The session (reports, checkpoints with [`Session::save`] and [`Session::load`],
    /// the learning-rate factor).
    pub fn session(&self) -> &Session<B> {
        &self.session
    }

    /// The session, for calls between steps ([`Session::load`],
    /// [`Session::set_lr_factor`]). After [`Session::load`], call
    /// [`DataParallel::sync_vars`] so the model sees the loaded parameters.
    pub fn session_mut(&mut self) -> &mut Session<B> {
        &mut self.session
    }

    /// The copies of the last completed step.
    pub fn copies(&self) -> Copies {
        self.last_copies
    }

    /// Seconds the last completed step spent handing gradients in: copying them into
    /// the session's buffers and the session's calls (the trainer's forward and
    /// backward excluded).
    pub fn hand_in_seconds(&self) -> f64 {
        self.last_hand_in
    }

    /// Starts the step's next micro-batch with its gate from `[accumulation]`. With
    /// `[forward]` it also runs the forward's gathers of every layer, lowest first,
    /// writing each layer's full parameters into its `Var`s before the trainer's
    /// forward reads them. (The segmented path, [`DataParallel::micro_batch`], begins
    /// its micro-batches itself.)
    pub fn begin_micro_batch(&mut self) -> Result<(), Error> {
        self.begin("begin_micro_batch")?;
        if self.session.has_forward() {
            for layer in self.session.forward_layers() {
                self.gather_into_vars(layer)?;
            }
        }
        Ok(())
    }

    /// Begins the next micro-batch in the session.
    pub(crate) fn begin(&mut self, what: &str) -> Result<usize, Error> {
        if self.open {
            return Err(Error::Usage(format!(
                "{what}: micro-batch {} still waits for its gradients (backward_rank or grads_rank for each rank then end_micro_batch, or backward, grads, micro_batch)",
                self.begun - 1
            )));
        }
        let m = self.begun;
        let Some(&gate) = self.gates.get(m) else {
            return Err(Error::Usage(format!(
                "{what}: the step's {} micro-batches ([accumulation]) are done; call step()",
                self.gates.len()
            )));
        };
        self.runtime
            .block_on(self.session.begin_micro_batch(gate))?;
        self.begun += 1;
        self.open = true;
        Ok(m)
    }

    /// The micro-batch that waits for its gradients.
    pub(crate) fn open_micro_batch(&self, what: &str) -> Result<usize, Error> {
        if !self.open {
            return Err(Error::Usage(format!(
                "{what} without a micro-batch: call begin_micro_batch first"
            )));
        }
        Ok(self.begun - 1)
    }

    pub(crate) fn close_micro_batch(&mut self) {
        self.open = false;
        self.copied.fill(false);
    }

    /// The forward's gathers of `layer` (`[forward]`), written into the `Var`s: once per
    /// parameter, from the first local rank (every replica holds the same values).
    pub(crate) fn gather_into_vars(&mut self, layer: u32) -> Result<(), Error> {
        let first = self.ranks.first().copied();
        let params = &self.params;
        let mut failed = None;
        let mut copies = 0u64;
        let mut bytes = 0u64;
        self.runtime
            .block_on(self.session.forward_ready(layer, |rank, id, full| {
                if Some(rank) != first || failed.is_some() {
                    return;
                }
                let var = &params[id as usize].var;
                let written =
                    Tensor::from_slice(full, var.shape(), &Device::Cpu).and_then(|t| var.set(&t));
                match written {
                    Ok(()) => {
                        copies += 2;
                        bytes += 2 * 4 * full.len() as u64;
                    }
                    Err(e) => failed = Some(e),
                }
            }))?;
        if let Some(e) = failed {
            return Err(e.into());
        }
        self.step_copies.params += copies;
        self.step_copies.param_bytes += bytes;
        Ok(())
    }

    /// The backward point of `layer` on a forward plan. The gathered parameters are not
    /// written again: the trainer's forward graph already holds the `Var`s it read.
    pub(crate) fn backward_point(&mut self, layer: u32) -> Result<(), Error> {
        if self.session.has_forward() {
            self.runtime
                .block_on(self.session.backward_ready(layer, |_, _, _| {}))?;
        }
        Ok(())
    }

    /// Ends the open micro-batch with each local rank's loss: [`DataParallel::backward_rank`]
    /// for each, then [`DataParallel::end_micro_batch`]. `losses` holds every local rank
    /// once.
    pub fn backward(&mut self, losses: &[(u32, Tensor)]) -> Result<(), Error> {
        self.open_micro_batch("backward")?;
        self.rank_order(losses.iter().map(|(r, _)| *r), "backward")?;
        for (rank, loss) in losses {
            self.backward_rank(*rank, loss)?;
        }
        self.end_micro_batch()
    }

    /// Runs rank `rank`'s backward of the open micro-batch, `(loss / M).backward()` (`M`
    /// micro-batches per step, so the step's gradient is the mean over its
    /// micro-batches, as with PyTorch's gradient accumulation), and copies its gradients
    /// into the session's buffers at once, so candle's gradients and graph are freed
    /// before the next rank's forward. [`DataParallel::end_micro_batch`] hands them in.
    pub fn backward_rank(&mut self, rank: u32, loss: &Tensor) -> Result<(), Error> {
        self.open_micro_batch("backward_rank")?;
        let scale = 1.0 / self.gates.len() as f64;
        let store = loss.affine(scale, 0.0)?.backward()?;
        self.grads_rank(rank, &store)
    }

    /// Copies rank `rank`'s gradients of the open micro-batch, as `loss.backward()`
    /// returned them, into the session's buffers (scale the loss yourself: divide it by
    /// the micro-batches per step for a mean). A parameter the store has no gradient for
    /// contributes zeros. [`DataParallel::end_micro_batch`] hands them in.
    pub fn grads_rank(&mut self, rank: u32, store: &GradStore) -> Result<(), Error> {
        let m = self.open_micro_batch("grads_rank")?;
        let ri = self.ranks.iter().position(|&r| r == rank).ok_or_else(|| {
            Error::Usage(format!(
                "grads_rank: rank {rank} is not a local rank of this process ({:?})",
                self.ranks
            ))
        })?;
        if self.copied[ri] {
            return Err(Error::Usage(format!(
                "grads_rank: rank {rank}'s gradients of micro-batch {m} were given already"
            )));
        }
        let started = std::time::Instant::now();
        for id in 0..self.params.len() as ParamId {
            let g = store.get(self.params[id as usize].var.as_tensor()).cloned();
            self.copy_grad(m, ri, id, g)?;
        }
        self.copied[ri] = true;
        self.hand_in += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// Ends the open micro-batch with each local rank's gradients, as `loss.backward()`
    /// returned them: [`DataParallel::grads_rank`] for each, then
    /// [`DataParallel::end_micro_batch`]. `stores` holds every local rank once.
    pub fn grads(&mut self, stores: &[(u32, GradStore)]) -> Result<(), Error> {
        self.open_micro_batch("grads")?;
        self.rank_order(stores.iter().map(|(r, _)| *r), "grads")?;
        for (rank, store) in stores {
            self.grads_rank(*rank, store)?;
        }
        self.end_micro_batch()
    }

    /// Hands the open micro-batch's gradients to the session, layer by layer, highest
    /// first, once every local rank's were given ([`DataParallel::backward_rank`] or
    /// [`DataParallel::grads_rank`]).
    pub fn end_micro_batch(&mut self) -> Result<(), Error> {
        let m = self.open_micro_batch("end_micro_batch")?;
        let missing: Vec<u32> = self
            .ranks
            .iter()
            .zip(&self.copied)
            .filter(|(_, &c)| !c)
            .map(|(&r, _)| r)
            .collect();
        if !missing.is_empty() {
            return Err(Error::Usage(format!(
                "end_micro_batch: micro-batch {m} has no gradients of ranks {missing:?} yet (backward_rank or grads_rank)"
            )));
        }
        for i in 0..self.layers.len() {
            self.backward_point(self.layers[i].0)?;
            self.submit(m, i)?;
        }
        self.close_micro_batch();
        Ok(())
    }

    /// For each local rank (in [`DataParallel::local_ranks`] order), the position in the
    /// caller's list that holds it: every local rank exactly once.
    pub(crate) fn rank_order(
        &self,
        given: impl Iterator<Item = u32>,
        what: &str,
    ) -> Result<Vec<usize>, Error> {
        let given: Vec<u32> = given.collect();
        let mut order = Vec::with_capacity(self.ranks.len());
        for &rank in &self.ranks {
            let mut at = given.iter().enumerate().filter(|(_, &r)| r == rank);
            match (at.next(), at.next()) {
                (Some((i, _)), None) => order.push(i),
                (None, _) => {
                    return Err(Error::Usage(format!(
                        "{what}: nothing for rank {rank}; give every local rank {:?} once",
                        self.ranks
                    )))
                }
                (Some(_), Some(_)) => {
                    return Err(Error::Usage(format!("{what}: rank {rank} given twice")))
                }
            }
        }
        if let Some(r) = given.iter().find(|r| !self.ranks.contains(r)) {
            return Err(Error::Usage(format!(
                "{what}: rank {r} is not a local rank of this process ({:?})",
                self.ranks
            )));
        }
        Ok(order)
    }

    /// Copies the `i`-th layer's gradients of every local rank into the micro-batch's
    /// buffers and hands them to the session. `grad(ri, id)` is the gradient of
    /// parameter `id` on the `ri`-th local rank, `None` for zeros.
    pub(crate) fn hand_layer(
        &mut self,
        m: usize,
        i: usize,
        mut grad: impl FnMut(usize, ParamId) -> Option<Tensor>,
    ) -> Result<(), Error> {
        let started = std::time::Instant::now();
        for ri in 0..self.ranks.len() {
            for k in 0..self.layers[i].1.len() {
                let id = self.layers[i].1[k];
                self.copy_grad(m, ri, id, grad(ri, id))?;
            }
        }
        self.hand_in += started.elapsed().as_secs_f64();
        self.submit(m, i)
    }

    /// Copies one gradient (zeros for `None`) into its buffer of micro-batch `m`.
    fn copy_grad(
        &mut self,
        m: usize,
        ri: usize,
        id: ParamId,
        grad: Option<Tensor>,
    ) -> Result<(), Error> {
        let rank = self.ranks[ri];
        let var = &self.params[id as usize].var;
        let numel = var.elem_count();
        let buf = match self.grad_bufs[m].get(&(rank, id)) {
            Some(b) => b.clone(),
            None => {
                let b = self.backend.alloc_uninit(rank, numel).map_err(ops_error)?;
                self.grad_bufs[m].insert((rank, id), b.clone());
                b
            }
        };
        let g = match grad {
            Some(g) => g,
            None => Tensor::zeros(var.shape(), DType::F32, &Device::Cpu)?,
        };
        if g.dims() != var.dims() || g.dtype() != DType::F32 {
            return Err(Error::Param {
                name: self.params[id as usize].name.clone(),
                reason: format!(
                    "rank {rank}'s gradient is {:?} {:?}, the parameter f32 {:?}",
                    g.dtype(),
                    g.dims(),
                    var.dims()
                ),
            });
        }
        with_f32_slice(&g, |s| self.backend.upload(&buf, s))?.map_err(ops_error)?;
        self.step_copies.grads += 1;
        self.step_copies.grad_bytes += 4 * numel as u64;
        Ok(())
    }

    /// Hands the `i`-th layer's buffers of micro-batch `m` to the session.
    fn submit(&mut self, m: usize, i: usize) -> Result<(), Error> {
        let started = std::time::Instant::now();
        let layer = self.layers[i].0;
        let bufs = &self.grad_bufs[m];
        let empty = &self.empty;
        self.runtime
            .block_on(self.session.grad_ready_device(layer, &[], |rank, id| {
                bufs.get(&(rank, id)).unwrap_or(empty).clone()
            }))?;
        self.hand_in += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// Ends the step: runs the optimizers and the publishes on every rank, then (without
    /// `[forward]`) writes every updated parameter into its `Var`. With `[forward]` the
    /// next micro-batch's gathers write them, layer by layer; call
    /// [`DataParallel::sync_vars`] to have them all at once (to evaluate or save the
    /// model).
    pub fn step(&mut self) -> Result<StepReport, Error> {
        if self.open {
            return Err(Error::Usage(format!(
                "step: micro-batch {} still waits for its gradients",
                self.begun - 1
            )));
        }
        if self.begun < self.gates.len() {
            return Err(Error::Usage(format!(
                "step after {} of the step's {} micro-batches ([accumulation])",
                self.begun,
                self.gates.len()
            )));
        }
        let report = self.runtime.block_on(self.session.step())?;
        self.begun = 0;
        if !self.session.has_forward() {
            self.sync_vars()?;
        }
        self.last_copies = std::mem::take(&mut self.step_copies);
        self.last_hand_in = std::mem::take(&mut self.hand_in);
        Ok(report)
    }

    /// Writes every parameter's full tensor, as the session holds it, into its `Var`.
    /// Needs local ranks that cover every parameter (the CPU backend's in-process
    /// mesh, or a job of one rank): [`Session::full_param`].
    pub fn sync_vars(&mut self) -> Result<(), Error> {
        for (id, p) in self.params.iter().enumerate() {
            let full = self.session.full_param(id as ParamId)?;
            let bytes = 4 * full.len() as u64;
            p.var
                .set(&Tensor::from_vec(full, p.var.shape(), &Device::Cpu)?)?;
            self.step_copies.params += 3;
            self.step_copies.param_bytes += 3 * bytes;
        }
        Ok(())
    }

    /// Drops the step in progress (its micro-batches' gradients, partials and
    /// accumulations).
    pub fn zero_grad(&mut self) -> Result<(), Error> {
        self.runtime.block_on(self.session.zero_grad())?;
        self.begun = 0;
        self.close_micro_batch();
        self.step_copies = Copies::default();
        self.hand_in = 0.0;
        Ok(())
    }
}

/// A backend's error as the crate's.
fn ops_error(e: overlap::ops::OpsError) -> Error {
    Error::from(overlap::Error::from(overlap::executor::ExecError::from(e)))
}

/// Runs `f` over a tensor's elements as one `f32` slice (made contiguous first if it is
/// not: a copy candle makes).
pub(crate) fn with_f32_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R, Error> {
    let t = if t.is_contiguous() {
        t.clone()
    } else {
        t.contiguous()?
    };
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(Error::Usage(
            "a gradient is not on the CPU device; this build of overlap-candle takes CPU tensors"
                .into(),
        ));
    };
    let all = cpu.as_slice::<f32>()?;
    let start = layout.start_offset();
    let slice = all.get(start..start + t.elem_count()).ok_or_else(|| {
        Error::Usage(format!(
            "internal: a contiguous tensor of {} elements at offset {start} in a storage of {}",
            t.elem_count(),
            all.len()
        ))
    })?;
    Ok(f(slice))
}
