//! `examples/train.rs --backend cuda`: the same trainer with its model on the GPU, one
//! process per rank, the way a GPU trainer embeds `overlap`.
//!
//! ```sh
//! cargo build --release --features cuda --example train
//! overlap launch --nproc-per-node 1 -- target/release/examples/train --backend cuda --mesh 1x1 --json
//! ```
//!
//! Each process opens its rank's GPU through `overlap_dist::cuda::open` (the rendezvous, the
//! NCCL communicators; with `OVERLAP_SHARE_GPU=1`, every rank on one GPU over the copy
//! transport, a test mode) and a [`Session`] over the CUDA backend. Its model is the CPU
//! model's, run on the device: the affine maps are cuBLAS SGEMMs, the rest a few NVRTC
//! kernels (`kernels.cu`), all on a stream of the trainer's own, in the device's primary
//! context (the one the backend uses). Per micro-batch:
//!
//! - **forward**, layers ascending: [`Session::forward_ready_device`] hands the layer's
//!   gathered full parameters as device buffers; the trainer's kernels read them where
//!   they are, and an event recorded after them goes to the next call (`after`), so the
//!   plan frees the buffers only once the kernels have read them;
//! - **backward**, layers descending: [`Session::backward_ready_device`] again, then the
//!   kernels write the layer's gradients straight into buffers the trainer allocated
//!   from the backend (one set per micro-batch, kept until the step returns), and
//!   [`Session::grad_ready_device`] hands them in with an event recorded after them:
//!   nothing is copied to the host, nothing synchronises it.
//!
//! The same example then runs on the CPU backend in this process (every rank
//! simulated, the CPU model; that run is itself checked against the independent
//! reference by `--backend cpu`), and this rank's loss curve, the global gradient norms
//! and this rank's final parameters are compared with it. The exit status is 0 when all
//! three agree to [`GPU_TOLERANCE`] relative and the loss at least halved.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use overlap::graph::PlanSpec;
use overlap::graph::Transport;
use overlap::ops::cuda::cudarc::cublas::{result as cublas, sys as cublas_sys, CudaBlas};
use overlap::ops::cuda::cudarc::driver::{
    sys as cu_sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use overlap::ops::cuda::cudarc::nvrtc::{self, CompileOptions};
use overlap::ops::cuda::{
    mesh_comms_with_forward, CudaBackend, CudaBuffer, CudaEvent, DEFAULT_COPY_RING_DEPTH,
    DEFAULT_COPY_SLOT_BYTES,
};
use overlap::ops::Backend;
use overlap::{ParamId, Session};
use overlap_dist::cuda::{copy_setup, open, rank_env, shared_gpu, CudaWorld, Links};
use overlap_dist::fingerprint::Fingerprint;
use serde::Serialize;

use super::{
    new_session, plan_spec, train, Args, Error, Hyper, Task, B0, B1, C, D, H, HEAD_B, HEAD_W,
    LAYER_OF, NORM, NORM_EPS, PARAMS, W0, W1,
};

/// The bound on the relative errors against the CPU backend's run after `--steps`
/// steps in f32 (the GEMMs sum in another order than the CPU model's loops).
pub const GPU_TOLERANCE: f64 = 1e-4;

/// What a rank found: its JSON line.
#[derive(Debug, Clone, Serialize)]
pub struct GpuReport {
    /// Always `"cuda"`.
    pub backend: &'static str,
    /// This process's rank.
    pub rank: u32,
    /// The GPU.
    pub gpu: String,
    /// The mesh, `SxR`.
    pub mesh: String,
    /// Steps trained.
    pub steps: u64,
    /// Micro-batches per step.
    pub micro_batches: u32,
    /// Samples per rank and micro-batch.
    pub batch: u32,
    /// This rank's first and last loss (mean over its micro-batches).
    pub loss_first: f64,
    /// See `loss_first`.
    pub loss_last: f64,
    /// The CPU backend's run: this rank's last loss.
    pub cpu_loss_last: f64,
    /// Worst `|loss − cpu loss| / |cpu loss|` of this rank's loss over the steps.
    pub loss_rel_err: f64,
    /// Worst relative difference of the global gradient norm (before clipping).
    pub grad_norm_rel_err: f64,
    /// This rank's final parameter pieces against the CPU run's same rank: worst over
    /// parameters of `max |p − p_cpu| / max |p_cpu|`.
    pub param_rel_err: f64,
    /// Mean wall time of a step after the first, in ms (this model is tiny: the step is
    /// dominated by launches and the plan's synchronisation points).
    pub step_ms: f64,
    /// The executor's host time per node issued, in µs, over the steps after the first
    /// (`StepStats::issue_seconds / nodes`): what the gradient path costs the host with
    /// gradients handed in on the device.
    pub host_us_per_node: f64,
    /// Mean host time of one `grad_ready_device` call, in µs (it issues the layer's
    /// nodes), over the steps after the first.
    pub grad_ready_device_us: f64,
    /// `host_us_per_node` by node kind: µs per node of that kind, and the kind's nodes
    /// per step.
    pub host_us_by_kind: std::collections::BTreeMap<String, (f64, f64)>,
    /// The overlap figures of `docs/performance.md` with the trainer's own kernels as
    /// the compute ([`Overlap`]).
    #[serde(flatten)]
    pub overlap: Overlap,
    /// The loss at least halved and every relative error is within [`GPU_TOLERANCE`].
    pub ok: bool,
}

/// How well the gradient path hides behind the trainer's own forward and backward,
/// in `docs/performance.md`'s terms, from host wall times of whole steps (median over
/// [`OVERLAP_STEPS`] after one warm-up each):
///
/// - `compute_only_ms`: the trainer's kernels of a step alone (every micro-batch's
///   forward and backward on parameters uploaded once, no session), then a
///   synchronisation;
/// - `comm_only_ms`: a step of the session alone (the same calls, with the gradients of
///   the step before handed in at once and no trainer kernel);
/// - `overlap_ms`: the training steps' `step_ms`;
/// - `serial_ms = compute + comm` (the bench measures it with everything on one
///   stream; here it is their sum), `ideal_ms = max(compute, comm) + comm / L` with `L`
///   the model's three layers, and `eta = (serial − overlap) / (serial − ideal)`
///   (`None` where serial is not above ideal).
///
/// On one GPU the "communication" is the plan's own work (copies for groups of one, the
/// optimizers), so `eta` says little there; on two GPUs it is the overlap figure of the
/// trainer's real run.
#[derive(Debug, Clone, Serialize)]
pub struct Overlap {
    /// See [`Overlap`].
    pub compute_only_ms: f64,
    /// See [`Overlap`].
    pub comm_only_ms: f64,
    /// See [`Overlap`].
    pub serial_ms: f64,
    /// See [`Overlap`].
    pub ideal_ms: f64,
    /// See [`Overlap`].
    pub eta: Option<f64>,
}

/// Steps timed for each of the overlap variants (after one warm-up step).
pub const OVERLAP_STEPS: usize = 5;

/// The median of a non-empty list.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// `--backend cuda`: trains on this rank's GPU and compares with the CPU backend.
pub fn main(args: &Args) -> ExitCode {
    match run(args) {
        Ok(r) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string(&r).expect("a report serialises")
                );
            } else {
                println!(
                    "rank {} on {}: loss {:.4} -> {:.4}; against the CPU backend (relative): loss {:.2e}, \
                     gradient norm {:.2e}, parameters {:.2e}; step {:.2} ms, host {:.2} µs/node, \
                     grad_ready_device {:.1} µs; compute_only {:.2} ms, comm_only {:.2} ms, eta {}; {}",
                    r.rank,
                    r.gpu,
                    r.loss_first,
                    r.loss_last,
                    r.loss_rel_err,
                    r.grad_norm_rel_err,
                    r.param_rel_err,
                    r.step_ms,
                    r.host_us_per_node,
                    r.grad_ready_device_us,
                    r.overlap.compute_only_ms,
                    r.overlap.comm_only_ms,
                    r.overlap.eta.map_or_else(|| "n/a".into(), |e| format!("{e:.2}")),
                    if r.ok { "ok" } else { "FAILED" }
                );
            }
            if r.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("train: {e}");
            ExitCode::from(1)
        }
    }
}

