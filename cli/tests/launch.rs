//! `overlap launch` and the multi-process plumbing, without a GPU: ranks get torchrun's
//! variables, meet at rank 0's rendezvous (on the CPU backend each process then runs one
//! rank of the mesh), their output comes back prefixed, and the first failure decides
//! the exit code. Also: `--backend cuda` in a build without it is a clear error.

use std::net::TcpListener;
use std::process::Command;

fn overlap() -> Command {
    Command::new(env!("CARGO_BIN_EXE_overlap"))
}

/// The example `hsdp_2x2.toml` on a mesh of two ranks (2x1), written to a temporary file
/// named after `name`: a CPU job of two processes runs one rank each.
fn two_rank_config(name: &str) -> std::path::PathBuf {
    let text = two_rank_text();
    let path =
        std::env::temp_dir().join(format!("overlap-launch-{name}-{}.toml", std::process::id()));
    std::fs::write(&path, text).expect("a temporary config");
    path
}

fn two_rank_text() -> String {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/hsdp_2x2.toml"
    ))
    .expect("the example config");
    assert!(text.contains("replicate = 2"));
    text.replacen("replicate = 2", "replicate = 1", 1)
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[test]
fn launch_starts_ranks_with_torchrun_variables_and_prefixes_their_output() {
    let port = free_port().to_string();
    let out = overlap()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--",
            "env",
            "--rendezvous",
        ])
        .output()
        .expect("overlap runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for rank in 0..2 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("[rank {rank}] {{")))
            .unwrap_or_else(|| panic!("no env line of rank {rank} in:\n{stdout}"));
        assert!(line.contains(&format!("\"rank\":{rank}")), "{line}");
        assert!(line.contains("\"world_size\":2"), "{line}");
        assert!(line.contains(&format!("\"local_rank\":{rank}")), "{line}");
        assert!(line.contains(&format!("\"master_port\":{port}")), "{line}");
    }
    assert!(
        stdout.contains("[rank 0] rendezvous: 2 ranks arrived"),
        "{stdout}"
    );
}

#[test]
fn launch_exits_with_the_first_failure_of_its_ranks() {
    let port = free_port().to_string();
    let out = overlap()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--",
        ])
        .args(["verify", "--config", "/nonexistent/overlap.toml"])
        .output()
        .expect("overlap runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/overlap.toml"), "{stderr}");
    assert!(stderr.lines().any(|l| l.starts_with("[rank ")), "{stderr}");
}

#[test]
fn launch_runs_a_program_that_is_not_an_overlap_subcommand_with_the_same_variables() {
    let port = free_port().to_string();
    let out = overlap()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--",
            "sh",
            "-c",
            "echo trainer $RANK/$WORLD_SIZE local $LOCAL_RANK at $MASTER_ADDR:$MASTER_PORT",
        ])
        .output()
        .expect("overlap runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    for rank in 0..2 {
        let want = format!("[rank {rank}] trainer {rank}/2 local {rank} at 127.0.0.1:{port}");
        assert!(
            stdout.lines().any(|l| l == want),
            "no `{want}` in:\n{stdout}"
        );
    }
    // A program that does not exist is named.
    let out = overlap()
        .args(["launch", "--nproc-per-node", "1", "--", "./no-such-trainer"])
        .output()
        .expect("overlap runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot start rank 0 (./no-such-trainer)"),
        "{stderr}"
    );
}

#[test]
fn launch_without_a_command_is_a_usage_error() {
    let out = overlap()
        .args(["launch", "--nproc-per-node", "2"])
        .output()
        .expect("overlap runs");
    assert!(!out.status.success());
}

