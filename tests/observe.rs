//! Observing a run: the analysis of real steps and the metrics a session records (with
//! the `metrics` feature). The command line's `--metrics/--trace/--svg` are tested in
//! `cli/tests/observe.rs`.

use std::path::Path;

use overlap::graph::{CollectiveKind, Stream};
#[cfg(feature = "metrics")]
use overlap::observe::metrics::{self, METRICS};
use overlap::observe::StepAnalysis;
use overlap::{drive, Config, Session};

fn example() -> Config {
    Config::from_file(&Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/hsdp_2x2.toml"))
        .unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn analysis_of_a_real_step_sees_the_synthetic_backward_and_the_collectives() {
    let cfg = example();
    assert_eq!(cfg.run.backward_us_per_layer, 400);
    runtime().block_on(async {
        let mut s = Session::cpu(&cfg).unwrap();
        let r = drive::synthetic_step(&mut s, cfg.run.seed, 0, &cfg.gates)
            .await
            .unwrap();
        let plan = s.step_plan(&r.gates).unwrap();
        let a = StepAnalysis::new(&r, &plan);
        assert_eq!(a.ranks.len(), 4);
        assert_eq!(a.layers, 4);
        for rank in &a.ranks {
            // 4 layers × 2 micro-batches × 400 µs of backward at least.
            assert!(rank.compute_seconds() >= 8.0 * 400e-6, "{rank:?}");
            assert!(rank.communication_seconds() > 0.0);
            assert!(rank.exposed_seconds() <= rank.communication_seconds() + 1e-12);
            assert!(rank.span_seconds() >= rank.compute_seconds());
            let busiest = Stream::ALL
                .iter()
                .map(|&st| rank.busy_seconds(st))
                .fold(0.0, f64::max);
            assert!(rank.span_seconds() + 1e-12 >= busiest);
        }
        assert!(a.efficiency().is_some());
        // One gate-off micro-batch holds every partial of the rank at once.
        assert!(a.partial_bytes > 0 && a.accumulation_bytes == 0);
        let rs = a
            .collectives
            .iter()
            .find(|c| c.op == "stage1" && c.kind == CollectiveKind::ReduceScatter)
            .expect("sharded routes reduce-scatter in stage 1");
        assert!(rs.calls > 0 && rs.bytes > 0 && rs.bus_bandwidth().is_some());
        // Stage 2 runs once per step (gate on) and its bytes match the report's.
        let stage2: u64 = a
            .collectives
            .iter()
            .filter(|c| c.op == "stage2")
            .map(|c| c.bytes)
            .sum();
        assert_eq!(stage2, r.stage2_bytes);
    });
}

#[test]
fn analysis_of_a_copy_transport_step_counts_its_exchanges_as_communication() {
    let mut cfg = example();
    cfg.plan.schedule.transport = overlap::graph::Transport::Copy;
    cfg.plan.reduce.dtype = overlap::graph::DType::Bf16;
    runtime().block_on(async {
        let mut s = Session::cpu(&cfg).unwrap();
        let r = drive::synthetic_step(&mut s, cfg.run.seed, 0, &cfg.gates)
            .await
            .unwrap();
        let plan = s.step_plan(&r.gates).unwrap();
        let a = StepAnalysis::new(&r, &plan);
        for rank in &a.ranks {
            // Exchanges run on the copy stream, which counts as communication.
            assert!(rank.busy_seconds(Stream::Copy) > 0.0, "{rank:?}");
            assert!(rank.communication_seconds() >= rank.busy_seconds(Stream::Copy));
        }
        assert!(!a.collectives.iter().any(|c| c.op == "stage1"));
        let ex = a
            .collectives
            .iter()
            .find(|c| c.op == "exchange" && c.kind == CollectiveKind::ReduceScatter)
            .expect("sharded routes exchange reduce-scatter chunks");
        assert!(ex.calls > 0 && ex.bytes > 0 && ex.bus_bandwidth().is_some());
        // Stage 2's exchanges and gathers move f32 whatever the reduce dtype: the
        // session's count is what the backend says each of them received (a reduce's
        // non-roots receive nothing).
        let stage2: u64 = r
            .stats
            .timings
            .iter()
            .filter(|t| {
                let op = &plan.rank(t.rank).nodes[t.tag.node as usize].op;
                matches!(op.kind(), "exchange" | "gather") && op.stage() == Some(2)
            })
            .map(|t| t.bytes)
            .sum();
        assert!(stage2 > 0);
        assert_eq!(stage2, r.stage2_bytes);
    });
}

#[cfg(feature = "metrics")]
#[test]
fn a_session_records_every_metric_once_enabled() {
    use overlap::{Error, Gate};
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let cfg = example();
    ::metrics::with_local_recorder(&recorder, || {
        metrics::enable();
        runtime().block_on(async {
            let mut s = Session::cpu(&cfg).unwrap();
            for step in 0..2 {
                drive::synthetic_step(&mut s, cfg.run.seed, step, &cfg.gates)
                    .await
                    .unwrap();
            }
            // A step that would leave partials unflushed is refused and counted.
            s.begin_micro_batch(Gate::ReplicateOff).await.unwrap();
            for layer in s.layers() {
                s.grad_ready(layer, |_, _, out| out.fill(1.0))
                    .await
                    .unwrap();
            }
            assert!(matches!(s.step().await, Err(Error::Unflushed { .. })));
        });
    });
    let text = handle.render();
    for (name, _, _) in METRICS {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    assert!(text.contains("overlap_steps_total 2"), "{text}");
    assert!(
        text.contains("overlap_validator_rejections_total{invariant=\"partials-flushed\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("overlap_micro_batches_total{gate=\"no_sync\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("overlap_micro_batch_gate{micro_batch=\"1\"} 2"),
        "{text}"
    );
}
