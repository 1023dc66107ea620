//! `overlap verify --backend cuda`: what each GPU's optimizers consume, against the
//! exact no_sync reference, and what they produce, against the CPU backend.
//!
//! Every rank runs the configured gate pattern on its GPU and, beside it, the same
//! schedule on the CPU backend (all ranks as threads: the reference implementation,
//! [`Session::cpu`]), from the same seeded parameters and gradients. After every step it
//! compares the reduced gradient of each piece it holds with
//! [`overlap::verify::reference_grad`] (f64); after the last step, its parameters with the
//! CPU session's (`param_rel_err`), and each optimizer's accumulated update
//! (`p_last - p_0`) with the CPU one (`update_rel_err`, per optimizer). Rank 0 gathers
//! every rank's figures over the rendezvous and builds one [`VerifyReport`].
//!
//! With `[clip]` the GPU's global norm is also compared, step by step, with the exact
//! reference's and with the CPU session's, and the gradient comparison uses the
//! reference scaled by its clip factor ([`overlap::verify::NormCheck`]); a step skipped as
//! non-finite (an `OVERLAP_FAULT` NaN) must be skipped by both, and its gradients are not
//! compared.
//!
//! Tolerances ([`tolerances`]): gradients as the CPU verify (1e-6 in f32;
//! 1e-2 in bf16); parameters 1e-5 (f32) and 5e-2 (bf16) of their magnitude; updates in
//! f32 1e-5 for AdamW (the kernels reproduce the reference's arithmetic) and 1e-4 for
//! Muon with `ns_dtype = "f32"` (Newton–Schulz runs in f32 on the GPU, in f64 in the
//! reference: about 5e-6 apart); with a coarser Newton–Schulz somewhere in the config
//! (`bf16`, the default, or `tf32`), Muon's update bound is that precision's
//! ([`muon_update_tolerance`]) and the parameters' bound is at least as loose (a
//! parameter moves by less than itself in a step). bf16 updates are reported but not
//! judged: a gradient element rounded to the other side of zero flips AdamW's
//! first-step update of that element, so only the parameters are bounded.

use overlap_graph::{DType, ParamId, Route};
use overlap_ops::cuda::CudaBackend;
use overlap_ops::NsDtype;

use super::{CudaWorld, GATHER_TIMEOUT};
use crate::figures::{self, RankFigures, Tolerances};
use overlap::config::{BackendChoice, Config};
use overlap::drive::{synthetic_step, synthetic_step_with};
use overlap::faults::Faults;
use overlap::session::Session;
use overlap::verify::{
    clipped, current_params, full_rel_err, reference_grad, rel_err, NormCheck, StepCheck,
    VerifyReport,
};
use overlap::{synthetic, Error};

