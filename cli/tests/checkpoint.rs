//! `overlap run --checkpoint/--save-every/--resume` (`docs/checkpoints.md`): a run
//! resumed after two steps saves the same files as four steps straight, a resume that
//! cannot continue the run is refused, a job of two processes (`overlap launch`) saves
//! the checkpoint one process saves and resumes one process's (and the reverse), and a
//! rank whose save fails leaves the previous checkpoint. Crashes and full disks
//! mid-save: `checkpoint_crash.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;

use overlap::checkpoint::{Manifest, LATEST, MANIFEST};

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("checkpoint")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn overlap(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_overlap"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("the binary runs")
}

fn file_sums(ckpt: &Path) -> Vec<String> {
    let m: Manifest = serde_json::from_slice(&std::fs::read(ckpt.join(MANIFEST)).unwrap()).unwrap();
    m.files.into_iter().map(|f| f.sha256).collect()
}

/// The four-parameter 2x2 config of these tests, written into `dir`.
fn mixed_config(dir: &Path) -> String {
    let config = dir.join("mixed.toml");
    std::fs::write(
        &config,
        "[mesh]\nshard = 2\nreplicate = 2\n[run]\nseed = 5\n\
         [[param]]\nname = \"w\"\nshape = [6, 5]\nroute = \"muon\"\nlayer = 2\n\
         [[param]]\nname = \"norm\"\nshape = [9]\nroute = \"fsdp\"\nlayer = 2\n\
         [[param]]\nname = \"bias\"\nshape = [7]\nroute = \"adamw\"\nlayer = 1\n\
         [[param]]\nname = \"emb\"\nshape = [11, 3]\nroute = \"sharded_adamw\"\nlayer = 0\n",
    )
    .unwrap();
    config.to_str().unwrap().to_string()
}

/// `overlap run --config config ARGS...`.
fn run(config: &str, rest: &[&str]) -> std::process::Output {
    overlap(&[&["run", "--config", config][..], rest].concat())
}

#[test]
fn overlap_run_resumed_after_two_steps_saves_the_same_files_as_four_steps() {
    let dir = scratch("cli");
    let c = mixed_config(&dir);
    let (a, b) = (dir.join("a"), dir.join("b"));
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    succeeded(run(&c, &["--steps", "4", "--checkpoint", a]));
    let out = succeeded(run(
        &c,
        &["--steps", "2", "--save-every", "1", "--checkpoint", b],
    ));
    assert!(
        out.contains("checkpoint: step 1 saved") && out.contains("checkpoint: step 2 saved"),
        "{out}"
    );
    let out = succeeded(run(&c, &["--steps", "2", "--resume", b, "--checkpoint", b]));
    assert!(
        out.contains("resumed from") && out.contains("step 3/4") && out.contains("step 4/4"),
        "{out}"
    );
    let (a, b) = (Path::new(a), Path::new(b));
    assert_eq!(
        file_sums(&a.join("step-000004")),
        file_sums(&b.join("step-000004"))
    );
    assert_eq!(
        std::fs::read_to_string(b.join(LATEST)).unwrap().trim(),
        "step-000004"
    );
}

