//! `--bench`: candle alone against candle + `overlap`, timed in one run.
//!
//! The three contenders train the same model from the same weights on the same slices,
//! one step each in turn (so drift of the machine touches them alike):
//!
//! - **candle alone**: every rank's micro-batches run one after the other in this
//!   process, their gradients summed into one `GradStore` (what a candle user does to
//!   accumulate), then one step of candle-nn's AdamW;
//! - **overlap, simple path**: the same forwards and backwards, each micro-batch's
//!   gradients handed to the session ([`DataParallel::backward`]), then its step;
//! - **overlap, segmented**: the backward block by block ([`DataParallel::micro_batch`]).
//!
//! It prints each one's median step time, the overhead against candle alone, and where
//! the time of the `overlap` steps goes: handing gradients in, the step (optimizers,
//! publishes, writing the `Var`s), and the rest (the trainer's forward and backward).

use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::Device;
use candle_nn::{AdamW, Optimizer};
use overlap_candle::{DataParallel, Error};

use crate::model::{self, Batch, Corpus, Gpt};
use crate::{micro_batch, slices, Args};

/// Median of a list of seconds, in milliseconds.
fn median_ms(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    1e3 * v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

struct Alone {
    model: Gpt,
    vars: candle_nn::VarMap,
    opt: AdamW,
}

impl Alone {
    /// One step: every slice's backward summed, then AdamW; the optimizer's seconds.
    fn step(&mut self, batches: &[Batch], scale: f64) -> Result<f64, Error> {
        let mut sum: Option<GradStore> = None;
        for b in batches {
            let grads = self.model.loss(b)?.affine(scale, 0.0)?.backward()?;
            sum = Some(match sum {
                None => grads,
                Some(mut acc) => {
                    for var in self.vars.all_vars() {
                        let t = var.as_tensor();
                        if let (Some(a), Some(g)) = (acc.get(t), grads.get(t)) {
                            let total = (a + g)?;
                            acc.insert(t, total);
                        }
                    }
                    acc
                }
            });
        }
        let started = Instant::now();
        if let Some(grads) = sum {
            self.opt.step(&grads)?;
        }
        Ok(started.elapsed().as_secs_f64())
    }
}

struct Timed {
    step: Vec<f64>,
    hand_in: Vec<f64>,
    optimizer: Vec<f64>,
}

impl Timed {
    fn new() -> Self {
        Timed {
            step: Vec::new(),
            hand_in: Vec::new(),
            optimizer: Vec::new(),
        }
    }
}

fn overlap_step(
    dp: &mut DataParallel,
    model: &Gpt,
    corpus: &Corpus,
    args: &Args,
    step: u64,
    simple: bool,
) -> Result<f64, Error> {
    for m in 0..dp.micro_batches() {
        let batches = slices(corpus, args, step, m, dp.local_ranks())?;
        micro_batch(dp, model, &batches, simple)?;
    }
    let started = Instant::now();
    dp.step()?;
    Ok(started.elapsed().as_secs_f64())
}

/// The benchmark (module docs).
pub fn run(args: &Args) -> Result<(), Error> {
    let corpus = Corpus::new(model::CORPUS);
    let gpt = args.gpt(&corpus);
    let (text, source) = args.config()?;
    let make = || -> Result<(Gpt, DataParallel), Error> {
        let (model, vars) = model::build(gpt, args.seed, &Device::Cpu)?;
        let dp = DataParallel::builder(&vars)
            .config_toml(text.clone(), source.clone())
            .rules(args.rules())
            .adamw(&args.adamw())
            .cpu()?;
        Ok((model, dp))
    };
    let (simple_model, mut simple) = make()?;
    let (seg_model, mut segmented) = make()?;
    let (model, vars) = model::build(gpt, args.seed, &Device::Cpu)?;
    let opt = AdamW::new(vars.all_vars(), args.adamw())?;
    let mut alone = Alone { model, vars, opt };
    let ranks = simple.local_ranks().to_vec();
    let micro = simple.micro_batches();
    let scale = 1.0 / (ranks.len() * micro) as f64;
    let elements: usize = alone.vars.all_vars().iter().map(|v| v.elem_count()).sum();
    println!(
        "bench: gpt of {elements} parameters ({} blocks, width {}, {} characters), {} ranks x {micro} micro-batches x {} sequences; 1 warm-up + {} steps each, interleaved",
        args.blocks, args.width, args.context, ranks.len(), args.batch, args.bench_steps
    );
    let (mut t_alone, mut t_simple, mut t_seg) = (Timed::new(), Timed::new(), Timed::new());
    for step in 0..=args.bench_steps {
        let batches: Vec<Batch> = (0..micro)
            .map(|m| slices(&corpus, args, step, m, &ranks))
            .collect::<Result<Vec<_>, Error>>()?
            .into_iter()
            .flatten()
            .map(|(_, b)| b)
            .collect();
        let started = Instant::now();
        let opt = alone.step(&batches, scale)?;
        let a = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let s_opt = overlap_step(&mut simple, &simple_model, &corpus, args, step, true)?;
        let s = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let g_opt = overlap_step(&mut segmented, &seg_model, &corpus, args, step, false)?;
        let g = started.elapsed().as_secs_f64();
        if step == 0 {
            continue;
        }
        for (t, total, opt, hand_in) in [
            (&mut t_alone, a, opt, 0.0),
            (&mut t_simple, s, s_opt, simple.hand_in_seconds()),
            (&mut t_seg, g, g_opt, segmented.hand_in_seconds()),
        ] {
            t.step.push(total);
            t.optimizer.push(opt);
            t.hand_in.push(hand_in);
        }
        eprint!("\rbench: step {step}/{}", args.bench_steps);
    }
    eprintln!();
    let base = median_ms(&t_alone.step);
    println!("contender                  ms/step  vs candle  hand-in ms  step ms  rest ms");
    for (name, t) in [
        ("candle alone (AdamW)", &t_alone),
        ("candle + overlap, simple", &t_simple),
        ("candle + overlap, segmented", &t_seg),
    ] {
        let step = median_ms(&t.step);
        let (hand_in, opt) = (median_ms(&t.hand_in), median_ms(&t.optimizer));
        println!(
            "{name:<27}{step:>8.2}  {:>+8.1}%  {hand_in:>10.2}  {opt:>7.2}  {:>7.2}",
            100.0 * (step / base - 1.0),
            step - hand_in - opt
        );
    }
    println!(
        "host copies per step: {} (simple), {} (segmented, plus {} activation copies)",
        simple.copies().host(),
        segmented.copies().host(),
        segmented.copies().activations
    );
    Ok(())
}
