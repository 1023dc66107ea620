//! Restarts (`docs/checkpoints.md`, Restarts): `overlap launch --max-restarts N` starts
//! every rank again after one fails, and `overlap run --resume-latest` goes on from the
//! latest checkpoint, so a job whose rank 1 fails in step 5 of its first attempt
//! (`OVERLAP_FAULT=...,attempt=0`) ends with the parameters and optimizer state of a run
//! that never failed, bit for bit. Without restarts the same failure fails the job; a
//! failure on every attempt uses the restarts up and fails with its status.
//!
//! Each process runs one rank of the mesh on the CPU backend; the assertions hold as
//! well where each runs the whole mesh (all meet the fault; rank 0's process saves).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use overlap::checkpoint::{unfinished, Manifest, LATEST, MANIFEST};

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/hsdp_2x2.toml");

/// Rank 1 fails in its first `stage1` of step 5 (of 8), on the first attempt only.
const FIRST_ATTEMPT_FAULT: &str = "rank=1,kind=stage1,step=5,mode=fail,attempt=0";

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("restart")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The example config on mesh 2x1 (a job of two processes), written into `dir`.
fn two_rank_config(dir: &Path) -> String {
    let text = std::fs::read_to_string(EXAMPLE).expect("the example config");
    let text = text.replacen("replicate = 2", "replicate = 1", 1);
    assert!(text.contains("shard = 2\nreplicate = 1"), "{text}");
    let path = dir.join("hsdp_2x1.toml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

fn overlap(args: &[&str], fault: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_overlap"));
    c.args(args)
        .env_remove("OVERLAP_JOB_SECRET")
        .env_remove("OVERLAP_FAULT")
        .env_remove("OVERLAP_RESTART_COUNT");
    if let Some(f) = fault {
        c.env("OVERLAP_FAULT", f);
    }
    c.output().expect("the binary runs")
}

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port().to_string())
        .expect("a free port")
}

/// `overlap launch --nproc-per-node 2 --max-restarts R -- run --config C --seed 7 --steps
/// N --checkpoint ROOT --save-every 2 --resume-latest EXTRA...` on a free port.
fn job_args(config: &str, restarts: &str, steps: &str, root: &Path, extra: &[&str]) -> Vec<String> {
    let port = free_port();
    let root = root.to_str().unwrap();
    let args = [
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        &port,
        "--max-restarts",
        restarts,
        "--",
        "run",
        "--config",
        config,
        "--seed",
        "7",
        "--steps",
        steps,
        "--checkpoint",
        root,
        "--save-every",
        "2",
        "--resume-latest",
    ];
    args.iter().chain(extra).map(|a| a.to_string()).collect()
}

