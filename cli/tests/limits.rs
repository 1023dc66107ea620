//! The command line's side of the limits (`tests/limits.rs` has the library's): each
//! input that used to abort, panic or run away is exit 2 naming the key and the limit,
//! before any thread or allocation of the job's size; names with control characters,
//! quotes and markup come out escaped.

use std::path::PathBuf;
use std::process::{Command, Output};

use overlap::graph::Mesh;
use overlap::ops::cpu::{CpuBackend, MAX_RANKS};

const MESH: &str = "[mesh]\nshard = 2\nreplicate = 2\n";
const PARAM: &str = "[[param]]\nname = \"w\"\nshape = [4, 3]\nroute = \"muon\"\n";

fn model(layers: &str, hidden: &str, vocab: &str) -> String {
    format!("{MESH}[model]\nlayers = {layers}\nhidden = {hidden}\nvocab = {vocab}\n")
}

fn overlap(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_overlap"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("the binary runs")
}

fn scratch(name: &str, contents: &str) -> String {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("limits");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, contents).unwrap();
    p.to_str().unwrap().to_string()
}

#[track_caller]
fn exits(o: &Output, code: i32, phrases: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(code), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for p in phrases {
        assert!(err.contains(p), "stderr lacks {p:?}: {err}");
    }
}

#[test]
fn cli_past_the_cpu_rank_limit_is_exit_2_before_any_thread() {
    assert_eq!(MAX_RANKS, 1024);
    assert!(CpuBackend::check_mesh(Mesh::new(16, 16).unwrap()).is_ok());
    let f = scratch(
        "ranks.toml",
        "[mesh]\nshard = 2048\nreplicate = 1\n[[param]]\nname = \"w\"\nshape = [8]\nroute = \"fsdp\"\n",
    );
    for cmd in ["run", "verify"] {
        let started = std::time::Instant::now();
        let o = overlap(&[cmd, "--config", &f, "--backend", "cpu"]);
        exits(&o, 2, &["2048 ranks", "CPU backend's limit of 1024"]);
        assert!(started.elapsed().as_secs() < 30);
    }
    // Planning it is fine.
    let o = overlap(&["plan", "--config", &f, "--format", "text", "--ranks", "0"]);
    exits(&o, 0, &[]);
}

#[test]
fn cli_refuses_a_job_the_machine_cannot_hold_with_the_estimate() {
    let f = scratch(
        "memory.toml",
        "[mesh]\nshard = 32\nreplicate = 32\n[[param]]\nname = \"w\"\nshape = [65535, 65537]\nroute = \"fsdp\"\n",
    );
    for cmd in ["run", "verify"] {
        let o = overlap(&[cmd, "--config", &f, "--backend", "cpu"]);
        exits(&o, 2, &["needs about", "TiB", "available"]);
    }
}

