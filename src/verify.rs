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
//! summation's error bound is proportional to `Σ |g|`, not to `|Σ g|`. A NaN or an
//! infinity where the reference is finite is the largest error (`f64::MAX`).
//!
//! With `[clip]` ([`NormCheck`]) the step's global norm is compared with the
//! reference's (f64, every element of every parameter once), and the reference gradient
//! is scaled by the clip factor of the reference's norm before the comparison (the
//! optimizers consume the clipped gradient). A step skipped as non-finite is expected
//! only where `OVERLAP_FAULT` injects a NaN (`mode=nan`): its gradients are not compared
//! (they hold the NaN), and any other skip, or a NaN step that is not skipped, fails.

use crate::faults::Faults;
use std::collections::BTreeMap;

use overlap_graph::{DType, Gate, ParamId, ReduceOp};
use serde::Serialize;

use crate::config::Config;
use crate::drive::{no_sync_pattern, synthetic_step, synthetic_step_with};
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
    /// With `[forward]` (on the CPU backend): elements of the full parameters the
    /// gathers handed the trainer, over every rank, pass and micro-batch, that differ
    /// from the parameters the session held at the step's start (bit for bit); absent
    /// without the forward.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forward_mismatches: Option<u64>,
    /// With `[forward]`: worst relative error (of the parameter's magnitude) of the full
    /// parameters the gathers handed the trainer, over every rank, pass and
    /// micro-batch, against the reference's parameters at the step's start (on the CPU
    /// backend the no_sync reference session's; on CUDA the CPU backend's run of the
    /// same gates). Judged against the parameter tolerance; absent without the forward.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forward_rel_err: Option<f64>,
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
    /// With `[clip]`: the norm checks ([`NormFigures`]).
    #[serde(flatten)]
    pub norm: Option<NormFigures>,
}

/// What `overlap verify` found of the global gradient norm with `[clip]` (flattened into
/// [`VerifyReport`]'s JSON).
#[derive(Debug, Clone, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct NormFigures {
    /// Each step's global norm as the session under test reported it (on the CUDA
    /// backend, the GPU's); `null` for a non-finite one.
    pub grad_norms: Vec<Option<f64>>,
    /// Worst relative error of a finite step's norm against the reference's (f64).
    pub grad_norm_rel_err: f64,
    /// CUDA backend only: worst relative difference of the GPU's norm from the CPU
    /// backend's, step by step (0 when both are non-finite, `f64::MAX` when one is).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm_cpu_rel_err: Option<f64>,
    /// Steps skipped as non-finite.
    pub skipped_steps: u64,
    /// Steps skipped as `OVERLAP_FAULT` (`mode=nan`) makes one: the step it names, when
    /// it is within the run; otherwise 0.
    pub expected_skips: u64,
}

impl NormFigures {
    /// Whether the norms are within `tol` and exactly the expected steps were skipped.
    pub fn ok(&self, tol: f64) -> bool {
        self.grad_norm_rel_err <= tol
            && self.grad_norm_cpu_rel_err.map_or(true, |e| e <= tol)
            && self.skipped_steps == self.expected_skips
    }

    /// Folds another rank's figures into these (worst errors; the norms and skips are
    /// the same on every rank, kept from the first).
    pub fn merge(&mut self, other: &NormFigures) {
        self.grad_norm_rel_err = self.grad_norm_rel_err.max(other.grad_norm_rel_err);
        self.grad_norm_cpu_rel_err = match (self.grad_norm_cpu_rel_err, other.grad_norm_cpu_rel_err)
        {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.skipped_steps = self.skipped_steps.max(other.skipped_steps);
    }
}

/// The global-norm side of a verification (`[clip]`): what to compare each step with.
#[derive(Debug, Clone)]
pub struct NormCheck {
    max_norm: Option<f32>,
    /// The 0-based step `OVERLAP_FAULT` (`mode=nan`) makes non-finite, if any.
    nan_step: Option<u64>,
    figures: NormFigures,
}

/// What one step's gradients are compared with, after [`NormCheck::step`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepCheck {
    /// Compare, with the reference scaled by this clip factor (1 when nothing clips).
    Compare(f64),
    /// The step was skipped as non-finite: its gradients are not compared.
    Skipped,
}

impl NormCheck {
    /// The checks for a config (`None` without `[clip]`) run for `steps` steps, with the
    /// step fault the sessions inject (`faults.step`).
    pub fn of(config: &Config, steps: u64, faults: &Faults) -> Option<NormCheck> {
        let clip = config.clip?;
        let nan_step = faults
            .step
            .filter(|f| {
                f.mode == overlap_executor::FaultMode::Nan && f.rank < config.plan.mesh.world()
            })
            .map(|f| f.step - 1);
        Some(NormCheck {
            max_norm: clip.max_norm,
            nan_step,
            figures: NormFigures {
                expected_skips: u64::from(nan_step.is_some_and(|s| s < steps)),
                ..NormFigures::default()
            },
        })
    }

