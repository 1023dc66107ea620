//! The CPU backend as one rank per process (`overlap launch --nproc-per-node N -- run
//! --backend cpu`): the final parameters of every rank are the single process's bit for
//! bit, on meshes 2x1, 1x2 and 2x2, every route, gate patterns with no_sync
//! micro-batches, both transports, with the forward's gathers and clipping;
//! `overlap launch ... -- verify` passes and reports the single process's figures,
//! every one equal to the last bit (they are computed from the same gradients); processes
//! started with Slurm's or Open MPI's variables do the same. (Failures of such jobs:
//! `faults.rs`.)

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

fn overlap() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_overlap"));
    c.env_remove("OVERLAP_JOB_SECRET")
        .env_remove("OVERLAP_FAULT")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE");
    c
}

fn free_port() -> String {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port().to_string())
        .expect("a free port")
}

fn example(name: &str) -> String {
    let path = format!("{}/../examples/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `text` with each `(from, to)` replaced, every `from` required.
fn edit(text: &str, edits: &[(&str, &str)]) -> String {
    edits.iter().fold(text.to_string(), |t, (from, to)| {
        assert!(t.contains(from), "`{from}` is not in the example");
        t.replacen(from, to, 1)
    })
}

/// A config written to a temporary file named after `name`.
fn config(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("overlap-cpu-ranks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).expect("a temporary config");
    path
}

/// The meshes, routes, gate patterns and transports the tests cover: `(name, config,
/// ranks)`.
fn cases() -> Vec<(&'static str, String, u32)> {
    let hsdp = example("hsdp_2x2.toml");
    let gates = (
        "micro_batches = 2\nreplicate_gate = [\"off\", \"on\"]\nreduce_gate = [\"on\", \"on\"]",
        "gates = [\"no_sync\", \"off\", \"on\"]",
    );
    let copy = "\n[overlap]\ntransport = \"copy\"\n";
    vec![
        (
            "2x1-nccl-no_sync",
            edit(
                &hsdp,
                &[
                    ("replicate = 2", "replicate = 1"),
                    (gates.0, "gates = [\"no_sync\", \"on\"]"),
                    ("transport = \"auto\"", "transport = \"nccl\""),
                ],
            ),
            2,
        ),
        (
            "1x2-copy-no_sync",
            edit(
                &example("no_sync_1x4.toml"),
                &[("replicate = 4", "replicate = 2")],
            ) + copy,
            2,
        ),
        ("2x2-auto", hsdp.clone(), 4),
        (
            "2x2-copy-no_sync",
            edit(
                &hsdp,
                &[
                    (gates.0, gates.1),
                    ("transport = \"auto\"", "transport = \"copy\""),
                ],
            ),
            4,
        ),
        (
            "2x2-groups-schedule-copy",
            example("groups_schedule_2x2.toml") + copy,
            4,
        ),
        (
            "2x2-copy-no_sync-forward-clip",
            edit(
                &hsdp,
                &[
                    (gates.0, gates.1),
                    ("transport = \"auto\"", "transport = \"copy\""),
                ],
            ) + "\n[forward]\nprefetch = 1\n\n[clip]\nmax_norm = 0.5\n",
            4,
        ),
    ]
}

fn ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `params rank R: HASH` lines of a run's stdout (with or without the launcher's
/// `[rank k] ` prefix), by rank.
fn digests(stdout: &str) -> BTreeMap<u32, String> {
    stdout
        .lines()
        .filter_map(|l| {
            let l = l.split_once("] ").map_or(l, |(_, rest)| rest);
            let rest = l.strip_prefix("params rank ")?;
            let (rank, hash) = rest.split_once(": ")?;
            Some((rank.parse().ok()?, hash.to_string()))
        })
        .collect()
}

/// `overlap run` of `config` in one process, then as `ranks` processes.
fn both_ways(args: &[&str], config: &Path, ranks: u32) -> (Output, Output) {
    let one = overlap()
        .args(args)
        .arg("--config")
        .arg(config)
        .args(["--backend", "cpu"])
        .output()
        .expect("overlap runs");
    let port = free_port();
    let job = overlap()
        .args(["launch", "--nproc-per-node", &ranks.to_string()])
        .args(["--master-port", &port, "--"])
        .args(args)
        .arg("--config")
        .arg(config)
        .args(["--backend", "cpu"])
        .output()
        .expect("overlap launch runs");
    (one, job)
}

#[test]
fn one_rank_per_process_ends_with_the_single_process_parameters_bit_for_bit() {
    for (name, text, ranks) in cases() {
        let path = config(name, &text);
        let t0 = Instant::now();
        let (one, job) = both_ways(&["run", "--steps", "2", "--param-digest"], &path, ranks);
        ok(&one, name);
        ok(&job, name);
        let (want, got) = (
            digests(&String::from_utf8_lossy(&one.stdout)),
            digests(&String::from_utf8_lossy(&job.stdout)),
        );
        assert_eq!(want.len(), ranks as usize, "{name}: {want:?}");
        assert_eq!(got, want, "{name}: one rank per process vs one process");
        // Each process printed its own rank's digest, and only it.
        let stdout = String::from_utf8_lossy(&job.stdout);
        for r in 0..ranks {
            let line = format!("[rank {r}] params rank {r}: ");
            assert!(stdout.contains(&line), "{name}: no `{line}` in\n{stdout}");
        }
        eprintln!(
            "{name}: one process and {ranks} processes, 2 steps each: {:?}",
            t0.elapsed()
        );
    }
}

/// The figures of a `verify --json` line, without where the worst was seen (the order
/// in which ties are broken differs between one process and rank 0's merge).
fn figures(stdout: &str) -> serde_json::Value {
    let line = stdout
        .lines()
        .map(|l| l.split_once("] ").map_or(l, |(_, rest)| rest))
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line in\n{stdout}"));
    let mut v: serde_json::Value = serde_json::from_str(line).expect("the report is JSON");
    v.as_object_mut().expect("an object").remove("worst_at");
    v
}

#[test]
fn verify_of_one_rank_per_process_passes_with_the_single_process_figures() {
    for (name, text, ranks) in cases().into_iter().filter(|c| c.0.contains("no_sync")) {
        let path = config(&format!("verify-{name}"), &text);
        let t0 = Instant::now();
        let (one, job) = both_ways(&["verify", "--steps", "2", "--json"], &path, ranks);
        ok(&one, name);
        ok(&job, name);
        let (want, got) = (
            figures(&String::from_utf8_lossy(&one.stdout)),
            figures(&String::from_utf8_lossy(&job.stdout)),
        );
        assert_eq!(got["ok"], true, "{name}: {got}");
        assert_eq!(got, want, "{name}: one rank per process vs one process");
        eprintln!(
            "{name}: verify in one process and in {ranks}: {:?}",
            t0.elapsed()
        );
    }
}

#[test]
fn a_job_whose_size_is_not_the_meshs_is_refused_naming_both() {
    let path = config("refused", &example("hsdp_2x2.toml"));
    let out = overlap()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &free_port(),
        ])
        .args(["--", "run", "--backend", "cpu", "--config"])
        .arg(&path)
        .output()
        .expect("overlap runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the job has 2 ranks (WORLD_SIZE) but mesh 2x2 needs shard × replicate = 4")
            && err.contains("--nproc-per-node 4"),
        "{err}"
    );
}

