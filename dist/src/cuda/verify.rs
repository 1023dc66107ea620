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

use std::collections::BTreeMap;

use overlap_graph::{DType, Gate, ParamId, Route};
use overlap_ops::cuda::CudaBackend;
use overlap_ops::NsDtype;
use serde::{Deserialize, Serialize};

use super::{CudaWorld, GATHER_TIMEOUT};
use overlap::config::{BackendChoice, Config};
use overlap::drive::{synthetic_step, synthetic_step_with};
use overlap::session::Session;
use overlap::verify::{
    clipped, current_params, full_rel_err, reference_grad, rel_err, NormCheck, NormFigures,
    StepCheck, VerifyReport,
};
use overlap::{synthetic, Error};

use crate::DistError;

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

/// One rank's figures, sent to rank 0.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct RankFigures {
    rank: u32,
    worst: f64,
    worst_at: String,
    per_route: BTreeMap<String, f64>,
    param_rel_err: f64,
    update_rel_err: BTreeMap<String, f64>,
    partials_left: usize,
    norm: Option<NormFigures>,
    /// With `[forward]`: the worst relative error of a gathered full parameter
    /// against the CPU backend's parameters at the step's start.
    forward_rel_err: Option<f64>,
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
    let params = gpu.planner().params().to_vec();
    let mut fig = RankFigures {
        rank,
        ..RankFigures::default()
    };
    let coord = mesh.coord(rank);
    let mut norms = NormCheck::of(&config, steps)?;
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
            let slot = fig
                .per_route
                .entry(p.spec.route.name().to_string())
                .or_insert(0.0);
            *slot = slot.max(e);
            if e > fig.worst || fig.worst_at.is_empty() {
                fig.worst = fig.worst.max(e);
                fig.worst_at = format!("step {}, rank {rank}, {}", step + 1, p.spec.name);
            }
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
    let bytes = serde_json::to_vec(&fig).map_err(|e| Error::Usage(e.to_string()))?;
    let Some(all) = world.rendezvous.gather(&bytes, GATHER_TIMEOUT)? else {
        return Ok(None);
    };
    let figures = all
        .iter()
        .enumerate()
        .map(|(r, b)| {
            serde_json::from_slice::<RankFigures>(b).map_err(|e| {
                Error::Dist(DistError::Rendezvous(format!(
                    "rank {r} sent unreadable verify figures: {e}"
                )))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(merge(&config, steps, &gates, &figures)))
}

/// Rank 0's report from every rank's figures.
fn merge(config: &Config, steps: u64, gates: &[Gate], figures: &[RankFigures]) -> VerifyReport {
    let (grad_tol, param_tol, update_tol) =
        tolerances(config.plan.reduce.dtype, coarsest_ns(config));
    let mut per_route: BTreeMap<String, f64> = BTreeMap::new();
    let mut update_rel_err: BTreeMap<String, f64> = BTreeMap::new();
    let (mut worst, mut worst_at, mut param_rel_err, mut partials_left) =
        (0.0f64, String::new(), 0.0f64, 0usize);
    let mut norm: Option<NormFigures> = None;
    let mut forward_rel_err: Option<f64> = None;
    for f in figures {
        if let Some(e) = f.forward_rel_err {
            forward_rel_err = Some(forward_rel_err.unwrap_or(0.0).max(e));
        }
        for (k, v) in &f.per_route {
            let slot = per_route.entry(k.clone()).or_insert(0.0);
            *slot = slot.max(*v);
        }
        for (k, v) in &f.update_rel_err {
            let slot = update_rel_err.entry(k.clone()).or_insert(0.0);
            *slot = slot.max(*v);
        }
        if f.worst > worst || worst_at.is_empty() {
            worst = worst.max(f.worst);
            worst_at = f.worst_at.clone();
        }
        param_rel_err = param_rel_err.max(f.param_rel_err);
        partials_left += f.partials_left;
        match (&mut norm, &f.norm) {
            (Some(n), Some(other)) => n.merge(other),
            (None, Some(other)) => norm = Some(other.clone()),
            _ => {}
        }
    }
    let updates_ok = update_tol.map_or(true, |tols| {
        tols.iter()
            .all(|(k, tol)| update_rel_err.get(*k).map_or(true, |e| e <= tol))
    });
    let ok = worst <= grad_tol
        && param_rel_err <= param_tol
        && updates_ok
        && partials_left == 0
        && forward_rel_err.map_or(true, |e| e <= param_tol)
        && norm.as_ref().map_or(true, |n| n.ok(grad_tol));
    VerifyReport {
        ok,
        worst_rel_err: worst,
        per_route,
        param_rel_err,
        update_rel_err,
        partials_left,
        forward_mismatches: None,
        forward_rel_err,
        steps,
        ranks: config.plan.mesh.world(),
        gates: Gate::pattern_label(gates),
        grad_tolerance: grad_tol,
        param_tolerance: param_tol,
        worst_at,
        norm,
    }
}