/// `verify` of a 2x1 job with a 400 MB parameter under a 4 GiB address-space limit
/// (`prlimit --as`, `ulimit -v`): it would take about 9 GB, and used to abort on a failed
/// allocation (signal 6); it is exit 2 naming the limit, before any allocation.
/// Starts `c` under an address-space limit of `bytes` (`prlimit --as`).
#[cfg(target_os = "linux")]
fn limit_address_space(c: &mut Command, bytes: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setrlimit is async-signal-safe, and the closure touches nothing else.
    unsafe {
        c.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

#[cfg(target_os = "linux")]
#[test]
fn cli_respects_the_address_space_limit() {
    let f = scratch(
        "address.toml",
        "[mesh]\nshard = 2\nreplicate = 1\n[[param]]\nname = \"w\"\nshape = [100000000]\nroute = \"fsdp\"\n",
    );
    for cmd in ["verify", "run"] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_overlap"));
        c.args([cmd, "--config", &f, "--backend", "cpu"]);
        limit_address_space(&mut c, 4 << 30);
        let o = c.output().expect("the binary runs");
        exits(&o, 2, &["needs about", "address-space limit (ulimit -v)"]);
    }
    // One process per rank: each counts its own rank, its links' receptions and the
    // reference session, against its own limit; verify's two sessions do not fit and
    // every rank says so with exit 2 instead of aborting in an allocation.
    let mut c = Command::new(env!("CARGO_BIN_EXE_overlap"));
    c.args([
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        "verify",
        "--config",
        &f,
    ])
    .args(["--backend", "cpu", "--steps", "1"]);
    // The ranks inherit the launcher's limit.
    limit_address_space(&mut c, 4 << 30);
    let o = c.output().expect("the launcher runs");
    exits(
        &o,
        2,
        &["this process: rank(s) [", "address-space limit (ulimit -v)"],
    );
    assert!(!String::from_utf8_lossy(&o.stderr).contains("signal"));
}

#[test]
fn cli_config_limits_are_exit_2_naming_the_key() {
    for (name, text, key) in [
        (
            "layers.toml",
            model("4000000000", "8", "8"),
            "`model.layers`",
        ),
        (
            "hidden.toml",
            model("2", "18446744073709551615", "8"),
            "`model.hidden`",
        ),
        (
            "mb.toml",
            format!("{MESH}{PARAM}[accumulation]\nmicro_batches = 4000000000\n"),
            "`accumulation.micro_batches`",
        ),
        (
            "dup.toml",
            "[mesh]\nshard = 2\nshard = 3\nreplicate = 1\n".into(),
            "`mesh.shard`",
        ),
    ] {
        let f = scratch(name, &text);
        for cmd in [
            &["plan", "--config", &f][..],
            &["run", "--config", &f, "--steps", "1"][..],
        ] {
            exits(&overlap(cmd), 2, &[key]);
        }
    }
}

#[test]
fn cli_plan_gates_past_the_limit_is_exit_2() {
    // One argument holds at most 128 KiB, so `--gates` reaches the node limit first:
    // 40000 micro-batches on the 2x2 example are about 20 M nodes.
    let gates = vec!["on"; 40_000].join(",");
    let o = overlap(&[
        "plan",
        "--config",
        "examples/hsdp_2x2.toml",
        "--gates",
        &gates,
    ]);
    exits(
        &o,
        2,
        &[
            "accumulation.micro_batches",
            "plan nodes",
            "limit of 16777216",
        ],
    );
}

#[test]
fn cli_check_rejects_a_plan_with_billions_of_events_and_escapes_names() {
    let o = overlap(&[
        "plan",
        "--config",
        "examples/hsdp_2x2.toml",
        "--format",
        "json",
    ]);
    exits(&o, 0, &[]);
    let mut plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    plan["ranks"][1]["events"] = 4_000_000_000u64.into();
    let f = scratch("events.json", &plan.to_string());
    exits(
        &overlap(&["check", "--plan", &f]),
        1,
        &["ranks[1].events", "4000000000 events"],
    );
    // A name from another tool with an escape sequence, in a plan that breaks an
    // invariant naming it: the message shows it escaped.
    let mut plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    plan["params"][0]["name"] = "e\u{1b}[2Jmbed\n".into();
    plan["params"][0]["layer"] = 7.into();
    let f = scratch("name.json", &plan.to_string());
    let o = overlap(&["check", "--plan", &f]);
    exits(&o, 1, &["e\\u{1b}[2Jmbed\\u{a}"]);
    assert!(!o.stderr.contains(&0x1b));
}

#[test]
fn verify_runs_256_ranks() {
    let f = scratch(
        "r256.toml",
        "[mesh]\nshard = 16\nreplicate = 16\n[model]\nlayers = 2\nhidden = 8\nvocab = 16\n",
    );
    let o = overlap(&[
        "verify",
        "--config",
        &f,
        "--backend",
        "cpu",
        "--steps",
        "1",
        "--json",
    ]);
    exits(&o, 0, &[]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("\"ok\":true") && out.contains("\"ranks\":256"),
        "{out}"
    );
}
