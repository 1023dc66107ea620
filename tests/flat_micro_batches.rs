//! A micro-batch costs the same however many came before it in the step (issue 12):
//! how many plans the session builds and the executor prepares as the micro-batches
//! grow, and that running micro-batches on plans planned ahead of them gives, bit for
//! bit, the results of running each step on its own plan planned fresh.

use std::sync::Arc;

use overlap::drive::synthetic_step;
use overlap::executor::{ExecConfig, Executor};
use overlap::graph::{Buffer, Mode, ParamId, Planner, Schedule, Transport};
use overlap::ops::cpu::CpuBackend;
use overlap::{synthetic, Gate, Mesh, ParamSpec, PlanSpec, Route, Session};
use Gate::{NoSync as N, On as O, ReplicateOff as F};

const SEED: u64 = 7;

fn spec(shard: u32, replicate: u32, schedule: Schedule) -> PlanSpec {
    PlanSpec::new(
        Mesh::new(shard, replicate).unwrap(),
        vec![
            ParamSpec::new("w", [6, 5], Route::Muon, 2),
            ParamSpec::new("norm", [9], Route::Fsdp, 2),
            ParamSpec::new("bias", [7], Route::Adamw, 1),
            ParamSpec::new("emb", [11, 3], Route::ShardedAdamw, 0),
        ],
    )
    .with_bucket_cap_bytes(1 << 20)
    .with_schedule(schedule)
}

fn session(spec: PlanSpec) -> (Session<CpuBackend>, Arc<CpuBackend>) {
    let backend = Arc::new(CpuBackend::new(spec.mesh));
    let mut s = Session::new(spec, backend.clone(), ExecConfig::default()).unwrap();
    s.init_params(|i, p| synthetic::init(SEED, i, p.spec.numel() as usize))
        .unwrap();
    (s, backend)
}

