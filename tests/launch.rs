//! `overlap launch` and the multi-process plumbing, without a GPU: ranks get torchrun's
//! variables, meet at rank 0's rendezvous, their output comes back prefixed, and the
//! first failure decides the exit code. Also: `--backend cuda` in a build without it is
//! a clear error.

use std::net::TcpListener;
use std::process::Command;

fn overlap() -> Command {
    Command::new(env!("CARGO_BIN_EXE_overlap"))
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
        .output()
        .expect("overlap runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("could not reach rank 0"), "{stderr}");
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
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/gpu/gpu_2x1.toml");
    for cmd in [["verify", "--config", config], ["run", "--config", config]] {
        let out = overlap().args(cmd).output().expect("overlap runs");
        assert_eq!(out.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--features cuda"), "{stderr}");
    }
}