/// One step of the GPU run.
struct GpuStep {
    loss: f64,
    grad_norm: f64,
}

/// This rank's GPU and line to the others, and the plan to run on it. Ranks sharing one
/// GPU (`OVERLAP_SHARE_GPU=1`, a test mode) have no NCCL: the plan then moves
/// everything over the copy transport.
fn open_world(args: &Args, task: &Task) -> Result<(CudaWorld, PlanSpec), Error> {
    let env = rank_env(args.mesh)?;
    let shared = shared_gpu()?;
    let mut spec = plan_spec(task);
    if shared {
        let schedule = spec.schedule.with_transport(Transport::Copy);
        spec = spec.with_schedule(schedule);
    }
    let links = Links {
        copy: shared.then(|| {
            copy_setup(
                &[&spec],
                DEFAULT_COPY_SLOT_BYTES,
                DEFAULT_COPY_RING_DEPTH,
                true,
            )
        }),
        ..Links::default()
    };
    let world = open(
        env,
        args.mesh,
        mesh_comms_with_forward(args.mesh, &spec.bindings, shared, true),
        false,
        links,
        Fingerprint::build(),
    )?;
    Ok((world, spec))
}

/// The GPU run and the CPU run, compared.
pub fn run(args: &Args) -> Result<GpuReport, Error> {
    super::check_args(args)?;
    let hyper = Hyper::new(args.steps);
    let task = Task::new(args);
    let log = !args.json;
    let (world, spec) = open_world(args, &task)?;
    let rank = world.env.rank;
    let backend = world.backend.clone();
    let gpu = backend.info().name.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;

    let mut session = Session::new(spec, backend.clone(), hyper.exec_config())?;
    session.init_params(|i, _| task.init[i as usize].clone())?;
    let mut model = Model::new(&backend, &task)?;
    let mut grad_ready_seconds = 0.0;
    let mut grad_ready_calls = 0u64;
    let (mut issue_seconds, mut nodes, mut wall) = (0.0, 0usize, 0.0);
    let mut by_kind: std::collections::BTreeMap<String, (f64, usize)> = Default::default();
    let mut curve = Vec::new();
    for k in 0..args.steps {
        let started = Instant::now();
        let (report, calls) = runtime.block_on(model.step(&mut session, &backend, &task, rank))?;
        let step_wall = started.elapsed().as_secs_f64();
        let loss = model.rank_loss(&task)?;
        let grad_norm = report
            .grad_norm
            .ok_or("the plan computes the global norm")?;
        if k > 0 {
            issue_seconds += report.stats.issue_seconds;
            nodes += report.stats.nodes;
            wall += step_wall;
            grad_ready_seconds += calls.0;
            grad_ready_calls += calls.1;
            for &(kind, secs, count) in &report.stats.issue_by_kind {
                let slot = by_kind.entry(kind.to_string()).or_default();
                slot.0 += secs;
                slot.1 += count;
            }
        }
        if log {
            println!(
                "rank {rank} step {:>3}/{}  loss {loss:.6}  grad_norm {grad_norm:.4e}  {:.2} ms",
                report.step,
                args.steps,
                1e3 * step_wall
            );
        }
        curve.push(GpuStep { loss, grad_norm });
    }
    let pieces: Vec<Option<Vec<f32>>> = (0..PARAMS as ParamId)
        .map(|p| session.param_values(rank, p))
        .collect::<Result<_, _>>()?;
    // The overlap variants, after the compared run (comm_only's steps update the
    // parameters with stale gradients).
    let mut comm = Vec::new();
    for _ in 0..=OVERLAP_STEPS {
        let started = Instant::now();
        runtime.block_on(model.comm_only_step(&mut session, &task))?;
        comm.push(1e3 * started.elapsed().as_secs_f64());
    }
    drop(session);
    let compute = model.compute_only(&backend, &task, rank)?;

    // The same example on the CPU backend, every rank simulated.
    let (cpu_curve, cpu_pieces) = runtime.block_on(async {
        let mut s = new_session(&task, &hyper)?;
        s.init_params(|i, _| task.init[i as usize].clone())?;
        let curve = train(&mut s, &task, &hyper, args.steps, None, false).await?;
        let pieces: Vec<Option<Vec<f32>>> = (0..PARAMS as ParamId)
            .map(|p| s.param_values(rank, p))
            .collect::<Result<_, _>>()?;
        Ok::<_, Error>((curve, pieces))
    })?;

    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(f64::MIN_POSITIVE);
    let loss_rel_err = curve
        .iter()
        .zip(&cpu_curve)
        .map(|(g, c)| rel(g.loss, c.rank_loss[rank as usize]))
        .fold(0.0, f64::max);
    let grad_norm_rel_err = curve
        .iter()
        .zip(&cpu_curve)
        .map(|(g, c)| rel(g.grad_norm, c.grad_norm))
        .fold(0.0, f64::max);
    let mut param_rel_err = 0.0f64;
    for (p, (g, c)) in pieces.iter().zip(&cpu_pieces).enumerate() {
        match (g, c) {
            (Some(g), Some(c)) if g.len() == c.len() => {
                let diff = g.iter().zip(c).map(|(a, b)| (a - b).abs());
                let scale = c.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
                let err = f64::from(diff.fold(0.0f32, f32::max))
                    / f64::from(scale).max(f64::MIN_POSITIVE);
                param_rel_err = param_rel_err.max(err);
            }
            (None, None) => {}
            _ => {
                return Err(format!(
                "rank {rank} holds a different piece of parameter {p} on the GPU than on the CPU"
            )
                .into())
            }
        }
    }
    let later = (args.steps - 1) as f64;
    let step_ms = 1e3 * wall / later;
    let (compute_only_ms, comm_only_ms) = (median(compute), median(comm[1..].to_vec()));
    let serial_ms = compute_only_ms + comm_only_ms;
    let ideal_ms = compute_only_ms.max(comm_only_ms) + comm_only_ms / 3.0;
    let overlap = Overlap {
        compute_only_ms,
        comm_only_ms,
        serial_ms,
        ideal_ms,
        eta: (serial_ms > ideal_ms).then(|| (serial_ms - step_ms) / (serial_ms - ideal_ms)),
    };
    let (loss_first, loss_last) = (curve[0].loss, curve[curve.len() - 1].loss);
    let ok = loss_last <= 0.5 * loss_first
        && loss_rel_err <= GPU_TOLERANCE
        && grad_norm_rel_err <= GPU_TOLERANCE
        && param_rel_err <= GPU_TOLERANCE;
    Ok(GpuReport {
        backend: "cuda",
        rank,
        gpu,
        mesh: args.mesh.to_string(),
        steps: args.steps,
        micro_batches: args.micro_batches,
        batch: args.batch,
        loss_first,
        loss_last,
        cpu_loss_last: cpu_curve[cpu_curve.len() - 1].rank_loss[rank as usize],
        loss_rel_err,
        grad_norm_rel_err,
        param_rel_err,
        step_ms,
        host_us_per_node: 1e6 * issue_seconds / nodes.max(1) as f64,
        grad_ready_device_us: 1e6 * grad_ready_seconds / grad_ready_calls.max(1) as f64,
        host_us_by_kind: by_kind
            .into_iter()
            .map(|(k, (secs, n))| (k, (1e6 * secs / n.max(1) as f64, n as f64 / later)))
            .collect(),
        overlap,
        ok,
    })
}