/// `ceil(log2(m + 1))`: the doublings from one micro-batch to `m`.
fn doublings(m: usize) -> u64 {
    u64::from(usize::BITS - m.leading_zeros())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_micro_batches_build_and_prepare_no_plan_after_the_first_step() {
    for m in [1usize, 2, 37, 200] {
        let (mut s, _) = session(spec(2, 1, Schedule::default()));
        let gates = Gate::default_pattern(m);
        synthetic_step(&mut s, SEED, 0, &gates).await.unwrap();
        let built = s.plans_built();
        let prepared = s.plan_cache().prepared;
        // Plans of 2, 6, 14, … micro-batches while the guess holds, one when the last
        // gate breaks it, and the step's own: O(log M), not one per micro-batch.
        assert!(
            built <= doublings(m) + 3,
            "M = {m}: {built} plans built in the first step"
        );
        // Each plan built was adopted once, none twice.
        assert_eq!(prepared, built, "M = {m}");
        for step in 1..4 {
            synthetic_step(&mut s, SEED, step, &gates).await.unwrap();
        }
        assert_eq!(s.plans_built(), built, "M = {m}: later steps plan nothing");
        assert_eq!(
            s.plan_cache().prepared,
            prepared,
            "M = {m}: later steps prepare nothing"
        );
        // Only the step plan stays prepared: the plans planned ahead are let go of.
        assert_eq!(s.plan_cache().held, 1, "M = {m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alternating_patterns_reuse_their_step_plans() {
    let (mut s, _) = session(spec(2, 1, Schedule::default()));
    let long = Gate::default_pattern(150);
    let alternating: Vec<Gate> = (0..60)
        .map(|i| if i % 2 == 0 { Gate::NoSync } else { Gate::On })
        .collect();
    synthetic_step(&mut s, SEED, 0, &long).await.unwrap();
    let after_long = s.plans_built();
    synthetic_step(&mut s, SEED, 1, &alternating).await.unwrap();
    // A period-2 pattern is guessed from its first two gates: a few plans, not 60.
    assert!(
        s.plans_built() - after_long <= doublings(60) + 3,
        "{} plans for the alternating step",
        s.plans_built() - after_long
    );
    let (built, prepared) = (s.plans_built(), s.plan_cache().prepared);
    for step in 2..6 {
        let gates = if step % 2 == 0 { &long } else { &alternating };
        synthetic_step(&mut s, SEED, step, gates).await.unwrap();
    }
    assert_eq!(s.plans_built(), built, "both step plans are cached");
    assert_eq!(s.plan_cache().prepared, prepared);
    assert_eq!(s.plan_cache().held, 2);
}

/// The reference: an executor that runs every step on the plan of exactly its gates,
/// planned and validated fresh, adopted once before its first micro-batch.
struct Fresh {
    planner: Planner,
    exec: Executor<CpuBackend>,
    backend: Arc<CpuBackend>,
    layers: Vec<u32>,
}

impl Fresh {
    fn new(spec: PlanSpec) -> Fresh {
        let planner = Planner::new(spec).unwrap();
        let mesh = planner.spec().mesh;
        let backend = Arc::new(CpuBackend::new(mesh));
        let mut exec = Executor::new(backend.clone(), ExecConfig::default());
        for (i, p) in planner.params().iter().enumerate() {
            let full = synthetic::init(SEED, i as ParamId, p.spec.numel() as usize);
            for rank in exec.local_ranks() {
                let c = mesh.coord(rank);
                if p.owner.is_some_and(|o| o.shard != c.shard) {
                    continue;
                }
                let r = p.spec.shard_range(mesh.shard, c.shard);
                exec.init_param(rank, i as ParamId, &full[r.start as usize..r.end as usize])
                    .unwrap();
            }
        }
        let mut layers: Vec<u32> = planner.params().iter().map(|p| p.spec.layer).collect();
        layers.sort_unstable_by(|a, b| b.cmp(a));
        layers.dedup();
        Fresh {
            planner,
            exec,
            backend,
            layers,
        }
    }

    /// Hands in `gates`' micro-batches of step `step` on the plan of exactly them
    /// (`whole`: the step's, else the prefix's), the last one up to `last_layers` layers.
    async fn issue(&mut self, step: u64, gates: &[Gate], whole: bool, last_layers: usize) {
        let mode = if whole { Mode::Step } else { Mode::Prefix };
        let plan = self.planner.plan_checked(gates, mode).unwrap();
        self.exec.adopt(&plan);
        for m in 0..gates.len() as u32 {
            let n = if m as usize + 1 == gates.len() {
                last_layers
            } else {
                self.layers.len()
            };
            for &layer in &self.layers[..n] {
                self.exec
                    .grad_ready(m, layer, |r, p, out| {
                        synthetic::grad(SEED, step, m, r, p, out)
                    })
                    .await
                    .unwrap();
            }
        }
    }
}

/// What the session did, step by step, and the reference does the same way.
#[derive(Clone, Copy)]
enum Act<'a> {
    /// A whole step with these gates.
    Step(&'a [Gate]),
    /// A whole step with these gates whose `fold` on rank 1 fails.
    Failing(&'a [Gate]),
    /// These micro-batches, the last one with only its first layer, then `zero_grad`.
    Discard(&'a [Gate]),
}

async fn same_as_fresh(spec: PlanSpec, acts: &[Act<'_>]) {
    let (mut s, backend) = session(spec.clone());
    let mut fresh = Fresh::new(spec);
    let ranks = s.local_ranks();
    let params = s.params().len() as ParamId;
    for (step, act) in acts.iter().enumerate() {
        let step = step as u64;
        match *act {
            Act::Step(gates) => {
                synthetic_step(&mut s, SEED, step, gates).await.unwrap();
                fresh.issue(step, gates, true, fresh.layers.len()).await;
                fresh.exec.finish_step().await.unwrap();
            }
            Act::Failing(gates) => {
                backend.inject_fault(1, "fold");
                assert!(synthetic_step(&mut s, SEED, step, gates).await.is_err());
                backend.clear_faults();
                fresh.backend.inject_fault(1, "fold");
                fresh.issue(step, gates, true, fresh.layers.len()).await;
                assert!(fresh.exec.finish_step().await.is_err());
                fresh.backend.clear_faults();
            }
            Act::Discard(gates) => {
                for (m, &gate) in gates.iter().enumerate() {
                    s.begin_micro_batch(gate).await.unwrap();
                    let n = if m + 1 == gates.len() {
                        1
                    } else {
                        s.layers().len()
                    };
                    for layer in s.layers().into_iter().take(n) {
                        s.grad_ready(layer, |r, p, out| {
                            synthetic::grad(SEED, step, m as u32, r, p, out)
                        })
                        .await
                        .unwrap();
                    }
                }
                s.zero_grad().await.unwrap();
                fresh.issue(step, gates, false, 1).await;
                fresh.exec.discard().await.unwrap();
            }
        }
        for &rank in &ranks {
            for param in 0..params {
                let bits = |v: Option<Vec<f32>>| {
                    v.map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
                };
                let ours = bits(s.param_values(rank, param).unwrap());
                let theirs = bits(fresh.exec.read(rank, Buffer::Param { param }).unwrap());
                assert_eq!(ours, theirs, "after act {step}: rank {rank} param {param}");
                if matches!(act, Act::Step(_)) {
                    let ours = bits(s.reduced_grad(rank, param).unwrap());
                    let theirs = bits(fresh.exec.read(rank, Buffer::Reduced { param }).unwrap());
                    assert_eq!(
                        ours, theirs,
                        "after act {step}: rank {rank} reduced gradient of {param}"
                    );
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gate_pattern_changes_mid_stream_match_planning_each_step_fresh() {
    let acts = [
        Act::Step(&[F, F, O]),
        Act::Step(&[O, O]),
        Act::Step(&[N, O]),
        // Longer than any plan so far, then back to a cached pattern.
        Act::Step(&[O, O, O, O, O]),
        Act::Step(&[F, F, O]),
        // Diverges from the current plan at its second micro-batch.
        Act::Step(&[F, O]),
        Act::Discard(&[O, F, F]),
        Act::Step(&[N, F, O]),
        Act::Failing(&[F, F, O]),
        Act::Step(&[F, F, O]),
        Act::Step(&[N, N, N, O, F, O]),
        Act::Step(&[O]),
        Act::Step(&[N, O]),
    ];
    let copy = |combine_lag| {
        Schedule::default()
            .with_transport(Transport::Copy)
            .with_combine_lag(combine_lag)
    };
    for (shard, replicate, schedule) in [
        (2, 2, Schedule::default()),
        (2, 2, copy(1)),
        (1, 2, copy(0)),
        (2, 1, copy(1)),
    ] {
        same_as_fresh(spec(shard, replicate, schedule), &acts).await;
    }
}
