//! Host cost of issuing a plan that is reused step after step: the executor's time per
//! node (launches, records, waits, buffer and pool bookkeeping), measured on the CPU
//! backend for a 1,000-parameter, 64-layer model on a 2x2 mesh with gates `[off, on]`.
//!
//! ```text
//! cargo bench --bench host -- --warm-up-time 1 --measurement-time 5
//! ```
//!
//! Criterion reports the time per node (throughput in elements = nodes). The measured
//! time is the executor's own issue time (`StepStats::issue_seconds`), not the step's
//! wall time, which on the CPU backend is dominated by the kernels' arithmetic.

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use overlap::drive::synthetic_step;
use overlap::executor::ExecConfig;
use overlap::ops::cpu::CpuBackend;
use overlap::{Gate, Mesh, ParamSpec, PlanSpec, Route, Session};

fn spec() -> PlanSpec {
    let params = (0..1000u32)
        .map(|i| {
            let layer = i * 64 / 1000;
            let (route, shape) = match i % 8 {
                0..=3 => (Route::Muon, vec![8, 8]),
                4 | 5 => (Route::Fsdp, vec![8]),
                6 => (Route::Adamw, vec![8]),
                _ => (Route::ShardedAdamw, vec![16, 8]),
            };
            ParamSpec::new(format!("l{layer}.p{i}"), shape, route, layer)
        })
        .collect();
    PlanSpec::new(Mesh::new(2, 2).unwrap(), params).with_bucket_cap_bytes(256)
}

fn bench_host(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let spec = spec();
    let backend = Arc::new(CpuBackend::new(spec.mesh));
    let mut session = Session::new(spec, backend, ExecConfig::default()).unwrap();
    let gates = [Gate::ReplicateOff, Gate::On];
    // First step builds, validates and caches the plans; later steps reuse them.
    let first = rt
        .block_on(synthetic_step(&mut session, 1, 0, &gates))
        .unwrap();
    let nodes = first.stats.nodes as u64;
    println!(
        "host: {nodes} nodes per step over 4 ranks ({} per rank per micro-batch)",
        nodes / 4 / 2
    );
    let mut group = c.benchmark_group("host");
    group.throughput(Throughput::Elements(nodes));
    let mut step = 1;
    group.bench_function("issue_per_node_reused_plan", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let r = rt
                    .block_on(synthetic_step(&mut session, 1, step, &gates))
                    .unwrap();
                step += 1;
                total += Duration::from_secs_f64(r.stats.issue_seconds);
            }
            total
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench_host
}
criterion_main!(benches);
