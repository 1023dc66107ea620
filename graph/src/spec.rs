//! Limits on the planner's input, so that no input makes planning abort or run for hours.
//!
//! A step plan holds, for every rank of the world, every node of every micro-batch, so
//! its size is the product of the sizes of the input: ranks × micro-batches × (layers +
//! bucket chains) plus the optimizer tail. Each factor has its own limit (a mesh's
//! [`MAX_WORLD`](crate::MAX_WORLD), a parameter's [`MAX_NUMEL`](crate::MAX_NUMEL),
//! [`MAX_PARAMS`], [`MAX_MICRO_BATCHES`]) and the product has [`MAX_STEP_NODES`]:
//! [`PlanSpec::check`] and [`Planner::check_step`] reject input past them with an error
//! that names the key, before anything of that size is allocated.

use crate::build::Planner;
use crate::plan::PlanSpec;
use crate::PlanError;

/// The most parameters a spec may have. Packing buckets compares every parameter with
/// every (layer, route, owner) group, so planning grows with its square: 4096 model
/// layers (24 579 parameters) take 16 s to plan in a debug build.
pub const MAX_PARAMS: usize = 32_768;

/// The most micro-batches a step may have.
pub const MAX_MICRO_BATCHES: usize = 65_536;

/// The most nodes a step plan may have over all ranks (an upper bound computed by
/// [`PlanSpec::step_nodes_bound`]). A plan and its validation take about 160 bytes per
/// node (measured on `overlap plan` of a 16x16 mesh, 865 k nodes, 136 MB), so this is
/// about 2.7 GB.
pub const MAX_STEP_NODES: u64 = 1 << 24;

/// Nodes a bucket's chain has at most in one micro-batch: pack, a Stage 1 (one node, or
/// an exchange and a combine), a fold, a Stage 2 (one node, or an exchange, a combine
/// and a gather), an unpack, and one spare for an accumulation.
const CHAIN_NODES: u64 = 9;

impl PlanSpec {
    /// Checks everything [`Planner::new`] needs, and the sizes: the mesh, at least one and
    /// at most [`MAX_PARAMS`] parameters, each parameter, unique names, a non-zero
    /// bucket cap, and that a one-micro-batch step stays within [`MAX_STEP_NODES`] even
    /// with a bucket per parameter.
    pub fn check(&self) -> Result<(), PlanError> {
        self.mesh.check()?;
        if self.params.is_empty() {
            return Err(PlanError::Input {
                key: "param".into(),
                reason: "no parameters: add [[param]] entries or a [model]".into(),
            });
        }
        if self.params.len() > MAX_PARAMS {
            return Err(PlanError::Input {
                key: "param".into(),
                reason: format!(
                    "{} parameters, more than the limit of {MAX_PARAMS}",
                    self.params.len()
                ),
            });
        }
        let mut names = std::collections::HashSet::new();
        for p in &self.params {
            p.check()?;
            if !names.insert(p.name.as_str()) {
                return Err(PlanError::Param {
                    name: p.name.clone(),
                    reason: "the name is used twice".into(),
                });
            }
        }
        if self.bucket_cap_bytes == 0 {
            return Err(PlanError::Input {
                key: "buckets.cap_bytes".into(),
                reason: "must be at least 1".into(),
            });
        }
        self.check_step_nodes(self.params.len(), 1)
    }

