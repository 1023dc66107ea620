//! What a rank of a multi-process `overlap verify` found, sent to rank 0, and rank 0's
//! report from every rank's figures: shared by the CPU backend's verification
//! ([`crate::cpu::verify`]) and the GPU's (`crate::cuda::verify`).
//!
//! Invariant: the report judges the worst figure of any rank against the tolerances,
//! so a job passes only when every rank does.

use std::collections::BTreeMap;

use overlap::config::Config;
use overlap::verify::{NormFigures, VerifyReport};
use overlap::Error;
use overlap_graph::{Gate, Route};
use serde::{Deserialize, Serialize};

use crate::rendezvous::Rendezvous;
use crate::DistError;

/// One rank's figures, sent to rank 0.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct RankFigures {
    pub(crate) rank: u32,
    pub(crate) worst: f64,
    pub(crate) worst_at: String,
    pub(crate) per_route: BTreeMap<String, f64>,
    pub(crate) param_rel_err: f64,
    pub(crate) update_rel_err: BTreeMap<String, f64>,
    pub(crate) partials_left: usize,
    pub(crate) norm: Option<NormFigures>,
    /// With `[forward]`: the worst relative error of a gathered full parameter against
    /// the reference's parameters at the step's start.
    pub(crate) forward_rel_err: Option<f64>,
    /// With `[forward]` on the CPU backend: gathered elements that differ, bit for bit,
    /// from the piece this rank held at the step's start.
    #[serde(default)]
    pub(crate) forward_mismatches: Option<u64>,
}

impl RankFigures {
    /// Folds in a consumed gradient's relative error `e` of parameter `name` (of
    /// `route`) at 0-based `step`.
    pub(crate) fn gradient(&mut self, e: f64, step: u64, name: &str, route: Route) {
        let slot = self
            .per_route
            .entry(route.name().to_string())
            .or_insert(0.0);
        *slot = slot.max(e);
        if e > self.worst || self.worst_at.is_empty() {
            self.worst = self.worst.max(e);
            self.worst_at = format!("step {}, rank {}, {name}", step + 1, self.rank);
        }
    }
}

/// What the report judges against: gradients, parameters, and each optimizer's update
/// (`None`: not judged).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tolerances {
    pub(crate) grad: f64,
    pub(crate) param: f64,
    pub(crate) update: Option<[(&'static str, f64); 2]>,
}

/// Sends this rank's figures to rank 0, which returns every rank's (`None` elsewhere),
/// waiting at most `timeout` for each.
pub(crate) fn gather(
    rendezvous: &mut Rendezvous,
    fig: &RankFigures,
    timeout: std::time::Duration,
) -> Result<Option<Vec<RankFigures>>, Error> {
    let bytes = serde_json::to_vec(fig).map_err(|e| Error::Usage(e.to_string()))?;
    let Some(all) = rendezvous.gather(&bytes, timeout)? else {
        return Ok(None);
    };
    all.iter()
        .enumerate()
        .map(|(r, b)| {
            serde_json::from_slice::<RankFigures>(b).map_err(|e| {
                Error::Dist(DistError::Rendezvous(format!(
                    "rank {r} sent unreadable verify figures: {e}"
                )))
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// Rank 0's report from every rank's figures.
pub(crate) fn merge(
    config: &Config,
    steps: u64,
    gates: &[Gate],
    figures: &[RankFigures],
    tol: Tolerances,
) -> VerifyReport {
    let mut per_route: BTreeMap<String, f64> = BTreeMap::new();
    let mut update_rel_err: BTreeMap<String, f64> = BTreeMap::new();
    let (mut worst, mut worst_at, mut param_rel_err, mut partials_left) =
        (0.0f64, String::new(), 0.0f64, 0usize);
    let mut norm: Option<NormFigures> = None;
    let mut forward_rel_err: Option<f64> = None;
    let mut forward_mismatches: Option<u64> = None;
    for f in figures {
        if let Some(e) = f.forward_rel_err {
            forward_rel_err = Some(forward_rel_err.unwrap_or(0.0).max(e));
        }
        if let Some(n) = f.forward_mismatches {
            forward_mismatches = Some(forward_mismatches.unwrap_or(0) + n);
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
    let updates_ok = tol.update.map_or(true, |tols| {
        tols.iter()
            .all(|(k, t)| update_rel_err.get(*k).map_or(true, |e| e <= t))
    });
    let ok = worst <= tol.grad
        && param_rel_err <= tol.param
        && updates_ok
        && partials_left == 0
        && forward_mismatches.map_or(true, |n| n == 0)
        && forward_rel_err.map_or(true, |e| e <= tol.param)
        && norm.as_ref().map_or(true, |n| n.ok(tol.grad));
    VerifyReport {
        ok,
        worst_rel_err: worst,
        per_route,
        param_rel_err,
        update_rel_err,
        partials_left,
        forward_mismatches,
        forward_rel_err,
        steps,
        ranks: config.plan.mesh.world(),
        gates: Gate::pattern_label(gates),
        grad_tolerance: tol.grad,
        param_tolerance: tol.param,
        worst_at,
        norm,
    }
}
