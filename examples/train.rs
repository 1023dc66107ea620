//! A real trainer on top of `overlap`: a small MLP trained from scratch on a learnable
//! task, every simulated rank computing the gradients of its own data.
//!
//! ```sh
//! cargo run --release --example train -- --steps 50 --json
//! ```
//!
//! The task: classify 16-dimensional Gaussian inputs into the 8 classes a fixed random
//! *teacher* network (16 → 32 tanh → 8, argmax) assigns them; fresh samples every step,
//! generated from `(seed, step, micro-batch, rank)`, so nothing is downloaded and a
//! resumed run sees the same data. The student is a three-layer MLP:
//!
//! | layer | computes | parameters (route) |
//! | --- | --- | --- |
//! | 0 | `a0 = tanh(W0·x + b0)` | `l0.weight` 64×16 (`muon`), `l0.bias` (`fsdp`) |
//! | 1 | `a1 = tanh(W1·(g ⊙ a0 / rms(a0)) + b1)` | `l1.norm` = `g` (`fsdp`), `l1.weight` 64×64 (`muon`), `l1.bias` (`adamw`) |
//! | 2 | `logits = Wh·a1 + bh`, cross-entropy | `head.weight` 8×64 (`sharded_adamw`), `head.bias` (`adamw`) |
//!
//! The hidden matrices are on Muon (weight decay 0.01), the head on AdamW (weight decay
//! 0.01), and the vectors on AdamW without weight decay, through two parameter groups
//! (`*.bias` and `*.norm`, the code form of `[[optimizer.group]]`). The learning rate
//! warms up linearly for a tenth of the steps and then decays along a cosine to a tenth
//! of its peak (`[schedule]`), and the reduced gradients are clipped by their global
//! norm (`[clip] max_norm`), which the early steps exceed.
//!
//! Per step, on a mesh `S×R` (HSDP 2×2 by default) with `M` micro-batches (the
//! replicate gate off on all but the last): for each micro-batch every rank runs the
//! forward pass of its own samples layer by layer, lowest first, on the full parameters
//! the session gathers for it (`Session::forward_ready`: a sharded route's shards
//! all-gathered, an owned route's tensor broadcast from its owner's shard column), then
//! the backward pass layer by layer, highest first, on the layer's full parameters
//! gathered again (`Session::backward_ready`), handing each layer's gradients to
//! `Session::grad_ready` as soon as they exist. A rank holds only the layer it runs. Each micro-batch's loss is divided by `M` (the session averages
//! over ranks, not over micro-batches), so the optimizers consume the gradient of the
//! mean loss over every sample of the step.
//!
//! It trains three times:
//!
//! - an independent single-process reference trainer, in this file, with the same model
//!   and data: it averages every rank's gradients itself (in f64, the no_sync reference),
//!   clips them, and runs its own warm-up + cosine schedule, AdamW and Muon
//!   (Newton–Schulz); the session's loss curve and global gradient norms must agree with
//!   the reference's to 1e-5 relative;
//! - the session run uninterrupted for `--steps` steps;
//! - the session run for half the steps, saved with `Session::save` into a temporary
//!   directory, then a fresh session (parameters zero) that loads it and runs the rest:
//!   every parameter and optimizer state and every loss must equal the uninterrupted
//!   run's bit for bit.
//!
//! Started as one process per rank (`overlap launch --nproc-per-node N -- train --mesh
//! ...`, or torchrun, Slurm, Open MPI) with `--backend cpu`, each process trains its own
//! rank over the CPU backend's links instead and checks it against every rank run in
//! one process, bit for bit (`examples/train_cpu/job.rs`).
//!
//! Without `--json` it prints one line per step (loss, the reference's loss, learning
//! rate, gradient norm, whether it clipped) and a summary; with `--json` one JSON line.
//! The exit status is 0 when the loss at least halved, both relative errors are within
//! 1e-5 and the resume was bit-exact, 1 otherwise.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use overlap::executor::{LrSchedule, ParamGroup, ScheduleKind};
use overlap::graph::{Buffer, ForwardSpec, OptimizerKind};
use overlap::{
    AdamwParams, ClipConfig, CpuBackend, ExecConfig, Gate, Mesh, MuonParams, NsDtype, OnNonFinite,
    ParamSpec, PlanSpec, Route, Session,
};
use serde::Serialize;

/// The command line.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "train",
    about = "Train a small MLP with overlap's gradient path, against an independent reference"
)]
pub struct Args {
    /// Training steps; the schedule decays over them, and the checkpoint is taken after
    /// half of them.
    #[arg(long, default_value_t = 50)]
    pub steps: u64,
    /// The mesh, SHARDxREPLICATE.
    #[arg(long, default_value = "2x2", value_parser = parse_mesh)]
    pub mesh: Mesh,
    /// Micro-batches per step (the replicate gate off on all but the last).
    #[arg(long, default_value_t = 4)]
    pub micro_batches: u32,
    /// Samples per rank and micro-batch.
    #[arg(long, default_value_t = 16)]
    pub batch: u32,
    /// Seed of the teacher, the initial parameters and the data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON line at the end instead of the per-step lines.
    #[arg(long)]
    pub json: bool,
    /// Where the model runs: `cpu` (every rank simulated in this process; started as
    /// one process per rank by `overlap launch`, this process's rank over the CPU
    /// backend's links: `examples/train_cpu/job.rs`) or `cuda` (this process is one rank
    /// on its GPU, started by `overlap launch`; needs the `cuda` feature): see
    /// `examples/train_cuda/model.rs`.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub backend: String,
    /// Multiplies the reference trainer's learning rates (1 in every real run): the test
    /// sets it a little off to show that the comparison notices so small a difference.
    #[arg(skip = 1.0)]
    pub reference_lr_scale: f64,
}

impl Default for Args {
    fn default() -> Self {
        Args::parse_from(["train"])
    }
}

fn parse_mesh(s: &str) -> Result<Mesh, String> {
    s.parse::<overlap::Mesh>().map_err(|e| e.to_string())
}

