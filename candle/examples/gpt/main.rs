//! A small GPT trained character-level with candle + `overlap`, data-parallel over a mesh.
//!
//! ```sh
//! cargo run --release -p overlap-candle --example gpt -- --mesh 2x2 --micro-batches 2 --steps 300
//! cargo run --release -p overlap-candle --example gpt -- --steps 30 --json
//! cargo run --release -p overlap-candle --example gpt -- --bench
//! ```
//!
//! Every rank of the mesh runs in this process (the CPU backend): rank `r`'s micro-batch
//! `m` of step `t` is its own slice of the corpus (the repository's documentation). Beside
//! it, unless `--no-reference`, candle alone trains the same model from the same initial
//! weights on the global batch (every rank's micro-batches together) with candle-nn's
//! AdamW; the two must agree: `reference_rel_err` is the worst relative difference of the
//! loss curves over the first 30 steps (at most 1e-4 for `ok`), `reference_rel_err_all`
//! the same over the whole run and `reference_param_rel_err` that of the final parameters
//! (each one's difference over its magnitude, as Frobenius norms). The last two grow with
//! the steps: training amplifies rounding differences (Adam's normalisation of near-zero
//! gradients first), so two implementations that round differently drift apart over
//! hundreds of steps.
//!
//! `--bench` times, in one run, candle alone accumulating the same slices (one AdamW step
//! per step) against candle + `overlap` on the simple and the segmented path, and reports
//! the overhead and where it goes.

mod model;

use std::time::Instant;

use candle_core::Device;
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use clap::Parser;
use model::{Batch, Corpus, Gpt, GptConfig};
use overlap_candle::overlap::Route;
use overlap_candle::{DataParallel, Error, Rules};

#[derive(Parser, Debug, Clone)]
#[command(about = "Train a small GPT with candle + overlap, data-parallel over a mesh")]
struct Args {
    /// The mesh, SxR: S ranks per shard group, R replicate groups.
    #[arg(long, default_value = "2x2")]
    mesh: String,
    /// Micro-batches per step (gate off for all but the last).
    #[arg(long, default_value_t = 2)]
    micro_batches: usize,
    /// Training steps.
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Blocks of the GPT.
    #[arg(long, default_value_t = 2)]
    blocks: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Characters per sequence.
    #[arg(long, default_value_t = 64)]
    context: usize,
    /// Sequences in one rank's micro-batch.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Muon on the blocks' matrices (AdamW on the rest); candle alone has no Muon, so no
    /// reference run.
    #[arg(long)]
    muon: bool,
    /// The head reuses the token embedding's matrix.
    #[arg(long)]
    tied: bool,
    /// The forward's gathers (`[forward]`): each layer's parameters gathered before its
    /// forward and backward.
    #[arg(long)]
    forward: bool,
    /// The simple path (every gradient after the whole backward) instead of the
    /// segmented backward.
    #[arg(long)]
    simple: bool,
    /// An overlap config to use instead of the one the flags make (its mesh,
    /// accumulation, optimizer settings, clipping, schedule, `[forward]`).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Seed of the initial weights.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Skip the candle-alone reference run.
    #[arg(long)]
    no_reference: bool,
    /// Print one JSON line at the end.
    #[arg(long)]
    json: bool,
    /// Print progress every this many steps.
    #[arg(long, default_value_t = 25)]
    log_every: u64,
    /// Benchmark mode: time candle alone against candle + overlap.
    #[arg(long)]
    bench: bool,
    /// Steps timed per contender in benchmark mode (after one warm-up step).
    #[arg(long, default_value_t = 10)]
    bench_steps: u64,
}

impl Args {
    fn gpt(&self, corpus: &Corpus) -> GptConfig {
        GptConfig {
            vocab: corpus.chars.len(),
            context: self.context,
            width: self.width,
            heads: self.heads,
            blocks: self.blocks,
            tied: self.tied,
        }
    }

    fn mesh(&self) -> Result<(u32, u32), Error> {
        let bad = || Error::Usage(format!("--mesh {}: expected SxR, e.g. 2x2", self.mesh));
        let (s, r) = self.mesh.split_once('x').ok_or_else(bad)?;
        Ok((s.parse().map_err(|_| bad())?, r.parse().map_err(|_| bad())?))
    }

    /// The overlap config: the file given, or one made from the flags.
    fn config(&self) -> Result<(String, String), Error> {
        if let Some(path) = &self.config {
            let text = std::fs::read_to_string(path).map_err(|e| {
                Error::Usage(format!("cannot read --config {}: {e}", path.display()))
            })?;
            return Ok((text, path.display().to_string()));
        }
        let (s, r) = self.mesh()?;
        let mut c = format!(
            "[mesh]\nshard = {s}\nreplicate = {r}\n[accumulation]\nmicro_batches = {}\n\
             [optimizer.adamw]\nlr = {}\nweight_decay = {}\n",
            self.micro_batches, self.lr, self.weight_decay
        );
        if self.forward {
            c += "[forward]\n";
        }
        Ok((c, "gpt flags".into()))
    }