/// The trainer's kernels, from `kernels.cu`.
struct Kernels {
    bias_tanh: CudaFunction,
    rms_inv: CudaFunction,
    norm_apply: CudaFunction,
    softmax_ce: CudaFunction,
    ce_grad: CudaFunction,
    col_sum: CudaFunction,
    tanh_grad: CudaFunction,
    norm_gain_grad: CudaFunction,
    norm_input_grad: CudaFunction,
}

/// The model on this rank's GPU: its stream, cuBLAS handle, kernels, activations and
/// gradient buffers.
struct Model {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    /// This micro-batch's inputs (`batch × D`) and labels.
    x: CudaSlice<f32>,
    labels: CudaSlice<i32>,
    a0: CudaSlice<f32>,
    inv: CudaSlice<f32>,
    n: CudaSlice<f32>,
    a1: CudaSlice<f32>,
    probs: CudaSlice<f32>,
    /// The gradient flowing down: `batch × C`, then `batch × H`.
    up: CudaSlice<f32>,
    /// The second buffer of the gradient flowing down (`batch × H`).
    down: CudaSlice<f32>,
    /// Each sample's loss, per micro-batch of the step (`micro_batches × batch`).
    loss: CudaSlice<f64>,
    /// The gradients handed to the session, per micro-batch and parameter: lent by the
    /// backend, written by the backward, read in place by the plan, rewritten only the
    /// next step (after `step` returned).
    grads: Vec<Vec<CudaBuffer>>,
    /// The full parameters of the layer in use, by parameter (the buffers the session
    /// handed over), kept until the next session call has ordered its free after the
    /// kernels that read them.
    full: Vec<Option<CudaBuffer>>,
    batch: usize,
}

