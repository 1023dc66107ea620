//! No hang: a rank that fails or hangs mid-step (`OVERLAP_FAULT`) makes `overlap run`,
//! alone or as every process of `overlap launch` (one rank per process on the CPU
//! backend), exit non-zero within a bound, naming the root cause: the injected node, or
//! for a hang the streams and nodes the timed-out step was waiting on (`[run]
//! step_timeout`). A rank that fails, or is killed, in a job started without a launcher
//! (as torchrun or Slurm would start it) stops every other rank too.
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

/// The example config on a mesh of `shard × replicate` ranks, written to a temporary
/// file named after `name` (a job of one process per rank has as many processes).
fn config_on(name: &str, shard: u32, replicate: u32) -> PathBuf {
    let text = std::fs::read_to_string(CONFIG).expect("the example config");
    let text = text
        .replacen("shard = 2", &format!("shard = {shard}"), 1)
        .replacen("replicate = 2", &format!("replicate = {replicate}"), 1);
    let path =
        std::env::temp_dir().join(format!("overlap-faults-{name}-{}.toml", std::process::id()));
    std::fs::write(&path, text).expect("a temporary config");
    path
}

/// The example config with `[run] step_timeout = seconds`.
fn config_with_timeout(name: &str, seconds: u32) -> PathBuf {
    timeout_in(name, CONFIG.as_ref(), seconds)
}

/// `config` with `[run] step_timeout = seconds`, written next to the others.
fn timeout_in(name: &str, config: &std::path::Path, seconds: u32) -> PathBuf {
    let text = std::fs::read_to_string(config).expect("the example config");
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
    let config = config_on("launch-fail", 2, 1);
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
    .env("OVERLAP_FAULT", "rank=1,kind=stage1,step=2,mode=fail");
    let (out, took) = timed(c);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    // The process of rank 1 meets the fault and names it; rank 0 names rank 1 and its
    // error: its collective with rank 1 fails, or the job's watch tells it first.
    let rank0 = err
        .lines()
        .find(|l| l.starts_with("[rank 0] error: "))
        .unwrap_or_default();
    assert!(
        err.contains("[rank 1] error: step failed: rank 1 stream reduce node")
            && err.contains("a failure injected by OVERLAP_FAULT")
            && (rank0.contains("rank 1 could not take part")
                || rank0.contains("rank 1 of the job failed")),
        "{err}"
    );
    assert!(!err.contains("exited with status 0"), "{err}");
    eprintln!("fail, launch of 2 processes: all exited after {took:?}");
    assert!(took < FAIL_BOUND, "{took:?}");
    let _ = std::fs::remove_file(config);
}

#[test]
fn every_process_of_a_launch_exits_non_zero_when_a_rank_hangs() {
    let two = config_on("launch-hang-2x1", 2, 1);
    let config = timeout_in("launch-hang", &two, 1);
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
    let _ = std::fs::remove_file(two);
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
/// stop the others): `overlap run` of `config` (a mesh of `world` ranks) on the CPU
/// backend, rank `rank` of `world`, with `fault` in its environment only.
fn rank_process(
    config: &std::path::Path,
    (rank, world): (u32, u32),
    port: &str,
    steps: u32,
    fault: Option<&str>,
) -> Command {
    let mut c = overlap();
    c.args(["run", "--config"])
        .arg(config)
        .args(["--backend", "cpu", "--steps", &steps.to_string()])
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

/// Waits for every process and returns its output and how long after `t0` it ended.
fn wait_all(children: Vec<std::process::Child>, t0: Instant) -> Vec<(Output, Duration)> {
    let waiting: Vec<_> = children
        .into_iter()
        .map(|c| std::thread::spawn(move || (c.wait_with_output().unwrap(), t0.elapsed())))
        .collect();
    waiting.into_iter().map(|w| w.join().unwrap()).collect()
}

#[test]
fn a_failure_on_one_process_stops_the_others() {
    // 2x1 and 2x2: every rank has 1000 steps ahead of it, and only the failure of rank
    // 1 in step 2 can stop it soon: through its collectives with rank 1, or the
    // rendezvous (rank 2 of the 2x2 mesh shares no group with rank 1).
    for (shard, replicate) in [(2, 1), (2, 2)] {
        let world = shard * replicate;
        let config = config_on(&format!("fail-{world}"), shard, replicate);
        let port = free_port();
        let t0 = Instant::now();
        let fault = "rank=1,kind=stage1,step=2,mode=fail";
        let children = (0..world)
            .map(|r| {
                let f = (r == 1).then_some(fault);
                rank_process(&config, (r, world), &port, 1000, f)
                    .spawn()
                    .unwrap()
            })
            .collect();
        let outs = wait_all(children, t0);
        for (r, (o, took)) in outs.iter().enumerate() {
            let e = stderr(o);
            assert_eq!(o.status.code(), Some(2), "rank {r} of {world}: {e}");
            let named = match r {
                1 => e.contains("a failure injected by OVERLAP_FAULT"),
                // A peer's collective fails naming rank 1, or the watch reports it.
                _ => {
                    (e.contains("rank 1 could not take part")
                        || e.contains("rank 1 of the job failed"))
                        && e.contains("injected")
                }
            };
            assert!(named, "rank {r} of {world}: {e}");
            let steps = String::from_utf8_lossy(&o.stdout).matches("step ").count();
            eprintln!("{world} processes: rank {r} stopped after {steps} steps, {took:?}");
            assert!(steps < 100, "rank {r} ran on: {steps} steps");
            assert!(*took < FAIL_BOUND, "{took:?}");
        }
        let _ = std::fs::remove_file(config);
    }
}

#[test]
fn a_killed_process_stops_the_others() {
    for (shard, replicate) in [(2, 1), (2, 2)] {
        let world = shard * replicate;
        let config = config_on(&format!("killed-{world}"), shard, replicate);
        let port = free_port();
        let mut children: Vec<_> = (0..world)
            .map(|r| {
                rank_process(&config, (r, world), &port, 100_000, None)
                    .spawn()
                    .unwrap()
            })
            .collect();
        // Wait until rank 1 runs its steps, then kill it without a word.
        let mut r1 = children.remove(1);
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
        for (i, (o, took)) in wait_all(children, t0).into_iter().enumerate() {
            let r = if i == 0 { 0 } else { i + 1 };
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "rank {r} of {world}: {e}");
            // Its links or the rendezvous name rank 1; a rank that learns of the end
            // from another survivor's closed connection reads that survivor's farewell,
            // which names rank 1 too.
            assert!(
                e.contains("without a goodbye") && e.contains("rank 1"),
                "rank {r} of {world}: {e}"
            );
            eprintln!("{world} processes: rank {r} stopped {took:?} after rank 1 was killed");
            assert!(took < FAIL_BOUND, "{took:?}");
        }
        let _ = std::fs::remove_file(config);
    }
}

#[test]
fn processes_that_end_well_say_goodbye_and_exit_0() {
    let config = config_on("goodbye", 2, 1);
    for steps in [1, 3] {
        let port = free_port();
        let r0 = rank_process(&config, (0, 2), &port, steps, None)
            .spawn()
            .unwrap();
        let r1 = rank_process(&config, (1, 2), &port, steps, None)
            .spawn()
            .unwrap();
        for o in [
            r0.wait_with_output().unwrap(),
            r1.wait_with_output().unwrap(),
        ] {
            assert!(o.status.success(), "{}", stderr(&o));
            assert!(!stderr(&o).contains("failed"), "{}", stderr(&o));
        }
    }
    let _ = std::fs::remove_file(config);
}
