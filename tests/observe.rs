//! Observing a run: the analysis of real steps, the metrics a session records, and what
//! `overlap run --metrics/--trace/--svg` writes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use overlap::graph::{CollectiveKind, Planner, Stream};
use overlap::observe::metrics::{self, METRICS};
use overlap::observe::{trace, StepAnalysis};
use overlap::{drive, Config, Error, Gate, Session};
use serde_json::Value;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn example() -> Config {
    Config::from_file(&root().join("examples/hsdp_2x2.toml")).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("observe");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn overlap(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_overlap"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("the binary runs")
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

#[test]
fn a_session_records_every_metric_once_enabled() {
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

#[test]
fn run_writes_a_chrome_trace_with_a_lane_per_rank_and_stream_and_an_arrow_per_event_wait() {
    let path = scratch("trace.json");
    let o = overlap(&[
        "run",
        "--config",
        "examples/hsdp_2x2.toml",
        "--steps",
        "2",
        "--trace",
        path.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("trace: ") && out.contains("trace.json"),
        "{out}"
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let of = |ph: &'static str| events.iter().filter(move |e| e["ph"] == ph);

    // Lanes: one process per rank, one named thread per stream.
    for rank in 0..4u64 {
        for s in Stream::ALL {
            assert!(
                of("M").any(|e| e["name"] == "thread_name"
                    && e["pid"] == rank
                    && e["tid"] == s.index() as u64
                    && e["args"]["name"] == s.name()),
                "no lane for rank {rank} {s}"
            );
        }
    }
    // Slices on one lane never overlap (Perfetto needs them nested).
    let mut lanes: std::collections::HashMap<(u64, u64), Vec<(f64, f64)>> = Default::default();
    for e in of("X") {
        let ts = e["ts"].as_f64().unwrap();
        let dur = e["dur"].as_f64().unwrap();
        assert!(dur >= 0.0);
        lanes
            .entry((e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap()))
            .or_default()
            .push((ts, ts + dur));
    }
    for spans in lanes.values_mut() {
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        for w in spans.windows(2) {
            assert!(w[1].0 >= w[0].1 - 1e-3, "overlapping slices {w:?}");
        }
    }
    // Every cross-stream event wait of the plan is an arrow in every step, bound inside
    // a slice at both ends.
    let cfg = example();
    let plan = Planner::new(cfg.plan.clone())
        .unwrap()
        .plan(&cfg.gates)
        .unwrap();
    let flows = trace::flows(&plan);
    assert!(!flows.is_empty());
    let starts: Vec<&Value> = of("s").collect();
    let ends: Vec<&Value> = of("f").collect();
    assert_eq!(starts.len(), 2 * flows.len());
    assert_eq!(ends.len(), starts.len());
    let inside = |e: &Value| {
        let key = (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap());
        let ts = e["ts"].as_f64().unwrap();
        lanes[&key].iter().any(|&(s, t)| s <= ts && ts <= t)
    };
    for (s, f) in starts.iter().zip(&ends) {
        assert_eq!(s["id"], f["id"]);
        assert_ne!(s["tid"], f["tid"], "an arrow joins two streams");
        assert!(inside(s) && inside(f), "{s} {f}");
    }
    // Spans: a step per rank and step, a micro-batch per rank, step and micro-batch.
    assert_eq!(of("X").filter(|e| e["cat"] == "step").count(), 4 * 2);
    assert_eq!(of("b").count(), 4 * 2 * 2);
    assert_eq!(of("e").count(), of("b").count());
}

#[test]
fn run_draws_the_requested_step_as_an_svg_gantt_picture() {
    let path = scratch("schedule.svg");
    let o = overlap(&[
        "run",
        "--config",
        "examples/hsdp_2x2.toml",
        "--steps",
        "2",
        "--svg",
        path.to_str().unwrap(),
        "--svg-step",
        "1",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("schedule picture: ") && out.contains("(step 1)"),
        "{out}"
    );
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg ") && svg.trim_end().ends_with("</svg>"));
    assert!(
        svg.contains("step 1 · mesh 2x2"),
        "the picture names its step"
    );
    for rank in 0..4 {
        assert!(
            svg.contains(&format!(">rank {rank} (s=")),
            "no lanes of rank {rank}"
        );
    }
    for label in [
        "compute",
        "reduce",
        "replicate",
        "publish",
        "exposed communication",
        "stage 1",
        "backward (grad_ready)",
    ] {
        assert!(svg.contains(label), "no {label:?}");
    }
    assert_eq!(svg.matches("<svg").count(), 1);
    assert_eq!(
        svg.matches("<title>").count(),
        svg.matches("</title>").count()
    );
}

#[test]
fn svg_step_outside_the_run_is_a_usage_error() {
    let path = scratch("never.svg");
    let o = overlap(&[
        "run",
        "--config",
        "examples/hsdp_2x2.toml",
        "--steps",
        "2",
        "--svg",
        path.to_str().unwrap(),
        "--svg-step",
        "3",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--svg-step 3: the run has steps 1 to 2"),
        "{err}"
    );
    assert!(!err.contains("panicked"));
    let o = overlap(&[
        "run",
        "--config",
        "examples/hsdp_2x2.toml",
        "--svg-step",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--svg"));
}

#[test]
fn trace_to_an_unwritable_path_fails_before_running() {
    let o = overlap(&[
        "run",
        "--config",
        "examples/hsdp_2x2.toml",
        "--trace",
        "no/such/dir/trace.json",
    ]);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("no/such/dir/trace.json"), "{err}");
    assert!(!out.contains("step 1/"), "{out}");
}

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn scrape(addr: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

#[test]
fn run_with_metrics_serves_prometheus_text_while_it_runs() {
    let addr = free_addr();
    let mut child = Command::new(env!("CARGO_BIN_EXE_overlap"))
        .args([
            "run",
            "--config",
            "examples/hsdp_2x2.toml",
            "--steps",
            "500",
            "--step-interval-ms",
            "20",
            "--metrics",
            &addr.to_string(),
        ])
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let mut body = String::new();
    while start.elapsed() < Duration::from_secs(20) {
        if let Some(b) = scrape(addr) {
            if b.contains("overlap_step_duration_seconds_bucket") {
                body = b;
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        body.starts_with("HTTP/1.") && body.contains(" 200 "),
        "{body}"
    );
    for name in [
        "overlap_steps_total",
        "overlap_op_duration_seconds_bucket{op=\"stage1\",stream=\"reduce\",le=",
        "overlap_stream_busy_seconds_bucket{stream=\"compute\",le=",
        "overlap_overlap_efficiency_ratio",
        "# TYPE overlap_collective_bytes_total counter",
    ] {
        assert!(body.contains(name), "{name} missing:\n{body}");
    }
}

#[test]
fn metrics_on_an_address_in_use_is_a_clear_error() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let o = overlap(&[
        "run",
        "--config",
        "examples/hsdp_2x2.toml",
        "--metrics",
        &addr,
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("cannot serve /metrics on {addr}")),
        "{err}"
    );
    assert!(!err.contains("panicked"));
    let o = overlap(&[
        "run",
        "--config",
        "examples/hsdp_2x2.toml",
        "--metrics",
        "localhost",
    ]);
    assert_eq!(o.status.code(), Some(2));
}