#[test]
fn a_resume_that_cannot_continue_the_run_is_refused() {
    let dir = scratch("cli_refused");
    let c = mixed_config(&dir);
    let b = dir.join("b");
    let b = b.to_str().unwrap();
    succeeded(run(&c, &["--steps", "1", "--checkpoint", b]));
    // Another seed would not continue the run: refused, naming the seed to pass.
    let o = run(&c, &["--seed", "6", "--resume", b]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--seed 5"), "{err}");
    // No checkpoint there: a clean error.
    let o = run(&c, &["--resume", dir.join("none").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("not a checkpoint") && !err.contains("panicked"),
        "{err}"
    );
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// `overlap launch --nproc-per-node 2 -- run --config CONFIG ARGS...` on a free port.
fn launch_two(config: &str, args: &[&str]) -> std::process::Output {
    let port = free_port().to_string();
    let mut all = vec![
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        &port,
        "--",
        "run",
        "--config",
        config,
    ];
    all.extend_from_slice(args);
    overlap(&all)
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Its stdout, after checking that it succeeded.
fn succeeded(o: std::process::Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

#[test]
fn a_job_of_two_processes_saves_what_one_process_saves_and_each_resumes_the_other() {
    // Whether each process runs its own rank (every process writes its rank's files) or
    // the whole mesh (all hold the same state, so only rank 0's process saves), rank 0's
    // process alone commits, and the checkpoint is the one a single process saves.
    let dir = scratch("launch");
    let config = dir.join("mixed.toml");
    std::fs::write(
        &config,
        "[mesh]\nshard = 2\nreplicate = 1\n[run]\nseed = 5\n\
         [[param]]\nname = \"w\"\nshape = [6, 5]\nroute = \"muon\"\nlayer = 2\n\
         [[param]]\nname = \"norm\"\nshape = [9]\nroute = \"fsdp\"\nlayer = 1\n\
         [[param]]\nname = \"emb\"\nshape = [11, 3]\nroute = \"sharded_adamw\"\nlayer = 0\n",
    )
    .unwrap();
    let c = config.to_str().unwrap();
    let root = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let (one, two, six) = (root("one"), root("two"), root("six"));
    let save = |steps: &'static str, at: &str| {
        ["--steps", steps, "--save-every", "2", "--checkpoint", at].map(String::from)
    };
    succeeded(overlap(
        &[&["run", "--config", c][..], &args(&save("4", &one))].concat(),
    ));
    let out = succeeded(launch_two(c, &args(&save("4", &two))));
    let rank1: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("[rank 1] checkpoint:"))
        .collect();
    assert!(
        out.contains("[rank 0] checkpoint: step 2 saved")
            && out.contains("[rank 0] checkpoint: step 4 saved")
            && rank1
                .iter()
                .all(|l| l.contains("rank 0's process commits it")),
        "{out}"
    );
    let step = |r: &str, n: &str| Path::new(r).join(n);
    assert_eq!(
        file_sums(&step(&one, "step-000004")),
        file_sums(&step(&two, "step-000004"))
    );
    assert!(overlap::checkpoint::unfinished(Path::new(&two)).is_empty());

    // The job's checkpoint resumes in one process, one process's in a job of two, and
    // both save the step 6 of a run that was never interrupted.
    let resume =
        |from: &str| ["--steps", "2", "--resume", from, "--checkpoint", from].map(String::from);
    succeeded(overlap(
        &[&["run", "--config", c][..], &args(&resume(&two))].concat(),
    ));
    succeeded(launch_two(c, &args(&resume(&one))));
    succeeded(overlap(
        &[&["run", "--config", c][..], &args(&save("6", &six))].concat(),
    ));
    let want = file_sums(&step(&six, "step-000006"));
    assert_eq!(file_sums(&step(&two, "step-000006")), want);
    assert_eq!(file_sums(&step(&one, "step-000006")), want);
}

#[test]
fn a_rank_whose_save_fails_in_a_job_leaves_the_previous_checkpoint_for_the_resume() {
    // Rank 1's file hits a full disk at the save of step 4: the job fails naming the
    // file, rank 0's process commits nothing, and the resumed job is bit-exact.
    let dir = scratch("launch_enospc");
    let config = dir.join("mixed.toml");
    std::fs::write(
        &config,
        "[mesh]\nshard = 2\nreplicate = 1\n[run]\nseed = 5\n\
         [[param]]\nname = \"w\"\nshape = [6, 5]\nroute = \"muon\"\nlayer = 2\n\
         [[param]]\nname = \"emb\"\nshape = [11, 3]\nroute = \"sharded_adamw\"\nlayer = 0\n",
    )
    .unwrap();
    let (c, straight, root) = (
        config.to_str().unwrap(),
        dir.join("straight"),
        dir.join("ckpt"),
    );
    let r = root.to_str().unwrap();
    succeeded(overlap(&[
        "run",
        "--config",
        c,
        "--steps",
        "4",
        "--checkpoint",
        straight.to_str().unwrap(),
    ]));
    let o = Command::new(env!("CARGO_BIN_EXE_overlap"))
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &free_port().to_string(),
        ])
        .args([
            "--",
            "run",
            "--config",
            c,
            "--steps",
            "4",
            "--save-every",
            "2",
            "--checkpoint",
            r,
        ])
        .env(
            overlap::checkpoint::FAULT_VAR,
            "phase=shard,rank=1,step=4,mode=enospc",
        )
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!o.status.success(), "{all}");
    assert!(
        all.contains("rank-00001.safetensors") && all.contains("No space left on device"),
        "{all}"
    );
    assert_eq!(
        std::fs::read_to_string(root.join(LATEST)).unwrap().trim(),
        "step-000002"
    );
    let out = succeeded(launch_two(
        c,
        &["--steps", "2", "--resume", r, "--checkpoint", r],
    ));
    assert!(out.contains("at step 2"), "{out}");
    assert_eq!(
        file_sums(&root.join("step-000004")),
        file_sums(&straight.join("step-000004"))
    );
    assert!(overlap::checkpoint::unfinished(&root).is_empty());
}
