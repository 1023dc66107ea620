//! `overlap run --checkpoint/--save-every/--resume` (`docs/checkpoints.md`): a run
//! resumed after two steps saves the same files as four steps straight, and a resume
//! that cannot continue the run is refused.

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