    fn rules(&self) -> Rules {
        if self.muon {
            Rules::new().block_matrices(Route::Muon)
        } else {
            Rules::new()
        }
    }

    fn adamw(&self) -> ParamsAdamW {
        ParamsAdamW {
            lr: self.lr,
            weight_decay: self.weight_decay,
            ..ParamsAdamW::default()
        }
    }
}

/// One micro-batch of every local rank through the session; the sum of their losses.
fn micro_batch(
    dp: &mut DataParallel,
    model: &Gpt,
    batches: &[(u32, Batch)],
    simple: bool,
) -> Result<f64, Error> {
    if simple {
        // Each rank's forward and backward in turn; its gradients are copied into the
        // session's buffers at once, so its graph is freed before the next rank's.
        dp.begin_micro_batch()?;
        let mut sum = 0.0;
        for (rank, batch) in batches {
            let loss = model.loss(batch)?;
            sum += f64::from(loss.to_scalar::<f32>()?);
            dp.backward_rank(*rank, &loss)?;
        }
        dp.end_micro_batch()?;
        Ok(sum)
    } else {
        let refs: Vec<(u32, &Batch)> = batches.iter().map(|(r, b)| (*r, b)).collect();
        Ok(dp
            .micro_batch(model, &refs)?
            .iter()
            .map(|(_, l)| f64::from(*l))
            .sum())
    }
}

/// The slices of one micro-batch, for the given ranks.
fn slices(
    corpus: &Corpus,
    args: &Args,
    step: u64,
    m: usize,
    ranks: &[u32],
) -> Result<Vec<(u32, Batch)>, Error> {
    ranks
        .iter()
        .map(|&r| {
            Ok((
                r,
                corpus.slice(step, m, r, args.batch, args.context, &Device::Cpu)?,
            ))
        })
        .collect()
}

/// candle alone: the same model trained on the global batch with candle-nn's AdamW.
struct Reference {
    model: Gpt,
    vars: candle_nn::VarMap,
    opt: AdamW,
}

impl Reference {
    fn new(args: &Args, corpus: &Corpus) -> Result<Self, Error> {
        let (model, vars) = model::build(args.gpt(corpus), args.seed, &Device::Cpu)?;
        let opt = AdamW::new(vars.all_vars(), args.adamw())?;
        Ok(Reference { model, vars, opt })
    }

    /// One step on every rank's micro-batches together: the loss before the update.
    fn step(&mut self, batches: &[Batch]) -> Result<f64, Error> {
        let global = model::concat(&batches.iter().collect::<Vec<_>>())?;
        let loss = self.model.loss(&global)?;
        let value = f64::from(loss.to_scalar::<f32>()?);
        self.opt.backward_step(&loss)?;
        Ok(value)
    }
}

/// The worst relative difference of two sets of parameters (Frobenius, per parameter).
fn params_rel_err(a: &candle_nn::VarMap, b: &candle_nn::VarMap) -> Result<f64, Error> {
    let b: std::collections::HashMap<String, candle_core::Var> =
        overlap_candle::named_vars(b).into_iter().collect();
    let mut worst = 0.0f64;
    for (name, va) in overlap_candle::named_vars(a) {
        let vb = &b[&name];
        let diff = (va.as_tensor() - vb.as_tensor())?
            .sqr()?
            .sum_all()?
            .sqrt()?;
        let norm = vb.as_tensor().sqr()?.sum_all()?.sqrt()?;
        let rel =
            f64::from(diff.to_scalar::<f32>()?) / f64::from(norm.to_scalar::<f32>()?).max(1e-30);
        worst = worst.max(rel);
    }
    Ok(worst)
}