#[test]
fn a_rank_without_its_peers_times_out_naming_them() {
    // Rank 1 of 2, but rank 0 never starts: the rendezvous gives up with advice.
    let port = free_port().to_string();
    let out = overlap()
        .args(["env", "--rendezvous"])
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", "1")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port)
        .env("OVERLAP_RENDEZVOUS_TIMEOUT_S", "1")
        .env("OVERLAP_JOB_SECRET", SECRET)
        .output()
        .expect("overlap runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("could not reach rank 0"), "{stderr}");
}

const SECRET: &str = "a test secret that is long enough";

#[test]
fn malformed_timeouts_are_refused_naming_the_variable() {
    // Past a week would have overflowed the deadline (a panic); garbage was ignored.
    for bad in ["18446744073709551615", "soon", "0"] {
        let out = rank(1, 2, free_port(), Some(SECRET), &["env", "--rendezvous"])
            .env("OVERLAP_RENDEZVOUS_TIMEOUT_S", bad)
            .output()
            .expect("overlap runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("OVERLAP_RENDEZVOUS_TIMEOUT_S") && !stderr.contains("panicked"),
            "{stderr}"
        );
    }
    let out = overlap()
        .args(["launch", "--nproc-per-node", "2", "--", "env"])
        .env("OVERLAP_LAUNCH_GRACE_S", "forever")
        .output()
        .expect("overlap runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("OVERLAP_LAUNCH_GRACE_S"), "{stderr}");
    assert!(!stderr.contains("[rank 0]"), "no rank starts: {stderr}");
}

/// `overlap <args>` as rank `rank` of `world` on 127.0.0.1:`port`, with `secret`.
fn rank(rank: u32, world: u32, port: u16, secret: Option<&str>, args: &[&str]) -> Command {
    let mut c = overlap();
    c.args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("OVERLAP_RENDEZVOUS_TIMEOUT_S", "60")
        .env_remove("OVERLAP_JOB_SECRET")
        .env_remove("OVERLAP_JOB_SECRET_FILE");
    if let Some(s) = secret {
        c.env("OVERLAP_JOB_SECRET", s);
    }
    c
}

#[test]
fn a_job_without_a_secret_is_refused_with_advice() {
    let out = rank(1, 2, free_port(), None, &["env", "--rendezvous"])
        .output()
        .expect("overlap runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("OVERLAP_JOB_SECRET") && stderr.contains("is not set"),
        "{stderr}"
    );
}

#[test]
fn cpu_ranks_under_launch_meet_and_agree() {
    let port = free_port().to_string();
    let path = two_rank_config("agree");
    let config = path.to_str().expect("a UTF-8 path");
    let out = overlap()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--",
        ])
        .args([
            "verify",
            "--config",
            config,
            "--backend",
            "cpu",
            "--steps",
            "1",
        ])
        .env_remove("OVERLAP_JOB_SECRET")
        .output()
        .expect("overlap runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("[rank 0] rendezvous: 2 ranks agree on what they run")
            && stderr.contains("one rank per process, linked"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(path);
}

#[test]
fn ranks_with_different_configs_are_stopped_with_the_field_that_differs() {
    let base = two_rank_text();
    let other = base.replace("cap_bytes = 26214400", "cap_bytes = 1048576");
    assert_ne!(base, other);
    let dir = std::env::temp_dir().join(format!("overlap-agree-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (dir.join("a.toml"), dir.join("b.toml"));
    std::fs::write(&a, &base).unwrap();
    std::fs::write(&b, &other).unwrap();
    let port = free_port();
    let args = |p: &std::path::Path| {
        vec![
            "verify".to_string(),
            "--config".into(),
            p.display().to_string(),
            "--backend".into(),
            "cpu".into(),
            "--steps".into(),
            "1".into(),
        ]
    };
    let spawn = |r: u32, p: &std::path::Path| {
        let a = args(p);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        rank(r, 2, port, Some(SECRET), &a)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("overlap starts")
    };
    let (r0, r1) = (spawn(0, &a), spawn(1, &b));
    for (r, child) in [(0, r0), (1, r1)] {
        let out = child.wait_with_output().expect("overlap runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "rank {r}: {stderr}");
        assert!(
            stderr.contains(
                "error: ranks 0 and 1 disagree on `buckets.cap_bytes`: 26214400 vs 1048576"
            ),
            "rank {r}: {stderr}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn inconsistent_launcher_variables_are_named() {
    let out = overlap()
        .args(["env"])
        .env("RANK", "2")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", "0")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "29500")
        .output()
        .expect("overlap runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 2 is not below the world size 2"),
        "{stderr}"
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn backend_cuda_without_the_feature_says_how_to_rebuild() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/gpu/gpu_2x1.toml");
    for cmd in [["verify", "--config", config], ["run", "--config", config]] {
        let out = overlap().args(cmd).output().expect("overlap runs");
        assert_eq!(out.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--features cuda"), "{stderr}");
    }
}

/// Ranks sharing one GPU (`OVERLAP_SHARE_GPU=1`) run over the copy transport only:
/// a job whose collectives go through NCCL is refused naming NCCL, before any rank
/// opens a GPU (so no GPU is needed to see it), and a value that is neither 1 nor 0 is
/// refused naming the variable.
#[cfg(feature = "cuda")]
#[test]
fn ranks_sharing_a_gpu_refuse_nccl_by_name() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/gpu/gpu_2x1.toml");
    let port = free_port().to_string();
    let job = |share: &str| {
        overlap()
            .env("OVERLAP_SHARE_GPU", share)
            .args([
                "launch",
                "--nproc-per-node",
                "2",
                "--master-port",
                &port,
                "--",
            ])
            .args(["verify", "--config", config, "--backend", "cuda"])
            .args(["--transport", "nccl", "--steps", "1"])
            .output()
            .expect("overlap runs")
    };
    let out = job("1");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("NCCL refuses two ranks on one device")
            && stderr.contains("transport = \"copy\""),
        "{stderr}"
    );
    let out = job("yes");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("OVERLAP_SHARE_GPU=\"yes\""), "{stderr}");
}

/// The pids of the processes whose parent is `parent` (from /proc).
#[cfg(target_os = "linux")]
fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so read after the last ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(parent) {
            out.push(pid);
        }
    }
    out
}

#[cfg(target_os = "linux")]
#[test]
fn sigterm_to_launch_stops_every_rank_and_each_rank_serves_its_own_metrics_port() {
    use std::io::{BufRead, BufReader, Read, Write};
    // A base port whose next port is free too (rank 1 serves there).
    let base = (0..50)
        .map(|_| free_port())
        .find(|&p| p < 65000 && TcpListener::bind(("127.0.0.1", p + 1)).is_ok())
        .expect("two free ports");
    let path = two_rank_config("sigterm");
    let config = path.to_str().expect("a UTF-8 path");
    let metrics = format!("127.0.0.1:{base}");
    let mut launch = overlap()
        .args(["launch", "--nproc-per-node", "2", "--master-port"])
        .arg(free_port().to_string())
        .args(["--", "run", "--config", config, "--backend", "cpu"])
        .args([
            "--steps",
            "100000",
            "--step-interval-ms",
            "20",
            "--metrics",
            &metrics,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("overlap starts");
    let stdout = launch.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let mut stepping = [false, false];
    let mut seen = Vec::new();
    while stepping != [true, true] {
        let Some(Ok(line)) = lines.next() else {
            let _ = launch.kill();
            panic!("the ranks stopped before stepping: {seen:?}");
        };
        for (r, s) in stepping.iter_mut().enumerate() {
            *s |= line.starts_with(&format!("[rank {r}] step "));
        }
        seen.push(line);
    }
    for (r, port) in [(0, base), (1, base + 1)] {
        let line = format!("[rank {r}] metrics: serving http://127.0.0.1:{port}/metrics");
        assert!(seen.contains(&line), "{line} not in {seen:?}");
        let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        c.read_to_string(&mut body).unwrap();
        assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
        assert!(body.contains("overlap_steps_total"), "{body}");
    }
    let ranks = children_of(launch.id());
    assert_eq!(ranks.len(), 2, "{ranks:?}");
    // Keep reading so a rank never blocks on a full pipe.
    let drain = std::thread::spawn(move || lines.count());
    // SAFETY: kill on the pid of our own child, not yet reaped.
    unsafe {
        libc::kill(launch.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = launch.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
    drain.join().unwrap();
    for pid in ranks {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "rank process {pid} outlived the launcher"
        );
    }
    let _ = std::fs::remove_file(path);
}