/// [`job_args`] for 8 steps, run to the end with `fault` in OVERLAP_FAULT.
fn restartable_job(config: &str, restarts: &str, root: &Path, fault: &str) -> Output {
    let args = job_args(config, restarts, "8", root, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    overlap(&args, Some(fault))
}

/// Stdout and stderr together.
fn all(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The sha256 of every file of a checkpoint directory, from its manifest.
fn file_sums(ckpt: &Path) -> Vec<String> {
    let m: Manifest = serde_json::from_slice(&std::fs::read(ckpt.join(MANIFEST)).unwrap()).unwrap();
    m.files.into_iter().map(|f| f.sha256).collect()
}

fn latest(root: &Path) -> String {
    std::fs::read_to_string(root.join(LATEST))
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The sha256 of the files of the uninterrupted run's last checkpoint, after `steps`
/// steps in one process (every rank).
fn straight_run(config: &str, dir: &Path, steps: u64) -> Vec<String> {
    let root = dir.join("straight");
    let n = steps.to_string();
    let args = [
        "run",
        "--config",
        config,
        "--seed",
        "7",
        "--steps",
        &n,
        "--checkpoint",
        root.to_str().unwrap(),
    ];
    let o = overlap(&args, None);
    assert!(o.status.success(), "{}", all(&o));
    file_sums(&root.join(format!("step-{steps:06}")))
}

#[test]
fn a_job_restarted_after_a_failure_ends_as_a_run_that_never_failed() {
    let dir = scratch("restarted");
    let c = two_rank_config(&dir);
    let want = straight_run(&c, &dir, 8);
    let root = dir.join("ckpt");
    let o = restartable_job(&c, "1", &root, FIRST_ATTEMPT_FAULT);
    let out = all(&o);
    assert!(o.status.success(), "{out}");
    let restart_line = out
        .lines()
        .find(|l| l.starts_with("[launch] rank ") && l.contains("; restart 1 of 1: "))
        .unwrap_or_else(|| panic!("no restart line: {out}"));
    assert!(
        restart_line.ends_with("exited with status 2; restart 1 of 1: starting every rank again"),
        "{restart_line}"
    );
    assert!(out.contains("a failure injected by OVERLAP_FAULT"), "{out}");
    // The first attempt started fresh; the second resumed from the last complete save
    // (step 4, or step 2 when the failure stopped rank 0 before it committed step 4).
    assert!(out.contains("[rank 0] resume-latest: ") && out.contains("holds no checkpoint yet"));
    let resumed = out
        .lines()
        .find(|l| l.starts_with("[rank 0] resumed from "))
        .unwrap_or_else(|| panic!("the restart did not resume: {out}"));
    assert!(
        resumed.contains(" at step 4 ") || resumed.contains(" at step 2 "),
        "{resumed}"
    );
    assert!(out.contains("[rank 0] step 8/8"), "{out}");
    assert_eq!(latest(&root), "step-000008");
    assert_eq!(file_sums(&root.join("step-000008")), want);
    assert!(unfinished(&root).is_empty(), "{:?}", unfinished(&root));
}

#[test]
fn without_restarts_the_failure_fails_the_job_and_a_failure_on_every_attempt_uses_them_up() {
    let dir = scratch("used_up");
    let c = two_rank_config(&dir);
    let o = restartable_job(&c, "0", &dir.join("none"), FIRST_ATTEMPT_FAULT);
    let out = all(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(
        out.contains("a failure injected by OVERLAP_FAULT") && !out.contains("; restart "),
        "{out}"
    );
    assert!(!out.contains("step 8/8"), "{out}");

    // The fault without `attempt=` fires on every attempt: two restarts, then the status.
    let every = FIRST_ATTEMPT_FAULT.replace(",attempt=0", "");
    let root = dir.join("every");
    let o = restartable_job(&c, "2", &root, &every);
    let out = all(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    for k in 1..=2 {
        let line = format!("; restart {k} of 2: starting every rank again");
        assert_eq!(out.matches(&line).count(), 1, "{line}: {out}");
    }
    assert!(
        out.contains("exited with status 2; the 2 restart(s) of --max-restarts are used up: exiting with status 2"),
        "{out}"
    );
    assert_eq!(out.matches("[rank 0] resumed from ").count(), 2, "{out}");
    assert!(!out.contains("step 8/8"), "{out}");
    assert!(matches!(
        latest(&root).as_str(),
        "step-000002" | "step-000004"
    ));
}

#[test]
fn resume_latest_needs_a_checkpoint_root_and_continues_only_its_own_run() {
    let dir = scratch("refusals");
    let c = two_rank_config(&dir);
    let root = dir.join("ckpt");
    let r = root.to_str().unwrap();
    let run = |extra: &[&str], fault: Option<&str>| {
        overlap(&[&["run", "--config", &c][..], extra].concat(), fault)
    };
    let o = run(&["--steps", "2", "--resume-latest"], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--checkpoint"), "{err}");
    let o = run(&["--resume", r, "--resume-latest", "--checkpoint", r], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--resume"), "{err}");

    // The same command line starts at step 0, then goes on from the checkpoint. What a
    // first save that did not finish left (no `latest` yet) is reported and removed.
    let left = [".step-000002-00000000000000ab.partial", "step-000002"];
    for d in left {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    let o = run(
        &["--steps", "2", "--checkpoint", r, "--resume-latest"],
        None,
    );
    let out = all(&o);
    assert!(
        o.status.success() && out.contains("holds no checkpoint yet"),
        "{out}"
    );
    for d in left {
        let line = format!("resume: ignored {}, left by", root.join(d).display());
        assert!(out.contains(&line), "{line}: {out}");
    }
    assert!(unfinished(&root).is_empty(), "{:?}", unfinished(&root));
    let o = run(
        &["--steps", "3", "--checkpoint", r, "--resume-latest"],
        None,
    );
    let out = all(&o);
    assert!(
        o.status.success() && out.contains("at step 2") && out.contains("step 3/3"),
        "{out}"
    );
    assert_eq!(latest(&root), "step-000003");
    // Another seed's checkpoint, or one past --steps, is refused by name.
    let o = run(
        &[
            "--steps",
            "4",
            "--checkpoint",
            r,
            "--resume-latest",
            "--seed",
            "8",
        ],
        None,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--resume-latest (--checkpoint ") && err.contains("--seed 42"),
        "{err}"
    );
    let o = run(
        &["--steps", "2", "--checkpoint", r, "--resume-latest"],
        None,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("at step 3, past --steps 2"), "{err}");

    // A malformed attempt count is named; restarts of a job of several nodes are refused.
    let o = Command::new(env!("CARGO_BIN_EXE_overlap"))
        .args(["run", "--config", &c, "--steps", "1"])
        .env("OVERLAP_FAULT", FIRST_ATTEMPT_FAULT)
        .env("OVERLAP_RESTART_COUNT", "first")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("OVERLAP_RESTART_COUNT=\"first\" is not a restart count"),
        "{err}"
    );
    let o = overlap(
        &[
            "launch",
            "--nproc-per-node",
            "1",
            "--nnodes",
            "2",
            "--max-restarts",
            "1",
            "--",
            "env",
        ],
        None,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--max-restarts 1 restarts the ranks of one node"),
        "{err}"
    );
}

/// The pid of the child of `launcher` that runs global rank `rank` (its `RANK`).
#[cfg(target_os = "linux")]
fn rank_pid(launcher: u32, rank: u32) -> Option<u32> {
    let want = format!("RANK={rank}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // pid (comm) state ppid ...: comm may hold spaces, so read after the last ')'.
        let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?;
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let ours = ppid.parse::<u32>().ok()? == launcher
            && environ.split(|&b| b == 0).any(|v| v == want.as_bytes());
        ours.then_some(pid)
    })
}

/// Starts [`job_args`] with its output piped: its stdout lines (read by the test) and a
/// thread collecting its stderr.
fn spawn_job(
    args: &[String],
) -> (
    Child,
    impl Iterator<Item = String>,
    std::thread::JoinHandle<String>,
) {
    let mut job = Command::new(env!("CARGO_BIN_EXE_overlap"))
        .args(args)
        .env_remove("OVERLAP_JOB_SECRET")
        .env_remove("OVERLAP_FAULT")
        .env_remove("OVERLAP_RESTART_COUNT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("overlap starts");
    let lines = BufReader::new(job.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok);
    let mut err = job.stderr.take().unwrap();
    let errs = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    (job, lines, errs)
}

#[cfg(target_os = "linux")]
#[test]
fn a_rank_killed_mid_run_is_started_again_and_the_job_ends_as_one_that_never_failed() {
    let dir = scratch("killed");
    let c = two_rank_config(&dir);
    let want = straight_run(&c, &dir, 24);
    let root = dir.join("ckpt");
    let args = job_args(&c, "1", "24", &root, &["--step-interval-ms", "25"]);
    let (mut job, mut lines, errs) = spawn_job(&args);
    // After the first attempt committed step 4, rank 1 is killed (SIGKILL) mid-run.
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|l: &String| l.starts_with("[rank 0] checkpoint: step 4 saved"))
    {
        let Some(line) = lines.next() else {
            let _ = job.kill();
            panic!("the job ended before saving step 4: {seen:?}");
        };
        seen.push(line);
    }
    let pid = rank_pid(job.id(), 1).expect("rank 1's process");
    // SAFETY: kill on the pid of a running rank of our own child.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
    let rest: Vec<String> = lines.collect();
    let status = job.wait().unwrap();
    let err = errs.join().unwrap();
    let out = format!("{}\n{}\n{err}", seen.join("\n"), rest.join("\n"));
    assert!(status.success(), "{out}");
    // Rank 1's death (128 + SIGKILL), or rank 0's failure on hearing of it when the
    // launcher sees both exits in one look.
    let restart = "; restart 1 of 1: starting every rank again";
    let killed = format!(
        "[launch] rank 1 exited with status {}{restart}",
        128 + libc::SIGKILL
    );
    let told = format!("[launch] rank 0 exited with status 2{restart}");
    assert!(err.contains(&killed) || err.contains(&told), "{out}");
    assert!(
        rest.iter().any(|l| l.starts_with("[rank 1] resumed from ")),
        "{out}"
    );
    assert_eq!(latest(&root), "step-000024");
    assert_eq!(file_sums(&root.join("step-000024")), want);
}

#[cfg(target_os = "linux")]
#[test]
fn a_signal_to_the_launcher_stops_the_job_without_a_restart() {
    let dir = scratch("signalled");
    let c = two_rank_config(&dir);
    let args = job_args(
        &c,
        "2",
        "100000",
        &dir.join("ckpt"),
        &["--step-interval-ms", "20"],
    );
    let (mut job, mut lines, errs) = spawn_job(&args);
    let mut stepping = [false, false];
    while stepping != [true, true] {
        let Some(line) = lines.next() else {
            let _ = job.kill();
            panic!("the ranks stopped before stepping");
        };
        for (r, s) in stepping.iter_mut().enumerate() {
            *s |= line.starts_with(&format!("[rank {r}] step "));
        }
    }
    // Keep reading so a rank never blocks on a full pipe.
    let drain = std::thread::spawn(move || lines.count());
    // SAFETY: kill on the pid of our own child, not yet reaped.
    unsafe {
        libc::kill(job.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = job.wait().unwrap();
    let _ = drain.join();
    let err = errs.join().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{err}");
    assert!(
        err.contains("[launch] received signal") && !err.contains("; restart "),
        "{err}"
    );
}