/// What a run found: the JSON line of `--json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Steps trained.
    pub steps: u64,
    /// The mesh, `SxR`.
    pub mesh: String,
    /// Micro-batches per step.
    pub micro_batches: u32,
    /// Samples per rank and micro-batch.
    pub batch: u32,
    /// The seed.
    pub seed: u64,
    /// The first step's loss (at the initial parameters): mean over ranks and
    /// micro-batches.
    pub loss_first: f64,
    /// The last step's loss (at the parameters after `steps − 1` updates).
    pub loss_last: f64,
    /// The reference trainer's last loss.
    pub reference_loss_last: f64,
    /// Worst `|loss − reference loss| / |reference loss|` over the steps.
    pub reference_rel_err: f64,
    /// Worst `|norm − reference norm| / reference norm` of the global gradient norm
    /// (before clipping) over the steps.
    pub clip_norm_rel_err: f64,
    /// The final parameters against the reference's: worst over parameters of
    /// `max |p − p_ref| / max |p_ref|`.
    pub param_rel_err: f64,
    /// The clipping threshold.
    pub max_norm: f32,
    /// Steps whose global norm exceeded `max_norm` (their gradients were scaled down).
    pub clipped_steps: u64,
    /// Whether half the steps, a checkpoint, a fresh session and the other half ended
    /// with the parameters, optimizer state and losses of the uninterrupted run, bit for
    /// bit.
    pub resume_bit_exact: bool,
    /// The loss at least halved, both relative errors are at most [`TOLERANCE`] and the
    /// resume is bit-exact.
    pub ok: bool,
}

/// The bound on the relative errors against the reference (f32 training).
pub const TOLERANCE: f64 = 1e-5;

type Error = Box<dyn std::error::Error>;

#[cfg(feature = "cuda")]
#[path = "train_cuda/model.rs"]
pub mod gpu;

#[path = "train_cpu/job.rs"]
pub mod cpu_job;

