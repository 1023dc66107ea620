//! Recording (the `metrics` feature): the Prometheus recorder, the `/metrics` server,
//! and what each step records.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use overlap_graph::validate::INVARIANTS;
use overlap_graph::{Gate, Plan, Stream, Violation};

use super::*;
use crate::observe::StepAnalysis;
use crate::session::StepReport;
use crate::Error;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Serves Prometheus `/metrics` on `addr` and turns recording on: the one call a
/// library user makes. Call it once per process, from inside a Tokio runtime or not (the
/// server runs on threads of its own).
///
/// The server answers `GET` (and `HEAD`) `/metrics` only: 404 for any other path, 405
/// for another method on `/metrics`; it closes a connection that sends no complete
/// request for [`IDLE_TIMEOUT`], and serves at most [`MAX_CONNECTIONS`] at once.
///
/// ```no_run
/// overlap::observe::metrics::install_prometheus("127.0.0.1:9464".parse().unwrap())?;
/// # Ok::<(), overlap::Error>(())
/// ```
pub fn install_prometheus(addr: SocketAddr) -> Result<(), Error> {
    let fail = |e: &dyn std::fmt::Display| {
        Error::Usage(format!("metrics: cannot serve /metrics on {addr}: {e}"))
    };
    let listener = std::net::TcpListener::bind(addr).map_err(|e| fail(&e))?;
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
        .map_err(|e| fail(&e))?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| fail(&e))?;
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_secs(5));
            upkeep.run_upkeep();
        })
        .map_err(|e| fail(&e))?;
    serve_http(listener, move || handle.render(), IDLE_TIMEOUT).map_err(|e| fail(&e))?;
    enable();
    Ok(())
}

/// How long the metrics server keeps a connection that has not sent a complete
/// request.
pub const IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Connections the metrics server serves at once; more are closed on arrival.
pub const MAX_CONNECTIONS: usize = 64;
/// The longest request head the metrics server reads.
const MAX_HEAD: usize = 8 << 10;

/// Serves `render()` as `GET /metrics` on `listener`, on threads of its own (see
/// [`install_prometheus`] for what it answers); returns once the server runs.
pub fn serve_http(
    listener: std::net::TcpListener,
    render: impl Fn() -> String + Send + Sync + 'static,
    idle: std::time::Duration,
) -> std::io::Result<()> {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    let render = Arc::new(render);
    let open = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                if open.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
                    continue; // dropped: closed
                }
                open.fetch_add(1, Ordering::SeqCst);
                let (render, count) = (render.clone(), open.clone());
                let spawned = std::thread::Builder::new()
                    .name("metrics-conn".into())
                    .stack_size(128 << 10)
                    .spawn(move || {
                        serve_connection(stream, &*render, idle);
                        count.fetch_sub(1, Ordering::SeqCst);
                    });
                if spawned.is_err() {
                    // The closure (and its count) is gone with the failed spawn.
                    open.fetch_sub(1, Ordering::SeqCst);
                }
            }
        })?;
    Ok(())
}

/// One connection: requests until the client closes, sends no complete request head
/// within `idle`, or sends something this server does not keep a connection for.
fn serve_connection(
    mut stream: std::net::TcpStream,
    render: &(dyn Fn() -> String + Send + Sync),
    idle: std::time::Duration,
) {
    use std::io::{Read, Write};
    use std::time::Instant;
    let mut buf: Vec<u8> = Vec::new();
    loop {
        // A request head must be complete within `idle` of the previous response.
        let by = Instant::now() + idle;
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break Some(i + 4);
            }
            if buf.len() > MAX_HEAD {
                break None;
            }
            let left = by.saturating_duration_since(Instant::now());
            if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
                return;
            }
            let mut chunk = [0u8; 2048];
            match stream.read(&mut chunk) {
                Ok(0) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return, // timed out or reset
            }
        };
        let Some(end) = head_end else {
            let _ = stream.write_all(&response(
                431,
                "Request Header Fields Too Large",
                "",
                "",
                false,
            ));
            return close_gently(stream);
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end);
        let mut lines = head.split("\r\n");
        let mut parts = lines.next().unwrap_or("").split(' ');
        let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let version = parts.next().unwrap_or("");
        if !version.starts_with("HTTP/1.") || parts.next().is_some() || !target.starts_with('/') {
            let _ = stream.write_all(&response(
                400,
                "Bad Request",
                "text/plain",
                "bad request\n",
                false,
            ));
            return close_gently(stream);
        }
        let path = target.split('?').next().unwrap_or("");
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_ascii_lowercase()))
            .collect();
        let header = |k: &str| {
            headers
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
        };
        // A request with a body is not one this server serves: answer and close.
        let has_body = header("content-length").is_some_and(|v| v != "0")
            || header("transfer-encoding").is_some();
        let keep =
            !has_body && header("connection") != Some("close") && !head.contains(" HTTP/1.0\r\n");
        let out = match (method, path) {
            ("GET" | "HEAD", "/metrics") => response(
                200,
                "OK",
                "text/plain; version=0.0.4; charset=utf-8",
                &render(),
                method == "HEAD",
            ),
            (_, "/metrics") => response(
                405,
                "Method Not Allowed",
                "text/plain",
                "only GET /metrics\n",
                false,
            ),
            _ => response(
                404,
                "Not Found",
                "text/plain",
                "not found; metrics are at /metrics\n",
                method == "HEAD",
            ),
        };
        if stream.write_all(&out).is_err() {
            return;
        }
        if !keep {
            return close_gently(stream);
        }
    }
}