fn train(args: &Args) -> Result<(), Error> {
    let corpus = Corpus::new(model::CORPUS);
    let (model, vars) = model::build(args.gpt(&corpus), args.seed, &Device::Cpu)?;
    let (text, source) = args.config()?;
    let mut dp = DataParallel::builder(&vars)
        .config_toml(text, source)
        .rules(args.rules())
        .adamw(&args.adamw())
        .cpu()?;
    let mut reference = if args.no_reference || args.muon || args.config.is_some() {
        None
    } else {
        Some(Reference::new(args, &corpus)?)
    };
    let world = dp.local_ranks().len() as f64;
    let elements: usize = vars.all_vars().iter().map(|v| v.elem_count()).sum();
    if !args.json {
        println!(
            "gpt: {elements} parameters ({} blocks, width {}), {} ranks x {} micro-batches x {} sequences of {} characters, {} path",
            args.blocks, args.width, world, dp.micro_batches(), args.batch, args.context,
            if args.simple { "simple" } else { "segmented" }
        );
    }
    let (mut curve, mut ref_curve, mut times, mut copies) = (vec![], vec![], vec![], 0u64);
    let mut memory = None;
    for step in 0..args.steps {
        let mut all = Vec::new();
        let started = Instant::now();
        let mut loss = 0.0;
        for m in 0..dp.micro_batches() {
            let batches = slices(&corpus, args, step, m, dp.local_ranks())?;
            loss += micro_batch(&mut dp, &model, &batches, args.simple)?;
            all.extend(batches.into_iter().map(|(_, b)| b));
        }
        let report = dp.step()?;
        times.push(started.elapsed().as_secs_f64());
        memory = report
            .memory
            .iter()
            .max_by_key(|m| m.param_peak_bytes)
            .map(|m| (*m, report.replica_bytes));
        copies += dp.copies().host();
        curve.push(loss / (world * dp.micro_batches() as f64));
        if let Some(r) = &mut reference {
            ref_curve.push(r.step(&all)?);
        }
        let done = step + 1;
        if !args.json && (done % args.log_every == 0 || done == 1 || done == args.steps) {
            let against = ref_curve
                .last()
                .map_or(String::new(), |r| format!(" (candle alone {r:.4})"));
            println!(
                "step {done:>4}/{}  loss {:.4}{against}  {:.1} ms/step  {} host copies/step{}",
                args.steps,
                curve[curve.len() - 1],
                1e3 * times[times.len() - 1],
                dp.copies().host(),
                report
                    .grad_norm
                    .map_or(String::new(), |n| format!("  grad norm {n:.3}"))
            );
        }
    }
    if dp.session().has_forward() {
        dp.sync_vars()?;
    }
    // Two implementations that round differently follow the same trajectory only for a
    // while: training amplifies differences (Adam in near-zero gradients, then the loss
    // landscape), so agreement is judged over the first HORIZON steps and the whole run's
    // figures are reported beside it.
    const HORIZON: usize = 30;
    let (reference_rel_err, reference_rel_err_all, reference_param_rel_err) = match &reference {
        Some(r) => {
            let rel: Vec<f64> = curve
                .iter()
                .zip(&ref_curve)
                .map(|(a, b)| (a - b).abs() / b.abs())
                .collect();
            let worst = |xs: &[f64]| xs.iter().copied().fold(0.0, f64::max);
            (
                Some(worst(&rel[..rel.len().min(HORIZON)])),
                Some(worst(&rel)),
                Some(params_rel_err(&vars, &r.vars)?),
            )
        }
        None => (None, None, None),
    };
    let first = curve.first().copied().unwrap_or(f64::NAN);
    let last = curve.last().copied().unwrap_or(f64::NAN);
    let timed = &times[times.len().min(1)..];
    let step_ms = 1e3 * timed.iter().sum::<f64>() / timed.len().max(1) as f64;
    let ok = last < first && reference_rel_err.map_or(true, |e| e <= 1e-4);
    let per_step = copies as f64 / args.steps.max(1) as f64;
    if args.json {
        let line = serde_json::json!({
            "ok": ok,
            "loss_first": first,
            "loss_last": last,
            "reference_rel_err": reference_rel_err,
            "reference_rel_err_all": reference_rel_err_all,
            "reference_param_rel_err": reference_param_rel_err,
            "host_copies_per_step": per_step,
            "step_ms": step_ms,
            "ranks": world,
            "micro_batches": dp.micro_batches(),
            "steps": args.steps,
            "parameters": elements,
            "path": if args.simple { "simple" } else { "segmented" },
        });
        println!("{line}");
    } else {
        if let Some((m, replica)) = memory {
            let kib = |b: u64| b as f64 / 1024.0;
            println!(
                "session memory, busiest rank: parameters {:.1} KiB at peak ({:.1} KiB its pieces, {:.1} KiB gathered), gradient path {:.1} KiB; a full replica {:.1} KiB",
                kib(m.param_peak_bytes),
                kib(m.shard_bytes),
                kib(m.full_peak_bytes),
                kib(m.grad_peak_bytes),
                kib(replica)
            );
        }
        println!(
            "loss {first:.4} -> {last:.4}; {step_ms:.1} ms/step; {per_step} host copies/step; candle alone: {}",
            match (reference_rel_err, reference_rel_err_all, reference_param_rel_err) {
                (Some(l), Some(all), Some(p)) => format!(
                    "loss curves {l:.2e} apart over the first {HORIZON} steps ({all:.2e} over the run), final parameters {p:.2e}"
                ),
                _ => "not run".into(),
            }
        );
    }
    if ok {
        Ok(())
    } else {
        Err(Error::Usage(
            "the run is not ok (the loss did not fall, or it differs from candle alone)".into(),
        ))
    }
}

fn main() {
    let args = Args::parse();
    let result = if args.bench {
        bench::run(&args)
    } else {
        train(&args)
    };
    if let Err(e) = result {
        eprintln!("gpt: {e}");
        std::process::exit(1);
    }
}

mod bench;