fn main() -> ExitCode {
    let args = Args::parse();
    if args.backend == "cuda" {
        #[cfg(feature = "cuda")]
        return gpu::main(&args);
        #[cfg(not(feature = "cuda"))]
        {
            eprintln!(
                "train: --backend cuda needs the `cuda` feature: cargo build --release --features cuda --example train"
            );
            return ExitCode::from(2);
        }
    }
    match overlap_dist::cpu::rank_env(args.mesh) {
        Ok(Some(env)) => return cpu_job::main(&args, env),
        Ok(None) => {}
        Err(e) => {
            eprintln!("train: {e}");
            return ExitCode::from(2);
        }
    }
    match run(&args) {
        Ok(report) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string(&report).expect("a report serialises")
                );
            }
            if report.ok {
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

/// Trains: the reference, the session uninterrupted, and the session resumed from a
/// mid-run checkpoint; prints progress unless `args.json`.
pub fn run(args: &Args) -> Result<Report, Error> {
    check_args(args)?;
    if args.mesh.world() > 64 {
        return Err(format!("--mesh {}: at most 64 ranks in this example", args.mesh).into());
    }
    let hyper = Hyper::new(args.steps);
    let task = Task::new(args);
    let log = !args.json;

    // The reference first, so that the session's progress lines can show its loss.
    let reference = reference_run(&task, &hyper, args.reference_lr_scale);

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let runs = runtime.block_on(session_runs(args, &task, &hyper, &reference))?;

    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(f64::MIN_POSITIVE);
    let curve = &runs.curve;
    let reference_rel_err = curve
        .iter()
        .zip(&reference.curve)
        .map(|(s, r)| rel(s.loss, r.loss))
        .fold(0.0, f64::max);
    let clip_norm_rel_err = curve
        .iter()
        .zip(&reference.curve)
        .map(|(s, r)| rel(s.grad_norm, r.grad_norm))
        .fold(0.0, f64::max);
    let param_rel_err = runs
        .params
        .iter()
        .zip(&reference.params)
        .map(|(p, r)| {
            let diff = p.iter().zip(r).map(|(a, b)| (a - b).abs());
            let scale = r.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
            f64::from(diff.fold(0.0f32, f32::max)) / f64::from(scale).max(f64::MIN_POSITIVE)
        })
        .fold(0.0, f64::max);
    let loss_first = curve[0].loss;
    let loss_last = curve[curve.len() - 1].loss;
    let clipped_steps = curve.iter().filter(|s| s.clipped).count() as u64;
    let ok = loss_last <= 0.5 * loss_first
        && reference_rel_err <= TOLERANCE
        && clip_norm_rel_err <= TOLERANCE
        && runs.resume_bit_exact;
    if log {
        println!(
            "loss {loss_first:.4} -> {loss_last:.4} ({:.1}%), {clipped_steps} of {} steps clipped at max_norm {}",
            100.0 * loss_last / loss_first,
            args.steps,
            hyper.max_norm
        );
        println!(
            "against the reference (relative): loss curve {reference_rel_err:.2e}, \
             gradient norm {clip_norm_rel_err:.2e}, final parameters {param_rel_err:.2e}"
        );
        println!("{}", if ok { "ok" } else { "FAILED" });
    }
    Ok(Report {
        steps: args.steps,
        mesh: args.mesh.to_string(),
        micro_batches: args.micro_batches,
        batch: args.batch,
        seed: args.seed,
        loss_first,
        loss_last,
        reference_loss_last: reference.curve[reference.curve.len() - 1].loss,
        reference_rel_err,
        clip_norm_rel_err,
        param_rel_err,
        max_norm: hyper.max_norm,
        clipped_steps,
        resume_bit_exact: runs.resume_bit_exact,
        ok,
    })
}

/// The flags both backends need in range.
fn check_args(args: &Args) -> Result<(), Error> {
    if args.steps < 2 || args.micro_batches == 0 || args.batch == 0 {
        return Err("--steps must be at least 2, --micro-batches and --batch at least 1".into());
    }
    Ok(())
}

/// What the session runs found.
struct SessionRuns {
    /// The uninterrupted run's steps.
    curve: Vec<StepLog>,
    /// Its final parameters.
    params: Params,
    /// Whether the resumed run ended bit-exact with it.
    resume_bit_exact: bool,
}

/// The session uninterrupted, then half the steps, a checkpoint, a fresh session that
/// loads it, and the other half.
async fn session_runs(
    args: &Args,
    task: &Task,
    hyper: &Hyper,
    reference: &Reference,
) -> Result<SessionRuns, Error> {
    let log = !args.json;
    let mut straight = new_session(task, hyper)?;
    straight.init_params(|i, _| task.init[i as usize].clone())?;
    let curve = train(&mut straight, task, hyper, args.steps, Some(reference), log).await?;

    let half = args.steps / 2;
    let dir = Scratch::new()?;
    let mut first = new_session(task, hyper)?;
    first.init_params(|i, _| task.init[i as usize].clone())?;
    let mut resumed = train(&mut first, task, hyper, half, None, false).await?;
    let saved = first.save(&dir.0)?;
    drop(first);
    // Parameters start at zero: everything must come from the checkpoint.
    let mut second = new_session(task, hyper)?;
    let loaded = second.load(&dir.0)?;
    if loaded.step != half || second.steps_done() != half {
        return Err(format!("loaded step {}, expected {half}", loaded.step).into());
    }
    let rest = args.steps - half;
    resumed.extend(train(&mut second, task, hyper, rest, None, false).await?);
    let losses = |c: &[StepLog]| c.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>();
    let resume_bit_exact =
        held_state(&straight)? == held_state(&second)? && losses(&curve) == losses(&resumed);
    if log {
        println!(
            "resume: {half} steps, saved {}, a fresh session loaded it and ran {rest} more: {}",
            saved.display(),
            if resume_bit_exact {
                "bit-exact with the uninterrupted run"
            } else {
                "DIFFERS from the uninterrupted run"
            }
        );
    }
    Ok(SessionRuns {
        params: full_params(&straight)?,
        curve,
        resume_bit_exact,
    })
}

// ---------------------------------------------------------------------------------------
// The optimizer settings, given to the session and, separately, to the reference.

/// The training hyper-parameters.
struct Hyper {
    /// Peak learning rates.
    adamw_lr: f32,
    muon_lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    momentum: f32,
    ns_steps: u32,
    /// Weight decay of the matrices (Muon's and the head's); vectors get none.
    weight_decay: f32,
    warmup_steps: u64,
    total_steps: u64,
    final_lr_frac: f64,
    max_norm: f32,
}

impl Hyper {
    fn new(steps: u64) -> Hyper {
        Hyper {
            adamw_lr: 0.01,
            muon_lr: 0.03,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            momentum: 0.95,
            ns_steps: 5,
            weight_decay: 0.01,
            warmup_steps: (steps / 10).max(1),
            total_steps: steps,
            final_lr_frac: 0.1,
            max_norm: 0.6,
        }
    }

    /// The session's settings: base AdamW and Muon, the groups of the vectors, the
    /// schedule and the clipping.
    fn exec_config(&self) -> ExecConfig {
        let no_decay = |pattern: &str| ParamGroup::new(pattern).with_weight_decay(Some(0.0));
        ExecConfig::default()
            .with_adamw(
                AdamwParams::default()
                    .with_lr(self.adamw_lr)
                    .with_beta1(self.beta1)
                    .with_beta2(self.beta2)
                    .with_eps(self.eps)
                    .with_weight_decay(self.weight_decay),
            )
            .with_muon(
                MuonParams::default()
                    .with_lr(self.muon_lr)
                    .with_momentum(self.momentum)
                    .with_ns_steps(self.ns_steps)
                    .with_weight_decay(self.weight_decay)
                    // Full f32: the GPU run is checked against the CPU backend's f64
                    // Newton–Schulz within 1e-4.
                    .with_ns_dtype(NsDtype::F32),
            )
            .with_groups(vec![no_decay("*.bias"), no_decay("*.norm")])
            .with_schedule(
                LrSchedule::decay(ScheduleKind::Cosine, self.total_steps, self.final_lr_frac)
                    .with_warmup(self.warmup_steps),
            )
            .with_clip(
                ClipConfig::default()
                    .with_max_norm(Some(self.max_norm))
                    .with_on_nonfinite(OnNonFinite::Error),
            )
    }
}

// ---------------------------------------------------------------------------------------
// The model: parameters, forward and backward, in f32.

/// Input features, hidden width, classes, the teacher's hidden width.
const D: usize = 16;
const H: usize = 64;
const C: usize = 8;
const TEACHER_H: usize = 32;
/// RMS-norm epsilon.
const NORM_EPS: f32 = 1e-5;

/// Parameter ids: the order of [`param_specs`].
const W0: usize = 0;
const B0: usize = 1;
const NORM: usize = 2;
const W1: usize = 3;
const B1: usize = 4;
const HEAD_W: usize = 5;
const HEAD_B: usize = 6;
const PARAMS: usize = 7;
/// Each parameter's layer, by id (as [`param_specs`] says).
const LAYER_OF: [u32; PARAMS] = [0, 0, 1, 1, 1, 2, 2];

/// The parameters, their routes and layers (backward makes the highest layer first).
fn param_specs() -> Vec<ParamSpec> {
    let (d, h, c) = (D as u64, H as u64, C as u64);
    vec![
        ParamSpec::new("l0.weight", [h, d], Route::Muon, 0),
        ParamSpec::new("l0.bias", [h], Route::Fsdp, 0),
        ParamSpec::new("l1.norm", [h], Route::Fsdp, 1),
        ParamSpec::new("l1.weight", [h, h], Route::Muon, 1),
        ParamSpec::new("l1.bias", [h], Route::Adamw, 1),
        ParamSpec::new("head.weight", [c, h], Route::ShardedAdamw, 2),
        ParamSpec::new("head.bias", [c], Route::Adamw, 2),
    ]
}

/// Every parameter's full tensor, by id.
type Params = Vec<Vec<f32>>;

/// The initial parameters: matrices `N(0, 1/fan_in)` (the head 0.1 times that), biases
/// 0, the norm's gain 1.
fn init_params(seed: u64) -> Params {
    let mut rng = Rng::stream(seed, &[1]);
    let mut gauss =
        |n: usize, std: f64| -> Vec<f32> { (0..n).map(|_| (rng.normal() * std) as f32).collect() };
    let mut p = vec![Vec::new(); PARAMS];
    p[W0] = gauss(H * D, (1.0 / D as f64).sqrt());
    p[B0] = vec![0.0; H];
    p[NORM] = vec![1.0; H];
    p[W1] = gauss(H * H, (1.0 / H as f64).sqrt());
    p[B1] = vec![0.0; H];
    p[HEAD_W] = gauss(C * H, 0.1 * (1.0 / H as f64).sqrt());
    p[HEAD_B] = vec![0.0; C];
    p
}

/// `out[i] = Σ_j w[i][j]·x[j] + b[i]` for a row-major `out.len() × x.len()` matrix.
fn affine(w: &[f32], b: &[f32], x: &[f32], out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let row = &w[i * x.len()..(i + 1) * x.len()];
        *o = row.iter().zip(x).map(|(a, b)| a * b).sum::<f32>() + b[i];
    }
}