/// `n` elements, one thread each.
fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

/// A device address from a cudarc slice (the trainer's one stream orders every use).
fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

impl Model {
    fn new(backend: &CudaBackend, task: &Task) -> Result<Model, Error> {
        let ctx = CudaContext::new(backend.ordinal() as usize)?;
        // One stream orders everything the trainer does; cudarc's per-slice events are
        // not needed.
        // SAFETY: every slice below is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let major = ctx
            .attribute(cu_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = ctx
            .attribute(cu_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let ptx = nvrtc::compile_ptx_with_opts(
            include_str!("kernels.cu"),
            CompileOptions {
                fmad: Some(false),
                options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
                name: Some("train_kernels.cu".into()),
                ..Default::default()
            },
        )
        .map_err(|e| format!("NVRTC could not compile examples/train_cuda/kernels.cu: {e:?}"))?;
        let module = ctx.load_module(ptx)?;
        let f = |name: &str| module.load_function(name);
        let k = Kernels {
            bias_tanh: f("bias_tanh")?,
            rms_inv: f("rms_inv")?,
            norm_apply: f("norm_apply")?,
            softmax_ce: f("softmax_ce")?,
            ce_grad: f("ce_grad")?,
            col_sum: f("col_sum")?,
            tanh_grad: f("tanh_grad")?,
            norm_gain_grad: f("norm_gain_grad")?,
            norm_input_grad: f("norm_input_grad")?,
        };
        let blas = CudaBlas::new(stream.clone())?;
        let b = task.batch;
        let rank = backend.rank();
        let numel: Vec<usize> = super::param_specs()
            .iter()
            .map(|p| p.numel() as usize)
            .collect();
        let grads = (0..task.micro_batches)
            .map(|_| {
                numel
                    .iter()
                    .map(|&n| backend.alloc(rank, n))
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Model {
            x: stream.alloc_zeros(b * D)?,
            labels: stream.alloc_zeros(b)?,
            a0: stream.alloc_zeros(b * H)?,
            inv: stream.alloc_zeros(b)?,
            n: stream.alloc_zeros(b * H)?,
            a1: stream.alloc_zeros(b * H)?,
            probs: stream.alloc_zeros(b * C)?,
            up: stream.alloc_zeros(b * H)?,
            down: stream.alloc_zeros(b * H)?,
            loss: stream.alloc_zeros(task.micro_batches as usize * b)?,
            grads,
            full: vec![None; PARAMS],
            batch: b,
            stream,
            blas,
            k,
        })
    }

    /// An event recorded on the trainer's stream after everything issued so far: the
    /// `after` of the next session call.
    fn mark(&self, backend: &CudaBackend, rank: u32) -> Result<Vec<(u32, CudaEvent)>, Error> {
        let ev = backend.event(rank);
        // SAFETY: the stream is live (owned by `self`) in the device's primary context.
        unsafe { backend.record_on(&ev, self.stream.cu_stream()) }?;
        Ok(vec![(rank, ev)])
    }

    /// One training step: every micro-batch's forward and backward on the device, the
    /// session's calls between the layers, then `step`. Returns the report and the host
    /// seconds and count of the `grad_ready_device` calls.
    async fn step(
        &mut self,
        s: &mut Session<CudaBackend>,
        backend: &CudaBackend,
        task: &Task,
        rank: u32,
    ) -> Result<(overlap::StepReport, (f64, u64)), Error> {
        let step = s.steps_done() + 1;
        let (mut seconds, mut calls) = (0.0, 0u64);
        for m in 0..task.micro_batches {
            s.begin_micro_batch(task.gate(m)).await?;
            let batch = task.batch(step, m, rank);
            let labels: Vec<i32> = batch.labels.iter().map(|&l| l as i32).collect();
            self.stream.memcpy_htod(&batch.x, &mut self.x)?;
            self.stream.memcpy_htod(&labels, &mut self.labels)?;
            let mut after = Vec::new();
            for layer in s.forward_layers() {
                let mut full = vec![None; PARAMS];
                s.forward_ready_device(layer, &after, |_, p, buf| {
                    full[p as usize] = Some(buf.clone())
                })
                .await?;
                // The previous layer's buffers: the call just ordered their free after
                // the kernels that read them.
                self.full = full;
                self.forward(layer, m as usize)?;
                after = self.mark(backend, rank)?;
            }
            for layer in s.layers() {
                let mut full = vec![None; PARAMS];
                s.backward_ready_device(layer, &after, |_, p, buf| {
                    full[p as usize] = Some(buf.clone())
                })
                .await?;
                self.full = full;
                self.backward(layer, m as usize, task.scale())?;
                let done = self.mark(backend, rank)?;
                let grads = &self.grads[m as usize];
                let started = Instant::now();
                s.grad_ready_device(layer, &done, |_, p| grads[p as usize].clone())
                    .await?;
                seconds += started.elapsed().as_secs_f64();
                calls += 1;
                after = Vec::new();
            }
        }
        let report = s.step().await?;
        self.full = vec![None; PARAMS];
        Ok((report, (seconds, calls)))
    }

    /// A step of the session alone: the same calls as [`Model::step`], with the
    /// gradients of the step before handed in at once and no kernel of the trainer.
    async fn comm_only_step(
        &mut self,
        s: &mut Session<CudaBackend>,
        task: &Task,
    ) -> Result<overlap::StepReport, Error> {
        for m in 0..task.micro_batches {
            s.begin_micro_batch(task.gate(m)).await?;
            for layer in s.forward_layers() {
                s.forward_ready_device(layer, &[], |_, _, _| {}).await?;
            }
            for layer in s.layers() {
                s.backward_ready_device(layer, &[], |_, _, _| {}).await?;
                let grads = &self.grads[m as usize];
                s.grad_ready_device(layer, &[], |_, p| grads[p as usize].clone())
                    .await?;
            }
        }
        Ok(s.step().await?)
    }

    /// The trainer's kernels of a step alone, [`OVERLAP_STEPS`] times after a warm-up:
    /// every micro-batch's forward and backward on the initial parameters uploaded once
    /// (no session), then a synchronisation. Milliseconds per step.
    fn compute_only(
        &mut self,
        backend: &CudaBackend,
        task: &Task,
        rank: u32,
    ) -> Result<Vec<f64>, Error> {
        let mut full = Vec::with_capacity(PARAMS);
        for values in &task.init {
            let buf = backend.alloc(rank, values.len())?;
            backend.upload(&buf, values)?;
            full.push(Some(buf));
        }
        self.full = full;
        let mut out = Vec::new();
        for k in 0..=OVERLAP_STEPS {
            let started = Instant::now();
            for m in 0..task.micro_batches {
                let batch = task.batch(1, m, rank);
                let labels: Vec<i32> = batch.labels.iter().map(|&l| l as i32).collect();
                self.stream.memcpy_htod(&batch.x, &mut self.x)?;
                self.stream.memcpy_htod(&labels, &mut self.labels)?;
                for layer in 0..3 {
                    self.forward(layer, m as usize)?;
                }
                for layer in (0..3).rev() {
                    self.backward(layer, m as usize, task.scale())?;
                }
            }
            self.stream.synchronize()?;
            if k > 0 {
                out.push(1e3 * started.elapsed().as_secs_f64());
            }
        }
        self.full = vec![None; PARAMS];
        Ok(out)
    }

    /// The full parameter `id` of the layer in use.
    fn param(&self, id: usize) -> Result<u64, Error> {
        self.full[id]
            .as_ref()
            .map(CudaBuffer::device_ptr)
            .ok_or_else(|| {
                format!(
                    "the session handed no buffer of parameter {id} (layer {})",
                    LAYER_OF[id]
                )
                .into()
            })
    }

    /// `C = op(A)·op(B)` in cuBLAS's column-major terms (`m × n`, inner `k`), on the
    /// trainer's stream; row-major callers pass their matrices transposed (see the
    /// call sites).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        (a, lda): (u64, usize),
        (b, ldb): (u64, usize),
        (c, ldc): (u64, usize),
    ) -> Result<(), Error> {
        let op = |t: bool| {
            if t {
                cublas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cublas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the addresses are live device buffers of at least the sizes the
        // shapes imply (the model's activations, the session's gathered parameters, the
        // gradient buffers), and the handle's stream is the trainer's.
        unsafe {
            cublas::sgemm(
                *self.blas.handle(),
                op(ta),
                op(tb),
                m as i32,
                n as i32,
                k as i32,
                &alpha,
                a as *const f32,
                lda as i32,
                b as *const f32,
                ldb as i32,
                &beta,
                c as *mut f32,
                ldc as i32,
            )
        }?;
        Ok(())
    }

    /// Row-major `Y (batch × rows) = X (batch × cols) · Wᵀ` for `W` row-major `rows × cols`.
    fn affine(&self, x: u64, w: u64, y: u64, rows: usize, cols: usize) -> Result<(), Error> {
        self.gemm(
            (true, false),
            (rows, self.batch, cols),
            (w, cols),
            (x, cols),
            (y, rows),
        )
    }

    /// Row-major `dW (rows × cols) = dYᵀ · X` over the batch.
    fn weight_grad(&self, dy: u64, x: u64, dw: u64, rows: usize, cols: usize) -> Result<(), Error> {
        self.gemm(
            (false, true),
            (cols, rows, self.batch),
            (x, cols),
            (dy, rows),
            (dw, cols),
        )
    }

    /// Row-major `dX (batch × cols) = dY (batch × rows) · W`.
    fn input_grad(&self, dy: u64, w: u64, dx: u64, rows: usize, cols: usize) -> Result<(), Error> {
        self.gemm(
            (false, false),
            (cols, self.batch, rows),
            (w, cols),
            (dy, rows),
            (dx, cols),
        )
    }

    /// Runs `layer`'s forward for micro-batch `m`'s samples.
    fn forward(&mut self, layer: u32, m: usize) -> Result<(), Error> {
        let st = &self.stream;
        let b = self.batch as i32;
        let (h, c) = (H as i32, C as i32);
        match layer {
            0 => {
                let (x, a0) = (ptr(&self.x, st), ptr(&self.a0, st));
                self.affine(x, self.param(W0)?, a0, H, D)?;
                let bias = self.param(B0)?;
                let inv = ptr(&self.inv, st);
                // SAFETY: arguments match kernels.cu's signatures; sizes as allocated.
                unsafe {
                    st.launch_builder(&self.k.bias_tanh)
                        .arg(&a0)
                        .arg(&bias)
                        .arg(&b)
                        .arg(&h)
                        .launch(cfg(self.batch * H))?;
                    st.launch_builder(&self.k.rms_inv)
                        .arg(&a0)
                        .arg(&inv)
                        .arg(&b)
                        .arg(&h)
                        .arg(&NORM_EPS)
                        .launch(cfg(self.batch))?;
                }
            }
            1 => {
                let (a0, inv, n, a1) = (
                    ptr(&self.a0, st),
                    ptr(&self.inv, st),
                    ptr(&self.n, st),
                    ptr(&self.a1, st),
                );
                let g = self.param(NORM)?;
                // SAFETY: as above.
                unsafe {
                    st.launch_builder(&self.k.norm_apply)
                        .arg(&a0)
                        .arg(&inv)
                        .arg(&g)
                        .arg(&n)
                        .arg(&b)
                        .arg(&h)
                        .launch(cfg(self.batch * H))?;
                }
                self.affine(n, self.param(W1)?, a1, H, H)?;
                let bias = self.param(B1)?;
                // SAFETY: as above.
                unsafe {
                    st.launch_builder(&self.k.bias_tanh)
                        .arg(&a1)
                        .arg(&bias)
                        .arg(&b)
                        .arg(&h)
                        .launch(cfg(self.batch * H))?;
                }
            }
            2 => {
                let (a1, probs, labels) = (
                    ptr(&self.a1, st),
                    ptr(&self.probs, st),
                    ptr(&self.labels, st),
                );
                self.affine(a1, self.param(HEAD_W)?, probs, C, H)?;
                let bias = self.param(HEAD_B)?;
                let loss = ptr(&self.loss, st) + (m * self.batch * 8) as u64;
                // SAFETY: as above; `loss` points at this micro-batch's `batch` doubles.
                unsafe {
                    st.launch_builder(&self.k.softmax_ce)
                        .arg(&probs)
                        .arg(&bias)
                        .arg(&labels)
                        .arg(&loss)
                        .arg(&b)
                        .arg(&c)
                        .launch(cfg(self.batch))?;
                }
            }
            _ => return Err(format!("the model has three layers, not layer {layer}").into()),
        }
        Ok(())
    }

    /// Runs `layer`'s backward for micro-batch `m`, writing the layer's gradients into
    /// `self.grads[m]` (layers 2, 1, 0 in order; `scale` is the loss scale).
    fn backward(&mut self, layer: u32, m: usize, scale: f32) -> Result<(), Error> {
        let st = &self.stream;
        let b = self.batch as i32;
        let (h, c) = (H as i32, C as i32);
        let g = |id: usize| self.grads[m][id].device_ptr();
        let (up, down) = (ptr(&self.up, st), ptr(&self.down, st));
        match layer {
            2 => {
                // up = dL/dlogits; head gradients; down = dL/da1.
                let (probs, labels, a1) = (
                    ptr(&self.probs, st),
                    ptr(&self.labels, st),
                    ptr(&self.a1, st),
                );
                // SAFETY: as in `forward`.
                unsafe {
                    st.launch_builder(&self.k.ce_grad)
                        .arg(&probs)
                        .arg(&labels)
                        .arg(&up)
                        .arg(&b)
                        .arg(&c)
                        .arg(&scale)
                        .launch(cfg(self.batch * C))?;
                }
                self.weight_grad(up, a1, g(HEAD_W), C, H)?;
                self.col_sum(up, g(HEAD_B), C)?;
                self.input_grad(up, self.param(HEAD_W)?, down, C, H)?;
            }
            1 => {
                // down = dL/da1 → dz1 in place; W1, b1; up = dL/dn; the norm's gain and
                // down = dL/da0.
                let (a0, a1, n, inv) = (
                    ptr(&self.a0, st),
                    ptr(&self.a1, st),
                    ptr(&self.n, st),
                    ptr(&self.inv, st),
                );
                let count = b * h;
                // SAFETY: as in `forward`.
                unsafe {
                    st.launch_builder(&self.k.tanh_grad)
                        .arg(&down)
                        .arg(&a1)
                        .arg(&count)
                        .launch(cfg(self.batch * H))?;
                }
                self.weight_grad(down, n, g(W1), H, H)?;
                self.col_sum(down, g(B1), H)?;
                self.input_grad(down, self.param(W1)?, up, H, H)?;
                let (gain, gamma) = (g(NORM), self.param(NORM)?);
                // SAFETY: as in `forward`; `down` is rewritten after `up` was computed
                // from it (same stream).
                unsafe {
                    st.launch_builder(&self.k.norm_gain_grad)
                        .arg(&up)
                        .arg(&a0)
                        .arg(&inv)
                        .arg(&gain)
                        .arg(&b)
                        .arg(&h)
                        .launch(cfg(H))?;
                    st.launch_builder(&self.k.norm_input_grad)
                        .arg(&up)
                        .arg(&a0)
                        .arg(&inv)
                        .arg(&gamma)
                        .arg(&down)
                        .arg(&b)
                        .arg(&h)
                        .launch(cfg(self.batch))?;
                }
            }
            0 => {
                // down = dL/da0 → dz0 in place; W0, b0.
                let (a0, x) = (ptr(&self.a0, st), ptr(&self.x, st));
                let count = b * h;
                // SAFETY: as in `forward`.
                unsafe {
                    st.launch_builder(&self.k.tanh_grad)
                        .arg(&down)
                        .arg(&a0)
                        .arg(&count)
                        .launch(cfg(self.batch * H))?;
                }
                self.weight_grad(down, x, g(W0), H, D)?;
                self.col_sum(down, g(B0), H)?;
            }
            _ => return Err(format!("the model has three layers, not layer {layer}").into()),
        }
        Ok(())
    }

    /// `out[i] = Σ_s dy[s][i]` over the batch: a bias gradient.
    fn col_sum(&self, dy: u64, out: u64, cols: usize) -> Result<(), Error> {
        let (b, n) = (self.batch as i32, cols as i32);
        // SAFETY: as in `forward`.
        unsafe {
            self.stream
                .launch_builder(&self.k.col_sum)
                .arg(&dy)
                .arg(&out)
                .arg(&b)
                .arg(&n)
                .launch(cfg(cols))?;
        }
        Ok(())
    }

    /// This rank's loss of the step just run: per micro-batch the mean over its samples,
    /// averaged over the micro-batches, summed in the CPU model's order.
    fn rank_loss(&self, task: &Task) -> Result<f64, Error> {
        self.stream.synchronize()?;
        let losses = self.stream.clone_dtoh(&self.loss)?;
        let mut total = 0.0f64;
        for per in losses.chunks_exact(self.batch) {
            let sum = per.iter().fold(0.0f64, |a, &l| a + l);
            total += sum / self.batch as f64 / f64::from(task.micro_batches);
        }
        Ok(total)
    }
}
