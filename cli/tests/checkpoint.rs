//! `overlap run --checkpoint/--save-every/--resume` (`docs/checkpoints.md`): a run
//! resumed after two steps saves the same files as four steps straight, a resume that
//! cannot continue the run is refused, and a job of two processes (`overlap launch`)
//! saves the checkpoint one process saves. Crashes and full disks mid-save:
//! `checkpoint_crash.rs`.

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

#[test]
fn overlap_run_resumed_after_two_steps_saves_the_same_files_as_four_steps() {
    let dir = scratch("cli");
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
    let (c, a, b) = (config.to_str().unwrap(), dir.join("a"), dir.join("b"));
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let ok = |o: std::process::Output| {
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "{out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        out
    };
    ok(overlap(&[
        "run",
        "--config",
        c,
        "--steps",
        "4",
        "--checkpoint",
        a,
    ]));
    let out = ok(overlap(&[
        "run",
        "--config",
        c,
        "--steps",
        "2",
        "--save-every",
        "1",
        "--checkpoint",
        b,
    ]));
    assert!(
        out.contains("checkpoint: step 1 saved") && out.contains("checkpoint: step 2 saved"),
        "{out}"
    );
    let out = ok(overlap(&[
        "run",
        "--config",
        c,
        "--steps",
        "2",
        "--resume",
        b,
        "--checkpoint",
        b,
    ]));
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

    // Another seed would not continue the run: refused, naming the seed to pass.
    let o = overlap(&[
        "run",
        "--config",
        c,
        "--seed",
        "6",
        "--resume",
        b.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--seed 5"), "{err}");
    // No checkpoint there: a clean error.
    let o = overlap(&[
        "run",
        "--config",
        c,
        "--resume",
        dir.join("none").to_str().unwrap(),
    ]);
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

#[test]
fn a_job_of_two_processes_saves_one_checkpoint_equal_to_one_processs() {
    // On the CPU backend each process of a job runs the whole mesh and holds the same
    // state, so only rank 0's process saves; the ranks still share a save job first.
    let dir = scratch("launch");
    let config = dir.join("mixed.toml");
    std::fs::write(
        &config,
        "[mesh]\nshard = 2\nreplicate = 2\n[run]\nseed = 5\n\
         [[param]]\nname = \"w\"\nshape = [6, 5]\nroute = \"muon\"\nlayer = 2\n\
         [[param]]\nname = \"emb\"\nshape = [11, 3]\nroute = \"sharded_adamw\"\nlayer = 0\n",
    )
    .unwrap();
    let (c, one, two) = (config.to_str().unwrap(), dir.join("one"), dir.join("two"));
    let o = overlap(&[
        "run",
        "--config",
        c,
        "--steps",
        "4",
        "--checkpoint",
        one.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let port = free_port().to_string();
    let o = overlap(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        &port,
        "--",
        "run",
        "--config",
        c,
        "--steps",
        "4",
        "--save-every",
        "2",
        "--checkpoint",
        two.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains("[rank 0] checkpoint: step 2 saved")
            && out.contains("[rank 0] checkpoint: step 4 saved")
            && !out.contains("[rank 1] checkpoint:"),
        "{out}"
    );
    assert_eq!(
        file_sums(&one.join("step-000004")),
        file_sums(&two.join("step-000004"))
    );
    assert_eq!(
        std::fs::read_to_string(two.join(LATEST)).unwrap().trim(),
        "step-000004"
    );
}