/// One micro-batch of one rank.
struct Batch {
    /// `batch × D` inputs.
    x: Vec<f32>,
    labels: Vec<usize>,
}

/// What the forward pass keeps for the backward pass, per sample.
struct Activations {
    a0: Vec<f32>,
    /// `1 / rms(a0)`.
    inv_rms: Vec<f32>,
    n: Vec<f32>,
    a1: Vec<f32>,
    probs: Vec<f32>,
}

/// The forward pass of a batch: activations and the mean cross-entropy loss.
fn forward(p: &Params, batch: &Batch) -> (Activations, f64) {
    let mut pass = Forward::new(batch);
    for layer in 0..3 {
        pass.layer(layer, p);
    }
    pass.finish()
}

/// The forward pass of one batch, one layer at a time from the bottom, as a trainer
/// runs it while the session hands it each layer's full parameters: [`Forward::layer`]
/// reads only that layer's parameters.
struct Forward<'a> {
    batch: &'a Batch,
    act: Activations,
    /// Sum of the samples' losses.
    loss: f64,
    /// The layer [`Forward::layer`] runs next.
    next: u32,
}

impl<'a> Forward<'a> {
    fn new(batch: &'a Batch) -> Forward<'a> {
        let b = batch.labels.len();
        Forward {
            batch,
            act: Activations {
                a0: vec![0.0; b * H],
                inv_rms: vec![0.0; b],
                n: vec![0.0; b * H],
                a1: vec![0.0; b * H],
                probs: vec![0.0; b * C],
            },
            loss: 0.0,
            next: 0,
        }
    }

    /// Runs `layer` (0, 1, 2 in order) on every sample, reading `p`'s entries of that
    /// layer's parameters only.
    fn layer(&mut self, layer: u32, p: &Params) {
        assert_eq!(
            layer, self.next,
            "the forward runs from the bottom layer up"
        );
        self.next += 1;
        let act = &mut self.act;
        for s in 0..self.batch.labels.len() {
            match layer {
                0 => {
                    // a0 = tanh(W0·x + b0), and 1 / rms(a0) for the norm.
                    let x = &self.batch.x[s * D..(s + 1) * D];
                    let a0 = &mut act.a0[s * H..(s + 1) * H];
                    affine(&p[W0], &p[B0], x, a0);
                    a0.iter_mut().for_each(|v| *v = v.tanh());
                    let ms = a0.iter().map(|v| v * v).sum::<f32>() / H as f32;
                    act.inv_rms[s] = 1.0 / (ms + NORM_EPS).sqrt();
                }
                1 => {
                    // n = g ⊙ a0 / rms(a0), a1 = tanh(W1·n + b1).
                    let inv = act.inv_rms[s];
                    let a0 = &act.a0[s * H..(s + 1) * H];
                    let n = &mut act.n[s * H..(s + 1) * H];
                    for ((n, &a), &g) in n.iter_mut().zip(a0.iter()).zip(&p[NORM]) {
                        *n = g * a * inv;
                    }
                    let a1 = &mut act.a1[s * H..(s + 1) * H];
                    affine(&p[W1], &p[B1], n, a1);
                    a1.iter_mut().for_each(|v| *v = v.tanh());
                }
                2 => {
                    // logits = Wh·a1 + bh, softmax, cross-entropy.
                    let a1 = &act.a1[s * H..(s + 1) * H];
                    let mut logits = [0.0f32; C];
                    affine(&p[HEAD_W], &p[HEAD_B], a1, &mut logits);
                    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let probs = &mut act.probs[s * C..(s + 1) * C];
                    for (q, &l) in probs.iter_mut().zip(&logits) {
                        *q = (l - max).exp();
                    }
                    let z: f32 = probs.iter().sum();
                    probs.iter_mut().for_each(|q| *q /= z);
                    // The loss in f64 from the f32 logits: log-sum-exp − the label's logit.
                    let lse = f64::from(max)
                        + logits
                            .iter()
                            .map(|&l| (f64::from(l) - f64::from(max)).exp())
                            .sum::<f64>()
                            .ln();
                    self.loss += lse - f64::from(logits[self.batch.labels[s]]);
                }
                _ => unreachable!("the model has three layers"),
            }
        }
    }

    /// The activations and the mean loss, once every layer ran.
    fn finish(self) -> (Activations, f64) {
        assert_eq!(self.next, 3, "the forward runs every layer");
        let b = self.batch.labels.len();
        (self.act, self.loss / b as f64)
    }
}

/// The backward pass of one batch, one layer at a time from the top, as a trainer's
/// autograd produces it: [`Backward::layer`] returns that layer's parameter gradients,
/// reading only that layer's parameters.
struct Backward<'a> {
    batch: &'a Batch,
    act: Activations,
    /// The loss's gradient with respect to the next layer's output, per sample.
    upstream: Vec<f32>,
    /// The layer [`Backward::layer`] makes next.
    next: Option<u32>,
}