/// `overlap run` of `config` as rank `rank` of a job of `world` started by `launcher`
/// (`slurm` or `openmpi`: its variables only, no `overlap launch`).
fn by_launcher(launcher: &str, config: &Path, (rank, world): (u32, u32), port: &str) -> Command {
    let mut c = overlap();
    c.args(["run", "--backend", "cpu", "--steps", "2", "--param-digest"])
        .arg("--config")
        .arg(config)
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .env("OVERLAP_JOB_SECRET", "a secret of this test job, 32 B.")
        .env("OVERLAP_RENDEZVOUS_TIMEOUT_S", "60")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let (r, w) = (rank.to_string(), world.to_string());
    let vars: [(&str, &str); 4] = match launcher {
        "slurm" => [
            ("SLURM_PROCID", &r),
            ("SLURM_NTASKS", &w),
            ("SLURM_LOCALID", &r),
            ("SLURM_JOB_NUM_NODES", "1"),
        ],
        _ => [
            ("OMPI_COMM_WORLD_RANK", &r),
            ("OMPI_COMM_WORLD_SIZE", &w),
            ("OMPI_COMM_WORLD_LOCAL_RANK", &r),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", &w),
        ],
    };
    for (k, v) in vars {
        c.env(k, v);
    }
    c
}

#[test]
fn ranks_started_by_slurm_or_open_mpi_run_one_rank_each() {
    let (name, text, ranks) = cases().swap_remove(0);
    let path = config(&format!("launchers-{name}"), &text);
    let one = overlap()
        .args([
            "run",
            "--backend",
            "cpu",
            "--steps",
            "2",
            "--param-digest",
            "--config",
        ])
        .arg(&path)
        .output()
        .expect("overlap runs");
    ok(&one, name);
    let want = digests(&String::from_utf8_lossy(&one.stdout));
    for launcher in ["slurm", "openmpi"] {
        let port = free_port();
        let children: Vec<_> = (0..ranks)
            .map(|r| {
                by_launcher(launcher, &path, (r, ranks), &port)
                    .spawn()
                    .expect("overlap starts")
            })
            .collect();
        let mut got = BTreeMap::new();
        for child in children {
            let out = child.wait_with_output().expect("overlap runs");
            ok(&out, launcher);
            got.extend(digests(&String::from_utf8_lossy(&out.stdout)));
        }
        assert_eq!(got, want, "{launcher}: one rank per process vs one process");
    }
}