    /// Checks step `step`'s (0-based) report against the reference, and `cpu`'s norm
    /// (the CPU backend's report of the same step) when given; says how to compare the
    /// step's gradients.
    pub fn step(
        &mut self,
        config: &Config,
        params: &[overlap_graph::PlacedParam],
        (step, micro_batches): (u64, u32),
        report: &crate::StepReport,
        cpu: Option<&crate::StepReport>,
    ) -> StepCheck {
        let f = &mut self.figures;
        let got = report.grad_norm.unwrap_or(f64::NAN);
        f.grad_norms.push(got.is_finite().then_some(got));
        if let Some(cpu) = cpu {
            let e = norm_diff(got, cpu.grad_norm.unwrap_or(f64::NAN));
            f.grad_norm_cpu_rel_err = Some(f.grad_norm_cpu_rel_err.unwrap_or(0.0).max(e));
        }
        let skipped = report.skipped.is_some();
        let nan_here = self.nan_step == Some(step);
        if skipped {
            f.skipped_steps += 1;
        }
        if skipped != nan_here {
            // A skip nobody injected, or an injected NaN the norm did not see.
            f.grad_norm_rel_err = f64::MAX;
        }
        if skipped {
            return StepCheck::Skipped;
        }
        let want = reference_norm(config, step, micro_batches, params);
        f.grad_norm_rel_err = f.grad_norm_rel_err.max(norm_diff(got, want));
        StepCheck::Compare(clip_factor(self.max_norm, want))
    }

    /// The figures after the last step.
    pub fn finish(self) -> NormFigures {
        self.figures
    }
}

/// `|a - b| / |b|` of two norms: 0 when both are non-finite (both skipped), `f64::MAX`
/// when only one is (or the difference is not finite).
fn norm_diff(a: f64, b: f64) -> f64 {
    match (a.is_finite(), b.is_finite()) {
        (false, false) => 0.0,
        (true, true) => {
            let d = (a - b).abs() / b.abs().max(f64::MIN_POSITIVE);
            if d.is_finite() {
                d
            } else {
                f64::MAX
            }
        }
        _ => f64::MAX,
    }
}

/// The factor torch's `clip_grad_norm_` scales by, in f64, for a norm `norm`:
/// `min(1, max_norm / (norm + 1e-6))`; 1 without `max_norm`.
pub fn clip_factor(max_norm: Option<f32>, norm: f64) -> f64 {
    max_norm.map_or(1.0, |m| (f64::from(m) / (norm + 1e-6)).min(1.0))
}

/// The reference's global L2 norm of step `step` (every element of every parameter
/// once, from [`reference_grad`], in f64).
pub fn reference_norm(
    config: &Config,
    step: u64,
    micro_batches: u32,
    params: &[overlap_graph::PlacedParam],
) -> f64 {
    params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (g, _) = reference_grad(
                config,
                step,
                micro_batches,
                i as ParamId,
                p.spec.numel() as usize,
            );
            g.iter().map(|x| x * x).sum::<f64>()
        })
        .sum::<f64>()
        .sqrt()
}

/// Relative error `max |a - b| / max(max |b|, max magnitude)` (0 when equal;
/// `f64::MAX` when a difference is NaN or infinite: a NaN must not pass for a match).
pub fn rel_err(a: &[f32], b: &[f64], magnitude: &[f64]) -> f64 {
    let mut num = 0.0f64;
    for (x, y) in a.iter().zip(b) {
        let d = (f64::from(*x) - y).abs();
        if !d.is_finite() {
            return f64::MAX;
        }
        num = num.max(d);
    }
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

/// Tolerances for a reduce dtype: (gradients, parameters). f32 is the documented 1e-6 bound (docs/cli.md, `overlap verify`);
/// bf16 inputs carry 8 bits of mantissa, so its bound is that of one rounding per
/// reduction stage (measured on `examples/pure_fsdp_4x1.toml`: 4.6e-3; docs/cli.md, *Verification*).
pub fn tolerances(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (1e-6, 1e-5),
        DType::Bf16 => (1e-2, 5e-2),
    }
}

/// Runs the verification of a config for `steps` steps with `seed`, without faults.
pub async fn verify(
    config: &Config,
    steps: u64,
    seed: u64,
    progress: impl FnMut(u64),
) -> Result<VerifyReport, Error> {
    verify_with_faults(config, steps, seed, &Faults::none(), progress).await
}

