//! No hang: a rank that fails or hangs mid-step (`OVERLAP_FAULT`) makes `overlap run`,
//! alone or as every process of `overlap launch`, exit non-zero within a bound, naming
//! the root cause: the injected node, or for a hang the streams and nodes the timed-out
//! step was waiting on (`[run] step_timeout`).
//!
//! The bounds asserted here are loose (debug build on a shared machine); README's
//! "When a rank fails or hangs" gives the measured figures.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/hsdp_2x2.toml");

/// Whole-run bound for a failing rank: startup, one good step, the failing one.
const FAIL_BOUND: Duration = Duration::from_secs(30);

/// What a hang may take beyond its step timeout: startup, one good step, the exit.
const HANG_SLACK: Duration = Duration::from_secs(20);

fn overlap() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_overlap"));
    c.env_remove("OVERLAP_JOB_SECRET");
    c
}

fn free_port() -> String {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port().to_string())
        .expect("a free port")
}

/// The example config with `[run] step_timeout = seconds`.
fn config_with_timeout(name: &str, seconds: u32) -> PathBuf {
    let text = std::fs::read_to_string(CONFIG).expect("the example config");
    let text = text.replacen("[run]\n", &format!("[run]\nstep_timeout = {seconds}\n"), 1);
    assert!(
        text.contains("step_timeout"),
        "the example has a [run] table"
    );
    let path =
        std::env::temp_dir().join(format!("overlap-faults-{name}-{}.toml", std::process::id()));
    std::fs::write(&path, text).expect("a temporary config");
    path
}

fn timed(mut c: Command) -> (Output, Duration) {
    let t0 = Instant::now();
    let out = c.output().expect("overlap runs");
    (out, t0.elapsed())
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_failing_rank_fails_the_run_naming_the_injected_node() {
    let mut c = overlap();
    c.args(["run", "--config", CONFIG, "--backend", "cpu"])
        .env("OVERLAP_FAULT", "rank=1,kind=stage1,step=2,mode=fail");
    let (out, took) = timed(c);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("error: step failed: rank 1 stream reduce node")
            && err.contains("stage1 b0 m0")
            && err.contains("a failure injected by OVERLAP_FAULT"),
        "{err}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("step 1/3") && !stdout.contains("step 2/3"),
        "{stdout}"
    );
    eprintln!("fail, one process: exited after {took:?}");
    assert!(took < FAIL_BOUND, "{took:?}");
}

#[test]
fn a_hung_rank_times_out_naming_the_streams_and_nodes_waited_on() {
    let config = config_with_timeout("hang", 1);
    let mut c = overlap();
    c.args(["run", "--config"])
        .arg(&config)
        .args(["--backend", "cpu"])
        .env("OVERLAP_FAULT", "rank=1,kind=stage1,step=2,mode=hang");
    let (out, took) = timed(c);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("error: step 2 timed out after 1.0 s; still busy:")
            && err.contains("rank 1 stream reduce running node")
            && err.contains("a hang injected by OVERLAP_FAULT"),
        "{err}"
    );
    eprintln!("hang, one process, step_timeout 1 s: exited after {took:?}");
    assert!(took < Duration::from_secs(1) + HANG_SLACK, "{took:?}");
    let _ = std::fs::remove_file(config);
}

#[test]
fn every_process_of_a_launch_exits_non_zero_when_a_rank_fails() {
    let mut c = overlap();
    c.args([
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        &free_port(),
        "--",
    ])
    .args(["run", "--config", CONFIG, "--backend", "cpu"])
    .env("OVERLAP_FAULT", "rank=1,kind=stage1,step=2,mode=fail");
    let (out, took) = timed(c);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    // Every process runs the whole mesh on the CPU backend, so each meets the fault; the
    // launcher stops whichever is still running after the first exits.
    assert!(err.contains("a failure injected by OVERLAP_FAULT"), "{err}");
    assert!(!err.contains("exited with status 0"), "{err}");
    eprintln!("fail, launch of 2 processes: all exited after {took:?}");
    assert!(took < FAIL_BOUND, "{took:?}");
}

#[test]
fn every_process_of_a_launch_exits_non_zero_when_a_rank_hangs() {
    let config = config_with_timeout("launch-hang", 1);
    let mut c = overlap();
    c.args([
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        &free_port(),
        "--",
    ])
    .args(["run", "--config"])
    .arg(&config)
    .args(["--backend", "cpu"])
    .env("OVERLAP_FAULT", "rank=0,kind=pack,step=2,mode=hang");
    let (out, took) = timed(c);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("timed out after 1.0 s") && err.contains("a hang injected by OVERLAP_FAULT"),
        "{err}"
    );
    eprintln!("hang, launch of 2 processes, step_timeout 1 s: all exited after {took:?}");
    assert!(took < Duration::from_secs(1) + HANG_SLACK, "{took:?}");
    let _ = std::fs::remove_file(config);
}

#[test]
fn a_malformed_fault_variable_is_named() {
    let out = overlap()
        .args(["run", "--config", CONFIG, "--backend", "cpu"])
        .env("OVERLAP_FAULT", "rank=1,kind=stage1")
        .output()
        .expect("overlap runs");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("OVERLAP_FAULT=\"rank=1,kind=stage1\": `step=` is missing"),
        "{err}"
    );
}

#[test]
fn a_hung_backward_stops_the_other_ranks_waits_within_the_timeout() {
    // Rank 2's compute stream hangs at its first grad_ready: its packs wait on it, its
    // peers' collectives wait on its packs, and backpressure waits inside `grad_ready`
    // are bounded by the step's deadline too.
    let config = config_with_timeout("backward", 1);
    let mut c = overlap();
    c.args(["run", "--config"])
        .arg(&config)
        .args(["--backend", "cpu"])
        .env("OVERLAP_FAULT", "rank=2,kind=grad_ready,step=2,mode=hang");
    let (out, took) = timed(c);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("rank 2 stream compute running node 0 (grad_ready")
            && err.contains("a hang injected by OVERLAP_FAULT"),
        "{err}"
    );
    assert!(took < Duration::from_secs(1) + HANG_SLACK, "{took:?}");
    let _ = std::fs::remove_file(config);
}