    /// An upper bound on the nodes of a step plan over all ranks, with `buckets` buckets
    /// and `micro_batches` micro-batches: per rank and micro-batch a `grad_ready` per
    /// layer and at most `CHAIN_NODES` per bucket, per rank an optimizer and a publish
    /// per parameter. Saturates instead of overflowing.
    pub fn step_nodes_bound(&self, buckets: usize, micro_batches: usize) -> u64 {
        let mut layers: Vec<u32> = self.params.iter().map(|p| p.layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let mut per_mb =
            (layers.len() as u64).saturating_add((buckets as u64).saturating_mul(CHAIN_NODES));
        if self.forward.is_some() {
            // A forward and a backward point per layer; per parameter at most two
            // gathers and two frees.
            per_mb = per_mb
                .saturating_add(2 * layers.len() as u64)
                .saturating_add(4 * self.params.len() as u64);
        }
        let tail = (self.params.len() as u64).saturating_mul(2);
        let per_rank = per_mb
            .saturating_mul(micro_batches as u64)
            .saturating_add(tail);
        per_rank.saturating_mul(u64::from(self.mesh.world()))
    }

    /// Rejects a step of `micro_batches` micro-batches over `buckets` buckets whose plan
    /// could pass [`MAX_STEP_NODES`], or more than [`MAX_MICRO_BATCHES`] micro-batches.
    /// The error's key is the factor most likely at fault: the micro-batches when there
    /// are several, else the mesh when it has several ranks, else the parameters.
    pub fn check_step_nodes(&self, buckets: usize, micro_batches: usize) -> Result<(), PlanError> {
        if micro_batches > MAX_MICRO_BATCHES {
            return Err(PlanError::Input {
                key: "accumulation.micro_batches".into(),
                reason: format!(
                    "{micro_batches} micro-batches, more than the limit of {MAX_MICRO_BATCHES}"
                ),
            });
        }
        let nodes = self.step_nodes_bound(buckets, micro_batches);
        if nodes <= MAX_STEP_NODES {
            return Ok(());
        }
        let key = if micro_batches > 1 {
            "accumulation.micro_batches"
        } else if self.mesh.world() > 1 {
            "mesh"
        } else {
            "param"
        };
        Err(PlanError::Input {
            key: key.into(),
            reason: format!(
                "a step of {micro_batches} micro-batches on mesh {} ({} ranks) with {} parameters in {buckets} buckets could have {nodes} plan nodes, more than the limit of {MAX_STEP_NODES}; use fewer micro-batches, ranks or parameters (or larger buckets)",
                self.mesh,
                self.mesh.world(),
                self.params.len(),
            ),
        })
    }
}

impl Planner {
    /// [`PlanSpec::check_step_nodes`] with this planner's buckets: call it before
    /// [`Planner::plan`] with a gate list of unknown length.
    pub fn check_step(&self, micro_batches: usize) -> Result<(), PlanError> {
        self.spec()
            .check_step_nodes(self.buckets().len(), micro_batches)
    }

    /// [`PlanSpec::step_nodes_bound`] with this planner's buckets.
    pub fn step_nodes_bound(&self, micro_batches: usize) -> u64 {
        self.spec()
            .step_nodes_bound(self.buckets().len(), micro_batches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Bindings, Gate, Mesh, ParamSpec, ReduceSpec, Route, Schedule};

    fn spec(shard: u32, replicate: u32, params: usize) -> PlanSpec {
        PlanSpec {
            mesh: Mesh { shard, replicate },
            params: (0..params)
                .map(|i| ParamSpec {
                    name: format!("p{i}"),
                    shape: vec![4, 3],
                    route: if i % 2 == 0 { Route::Muon } else { Route::Fsdp },
                    layer: (i % 3) as u32,
                })
                .collect(),
            reduce: ReduceSpec::default(),
            bucket_cap_bytes: 1 << 20,
            bindings: Bindings::default(),
            schedule: Schedule::default(),
            grad_norm: false,
            forward: None,
            update_rates: Default::default(),
        }
    }

    #[test]
    fn the_bound_holds_on_real_plans() {
        for (s, r, n, gates) in [
            (2, 2, 5, vec![Gate::ReplicateOff, Gate::On]),
            (3, 1, 7, vec![Gate::NoSync, Gate::ReplicateOff, Gate::On]),
            (1, 4, 2, vec![Gate::On]),
        ] {
            let mut sp = spec(s, r, n);
            for transport in [crate::Transport::Nccl, crate::Transport::Copy] {
                sp.schedule.transport = transport;
                let planner = Planner::new(sp.clone()).unwrap();
                let plan = planner.plan(&gates).unwrap();
                let nodes: u64 = plan.ranks.iter().map(|r| r.nodes.len() as u64).sum();
                let bound = planner.step_nodes_bound(gates.len());
                assert!(nodes <= bound, "{nodes} nodes > bound {bound}");
                planner.check_step(gates.len()).unwrap();
            }
        }
    }

    #[test]
    fn absurd_sizes_are_rejected_with_the_key() {
        let e = spec(MAX_WORLD_TEST, 1, 1).check().unwrap_err();
        assert!(matches!(e, PlanError::Mesh(_)), "{e}");
        let planner = Planner::new(spec(2, 2, 4)).unwrap();
        let e = planner.check_step(MAX_MICRO_BATCHES + 1).unwrap_err();
        assert!(
            e.to_string().starts_with("accumulation.micro_batches:"),
            "{e}"
        );
        let e = planner.check_step(1_000_000_000).unwrap_err();
        assert!(e.to_string().contains("limit of 65536"), "{e}");
        let big = spec(4096, 4, 128);
        let e = big.check().unwrap_err();
        assert!(e.to_string().starts_with("mesh:"), "{e}");
        assert!(e.to_string().contains("plan nodes"), "{e}");
        let e = spec(1, 1, 0).check().unwrap_err();
        assert!(e.to_string().contains("no parameters"), "{e}");
        let mut dup = spec(1, 1, 2);
        dup.params[1].name = "p0".into();
        assert!(dup.check().unwrap_err().to_string().contains("twice"));
    }

    const MAX_WORLD_TEST: u32 = crate::MAX_WORLD + 1;
}
