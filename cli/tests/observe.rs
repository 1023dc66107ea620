//! Observing a run from the command line: what `overlap run --metrics/--trace/--svg`
//! writes and serves (`tests/observe.rs` has the analysis and the session's metrics).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use overlap::graph::{Planner, Stream};
use overlap::observe::trace;
use overlap::Config;
use serde_json::Value;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
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
