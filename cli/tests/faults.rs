//! No hang: a rank that fails or hangs mid-step (`OVERLAP_FAULT`) makes `overlap run`,
//! alone or as every process of `overlap launch`, exit non-zero within a bound, naming
//! the root cause: the injected node, or for a hang the streams and nodes the timed-out
//! step was waiting on (`[run] step_timeout`).
//!
//! The bounds asserted here are loose (debug build on a shared machine); docs/gpus.md,
//! "When a rank fails or hangs", gives the measured figures.

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

/// The processes of a job started by hand (as torchrun or Slurm would, no launcher to
/// stop the others): `overlap run` on the CPU backend, rank `rank` of `world`, with
/// `fault` in its environment only.
fn rank_process(rank: u32, world: u32, port: &str, steps: u32, fault: Option<&str>) -> Command {
    let mut c = overlap();
    c.args([
        "run",
        "--config",
        CONFIG,
        "--backend",
        "cpu",
        "--steps",
        &steps.to_string(),
    ])
    .env("RANK", rank.to_string())
    .env("LOCAL_RANK", rank.to_string())
    .env("WORLD_SIZE", world.to_string())
    .env("LOCAL_WORLD_SIZE", world.to_string())
    .env("MASTER_ADDR", "127.0.0.1")
    .env("MASTER_PORT", port)
    .env("OVERLAP_JOB_SECRET", "a secret of this test job, 32 B.")
    .env_remove("OVERLAP_FAULT")
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped());
    if let Some(f) = fault {
        c.env("OVERLAP_FAULT", f);
    }
    c
}

#[test]
fn a_failure_on_one_process_stops_the_others_through_the_rendezvous() {
    let port = free_port();
    let t0 = Instant::now();
    // Rank 0 has 1000 steps ahead of it: only the failure of rank 1 can stop it soon.
    let r0 = rank_process(0, 2, &port, 1000, None).spawn().unwrap();
    let r1 = rank_process(
        1,
        2,
        &port,
        1000,
        Some("rank=1,kind=stage1,step=2,mode=fail"),
    )
    .spawn()
    .unwrap();
    let (o1, o0) = (
        r1.wait_with_output().unwrap(),
        r0.wait_with_output().unwrap(),
    );
    let took = t0.elapsed();
    let (e0, e1) = (stderr(&o0), stderr(&o1));
    assert_eq!(o1.status.code(), Some(2), "{e1}");
    assert!(e1.contains("a failure injected by OVERLAP_FAULT"), "{e1}");
    assert_eq!(o0.status.code(), Some(2), "{e0}");
    assert!(
        e0.contains("error: rank 1 of the job failed: step failed:")
            && e0.contains("a failure injected by OVERLAP_FAULT"),
        "{e0}"
    );
    let steps0 = String::from_utf8_lossy(&o0.stdout).matches("step ").count();
    eprintln!("rank 0 stopped after {steps0} steps, {took:?}");
    assert!(steps0 < 100, "rank 0 ran on: {steps0} steps");
    assert!(took < FAIL_BOUND, "{took:?}");
}

#[test]
fn a_killed_process_stops_the_others_through_the_rendezvous() {
    let port = free_port();
    let r0 = rank_process(0, 2, &port, 100_000, None).spawn().unwrap();
    let mut r1 = rank_process(1, 2, &port, 100_000, None).spawn().unwrap();
    // Wait until rank 1 runs its steps, then kill it without a word.
    let mut out1 = r1.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("step 2/") {
        use std::io::Read;
        let n = out1.read(&mut buf).unwrap();
        assert!(n > 0, "rank 1 ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    let t0 = Instant::now();
    r1.kill().unwrap();
    r1.wait().unwrap();
    let o0 = r0.wait_with_output().unwrap();
    let took = t0.elapsed();
    let e0 = stderr(&o0);
    assert_eq!(o0.status.code(), Some(2), "{e0}");
    assert!(
        e0.contains("rank 1 of the job failed") && e0.contains("without a goodbye"),
        "{e0}"
    );
    eprintln!("rank 0 stopped {took:?} after rank 1 was killed");
    assert!(took < FAIL_BOUND, "{took:?}");
}

#[test]
fn processes_that_end_well_say_goodbye_and_exit_0() {
    for steps in [1, 3] {
        let port = free_port();
        let r0 = rank_process(0, 2, &port, steps, None).spawn().unwrap();
        let r1 = rank_process(1, 2, &port, steps, None).spawn().unwrap();
        for o in [
            r0.wait_with_output().unwrap(),
            r1.wait_with_output().unwrap(),
        ] {
            assert!(o.status.success(), "{}", stderr(&o));
            assert!(!stderr(&o).contains("failed"), "{}", stderr(&o));
        }
    }
}
