//! `overlap verify --backend cpu` as one rank of a multi-process job: what this rank's
//! optimizers consume, against the exact reference, and its parameters against the
//! no_sync reference run the same way (one rank per process).
//!
//! The structure is the GPU's (`crate::cuda::verify`): each rank runs the configured
//! gate pattern on a session over its backend and, beside it, the no_sync pattern on a
//! second backend over the same links (every process makes them in the same order);
//! after every step it compares the reduced gradient of each piece it holds with
//! [`overlap::verify::reference_grad`] (f64), after the last step its parameters with
//! the reference session's; rank 0 gathers every rank's figures over the rendezvous and
//! builds one [`VerifyReport`] with the in-process tolerances
//! ([`overlap::verify::tolerances`]).
//!
//! With `[forward]` every rank checks what the gathers hand it against what it holds:
//! the elements of a gathered full parameter that lie in this rank's piece must equal
//! the piece at the step's start bit for bit (`forward_mismatches`; over every rank,
//! every element of every parameter is checked by a rank that holds it), and be within
//! the parameter tolerance of the reference session's piece (`forward_rel_err`).

use std::ops::Range;
use std::sync::Arc;

use overlap::config::Config;
use overlap::drive::{no_sync_pattern, synthetic_step, synthetic_step_with};
use overlap::faults::Faults;
use overlap::session::Session;
use overlap::verify::{
    clipped, full_rel_err, reference_grad, rel_err, tolerances, NormCheck, StepCheck, VerifyReport,
};
use overlap::Error;
use overlap_graph::ParamId;
use overlap_ops::cpu::CpuBackend;

use super::{session_on, CpuWorld, GATHER_TIMEOUT};
use crate::figures::{self, RankFigures, Tolerances};

/// Each parameter's piece a session's `rank` holds, with its range in the full tensor
/// (`None` where it holds none: as [`Session::full_param`] reads them).
type Pieces = Vec<Option<(Range<usize>, Vec<f32>)>>;

/// Runs the verification on this rank; rank 0 returns the job's report, the other
/// ranks `None`. `progress` is called after each step on rank 0.
pub async fn verify(
    config: &Config,
    steps: u64,
    seed: u64,
    world: &mut CpuWorld,
    faults: &Faults,
    mut progress: impl FnMut(u64),
) -> Result<Option<VerifyReport>, Error> {
    let mut config = config.clone();
    config.run.seed = seed;
    let gates = config.gates.clone();
    let (rank, mesh) = (world.env.rank, config.plan.mesh);
    let mut gated = session_on(&config, world.backend.clone())?;
    let reference = CpuBackend::one_rank(mesh, rank, &world.links)
        .map_err(|e| Error::Backend(e.to_string()))?;
    let mut reference = session_on(&config, Arc::new(reference))?;
    gated.inject_faults(*faults);
    reference.inject_faults(*faults);
    // Another rank's failure ends this one's waits (the gather below still works).
    world.rendezvous.watch(gated.peer_abort())?;
    let ref_gates = no_sync_pattern(gates.len());
    let params = gated.params().to_vec();
    let micro_batches = gates.len() as u32;
    let mut fig = RankFigures {
        rank,
        ..RankFigures::default()
    };
    let mut norms = NormCheck::of(&config, steps, faults);
    let forward = gated.has_forward();
    if forward {
        (fig.forward_mismatches, fig.forward_rel_err) = (Some(0), Some(0.0));
    }
    for step in 0..steps {
        let (mine, theirs) = match forward {
            true => (pieces(&gated, rank)?, pieces(&reference, rank)?),
            false => (Vec::new(), Vec::new()),
        };
        let (mut differ, mut forward_err) = (0u64, 0.0f64);
        let report = synthetic_step_with(&mut gated, seed, step, &gates, |_, _, p, v| {
            differ += mismatches(v, mine.get(p as usize));
            if let Some(Some((range, want))) = theirs.get(p as usize) {
                let got = v.get(range.clone()).unwrap_or_default();
                forward_err = forward_err.max(full_rel_err(got, want));
            }
        })
        .await?;
        if let (Some(n), Some(e)) = (
            fig.forward_mismatches.as_mut(),
            fig.forward_rel_err.as_mut(),
        ) {
            (*n, *e) = (*n + differ, e.max(forward_err));
        }
        fig.partials_left += report.stats.partials_left;
        synthetic_step(&mut reference, seed, step, &ref_gates).await?;
        let factor = match norms.as_mut() {
            None => 1.0,
            Some(n) => match n.step(&config, &params, (step, micro_batches), &report, None) {
                StepCheck::Compare(f) => f,
                StepCheck::Skipped => {
                    if rank == 0 {
                        progress(step + 1);
                    }
                    continue;
                }
            },
        };
        compare_grads(&mut fig, &gated, &config, (step, micro_batches), factor)?;
        if rank == 0 {
            progress(step + 1);
        }
    }
    compare_params(&mut fig, &gated, &reference)?;
    fig.norm = norms.map(NormCheck::finish);
    drop((gated, reference));
    let Some(all) = figures::gather(&mut world.rendezvous, &fig, GATHER_TIMEOUT)? else {
        return Ok(None);
    };
    let (grad, param) = tolerances(config.plan.reduce.dtype);
    let tol = Tolerances {
        grad,
        param,
        update: None,
    };
    Ok(Some(figures::merge(&config, steps, &gates, &all, tol)))
}

