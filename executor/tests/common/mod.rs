//! A small rig for the executor's own tests: a planner and an executor over the CPU
//! backend, parameters initialised, and whole steps driven the way a session drives them
//! (adopt the step's plan, hand in every layer of every micro-batch from the highest
//! down, finish the step). Each test binary uses part of it.
#![allow(dead_code)]

use std::sync::Arc;

use overlap_executor::{ExecConfig, ExecError, Executor, StepStats};
use overlap_graph::{Buffer, Gate, Mesh, Mode, ParamSpec, PlanSpec, Planner, Route, Validated};
use overlap_ops::cpu::CpuBackend;

/// `layers` layers of one `fsdp` parameter each (sizes that need padding on a shard
/// group of 2 among them), plus an `adamw` and a `muon` parameter on the top layer; a
/// bucket cap small enough that every layer packs a bucket of its own.
pub fn spec(shard: u32, replicate: u32, layers: u32) -> PlanSpec {
    let p = |name: String, shape: Vec<u64>, route, layer| ParamSpec::new(name, shape, route, layer);
    let top = layers.saturating_sub(1);
    let mut params: Vec<ParamSpec> = (0..layers)
        .map(|l| p(format!("l{l}.w"), vec![8 + u64::from(l)], Route::Fsdp, l))
        .collect();
    params.push(p("bias".into(), vec![7], Route::Adamw, top));
    params.push(p("proj".into(), vec![4, 6], Route::Muon, top));
    PlanSpec::new(Mesh::new(shard, replicate).expect("a valid mesh"), params)
        .with_bucket_cap_bytes(64)
}

/// An executor over the CPU backend for every rank of a spec's mesh, with its planner.
pub struct Rig {
    pub exec: Executor<CpuBackend>,
    pub planner: Planner,
}

impl Rig {
    /// Parameters set to a fixed pattern on every rank that holds them.
    pub fn new(spec: PlanSpec, cfg: ExecConfig) -> Rig {
        let backend = Arc::new(CpuBackend::new(spec.mesh));
        let mut exec = Executor::new(backend, cfg);
        let planner = Planner::new(spec).expect("a valid spec");
        let mesh = planner.spec().mesh;
        for (i, p) in planner.params().iter().enumerate() {
            let full: Vec<f32> = (0..p.spec.numel())
                .map(|e| (e % 13) as f32 * 0.1 - 0.6 + i as f32 * 0.01)
                .collect();
            for rank in exec.local_ranks() {
                let c = mesh.coord(rank);
                if p.owner.is_some_and(|o| o.shard != c.shard) {
                    continue;
                }
                let r = p.spec.shard_range(mesh.shard, c.shard);
                exec.init_param(rank, i as u32, &full[r.start as usize..r.end as usize])
                    .expect("init_param");
            }
        }
        Rig { exec, planner }
    }

    /// The validated plan of a whole step of `gates`.
    pub fn plan(&self, gates: &[Gate]) -> Validated {
        self.planner
            .plan_checked(gates, Mode::Step)
            .expect("a valid step plan")
    }

    /// The layers, from the highest down (the order a backward hands them in).
    pub fn layers(&self) -> Vec<u32> {
        let top = self
            .planner
            .params()
            .iter()
            .map(|p| p.spec.layer)
            .max()
            .unwrap_or(0);
        (0..=top).rev().collect()
    }

    /// Hands in every layer of micro-batch `m` with gradients that depend on the rank,
    /// the parameter, the element, `m` and the executor's step.
    pub async fn micro_batch(&mut self, m: u32) -> Result<(), ExecError> {
        let step = self.exec.steps_done() as u32;
        for layer in self.layers() {
            self.exec
                .grad_ready(m, layer, |rank, param, out| {
                    for (i, x) in out.iter_mut().enumerate() {
                        let k = rank * 7 + param * 13 + i as u32 + m * 3 + step;
                        *x = (k % 11) as f32 * 0.37 - 1.1;
                    }
                })
                .await?;
        }
        Ok(())
    }

    /// One whole step of `plan`: adopt, every micro-batch, finish.
    pub async fn step(&mut self, plan: &Validated) -> Result<StepStats, ExecError> {
        self.exec.adopt(plan);
        for m in 0..plan.plan().gates.len() as u32 {
            self.micro_batch(m).await?;
        }
        self.exec.finish_step().await
    }

    /// Every parameter's values on every local rank (`None` where a rank holds none).
    pub fn params(&self) -> Vec<Option<Vec<f32>>> {
        let mut out = Vec::new();
        for rank in self.exec.local_ranks() {
            for param in 0..self.planner.params().len() as u32 {
                out.push(self.exec.read(rank, Buffer::Param { param }).expect("read"));
            }
        }
        out
    }
}

/// The bits of every value, for comparisons that must be exact.
pub fn bits(values: &[Option<Vec<f32>>]) -> Vec<Option<Vec<u32>>> {
    values
        .iter()
        .map(|v| v.as_ref().map(|v| v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}
