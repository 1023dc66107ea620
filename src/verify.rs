//! `overlap verify`: the gated schedule against the no_sync reference.
//!
//! Two sessions start from the same parameters and see the same seeded gradients: one
//! runs the configured gate pattern, the other the no_sync pattern (local accumulation,
//! one reduction in the last micro-batch). After every step, the reduced gradient every
//! optimizer consumed, on every rank and route, is compared with the exact reference
//! computed on the host in f64 (each rank's sum over micro-batches, averaged over all
//! ranks); after the last step, the parameters of the two sessions are compared.
//!
//! Relative error of a tensor piece: `max |a - b| / max(max |b|, max m)`, where `m` is
//! the reference's *input magnitude*, `Σ |g|` over the summed gradients divided like the
//! reference. It is the max-norm relative error, normalised so that a piece whose
//! gradients cancel to nearly zero (a 1-element shard, say) is judged by the rounding a
//! sum of its inputs must incur, not divided by its accidental smallness: float
//! summation's error bound is proportional to `Σ |g|`, not to `|Σ g|`.

use std::collections::BTreeMap;

use overlap_graph::{DType, Gate, ParamId, ReduceOp};
use serde::Serialize;

use crate::config::Config;
use crate::drive::{no_sync_pattern, synthetic_step};
use crate::session::Session;
use crate::{synthetic, Error};

/// What `overlap verify --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    /// Every comparison within tolerance, and no partial left.
    pub ok: bool,
    /// Worst relative error of any consumed gradient against the reference.
    pub worst_rel_err: f64,
    /// Worst relative error per route.
    pub per_route: BTreeMap<String, f64>,
    /// Worst relative error of the parameters after the last step, gated vs no_sync
    /// (on the CUDA backend: the GPU's against the CPU backend's, same gates).
    pub param_rel_err: f64,
    /// CUDA backend only: worst relative error of each optimizer's accumulated update
    /// (`p_last - p_0`), GPU against CPU, by optimizer (`adamw`, `muon`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub update_rel_err: BTreeMap<String, f64>,
    /// Partials and accumulations left unflushed at the end of any step.
    pub partials_left: usize,
    /// Steps run.
    pub steps: u64,
    /// Ranks in the mesh.
    pub ranks: u32,
    /// The gate pattern verified.
    pub gates: String,
    /// Tolerance on gradients.
    pub grad_tolerance: f64,
    /// Tolerance on parameters.
    pub param_tolerance: f64,
    /// Where the worst gradient error was seen (`step 2, rank 1, blocks.0.qkv`).
    pub worst_at: String,
}

/// Relative error `max |a - b| / max(max |b|, max magnitude)` (0 when equal).
pub fn rel_err(a: &[f32], b: &[f64], magnitude: &[f64]) -> f64 {
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - y).abs())
        .fold(0.0, f64::max);
    let den = b
        .iter()
        .chain(magnitude)
        .map(|y| y.abs())
        .fold(0.0, f64::max);
    if num == 0.0 {
        0.0
    } else {
        num / den.max(f64::MIN_POSITIVE)
    }
}

/// Tolerances for a reduce dtype: (gradients, parameters). f32 is the documented 1e-6 bound (README, `overlap verify`);
/// bf16 inputs carry 8 bits of mantissa, so its bound is that of one rounding per
/// reduction stage (measured on `examples/pure_fsdp_4x1.toml`: 4.6e-3; README, *Verification*).
pub fn tolerances(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (1e-6, 1e-5),
        DType::Bf16 => (1e-2, 5e-2),
    }
}

/// Runs the verification of a config for `steps` steps with `seed`.
pub async fn verify(
    config: &Config,
    steps: u64,
    seed: u64,
    mut progress: impl FnMut(u64),
) -> Result<VerifyReport, Error> {
    let mut config = config.clone();
    config.run.seed = seed;
    let gates = config.gates.clone();
    // Two sessions: the gated one and the no_sync reference.
    crate::resources::check_cpu(&config, 2)?;
    let mut gated = Session::cpu(&config)?;
    let mut reference = Session::cpu(&config)?;
    let ref_gates = no_sync_pattern(gates.len());
    let mesh = config.plan.mesh;
    let (grad_tol, param_tol) = tolerances(config.plan.reduce.dtype);
    let params = gated.planner().params().to_vec();
    let mut per_route: BTreeMap<String, f64> = BTreeMap::new();
    let mut worst = 0.0f64;
    let mut worst_at = String::new();
    let mut partials_left = 0;
    for step in 0..steps {
        let report = synthetic_step(&mut gated, seed, step, &gates).await?;
        partials_left += report.stats.partials_left;
        synthetic_step(&mut reference, seed, step, &ref_gates).await?;
        for (i, p) in params.iter().enumerate() {
            let (full, magnitude) = reference_grad(
                &config,
                step,
                gates.len() as u32,
                i as ParamId,
                p.spec.numel() as usize,
            );
            for rank in mesh.ranks() {
                let Some(got) = gated.reduced_grad(rank, i as ParamId)? else {
                    continue;
                };
                let r = p.spec.shard_range(mesh.shard, mesh.coord(rank).shard);
                let piece = r.start as usize..r.end as usize;
                let e = rel_err(&got, &full[piece.clone()], &magnitude[piece]);
                let slot = per_route
                    .entry(p.spec.route.name().to_string())
                    .or_insert(0.0);
                *slot = slot.max(e);
                if e > worst || worst_at.is_empty() {
                    worst = worst.max(e);
                    worst_at = format!("step {}, rank {rank}, {}", step + 1, p.spec.name);
                }
            }
        }
        progress(step + 1);
    }
    let mut param_rel_err = 0.0f64;
    for i in 0..params.len() {
        for rank in mesh.ranks() {
            if let (Some(a), Some(b)) = (
                gated.param_values(rank, i as ParamId)?,
                reference.param_values(rank, i as ParamId)?,
            ) {
                let b: Vec<f64> = b.iter().map(|&x| f64::from(x)).collect();
                param_rel_err = param_rel_err.max(rel_err(&a, &b, &[]));
            }
        }
    }
    let ok = worst <= grad_tol && param_rel_err <= param_tol && partials_left == 0;
    Ok(VerifyReport {
        ok,
        worst_rel_err: worst,
        per_route,
        param_rel_err,
        update_rel_err: BTreeMap::new(),
        partials_left,
        steps,
        ranks: mesh.world(),
        gates: Gate::pattern_label(&gates),
        grad_tolerance: grad_tol,
        param_tolerance: param_tol,
        worst_at,
    })
}

/// The exact reduced gradient of a parameter in a step (every rank's sum over the
/// step's micro-batches, summed over ranks in f64, divided by the world size for `avg`),
/// and its input magnitude (the same over `|g|`).
pub fn reference_grad(
    config: &Config,
    step: u64,
    micro_batches: u32,
    param: ParamId,
    numel: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mesh = config.plan.mesh;
    let mut acc = vec![0.0f64; numel];
    let mut mag = vec![0.0f64; numel];
    let mut g = vec![0.0f32; numel];
    for rank in mesh.ranks() {
        for m in 0..micro_batches {
            synthetic::grad(config.run.seed, step, m, rank, param, &mut g);
            for ((a, b), x) in acc.iter_mut().zip(mag.iter_mut()).zip(&g) {
                *a += f64::from(*x);
                *b += f64::from(x.abs());
            }
        }
    }
    if config.plan.reduce.op == ReduceOp::Avg {
        let w = f64::from(mesh.world());
        acc.iter_mut().chain(mag.iter_mut()).for_each(|a| *a /= w);
    }
    (acc, mag)
}