/// Folds into `fig` the relative error of every gradient this rank's optimizers consumed
/// in step `step` (of `micro_batches`) against the exact reference, scaled by the clip
/// `factor`.
fn compare_grads(
    fig: &mut RankFigures,
    gated: &Session<CpuBackend>,
    config: &Config,
    (step, micro_batches): (u64, u32),
    factor: f64,
) -> Result<(), Error> {
    let (rank, mesh) = (fig.rank, config.plan.mesh);
    for (i, p) in gated.params().iter().enumerate() {
        let Some(got) = gated.reduced_grad(rank, i as ParamId)? else {
            continue;
        };
        let numel = p.spec.numel() as usize;
        let reference = reference_grad(config, step, micro_batches, i as ParamId, numel);
        let (full, magnitude) = clipped(reference, factor);
        let r = p.spec.shard_range(mesh.shard, mesh.coord(rank).shard);
        let piece = r.start as usize..r.end as usize;
        let e = rel_err(&got, &full[piece.clone()], &magnitude[piece]);
        fig.gradient(e, step, &p.spec.name, p.spec.route);
    }
    Ok(())
}

/// Folds into `fig` the relative error of this rank's parameters against the reference
/// session's.
fn compare_params(
    fig: &mut RankFigures,
    gated: &Session<CpuBackend>,
    reference: &Session<CpuBackend>,
) -> Result<(), Error> {
    for i in 0..gated.params().len() as ParamId {
        let (a, b) = (
            gated.param_values(fig.rank, i)?,
            reference.param_values(fig.rank, i)?,
        );
        if let (Some(a), Some(b)) = (a, b) {
            let b: Vec<f64> = b.iter().map(|&x| f64::from(x)).collect();
            fig.param_rel_err = fig.param_rel_err.max(rel_err(&a, &b, &[]));
        }
    }
    Ok(())
}

/// The pieces `rank` holds of every parameter, read as [`Session::full_param`] does.
fn pieces(s: &Session<CpuBackend>, rank: u32) -> Result<Pieces, Error> {
    let mesh = s.spec().mesh;
    let c = mesh.coord(rank);
    let mut out = Vec::new();
    for (i, p) in s.params().iter().enumerate() {
        let r = p.spec.shard_range(mesh.shard, c.shard);
        let range = r.start as usize..r.end as usize;
        let held = match p.owner.is_some_and(|o| o.shard != c.shard) {
            true => None,
            false => s.param_values(rank, i as ParamId)?,
        };
        out.push(held.filter(|v| v.len() == range.len()).map(|v| (range, v)));
    }
    Ok(out)
}

/// Elements of a gathered full parameter `got`, in the piece this rank held, that
/// differ bit for bit from it (a gather shorter than the piece counts the missing ones).
fn mismatches(got: &[f32], held: Option<&Option<(Range<usize>, Vec<f32>)>>) -> u64 {
    let Some(Some((range, want))) = held else {
        return 0;
    };
    let got = got.get(range.clone()).unwrap_or_default();
    let differ = got
        .iter()
        .zip(want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    (differ + want.len().abs_diff(got.len())) as u64
}