impl<'a> Backward<'a> {
    /// The backward pass of `forward`'s batch for the loss `scale · Σ_samples loss`
    /// (`scale = 1 / (batch · micro-batches)`: the micro-batch's mean loss divided by the
    /// number of micro-batches).
    fn new(batch: &'a Batch, act: Activations, scale: f32) -> Backward<'a> {
        // d loss / d logits = (softmax − one-hot) · scale.
        let mut upstream = act.probs.clone();
        for (s, &label) in batch.labels.iter().enumerate() {
            upstream[s * C + label] -= 1.0;
        }
        upstream.iter_mut().for_each(|g| *g *= scale);
        Backward {
            batch,
            act,
            upstream,
            next: Some(2),
        }
    }

    /// The gradients of `layer`'s parameters `(id, gradient)`; layers must come 2, 1, 0.
    /// `p` needs the layer's parameters only.
    fn layer(&mut self, layer: u32, p: &Params) -> Vec<(usize, Vec<f32>)> {
        assert_eq!(
            Some(layer),
            self.next,
            "backward runs from the top layer down"
        );
        self.next = layer.checked_sub(1);
        let b = self.batch.labels.len();
        match layer {
            2 => {
                // logits = Wh·a1 + bh.
                let dl = &self.upstream;
                let (w, bias) = outer_grads(dl, &self.act.a1, C, H, b);
                let da1 = transposed_product(&p[HEAD_W], dl, C, H, b);
                self.upstream = da1;
                vec![(HEAD_W, w), (HEAD_B, bias)]
            }
            1 => {
                // a1 = tanh(z1), z1 = W1·n + b1, n = g ⊙ a0 · inv_rms.
                let mut dz1 = std::mem::take(&mut self.upstream);
                for (d, &a) in dz1.iter_mut().zip(&self.act.a1) {
                    *d *= 1.0 - a * a;
                }
                let (w, bias) = outer_grads(&dz1, &self.act.n, H, H, b);
                let dn = transposed_product(&p[W1], &dz1, H, H, b);
                let mut gain = vec![0.0f32; H];
                let mut da0 = vec![0.0f32; b * H];
                for s in 0..b {
                    let dn = &dn[s * H..(s + 1) * H];
                    let a0 = &self.act.a0[s * H..(s + 1) * H];
                    let inv = self.act.inv_rms[s];
                    // dn/da: g_i·(δ_ij·inv − a_i·a_j·inv³/H).
                    let mut dot = 0.0f32;
                    for i in 0..H {
                        gain[i] += dn[i] * a0[i] * inv;
                        dot += dn[i] * p[NORM][i] * a0[i];
                    }
                    let k = dot * inv * inv * inv / H as f32;
                    for i in 0..H {
                        da0[s * H + i] = dn[i] * p[NORM][i] * inv - a0[i] * k;
                    }
                }
                self.upstream = da0;
                vec![(NORM, gain), (W1, w), (B1, bias)]
            }
            0 => {
                // a0 = tanh(W0·x + b0).
                let mut dz0 = std::mem::take(&mut self.upstream);
                for (d, &a) in dz0.iter_mut().zip(&self.act.a0) {
                    *d *= 1.0 - a * a;
                }
                let (w, bias) = outer_grads(&dz0, &self.batch.x, H, D, b);
                vec![(W0, w), (B0, bias)]
            }
            _ => unreachable!("the model has three layers"),
        }
    }
}

/// `(Σ_s dy_s ⊗ x_s, Σ_s dy_s)`: the gradients of `W` (`rows × cols`) and `b` of
/// `y = W·x + b` over `batch` samples.
fn outer_grads(
    dy: &[f32],
    x: &[f32],
    rows: usize,
    cols: usize,
    batch: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut w = vec![0.0f32; rows * cols];
    let mut b = vec![0.0f32; rows];
    for s in 0..batch {
        let dy = &dy[s * rows..(s + 1) * rows];
        let x = &x[s * cols..(s + 1) * cols];
        for i in 0..rows {
            b[i] += dy[i];
            for (w, &x) in w[i * cols..(i + 1) * cols].iter_mut().zip(x) {
                *w += dy[i] * x;
            }
        }
    }
    (w, b)
}

/// `Wᵀ·dy_s` for every sample: the gradient of `y = W·x + b` with respect to `x`.
fn transposed_product(w: &[f32], dy: &[f32], rows: usize, cols: usize, batch: usize) -> Vec<f32> {
    let mut dx = vec![0.0f32; batch * cols];
    for s in 0..batch {
        let dx = &mut dx[s * cols..(s + 1) * cols];
        for i in 0..rows {
            let g = dy[s * rows + i];
            for (d, &w) in dx.iter_mut().zip(&w[i * cols..(i + 1) * cols]) {
                *d += w * g;
            }
        }
    }
    dx
}

// ---------------------------------------------------------------------------------------
// The task: a teacher network labels Gaussian inputs.

/// A small deterministic generator (SplitMix64) with Gaussian samples.
struct Rng(u64);

impl Rng {
    /// A generator for one purpose, from the seed and the purpose's coordinates.
    fn stream(seed: u64, parts: &[u64]) -> Rng {
        let mut r = Rng(seed);
        for &p in parts {
            r.0 ^= p.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            r.0 = r.next_u64();
        }
        r
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// The learning problem and the run's shape.
struct Task {
    mesh: Mesh,
    micro_batches: u32,
    batch: usize,
    seed: u64,
    /// The teacher: `D → TEACHER_H` tanh `→ C`, argmax.
    teacher: [Vec<f32>; 4],
    /// The student's initial parameters.
    init: Params,
}

impl Task {
    fn new(args: &Args) -> Task {
        let mut rng = Rng::stream(args.seed, &[0]);
        let mut gauss = |n: usize, std: f64| -> Vec<f32> {
            (0..n).map(|_| (rng.normal() * std) as f32).collect()
        };
        let teacher = [
            gauss(TEACHER_H * D, 2.0 / (D as f64).sqrt()),
            gauss(TEACHER_H, 0.5),
            gauss(C * TEACHER_H, 3.0 / (TEACHER_H as f64).sqrt()),
            gauss(C, 0.5),
        ];
        Task {
            mesh: args.mesh,
            micro_batches: args.micro_batches,
            batch: args.batch as usize,
            seed: args.seed,
            teacher,
            init: init_params(args.seed),
        }
    }

    fn label(&self, x: &[f32]) -> usize {
        let [w1, b1, w2, b2] = &self.teacher;
        let mut h = [0.0f32; TEACHER_H];
        affine(w1, b1, x, &mut h);
        h.iter_mut().for_each(|v| *v = v.tanh());
        let mut y = [0.0f32; C];
        affine(w2, b2, &h, &mut y);
        (0..C).fold(0, |best, c| if y[c] > y[best] { c } else { best })
    }

    /// The samples of `rank` in micro-batch `micro` of 1-based step `step`.
    fn batch(&self, step: u64, micro: u32, rank: u32) -> Batch {
        let mut rng = Rng::stream(self.seed, &[2, step, u64::from(micro), u64::from(rank)]);
        let x: Vec<f32> = (0..self.batch * D).map(|_| rng.normal() as f32).collect();
        let labels = x.chunks_exact(D).map(|x| self.label(x)).collect();
        Batch { x, labels }
    }

    /// The loss scale of one micro-batch's samples: its mean, divided by the number of
    /// micro-batches.
    fn scale(&self) -> f32 {
        1.0 / (self.batch as f32 * self.micro_batches as f32)
    }

    /// The gate of micro-batch `m`: the replicate gate off on all but the last.
    fn gate(&self, m: u32) -> Gate {
        if m + 1 == self.micro_batches {
            Gate::On
        } else {
            Gate::ReplicateOff
        }
    }
}

// ---------------------------------------------------------------------------------------
// The session side.

/// One step as a run saw it.
#[derive(Debug, Clone)]
struct StepLog {
    /// Mean loss over ranks and micro-batches, at the parameters before the step.
    loss: f64,
    /// Each rank's mean loss over its micro-batches (a run of one rank per process
    /// compares its rank's).
    rank_loss: Vec<f64>,
    /// The global norm of the reduced gradients, before clipping.
    grad_norm: f64,
    clipped: bool,
}

/// The session's plan: the model's parameters on the mesh, the global norm for the
/// clipping, and each layer's full parameters gathered before its forward and again
/// before its backward, one layer ahead (`[forward]`'s defaults).
fn plan_spec(task: &Task) -> PlanSpec {
    PlanSpec::new(task.mesh, param_specs())
        .with_grad_norm(true)
        .with_forward(Some(ForwardSpec::default()))
}

fn new_session(task: &Task, hyper: &Hyper) -> Result<Session<CpuBackend>, Error> {
    let backend = Arc::new(CpuBackend::new(task.mesh));
    Ok(Session::new(plan_spec(task), backend, hyper.exec_config())?)
}

/// Runs `steps` steps numbered on from the session's step counter.
async fn train(
    s: &mut Session<CpuBackend>,
    task: &Task,
    hyper: &Hyper,
    steps: u64,
    reference: Option<&Reference>,
    log: bool,
) -> Result<Vec<StepLog>, Error> {
    let world = task.mesh.world();
    // The ranks this session drives: every rank in one process, one in a job of one
    // process per rank (`cpu_job`).
    let locals = s.local_ranks();
    let mut curve = Vec::new();
    for _ in 0..steps {
        let step = s.steps_done() + 1;
        let mut loss = 0.0f64;
        let mut rank_loss = vec![0.0f64; world as usize];
        // What each rank holds of the full parameters: only the layer it runs, as the
        // session gathers it (FSDP's all-gather before each layer), dropped after.
        let mut held: Vec<Params> = vec![vec![Vec::new(); PARAMS]; world as usize];
        let drop_layer = |held: &mut Vec<Params>, layer: u32| {
            for h in held.iter_mut() {
                for (id, p) in h.iter_mut().enumerate() {
                    if LAYER_OF[id] == layer {
                        *p = Vec::new();
                    }
                }
            }
        };
        for m in 0..task.micro_batches {
            s.begin_micro_batch(task.gate(m)).await?;
            let batches: Vec<Batch> = locals.iter().map(|&r| task.batch(step, m, r)).collect();
            let mut forwards: Vec<Forward> = batches.iter().map(Forward::new).collect();
            for layer in s.forward_layers() {
                // The layer's full parameters on every rank (a slice lives for the call),
                // then every rank's forward of the layer.
                s.forward_ready(layer, |rank, param, full| {
                    held[rank as usize][param as usize] = full.to_vec();
                })
                .await?;
                for (&rank, pass) in locals.iter().zip(forwards.iter_mut()) {
                    pass.layer(layer, &held[rank as usize]);
                }
                drop_layer(&mut held, layer);
            }
            let mut passes: Vec<Backward> = forwards
                .into_iter()
                .zip(&batches)
                .zip(&locals)
                .map(|((pass, batch), &rank)| {
                    let (act, l) = pass.finish();
                    loss += l;
                    rank_loss[rank as usize] += l / f64::from(task.micro_batches);
                    Backward::new(batch, act, task.scale())
                })
                .collect();
            for layer in s.layers() {
                // The layer's full parameters again, every rank's backward of the layer,
                // then its gradients go in.
                s.backward_ready(layer, |rank, param, full| {
                    held[rank as usize][param as usize] = full.to_vec();
                })
                .await?;
                let mut grads: Vec<Vec<Option<Vec<f32>>>> =
                    vec![vec![None; PARAMS]; world as usize];
                for (&rank, pass) in locals.iter().zip(passes.iter_mut()) {
                    for (id, g) in pass.layer(layer, &held[rank as usize]) {
                        grads[rank as usize][id] = Some(g);
                    }
                }
                drop_layer(&mut held, layer);
                s.grad_ready(layer, |rank, param, out| {
                    let g = grads[rank as usize][param as usize]
                        .as_ref()
                        .expect("backward made every parameter of the layer");
                    out.copy_from_slice(g);
                })
                .await?;
            }
        }
        let report = s.step().await?;
        let grad_norm = report
            .grad_norm
            .ok_or("the plan computes the global norm")?;
        let entry = StepLog {
            // Over the ranks this session drives: every rank in one process.
            loss: loss / (locals.len() as f64 * f64::from(task.micro_batches)),
            rank_loss,
            grad_norm,
            clipped: f64::from(hyper.max_norm) / (grad_norm + 1e-6) < 1.0,
        };
        if log {
            let rate = |kind: OptimizerKind| {
                report
                    .lr
                    .iter()
                    .find(|g| g.group.is_none() && g.optimizer == kind)
                    .map_or(f64::NAN, |g| g.lr)
            };
            let reference = reference
                .and_then(|r| r.curve.get(curve.len()))
                .map_or(String::new(), |r| format!(" (reference {:.6})", r.loss));
            println!(
                "step {:>3}/{}  loss {:.6}{reference}  lr x{:.3} (muon {:.2e}, adamw {:.2e})  grad_norm {:.4e}{}",
                report.step,
                hyper.total_steps,
                entry.loss,
                report.lr_factor,
                rate(OptimizerKind::Muon),
                rate(OptimizerKind::Adamw),
                entry.grad_norm,
                if entry.clipped { "  clipped" } else { "" }
            );
        }
        curve.push(entry);
    }
    Ok(curve)
}

/// Every parameter's full tensor, from the pieces the session's ranks hold: each shard
/// of a sharded route from the ranks of its shard index, an owned route's whole tensor
/// from its owner's shard column. Every replica of a piece must hold the same bits.
fn full_params(s: &Session<CpuBackend>) -> Result<Params, Error> {
    let mesh = s.spec().mesh;
    let mut out = Vec::new();
    for (id, p) in s.params().iter().enumerate() {
        let numel = p.spec.numel() as usize;
        let mut full = vec![0.0f32; numel];
        let mut seen = vec![false; numel];
        for rank in s.local_ranks() {
            let Some(piece) = s.param_values(rank, id as u32)? else {
                continue;
            };
            let c = mesh.coord(rank);
            if p.owner.is_some_and(|o| o.shard != c.shard) {
                return Err(
                    format!("rank {rank} holds `{}` off its owner's column", p.spec.name).into(),
                );
            }
            let range = p.spec.shard_range(mesh.shard, c.shard);
            let range = range.start as usize..range.end as usize;
            if piece.len() != range.len() {
                return Err(format!(
                    "rank {rank}: `{}` piece of {} elements, expected {}",
                    p.spec.name,
                    piece.len(),
                    range.len()
                )
                .into());
            }
            for (i, &v) in range.zip(&piece) {
                if seen[i] && full[i].to_bits() != v.to_bits() {
                    return Err(format!(
                        "replicas of `{}` disagree at element {i} (rank {rank})",
                        p.spec.name
                    )
                    .into());
                }
                full[i] = v;
                seen[i] = true;
            }
        }
        if let Some(i) = seen.iter().position(|&x| !x) {
            return Err(format!("no rank holds element {i} of `{}`", p.spec.name).into());
        }
        out.push(full);
    }
    Ok(out)
}

/// Every local rank's parameter pieces and optimizer states, as bits.
fn held_state(s: &Session<CpuBackend>) -> Result<Vec<Option<Vec<u32>>>, Error> {
    let mut out = Vec::new();
    for rank in s.local_ranks() {
        out.extend(rank_state(s, rank)?);
    }
    Ok(out)
}

/// One rank's parameter pieces and optimizer states, as bits.
fn rank_state(s: &Session<CpuBackend>, rank: u32) -> Result<Vec<Option<Vec<u32>>>, Error> {
    let mut out = Vec::new();
    for param in 0..s.params().len() as u32 {
        for buffer in [Buffer::Param { param }, Buffer::OptState { param }] {
            out.push(s.read_buffer(rank, buffer)?.map(|v| bits32(&v)));
        }
    }
    Ok(out)
}

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A temporary checkpoint root under `std::env::temp_dir()`, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Scratch, Error> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!(
            "overlap-train-{}-{nanos}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------
// The reference: one process, the same model and data, its own averaging, clipping,
// schedule and optimizers, written from the formulas (nothing of `overlap` is used).

/// The reference's run: its loss curve and its final parameters.
struct Reference {
    curve: Vec<StepLog>,
    params: Params,
}

/// Which optimizer a parameter gets in the reference, and whether it decays: Muon for
/// the hidden matrices, AdamW for the rest, no weight decay for vectors.
fn reference_optimizer(id: usize) -> (bool, bool) {
    let muon = id == W0 || id == W1;
    let decays = id == W0 || id == W1 || id == HEAD_W;
    (muon, decays)
}

fn reference_run(task: &Task, hyper: &Hyper, lr_scale: f64) -> Reference {
    let mut params = task.init.clone();
    let mut m: Params = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut v: Params = m.clone();
    let mut momentum: Params = m.clone();
    let world = task.mesh.world();
    let mut curve = Vec::new();
    for step in 1..=hyper.total_steps {
        // Every rank's gradient, summed over its micro-batches, averaged over the ranks:
        // in f64, rounded to f32 once.
        let mut sum: Vec<Vec<f64>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        let mut loss = 0.0f64;
        for micro in 0..task.micro_batches {
            for rank in 0..world {
                let batch = task.batch(step, micro, rank);
                let (act, l) = forward(&params, &batch);
                loss += l;
                let mut pass = Backward::new(&batch, act, task.scale());
                for layer in [2, 1, 0] {
                    for (id, g) in pass.layer(layer, &params) {
                        sum[id]
                            .iter_mut()
                            .zip(&g)
                            .for_each(|(s, &g)| *s += f64::from(g));
                    }
                }
            }
        }
        let mut grads: Params = sum
            .iter()
            .map(|s| s.iter().map(|&x| (x / f64::from(world)) as f32).collect())
            .collect();
        // Global-norm clipping: scale by min(1, max_norm / (‖g‖ + 1e-6)).
        let norm = grads
            .iter()
            .flatten()
            .map(|&g| f64::from(g).powi(2))
            .sum::<f64>()
            .sqrt();
        let coef = f64::from(hyper.max_norm) / (norm + 1e-6);
        let clipped = coef < 1.0;
        if clipped {
            let coef = coef as f32;
            grads.iter_mut().flatten().for_each(|g| *g *= coef);
        }
        // Warm-up, then cosine decay to the floor.
        let lr_factor = {
            let (w, t) = (hyper.warmup_steps, hyper.total_steps);
            if step <= w {
                step as f64 / w as f64
            } else if step >= t {
                hyper.final_lr_frac
            } else {
                let progress = (step - w) as f64 / (t - w) as f64;
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                hyper.final_lr_frac + (1.0 - hyper.final_lr_frac) * cosine
            }
        };
        for id in 0..PARAMS {
            let (muon, decays) = reference_optimizer(id);
            let wd = if decays { hyper.weight_decay } else { 0.0 };
            if muon {
                let lr = (f64::from(hyper.muon_lr) * lr_scale * lr_factor) as f32;
                let (rows, cols) = if id == W0 { (H, D) } else { (H, H) };
                reference_muon(
                    &mut params[id],
                    &grads[id],
                    &mut momentum[id],
                    rows,
                    cols,
                    lr,
                    wd,
                    hyper,
                );
            } else {
                let lr = (f64::from(hyper.adamw_lr) * lr_scale * lr_factor) as f32;
                reference_adamw(
                    &mut params[id],
                    &grads[id],
                    &mut m[id],
                    &mut v[id],
                    lr,
                    wd,
                    step,
                    hyper,
                );
            }
        }
        curve.push(StepLog {
            loss: loss / f64::from(world * task.micro_batches),
            rank_loss: Vec::new(),
            grad_norm: norm,
            clipped,
        });
    }
    Reference { curve, params }
}

/// AdamW with decoupled weight decay and bias correction; moments stored in f32, the
/// update computed in f64 from the unrounded moments.
#[allow(clippy::too_many_arguments)]
fn reference_adamw(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    lr: f32,
    wd: f32,
    step: u64,
    hyper: &Hyper,
) {
    let lr = f64::from(lr);
    let (b1, b2, eps) = (
        f64::from(hyper.beta1),
        f64::from(hyper.beta2),
        f64::from(hyper.eps),
    );
    let t = step as i32;
    let correct1 = 1.0 - b1.powi(t);
    let correct2 = 1.0 - b2.powi(t);
    for i in 0..p.len() {
        let gi = f64::from(g[i]);
        let mi = b1 * f64::from(m[i]) + (1.0 - b1) * gi;
        let vi = b2 * f64::from(v[i]) + (1.0 - b2) * gi * gi;
        m[i] = mi as f32;
        v[i] = vi as f32;
        let decayed = f64::from(p[i]) * (1.0 - lr * f64::from(wd));
        p[i] = (decayed - lr * (mi / correct1) / ((vi / correct2).sqrt() + eps)) as f32;
    }
}

/// Muon: momentum with a Nesterov look-ahead, orthogonalised by Newton–Schulz, scaled
/// by `0.2·sqrt(max(rows, cols))`, with decoupled weight decay.
#[allow(clippy::too_many_arguments)]
fn reference_muon(
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    rows: usize,
    cols: usize,
    lr: f32,
    wd: f32,
    hyper: &Hyper,
) {
    let mu = f64::from(hyper.momentum);
    let mut nesterov = vec![0.0f32; p.len()];
    for i in 0..p.len() {
        buf[i] = (mu * f64::from(buf[i]) + f64::from(g[i])) as f32;
        nesterov[i] = (f64::from(g[i]) + mu * f64::from(buf[i])) as f32;
    }
    let o = orthogonalise(&nesterov, rows, cols, hyper.ns_steps);
    let lr = f64::from(lr);
    let shrink = 1.0 - lr * f64::from(wd);
    let step = lr * 0.2 * (rows.max(cols) as f64).sqrt();
    for i in 0..p.len() {
        p[i] = (f64::from(p[i]) * shrink - step * f64::from(o[i])) as f32;
    }
}

/// Quintic Newton–Schulz in f64: `X ← a·X + (b·XXᵀ + c·(XXᵀ)²)·X` on the wide
/// orientation of `G / (‖G‖_F + 1e-7)`, with `(a, b, c) = (3.4445, −4.7750, 2.0315)`.
fn orthogonalise(g: &[f32], rows: usize, cols: usize, steps: u32) -> Vec<f32> {
    let (a, b, c) = (3.4445f64, -4.7750f64, 2.0315f64);
    let tall = rows > cols;
    let (r, k) = if tall { (cols, rows) } else { (rows, cols) };
    // x[i][j] of the wide (r × k) matrix.
    let at = |i: usize, j: usize| {
        if tall {
            g[j * cols + i]
        } else {
            g[i * cols + j]
        }
    };
    let mut x: Vec<f64> = (0..r * k).map(|e| f64::from(at(e / k, e % k))).collect();
    let frob = x.iter().map(|v| v * v).sum::<f64>().sqrt();
    x.iter_mut().for_each(|v| *v /= frob + 1e-7);
    for _ in 0..steps {
        // s = X·Xᵀ (r × r); poly = b·s + c·s·s; X = a·X + poly·X.
        let mut s = vec![0.0f64; r * r];
        for i in 0..r {
            for j in 0..r {
                s[i * r + j] = (0..k).map(|l| x[i * k + l] * x[j * k + l]).sum();
            }
        }
        let mut poly = vec![0.0f64; r * r];
        for i in 0..r {
            for j in 0..r {
                let ss: f64 = (0..r).map(|l| s[i * r + l] * s[l * r + j]).sum();
                poly[i * r + j] = b * s[i * r + j] + c * ss;
            }
        }
        let mut next = vec![0.0f64; r * k];
        for i in 0..r {
            for j in 0..k {
                let px: f64 = (0..r).map(|l| poly[i * r + l] * x[l * k + j]).sum();
                next[i * k + j] = a * x[i * k + j] + px;
            }
        }
        x = next;
    }
    // Back to rows × cols.
    let mut out = vec![0.0f32; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            let (wi, wj) = if tall { (j, i) } else { (i, j) };
            out[i * cols + j] = x[wi * k + wj] as f32;
        }
    }
    out
}
