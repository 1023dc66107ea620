//! Host cost as micro-batches grow: a tiny model (mesh 2x1, one layer, hidden 8) with
//! gates `off×(M−1),on` for M = 2, 16, 64, 256 and 1024 micro-batches, through
//! [`Session`] on the CPU backend.
//!
//! ```text
//! cargo bench --bench micro_batches
//! ```
//!
//! Per M, criterion measures the executor's host time per node of a steady-state step
//! (`StepStats::issue_seconds` over the nodes: plan adoption included, the kernels'
//! arithmetic on the CPU backend's threads not), with throughput in nodes. The summary
//! printed at the end adds, per M: that figure (mean over the measured steps), the time
//! to plan and validate the step's plan once (`Planner::plan` + `validate`), the first
//! step's wall time and the plans the session built in it and in the steady state, and
//! the peak heap during a steady-state step above what was held before it (a counting
//! global allocator). A flat cost per micro-batch shows as a constant µs/node, a plan +
//! validate time and a peak memory growing linearly with M, and no plan built after the
//! first step.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use overlap::drive::synthetic_step;
use overlap::graph::{validate, Mode};
use overlap::{Config, Planner, Session};

/// The system allocator, counting the bytes allocated now and the most at once.
struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            let now = NOW.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        NOW.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Starts a peak measurement: returns the bytes held now.
fn reset_peak() -> usize {
    let now = NOW.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    now
}

const MICRO_BATCHES: [usize; 5] = [2, 16, 64, 256, 1024];

fn config(m: usize) -> Config {
    let toml = format!(
        "[mesh]\nshard = 2\nreplicate = 1\n\
         [model]\nlayers = 1\nhidden = 8\nvocab = 16\n\
         [accumulation]\nmicro_batches = {m}\n"
    );
    Config::from_toml(&toml, "micro_batches.toml").expect("a valid config")
}

/// One row of the summary.
struct Row {
    m: usize,
    nodes: usize,
    host_us_per_node: f64,
    plan_ms: f64,
    validate_ms: f64,
    first_step_ms: f64,
    first_plans: u64,
    steady_plans: u64,
    steady_prepared: u64,
    peak_bytes: usize,
    held_bytes: usize,
}

fn bench_micro_batches(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let mut rows = Vec::new();
    let mut group = c.benchmark_group("micro_batches");
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(300));
    for m in MICRO_BATCHES {
        let cfg = config(m);
        let gates = cfg.gates.clone();
        let held_before = NOW.load(Ordering::Relaxed);
        let mut session = Session::cpu(&cfg).expect("a session");

        let t0 = Instant::now();
        let first = rt
            .block_on(synthetic_step(&mut session, 1, 0, &gates))
            .expect("the first step");
        let first_step_ms = t0.elapsed().as_secs_f64() * 1e3;
        let first_plans = session.plans_built();
        let nodes = first.stats.nodes;

        // Plan + validate of the step, outside the session (best of a few).
        let planner = Planner::new(session.spec().clone()).expect("a planner");
        let reps = if m >= 1024 { 2 } else { 5 };
        let (mut plan_s, mut validate_s) = (f64::MAX, f64::MAX);
        for _ in 0..reps {
            let t = Instant::now();
            let plan = planner.plan(&gates).expect("a plan");
            plan_s = plan_s.min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let v = validate(&plan, Mode::Step);
            validate_s = validate_s.min(t.elapsed().as_secs_f64());
            assert!(v.is_empty());
        }

        // Peak heap above what was held before one steady-state step.
        let mut step = 1u64;
        let base = reset_peak();
        rt.block_on(synthetic_step(&mut session, 1, step, &gates))
            .expect("a step");
        step += 1;
        let peak_bytes = PEAK.load(Ordering::Relaxed).saturating_sub(base);
        let held_bytes = NOW.load(Ordering::Relaxed).saturating_sub(held_before);

        let plans_before = session.plans_built();
        let prepared_before = session.plan_cache().prepared;
        let mut per_node = Vec::new();
        group.throughput(Throughput::Elements(nodes as u64));
        group.measurement_time(Duration::from_secs(if m >= 1024 { 4 } else { 2 }));
        group.bench_function(format!("host_per_node/M={m}"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let r = rt
                        .block_on(synthetic_step(&mut session, 1, step, &gates))
                        .expect("a step");
                    step += 1;
                    per_node.push(r.stats.issue_seconds / r.stats.nodes.max(1) as f64);
                    total += Duration::from_secs_f64(r.stats.issue_seconds);
                }
                total
            })
        });
        rows.push(Row {
            m,
            nodes,
            host_us_per_node: per_node.iter().sum::<f64>() / per_node.len().max(1) as f64 * 1e6,
            plan_ms: plan_s * 1e3,
            validate_ms: validate_s * 1e3,
            first_step_ms,
            first_plans,
            steady_plans: session.plans_built() - plans_before,
            steady_prepared: session.plan_cache().prepared - prepared_before,
            peak_bytes,
            held_bytes,
        });
    }
    group.finish();

    println!();
    println!("host cost as micro-batches grow (mesh 2x1, 1 layer, hidden 8, gates off×(M−1),on, CPU backend)");
    println!(
        "| M | nodes/step | host µs/node (steady) | plan ms | validate ms | first step ms | plans built: first step / later steps | prepared (later steps) | peak heap in a step | held after |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.1} | {} / {} | {} | {} | {} |",
            r.m,
            r.nodes,
            r.host_us_per_node,
            r.plan_ms,
            r.validate_ms,
            r.first_step_ms,
            r.first_plans,
            r.steady_plans,
            r.steady_prepared,
            mib(r.peak_bytes),
            mib(r.held_bytes),
        );
    }
}

fn mib(b: usize) -> String {
    format!("{:.2} MiB", b as f64 / f64::from(1 << 20))
}

criterion_group!(benches, bench_micro_batches);
criterion_main!(benches);