/// [`verify`] with both sessions injecting `faults` (a NaN step is then expected to be
/// skipped by both; `overlap verify` passes what `OVERLAP_FAULT` names).
pub async fn verify_with_faults(
    config: &Config,
    steps: u64,
    seed: u64,
    faults: &Faults,
    mut progress: impl FnMut(u64),
) -> Result<VerifyReport, Error> {
    let mut config = config.clone();
    config.run.seed = seed;
    let gates = config.gates.clone();
    // Two sessions: the gated one and the no_sync reference.
    crate::resources::check_cpu(&config, 2)?;
    let mut gated = Session::cpu(&config)?;
    let mut reference = Session::cpu(&config)?;
    gated.inject_faults(*faults);
    reference.inject_faults(*faults);
    let ref_gates = no_sync_pattern(gates.len());
    let mesh = config.plan.mesh;
    let (grad_tol, param_tol) = tolerances(config.plan.reduce.dtype);
    let params = gated.params().to_vec();
    let mut per_route: BTreeMap<String, f64> = BTreeMap::new();
    let mut worst = 0.0f64;
    let mut worst_at = String::new();
    let mut partials_left = 0;
    let mut norms = NormCheck::of(&config, steps, faults);
    let mut forward_mismatches = gated.has_forward().then_some(0u64);
    let mut forward_rel_err = gated.has_forward().then_some(0.0f64);
    for step in 0..steps {
        // The gathers must hand every rank exactly the parameters of the step's start,
        // and those must be the reference's within the parameter tolerance.
        let (current, reference_now) = match forward_mismatches {
            Some(_) => (current_params(&gated)?, current_params(&reference)?),
            None => (Vec::new(), Vec::new()),
        };
        let mut differ = 0u64;
        let mut forward_err = 0.0f64;
        let report = synthetic_step_with(&mut gated, seed, step, &gates, |_, _, p, v| {
            let want = &current[p as usize];
            differ += v
                .iter()
                .zip(want)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count() as u64
                + v.len().abs_diff(want.len()) as u64;
            forward_err = forward_err.max(full_rel_err(v, &reference_now[p as usize]));
        })
        .await?;
        if let Some(n) = forward_mismatches.as_mut() {
            *n += differ;
        }
        if let Some(e) = forward_rel_err.as_mut() {
            *e = e.max(forward_err);
        }
        partials_left += report.stats.partials_left;
        synthetic_step(&mut reference, seed, step, &ref_gates).await?;
        let micro_batches = gates.len() as u32;
        let factor = match norms.as_mut() {
            None => 1.0,
            Some(n) => match n.step(&config, &params, (step, micro_batches), &report, None) {
                StepCheck::Compare(f) => f,
                StepCheck::Skipped => {
                    progress(step + 1);
                    continue;
                }
            },
        };
        for (i, p) in params.iter().enumerate() {
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
    let norm = norms.map(NormCheck::finish);
    let ok = worst <= grad_tol
        && param_rel_err <= param_tol
        && partials_left == 0
        && forward_mismatches.map_or(true, |n| n == 0)
        && forward_rel_err.map_or(true, |e| e <= param_tol)
        && norm.as_ref().map_or(true, |n| n.ok(grad_tol));
    Ok(VerifyReport {
        ok,
        worst_rel_err: worst,
        per_route,
        param_rel_err,
        update_rel_err: BTreeMap::new(),
        partials_left,
        forward_mismatches,
        forward_rel_err,
        steps,
        ranks: mesh.world(),
        gates: Gate::pattern_label(&gates),
        grad_tolerance: grad_tol,
        param_tolerance: param_tol,
        worst_at,
        norm,
    })
}

/// Every parameter's full tensor from the pieces the session's ranks hold
/// ([`Session::full_param`]; a CPU session drives the whole mesh).
pub fn current_params<B: overlap_ops::Backend>(s: &Session<B>) -> Result<Vec<Vec<f32>>, Error> {
    (0..s.params().len() as ParamId)
        .map(|id| s.full_param(id))
        .collect()
}

/// A gathered full parameter (its `numel` values) against the reference's: the
/// relative error of [`rel_err`] (of the reference's magnitude), `f64::MAX` when the
/// lengths differ.
pub fn full_rel_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::MAX;
    }
    let want: Vec<f64> = want.iter().map(|&x| f64::from(x)).collect();
    rel_err(got, &want, &[])
}

/// A reference gradient and its magnitude scaled by a clip factor (as they are when it
/// is 1).
pub fn clipped(
    (mut full, mut magnitude): (Vec<f64>, Vec<f64>),
    factor: f64,
) -> (Vec<f64>, Vec<f64>) {
    if factor != 1.0 {
        full.iter_mut()
            .chain(magnitude.iter_mut())
            .for_each(|x| *x *= factor);
    }
    (full, magnitude)
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