/// Closes after a response while the client may still be sending (a body this server
/// does not read): without reading what is in flight, closing would reset the
/// connection and the client could lose the response. Reads and drops at most 64 KiB,
/// for at most a second.
fn close_gently(mut stream: std::net::TcpStream) {
    use std::io::Read;
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let by = std::time::Instant::now() + std::time::Duration::from_secs(1);
    let mut left = 64usize << 10;
    let mut sink = [0u8; 4096];
    while left > 0 {
        let wait = by.saturating_duration_since(std::time::Instant::now());
        if wait.is_zero() || stream.set_read_timeout(Some(wait)).is_err() {
            return;
        }
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => return,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

fn response(code: u16, reason: &str, ctype: &str, body: &str, head_only: bool) -> Vec<u8> {
    let allow = if code == 405 {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    let ctype = if ctype.is_empty() {
        String::new()
    } else {
        format!("Content-Type: {ctype}\r\n")
    };
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\n{ctype}{allow}Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    out
}

/// Turns recording on for a `metrics` recorder the caller installed, describes every
/// metric and creates the labelled counters at zero (so that dashboards show 0, not
/// "no data", for gates not used and invariants never broken).
pub fn enable() {
    describe();
    for gate in [Gate::NoSync, Gate::ReplicateOff, Gate::On] {
        counter!(MICRO_BATCHES, "gate" => gate.label()).increment(0);
    }
    for invariant in INVARIANTS {
        counter!(REJECTIONS, "invariant" => invariant).increment(0);
    }
    counter!(STEPS).increment(0);
    gauge!("overlap_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    ENABLED.store(true, Ordering::Release);
}

/// Whether steps are being recorded.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Acquire)
}

fn describe() {
    describe_histogram!(OP_DURATION, Unit::Seconds, METRICS[0].2);
    describe_counter!(STEPS, Unit::Count, METRICS[1].2);
    describe_histogram!(STEP_DURATION, Unit::Seconds, METRICS[2].2);
    describe_histogram!(STEP_DEVICE, Unit::Seconds, METRICS[3].2);
    describe_histogram!(STREAM_BUSY, Unit::Seconds, METRICS[4].2);
    describe_histogram!(EXPOSED, Unit::Seconds, METRICS[5].2);
    describe_gauge!(EFFICIENCY, Unit::Count, METRICS[6].2);
    describe_counter!(COLLECTIVE_BYTES, Unit::Bytes, METRICS[7].2);
    describe_gauge!(BUS_BANDWIDTH, METRICS[8].2);
    describe_gauge!(PARTIAL_BYTES, Unit::Bytes, METRICS[9].2);
    describe_counter!(STAGE2_BYTES, Unit::Bytes, METRICS[10].2);
    describe_counter!(STAGE2_SAVED, Unit::Bytes, METRICS[11].2);
    describe_counter!(MICRO_BATCHES, Unit::Count, METRICS[12].2);
    describe_gauge!(MICRO_BATCH_GATE, Unit::Count, METRICS[13].2);
    describe_counter!(REJECTIONS, Unit::Count, METRICS[14].2);
    describe_counter!(NODES, Unit::Count, METRICS[15].2);
    describe_histogram!(HOST_ISSUE, Unit::Seconds, METRICS[16].2);
    describe_gauge!(OP_HOST_ISSUE, Unit::Seconds, METRICS[17].2);
    describe_gauge!(OP_HOST_LAUNCH, Unit::Seconds, METRICS[18].2);
    describe_gauge!("overlap_build_info", Unit::Count, METRICS[19].2);
    describe_gauge!(LEARNING_RATE, METRICS[20].2);
    describe_gauge!(GRAD_NORM, METRICS[21].2);
    describe_counter!(STEPS_SKIPPED, Unit::Count, METRICS[22].2);
    describe_gauge!(PARAM_PEAK, Unit::Bytes, METRICS[23].2);
    describe_gauge!(GRAD_PEAK, Unit::Bytes, METRICS[24].2);
    describe_gauge!(REPLICA_BYTES, Unit::Bytes, METRICS[25].2);
}

/// Records a finished step of these local ranks when recording is on
/// ([`Session::step`](crate::Session::step) calls it).
pub fn record_step(report: &StepReport, plan: &Plan, local_ranks: impl FnOnce() -> Vec<u32>) {
    if enabled() {
        record_analysis(
            report,
            &StepAnalysis::on_ranks(report, plan, &local_ranks()),
        );
    }
}

/// Records a step already analysed (whether or not recording is on: the caller decides).
/// An untimed step ([`StepAnalysis::timed`]) leaves the device figures (device span,
/// stream busy, exposed communication, η, op durations, bus bandwidth) as the last timed
/// step left them, and counts everything else.
pub fn record_analysis(report: &StepReport, a: &StepAnalysis) {
    counter!(STEPS).increment(1);
    histogram!(STEP_DURATION).record(report.stats.wall_seconds);
    if a.timed() {
        histogram!(STEP_DEVICE).record(a.span_seconds());
        for s in Stream::ALL {
            histogram!(STREAM_BUSY, "stream" => s.name()).record(a.busy_seconds(s));
        }
        histogram!(EXPOSED).record(a.exposed_seconds());
        gauge!(EFFICIENCY).set(a.efficiency().unwrap_or(f64::NAN));
    }

    // Kernel durations, grouped so that each (op, stream) handle is looked up once.
    let mut durations: HashMap<(&'static str, Stream), Vec<f64>> = HashMap::new();
    for t in &report.stats.timings {
        durations
            .entry((t.tag.op, t.stream))
            .or_default()
            .push((t.end - t.start).max(0.0));
    }
    for ((op, stream), values) in durations {
        let h = histogram!(OP_DURATION, "op" => op, "stream" => stream.name());
        values.into_iter().for_each(|v| h.record(v));
    }

    for c in &a.collectives {
        let labels = [("op", c.op), ("collective", c.kind.name())];
        counter!(COLLECTIVE_BYTES, &labels).increment(c.bytes);
        if let Some(bw) = c.bus_bandwidth() {
            gauge!(BUS_BANDWIDTH, &labels).set(bw);
        }
    }

    gauge!(PARTIAL_BYTES, "buffer" => "partial").set(a.partial_bytes as f64);
    gauge!(PARTIAL_BYTES, "buffer" => "accumulation").set(a.accumulation_bytes as f64);
    counter!(STAGE2_BYTES).increment(report.stage2_bytes);
    counter!(STAGE2_SAVED).increment(report.stage2_bytes_saved);

    for (m, gate) in report.gates.iter().enumerate() {
        counter!(MICRO_BATCHES, "gate" => gate.label()).increment(1);
        gauge!(MICRO_BATCH_GATE, "micro_batch" => m.to_string()).set(gate_value(*gate));
    }
    for rate in &report.lr {
        gauge!(
            LEARNING_RATE,
            "group" => rate.label.clone(),
            "optimizer" => overlap_executor::hyper::optimizer_name(rate.optimizer)
        )
        .set(rate.lr);
    }
    gauge!(GRAD_NORM).set(report.grad_norm.unwrap_or(f64::NAN));
    for m in &report.memory {
        let rank = m.rank.to_string();
        gauge!(PARAM_PEAK, "rank" => rank.clone()).set(m.param_peak_bytes as f64);
        gauge!(GRAD_PEAK, "rank" => rank).set(m.grad_peak_bytes as f64);
    }
    gauge!(REPLICA_BYTES).set(report.replica_bytes as f64);
    counter!(STEPS_SKIPPED, "reason" => "nonfinite").increment(u64::from(report.skipped.is_some()));
    counter!(NODES).increment(report.stats.nodes as u64);
    histogram!(HOST_ISSUE).record(report.stats.issue_seconds.max(0.0));
    for (&(op, seconds, nodes), &(_, inside)) in report
        .stats
        .issue_by_kind
        .iter()
        .zip(&report.stats.launch_by_kind)
    {
        if nodes > 0 {
            gauge!(OP_HOST_ISSUE, "op" => op).set(seconds.max(0.0) / nodes as f64);
            gauge!(OP_HOST_LAUNCH, "op" => op).set(inside.max(0.0) / nodes as f64);
        }
    }
}

/// Counts a step refused for non-finite gradients (`[clip] on_nonfinite = "error"`),
/// which has no [`StepReport`].
pub fn record_refused_nonfinite() {
    if enabled() {
        counter!(STEPS_SKIPPED, "reason" => "nonfinite").increment(1);
    }
}

/// Counts a step refused before validation because its gates leave partials or no_sync
/// accumulations unflushed: the `partials-flushed` invariant the validator would name.
pub fn record_unflushed() {
    counter!(REJECTIONS, "invariant" => "partials-flushed").increment(1);
}

/// Counts a plan the validator rejected, once per broken invariant.
pub fn record_rejection(violations: &[Violation]) {
    let mut seen: Vec<&'static str> = Vec::new();
    for v in violations {
        if !seen.contains(&v.invariant) {
            seen.push(v.invariant);
            counter!(REJECTIONS, "invariant" => v.invariant).increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One request on a fresh connection: the status code and the whole response.
    fn ask(addr: SocketAddr, request: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        c.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        let code = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
        (code, out)
    }

    fn server(idle: std::time::Duration) -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        serve_http(l, || "overlap_steps_total 3\n".to_string(), idle).unwrap();
        addr
    }

    #[test]
    fn only_get_metrics_is_served() {
        let addr = server(std::time::Duration::from_secs(10));
        let close = "Connection: close\r\n\r\n";
        let (code, body) = ask(
            addr,
            &format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{close}"),
        );
        assert_eq!(code, 200, "{body}");
        assert!(body.ends_with("overlap_steps_total 3\n"), "{body}");
        assert!(
            body.contains("Content-Type: text/plain; version=0.0.4"),
            "{body}"
        );
        let (code, body) = ask(addr, &format!("GET /metrics?x=1 HTTP/1.1\r\n{close}"));
        assert_eq!(code, 200, "{body}");
        let (code, body) = ask(addr, &format!("HEAD /metrics HTTP/1.1\r\n{close}"));
        assert_eq!(code, 200, "{body}");
        assert!(!body.contains("overlap_steps_total"), "{body}");
        for path in ["/", "/metrics/", "/debug", "/../metrics"] {
            let (code, body) = ask(addr, &format!("GET {path} HTTP/1.1\r\n{close}"));
            assert_eq!(code, 404, "{path}: {body}");
        }
        for method in ["POST", "PUT", "DELETE", "OPTIONS"] {
            let (code, body) = ask(
                addr,
                &format!("{method} /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc"),
            );
            assert_eq!(code, 405, "{method}: {body}");
            assert!(body.contains("Allow: GET, HEAD"), "{body}");
        }
        // Garbage gets a 400 and the connection closes; an endless head gets 431.
        assert_eq!(ask(addr, "\x00\x01\x02\r\n\r\n").0, 400);
        assert_eq!(ask(addr, "GET /metrics\r\n\r\n").0, 400);
        let huge = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000));
        assert_eq!(ask(addr, &huge).0, 431);
    }

    #[test]
    fn idle_connections_are_closed_and_keep_alive_works() {
        use std::io::{Read, Write};
        let idle = std::time::Duration::from_millis(300);
        let addr = server(idle);
        // Two requests on one connection, then silence: the server closes it.
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        let start = std::time::Instant::now();
        for _ in 0..2 {
            c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
        }
        let mut all = Vec::new();
        // read_to_end returns only once the server closed the connection (or the
        // 20 s read timeout, which fails the test below).
        let r = c.read_to_end(&mut all);
        let text = String::from_utf8_lossy(&all);
        assert!(r.is_ok(), "{r:?}: {text}");
        assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 2, "{text}");
        assert!(start.elapsed() >= idle);
        // A connection that never sends anything is closed too.
        let mut silent = std::net::TcpStream::connect(addr).unwrap();
        silent
            .set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        let mut byte = [0u8; 1];
        assert_eq!(silent.read(&mut byte).unwrap(), 0);
    }
    use crate::observe::tests::cpu_step;
    use overlap_graph::Transport;

    /// The value of the series `series` (name and labels as rendered) in Prometheus text.
    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_untimed_step_counts_bytes_and_nodes_and_leaves_the_device_figures() {
        let (timed, plan, local) = cpu_step(&[Gate::ReplicateOff, Gate::On], Transport::Nccl).await;
        let mut untimed = timed.clone();
        untimed.stats.timings.clear();
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let record = |r: &StepReport| {
            ::metrics::with_local_recorder(&recorder, || {
                record_analysis(r, &StepAnalysis::on_ranks(r, &plan, &local))
            })
        };
        let a = StepAnalysis::on_ranks(&timed, &plan, &local);
        let stage1 = a
            .collectives
            .iter()
            .find(|c| c.op == "stage1")
            .expect("a stage-1 collective");
        let bytes = format!(
            "{COLLECTIVE_BYTES}{{op=\"stage1\",collective=\"{}\"}}",
            stage1.kind.name()
        );
        let bandwidth = format!(
            "{BUS_BANDWIDTH}{{op=\"stage1\",collective=\"{}\"}}",
            stage1.kind.name()
        );
        let device = [
            STEP_DEVICE,
            STREAM_BUSY,
            EXPOSED,
            EFFICIENCY,
            OP_DURATION,
            BUS_BANDWIDTH,
        ];

        record(&untimed);
        let text = handle.render();
        assert_eq!(value(&text, STEPS), Some(1.0), "{text}");
        assert_eq!(value(&text, NODES), Some(timed.stats.nodes as f64));
        assert_eq!(value(&text, STAGE2_BYTES), Some(timed.stage2_bytes as f64));
        assert_eq!(value(&text, &bytes), Some(stage1.bytes as f64), "{text}");
        assert_eq!(
            value(&text, &format!("{PARTIAL_BYTES}{{buffer=\"partial\"}}")),
            Some(a.partial_bytes as f64)
        );
        assert!(a.partial_bytes > 0);
        for name in device {
            assert!(
                !text.contains(name),
                "{name} recorded for an untimed step:\n{text}"
            );
        }

        // A timed step records them; the untimed step after it leaves them as they were.
        record(&timed);
        let eta = a
            .efficiency()
            .expect("the example's backward hides communication");
        record(&untimed);
        let text = handle.render();
        assert_eq!(value(&text, STEPS), Some(3.0));
        assert_eq!(value(&text, &bytes), Some(3.0 * stage1.bytes as f64));
        assert_eq!(
            value(&text, &format!("{STEP_DEVICE}_count")),
            Some(1.0),
            "{text}"
        );
        assert_eq!(value(&text, &format!("{EXPOSED}_count")), Some(1.0));
        assert_eq!(value(&text, EFFICIENCY), Some(eta), "{text}");
        assert_eq!(value(&text, &bandwidth), stage1.bus_bandwidth());
        assert_eq!(value(&text, &format!("{STEP_DURATION}_count")), Some(3.0));
    }

    /// The labels of `overlap_validator_rejections_total` are created at zero from
    /// [`INVARIANTS`]; it must list every invariant the validator's docs list.
    #[test]
    fn every_documented_invariant_is_a_rejection_label() {
        let docs = include_str!("../../../graph/src/validate/mod.rs");
        let documented: Vec<&str> = docs
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .filter_map(|l| l.strip_prefix("//! - `"))
            .filter_map(|l| l.split('`').next())
            .collect();
        assert!(documented.len() >= 9, "{documented:?}");
        assert_eq!(documented, INVARIANTS.to_vec());
    }

    #[test]
    fn gate_values_order_no_sync_off_on() {
        assert_eq!(gate_value(Gate::NoSync), 0.0);
        assert_eq!(gate_value(Gate::ReplicateOff), 1.0);
        assert_eq!(gate_value(Gate::On), 2.0);
    }

    #[test]
    fn every_metric_is_listed_once_with_a_prometheus_name() {
        let mut names: Vec<&str> = METRICS.iter().map(|m| m.0).collect();
        for n in &names {
            assert!(n.starts_with("overlap_"), "{n}");
            assert!(
                n.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{n}"
            );
        }
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), METRICS.len());
    }
}
