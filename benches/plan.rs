//! Planning cost of a large model: `Planner::new`, `Planner::plan` (build + lower) and
//! `validate`, for 1,000 parameters in 64 layers on an 8x16 mesh (128 ranks) with gates
//! `[off, on]`.
//!
//! ```text
//! cargo bench --bench plan -- --warm-up-time 1 --measurement-time 3
//! ```
//!
//! The plan's size is printed first, so per-node and per-rank costs can be derived.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use overlap_graph::{validate, Gate, Mesh, Mode, ParamSpec, PlanSpec, Planner, Route};

const PARAMS: usize = 1000;
const LAYERS: u32 = 64;
const HIDDEN: u64 = 1024;

/// A transformer-like stack: per layer, attention and MLP matrices (muon), norms (fsdp),
/// biases (adamw, owned), and a large embedding-like table (sharded_adamw) now and then.
fn params() -> Vec<ParamSpec> {
    let h = HIDDEN;
    (0..PARAMS)
        .map(|i| {
            let layer = (i as u64 * u64::from(LAYERS) / PARAMS as u64) as u32;
            let (route, shape) = match i % 8 {
                0 | 1 => (Route::Muon, vec![h, h]),
                2 => (Route::Muon, vec![4 * h, h]),
                3 => (Route::Muon, vec![h, 4 * h]),
                4 | 5 => (Route::Fsdp, vec![h]),
                6 => (Route::Adamw, vec![h]),
                _ => (Route::ShardedAdamw, vec![8 * h, h]),
            };
            ParamSpec::new(format!("l{layer}.p{i}"), shape, route, layer)
        })
        .collect()
}

fn spec() -> PlanSpec {
    PlanSpec::new(Mesh::new(8, 16).unwrap(), params()).with_bucket_cap_bytes(25 << 20)
}

fn bench_plan(c: &mut Criterion) {
    let gates = [Gate::ReplicateOff, Gate::On];
    let planner = Planner::new(spec()).unwrap();
    let plan = planner.plan(&gates).unwrap();
    let nodes: usize = plan.ranks.iter().map(|r| r.nodes.len()).sum();
    let instrs: usize = plan
        .ranks
        .iter()
        .flat_map(|r| &r.streams)
        .map(|s| s.instrs.len())
        .sum();
    let events: u64 = plan.ranks.iter().map(|r| u64::from(r.events)).sum();
    println!(
        "plan: {} params, {} buckets, mesh {} ({} ranks), gates {}: {nodes} nodes ({} per rank), {instrs} instructions, {events} events",
        plan.params.len(),
        plan.buckets.len(),
        plan.mesh,
        plan.mesh.world(),
        Gate::pattern_label(&gates),
        nodes / plan.ranks.len(),
    );
    let violations = validate(&plan, Mode::Step);
    assert!(violations.is_empty(), "{violations:#?}");

    let mut group = c.benchmark_group("plan");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    group.bench_function("planner_new", |b| {
        b.iter_batched(
            spec,
            |s| Planner::new(black_box(s)).unwrap(),
            BatchSize::SmallInput,
        )
    });
    group.bench_function("plan", |b| {
        b.iter(|| planner.plan(black_box(&gates)).unwrap())
    });
    group.bench_function("validate", |b| {
        b.iter(|| validate(black_box(&plan), Mode::Step))
    });
    group.finish();
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