/// Tolerances on the GPU: (gradients, parameters, updates per optimizer; `None`: not
/// judged), for a reduction in `dtype` and Newton–Schulz no finer than `ns`.
pub(crate) fn tolerances(
    dtype: DType,
    ns: NsDtype,
) -> (f64, f64, Option<[(&'static str, f64); 2]>) {
    let (grad, param) = overlap::verify::tolerances(dtype);
    let muon = muon_update_tolerance(ns);
    let param = if ns == NsDtype::F32 {
        param
    } else {
        param.max(muon)
    };
    match dtype {
        DType::F32 => (grad, param, Some([("adamw", 1e-5), ("muon", muon)])),
        DType::Bf16 => (grad, param, None),
    }
}

/// How far a GPU Muon update may be from the f64 reference's (relative), by the
/// precision of its Newton–Schulz (measured on an H200: `docs/performance.md`).
pub fn muon_update_tolerance(ns: NsDtype) -> f64 {
    match ns {
        NsDtype::F32 => 1e-4,
        NsDtype::Tf32 => 1e-2,
        NsDtype::Bf16 => 5e-2,
    }
}

/// The coarsest Newton–Schulz precision a config asks for (its base Muon setting and
/// its groups').
fn coarsest_ns(config: &Config) -> NsDtype {
    let rank = |d: NsDtype| match d {
        NsDtype::F32 => 0,
        NsDtype::Tf32 => 1,
        NsDtype::Bf16 => 2,
    };
    std::iter::once(config.muon.ns_dtype)
        .chain(config.groups.iter().filter_map(|g| g.ns_dtype))
        .max_by_key(|&d| rank(d))
        .unwrap_or_default()
}

/// The optimizer a route's parameters use.
fn optimizer(route: Route) -> &'static str {
    if route == Route::Muon {
        "muon"
    } else {
        "adamw"
    }
}

/// `max |a - b| / max |b|` over f64 slices (0 when equal; `f64::MAX` when a difference
/// is NaN or infinite).
fn rel_err64(a: &[f64], b: &[f64]) -> f64 {
    let mut num = 0.0f64;
    for (x, y) in a.iter().zip(b) {
        let d = (x - y).abs();
        if !d.is_finite() {
            return f64::MAX;
        }
        num = num.max(d);
    }
    let den = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
    if num == 0.0 {
        0.0
    } else {
        num / den.max(f64::MIN_POSITIVE)
    }
}

/// Runs the verification on this rank's GPU; rank 0 returns the job's report, the
/// other ranks `None`. `progress` is called after each step on rank 0.
pub async fn verify(
    config: &Config,
    steps: u64,
    seed: u64,
    world: &mut CudaWorld,
    faults: &Faults,
    mut progress: impl FnMut(u64),
) -> Result<Option<VerifyReport>, Error> {
    let mut config = config.clone();
    config.run.seed = seed;
    let gates = config.gates.clone();
    let rank = world.env.rank;
    let mesh = config.plan.mesh;
    let mut gpu: Session<CudaBackend> = Session::cuda(&config, world.backend.clone())?;
    // Another rank's failure ends this one's waits (the gather below still works).
    world.rendezvous.watch(gpu.peer_abort())?;
    world.backend.set_poisoned_collectives_join(false);
    let mut cpu_config = config.clone();
    cpu_config.run.backend = BackendChoice::Cpu;
    let mut cpu = Session::cpu(&cpu_config)?;
    gpu.inject_faults(*faults);
    cpu.inject_faults(*faults);
    let params = gpu.params().to_vec();
    let mut fig = RankFigures {
        rank,
        ..RankFigures::default()
    };
    let coord = mesh.coord(rank);
    let mut norms = NormCheck::of(&config, steps, faults);
    fig.forward_rel_err = gpu.has_forward().then_some(0.0);
    for step in 0..steps {
        // The gathers must hand this rank the parameters of the step's start: the CPU
        // backend's (all ranks in this process) within the parameter tolerance.
        let cpu_now = match fig.forward_rel_err {
            Some(_) => current_params(&cpu)?,
            None => Vec::new(),
        };
        let mut forward_err = 0.0f64;
        let report = synthetic_step_with(&mut gpu, seed, step, &gates, |_, _, p, v| {
            forward_err = forward_err.max(full_rel_err(v, &cpu_now[p as usize]));
        })
        .await?;
        if let Some(e) = fig.forward_rel_err.as_mut() {
            *e = e.max(forward_err);
        }
        fig.partials_left += report.stats.partials_left;
        let cpu_report = synthetic_step(&mut cpu, seed, step, &gates).await?;
        let micro_batches = gates.len() as u32;
        let factor = match norms.as_mut() {
            None => 1.0,
            Some(n) => {
                let at = (step, micro_batches);
                match n.step(&config, &params, at, &report, Some(&cpu_report)) {
                    StepCheck::Compare(f) => f,
                    StepCheck::Skipped => {
                        if rank == 0 {
                            progress(step + 1);
                        }
                        continue;
                    }
                }
            }
        };
        for (i, p) in params.iter().enumerate() {
            let Some(got) = gpu.reduced_grad(rank, i as ParamId)? else {
                continue;
            };
            let (full, magnitude) = clipped(
                reference_grad(
                    &config,
                    step,
                    micro_batches,
                    i as ParamId,
                    p.spec.numel() as usize,
                ),
                factor,
            );
            let r = p.spec.shard_range(mesh.shard, coord.shard);
            let piece = r.start as usize..r.end as usize;
            let e = rel_err(&got, &full[piece.clone()], &magnitude[piece]);
            fig.gradient(e, step, &p.spec.name, p.spec.route);
        }
        if rank == 0 {
            progress(step + 1);
        }
    }
    for (i, p) in params.iter().enumerate() {
        let id = i as ParamId;
        let (Some(a), Some(b)) = (gpu.param_values(rank, id)?, cpu.param_values(rank, id)?) else {
            continue;
        };
        let b64: Vec<f64> = b.iter().map(|&x| f64::from(x)).collect();
        fig.param_rel_err = fig.param_rel_err.max(rel_err(&a, &b64, &[]));
        let r = p.spec.shard_range(mesh.shard, coord.shard);
        let init = synthetic::init(seed, id, p.spec.numel() as usize);
        let init = &init[r.start as usize..r.end as usize];
        let du = |x: &[f32]| -> Vec<f64> {
            x.iter()
                .zip(init)
                .map(|(&v, &v0)| f64::from(v) - f64::from(v0))
                .collect()
        };
        let e = rel_err64(&du(&a), &du(&b));
        let slot = fig
            .update_rel_err
            .entry(optimizer(p.spec.route).to_string())
            .or_insert(0.0);
        *slot = slot.max(e);
    }
    fig.norm = norms.map(NormCheck::finish);
    let Some(all) = figures::gather(&mut world.rendezvous, &fig, GATHER_TIMEOUT)? else {
        return Ok(None);
    };
    let (grad, param, update) = tolerances(config.plan.reduce.dtype, coarsest_ns(&config));
    let tol = Tolerances {
        grad,
        param,
        update,
    };
    Ok(Some(figures::merge(&config, steps, &gates, &all, tol)))
}
