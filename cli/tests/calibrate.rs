//! `overlap calibrate` in a build without the `cuda` feature (what CI builds): the
//! command exists, refuses bad arguments naming the flag, refuses a job of one GPU
//! without `--base` naming what one GPU cannot measure, and otherwise says that it needs
//! `--features cuda`, writing nothing. (The derivation of a profile from measurements is
//! unit-tested in `sim/src/calibrate/tests.rs`; the measurements themselves run on
//! the CPU backend in `cli/src/calibrate/measure.rs`.)

#![cfg(not(feature = "cuda"))]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The launcher variables `overlap_dist::env::RankEnv` reads: removed, so that the command
/// sees a job of one process unless a test sets them.
const LAUNCHER_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_PROCID",
];

fn calibrate(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_overlap"));
    cmd.arg("calibrate").args(args).current_dir(root());
    for v in LAUNCHER_VARS {
        cmd.env_remove(v);
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("run overlap")
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("overlap-calibrate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Exit 2, nothing on stdout, and stderr one `error:` naming every one of `needles`.
fn refused(o: &Output, needles: &[&str]) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        o.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(err.contains("error"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
    err
}

/// A two-rank job as `overlap launch --nproc-per-node 2` starts it (rank 0's view).
const TWO_RANKS: &[(&str, &str)] = &[
    ("RANK", "0"),
    ("WORLD_SIZE", "2"),
    ("LOCAL_RANK", "0"),
    ("LOCAL_WORLD_SIZE", "2"),
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "29999"),
];

#[test]
fn without_cuda_the_command_says_it_needs_the_feature_and_writes_nothing() {
    let out = scratch().join("cuda.toml");
    let out_s = out.display().to_string();
    // One GPU with a base, and two GPUs without one: everything checks, then the GPU.
    for (args, env) in [
        (
            vec!["--out", &out_s, "--base", "hardware/h200-nvlink.toml"],
            &[][..],
        ),
        (vec!["--out", &out_s], TWO_RANKS),
    ] {
        refused(&calibrate(&args, env), &["--features cuda", "calibrate"]);
        assert!(!out.exists());
    }
    // The help names it.
    let o = Command::new(env!("CARGO_BIN_EXE_overlap"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("calibrate"));
}

#[test]
fn one_gpu_without_a_base_is_refused_naming_what_it_cannot_measure() {
    let out = scratch().join("one.toml");
    let err = refused(
        &calibrate(&["--out", &out.display().to_string()], &[]),
        &[
            "--base",
            "one GPU cannot measure",
            "overlap launch --nproc-per-node",
        ],
    );
    for key in [
        "`gpus_per_node`",
        "`copy_engine.peer_gbs`",
        "`copy_engine.piece_us`",
        "`nvlink.base_us`",
        "`nvlink.hop_us`",
        "`nvlink.busbw_gbs.reduce_scatter`",
        "`nvlink.busbw_gbs.reduce`",
        "`interference.nccl.gemm_cost`",
        "`interference.copy_engine.stretch`",
    ] {
        assert!(err.contains(key), "{key}: {err}");
    }
    // A job across nodes: one node only.
    let mut env = TWO_RANKS.to_vec();
    env[3] = ("LOCAL_WORLD_SIZE", "1");
    refused(
        &calibrate(&["--out", &out.display().to_string()], &env),
        &["LOCAL_WORLD_SIZE", "--nnodes 1"],
    );
}

#[test]
fn bad_arguments_are_refused_naming_the_flag() {
    let dir = scratch();
    let out = dir.join("bad.toml").display().to_string();
    let base = ["--base", "hardware/h200-nvlink.toml"];
    let with = |extra: &[&str]| {
        let mut a = vec!["--out", out.as_str()];
        a.extend_from_slice(&base);
        a.extend_from_slice(extra);
        calibrate(&a, &[])
    };
    for bad in ["0", "1025", "4,x", "", "1.5,4"] {
        refused(&with(&["--mib", bad]), &["--mib"]);
    }
    // One size (or the same twice) fits no line.
    refused(
        &with(&["--mib", "64,64"]),
        &["--mib", "two different sizes"],
    );
    for (flag, bad) in [
        ("--iters", "0"),
        ("--iters", "1001"),
        ("--warmup", "101"),
        ("--iters", "x"),
    ] {
        refused(&with(&[flag, bad]), &[flag]);
    }
    refused(&with(&["--name", "has space"]), &["--name"]);
    refused(&with(&["--name", "q\"uote"]), &["--name"]);
    // --out: required, a file, in a directory that exists.
    refused(&calibrate(&base, &[]), &["--out"]);
    refused(
        &calibrate(
            &["--out", &dir.display().to_string(), base[0], base[1]],
            &[],
        ),
        &["--out", "is a directory"],
    );
    let missing = dir.join("no-such-dir/p.toml").display().to_string();
    refused(
        &calibrate(&["--out", &missing, base[0], base[1]], &[]),
        &["--out", "does not exist"],
    );
    // --base: read and checked like `simulate --hardware`, the error naming the flag,
    // the file, the key and the line.
    let bad_base = dir.join("bad-base.toml");
    let text = std::fs::read_to_string(root().join("hardware/h200-nvlink.toml"))
        .unwrap()
        .replace("peer_gbs = 358", "peer_gbs = -1");
    std::fs::write(&bad_base, text).unwrap();
    let b = bad_base.display().to_string();
    refused(
        &calibrate(&["--out", &out, "--base", &b], &[]),
        &[
            "--base",
            "bad-base.toml:",
            "`copy_engine.peer_gbs`",
            "above 0",
        ],
    );
    refused(
        &calibrate(&["--out", &out, "--base", "no/such/profile.toml"], &[]),
        &["--base", "no/such/profile.toml", "cannot read"],
    );
    assert!(!Path::new(&out).exists());
}
