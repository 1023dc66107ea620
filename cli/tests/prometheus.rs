//! The dashboards' PromQL against a real Prometheus: `overlap run --metrics` serves a
//! long run, Debian's `prometheus` scrapes it every second, and every `expr` of every
//! panel of every dashboard in `dashboards/` must return data through Prometheus' HTTP
//! API.
//!
//! Without a `prometheus` binary the test is skipped with a message, except under CI
//! (`CI` set), where it fails: `.ci/run` installs the package. Everything is bounded in
//! time, and both processes are killed on every exit path (a guard with `Drop`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Kills and reaps a child process when dropped.
struct Killed(Child, &'static str);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Killed {
    /// Fails if the process already exited (with its stderr in the message).
    fn alive(&mut self) {
        if let Ok(Some(status)) = self.0.try_wait() {
            let mut err = String::new();
            if let Some(e) = self.0.stderr.as_mut() {
                let _ = e.read_to_string(&mut err);
            }
            panic!("{} exited early ({status}): {err}", self.1);
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}

fn prometheus_binary() -> Option<PathBuf> {
    let candidates = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|d| d.join("prometheus"))
        .chain([PathBuf::from("/usr/bin/prometheus")]);
    candidates.into_iter().find(|p| p.is_file())
}

/// `application/x-www-form-urlencoded` of a query parameter value.
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// A plain HTTP/1.0 GET on 127.0.0.1; returns the status code and the body.
fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, body.to_string()))
}

/// Runs an instant query; returns the `data.result` array or an error text.
fn query(prom: SocketAddr, promql: &str) -> Result<Vec<Value>, String> {
    let (code, body) = get(prom, &format!("/api/v1/query?query={}", encode(promql)))
        .map_err(|e| format!("HTTP: {e}"))?;
    let v: Value = serde_json::from_str(&body).map_err(|e| format!("{code}: {e}: {body}"))?;
    if v["status"] != "success" {
        return Err(format!("{code}: {body}"));
    }
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

/// Polls `check` every 250 ms until it returns true or `limit` passes.
fn wait_for(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A dashboard expression as Grafana would send it: `$__rate_interval` becomes a window
/// that holds several 1 s scrapes, template variables match everything.
fn substitute(expr: &str) -> String {
    let mut e = expr
        .replace("$__rate_interval", "30s")
        .replace("$__interval", "5s")
        .replace("$__range", "1m");
    for var in ["job", "instance"] {
        e = e
            .replace(&format!("${{{var}}}"), ".+")
            .replace(&format!("${var}"), ".+");
    }
    assert!(!e.contains('$'), "an unknown variable in {expr}");
    e
}

fn dashboard_exprs(root: &Path) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("dashboards"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    for f in files {
        let d: Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        let mut stack: Vec<&Value> = d["panels"].as_array().unwrap().iter().collect();
        while let Some(p) = stack.pop() {
            if let Some(inner) = p["panels"].as_array() {
                stack.extend(inner);
            }
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(e) = t["expr"].as_str() {
                    out.push((
                        f.file_name().unwrap().to_string_lossy().into_owned(),
                        p["title"].as_str().unwrap_or("?").to_string(),
                        e.to_string(),
                    ));
                }
            }
        }
    }
    out
}

#[test]
fn every_dashboard_query_returns_data_from_a_real_prometheus() {
    let started = Instant::now();
    let Some(prometheus) = prometheus_binary() else {
        if std::env::var_os("CI").is_some() {
            panic!("CI is set but no `prometheus` binary is on PATH or at /usr/bin/prometheus: .ci/run must install Debian's `prometheus` package");
        }
        eprintln!("SKIPPED every_dashboard_query_returns_data_from_a_real_prometheus: no `prometheus` binary (apt-get install prometheus)");
        return;
    };
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prometheus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(tmp.join("data")).unwrap();

    // The job: long enough to be scraped several times, and it stops by itself.
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut job = Killed(
        Command::new(env!("CARGO_BIN_EXE_overlap"))
            .args([
                "run",
                "--config",
                "examples/hsdp_2x2.toml",
                "--steps",
                "1000",
                "--step-interval-ms",
                "40",
                "--metrics",
                &metrics.to_string(),
            ])
            .current_dir(root)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("overlap runs"),
        "overlap run",
    );
    wait_for("overlap's /metrics", Duration::from_secs(15), || {
        job.alive();
        get(metrics, "/metrics").is_ok_and(|(c, b)| c == 200 && b.contains("overlap_steps_total"))
    });

    let prom: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let config = tmp.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: overlap\n    static_configs:\n      - targets: [\"{metrics}\"]\n"
        ),
    )
    .unwrap();
    let mut server = Killed(
        Command::new(&prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                tmp.join("data").display()
            ))
            .arg(format!("--web.listen-address={prom}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("prometheus starts"),
        "prometheus",
    );
    wait_for("Prometheus to be ready", Duration::from_secs(15), || {
        server.alive();
        get(prom, "/-/ready").is_ok_and(|(c, _)| c == 200)
    });
    // Several scrapes of a running job: rates over 30 s then have enough samples.
    wait_for("five scrapes of overlap", Duration::from_secs(20), || {
        job.alive();
        query(prom, "count_over_time(overlap_steps_total[1m])")
            .ok()
            .and_then(|r| r.first().cloned())
            .and_then(|s| s["value"][1].as_str().and_then(|v| v.parse::<f64>().ok()))
            .is_some_and(|n| n >= 5.0)
    });
    let scraped = started.elapsed();

    let exprs = dashboard_exprs(root);
    assert!(exprs.len() >= 20, "only {} expressions", exprs.len());
    let mut empty = Vec::new();
    for (file, title, expr) in &exprs {
        match query(prom, &substitute(expr)) {
            Ok(r) if !r.is_empty() => {}
            Ok(_) => empty.push(format!("{file} / {title}: no data: {expr}")),
            Err(e) => empty.push(format!("{file} / {title}: {e}: {expr}")),
        }
    }
    job.alive();
    drop(server);
    drop(job);
    let _ = std::fs::remove_dir_all(&tmp);
    eprintln!(
        "{} dashboard expressions evaluated; scrapes ready after {:.1?}, total {:.1?}",
        exprs.len(),
        scraped,
        started.elapsed()
    );
    assert!(
        empty.is_empty(),
        "queries without data:\n{}",
        empty.join("\n")
    );
    assert!(started.elapsed() < Duration::from_secs(60));
}
