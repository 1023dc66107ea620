//! Crashes and full disks during `overlap run --checkpoint` (`docs/checkpoints.md`,
//! "Crashes"). Each test stops a run's save of step 4 at one phase of the protocol with
//! the test hook `OVERLAP_CHECKPOINT_FAULT`, kills the process with SIGKILL once it says
//! it stopped, and checks that `latest` still names step 2's checkpoint, that what the
//! save left is detected and never read, that `--resume` continues bit-exactly (its
//! checkpoint of step 4 has the files of a run that was never interrupted), and that
//! this save removes what the killed one left.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use overlap::checkpoint::{unfinished, Manifest, FAULT_VAR, LATEST, MANIFEST, STOP_MARKER};

const CONFIG: &str = "[mesh]\nshard = 2\nreplicate = 2\n[run]\nseed = 5\n\
    [[param]]\nname = \"w\"\nshape = [6, 5]\nroute = \"muon\"\nlayer = 2\n\
    [[param]]\nname = \"norm\"\nshape = [9]\nroute = \"fsdp\"\nlayer = 2\n\
    [[param]]\nname = \"bias\"\nshape = [7]\nroute = \"adamw\"\nlayer = 1\n\
    [[param]]\nname = \"emb\"\nshape = [11, 3]\nroute = \"sharded_adamw\"\nlayer = 0\n";

/// A fresh directory with the config in it.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("checkpoint_crash")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.toml"), CONFIG).unwrap();
    dir
}

fn command(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_overlap"));
    c.arg("run")
        .arg("--config")
        .arg(dir.join("config.toml"))
        .args(args)
        .env_remove(FAULT_VAR)
        .current_dir(dir);
    c
}

fn run(dir: &Path, args: &[&str], fault: Option<&str>) -> Output {
    let mut c = command(dir, args);
    if let Some(f) = fault {
        c.env(FAULT_VAR, f);
    }
    c.output().expect("the binary runs")
}

/// Its stdout, after checking that it succeeded.
fn ok(o: Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// The sha256 of every rank file of a checkpoint, in rank order.
fn file_sums(ckpt: &Path) -> Vec<String> {
    let m: Manifest = serde_json::from_slice(&std::fs::read(ckpt.join(MANIFEST)).unwrap()).unwrap();
    m.files.into_iter().map(|f| f.sha256).collect()
}

fn latest(root: &Path) -> String {
    std::fs::read_to_string(root.join(LATEST))
        .unwrap()
        .trim()
        .to_string()
}

/// The files of step 4's checkpoint of a run that was never interrupted.
fn uninterrupted(dir: &Path) -> Vec<String> {
    let root = dir.join("straight");
    ok(run(
        dir,
        &["--steps", "4", "--checkpoint", root.to_str().unwrap()],
        None,
    ));
    file_sums(&root.join("step-000004"))
}

/// Runs 4 steps saving every 2 into `root` with `fault`, waits for the save to say it
/// stopped, and kills the process (SIGKILL). Returns the stop line.
fn run_until_stopped(dir: &Path, root: &Path, fault: &str) -> String {
    let mut child = command(
        dir,
        &[
            "--steps",
            "4",
            "--save-every",
            "2",
            "--checkpoint",
            root.to_str().unwrap(),
        ],
    )
    .env(FAULT_VAR, fault)
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("the binary starts");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen = Vec::new();
    let stop = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(STOP_MARKER) => break line,
            Ok(line) => seen.push(line),
            Err(e) => {
                let _ = child.kill();
                panic!("no stop line ({e}); stderr:\n{}", seen.join("\n"));
            }
        }
    };
    child.kill().expect("SIGKILL");
    let status = child.wait().unwrap();
    assert!(!status.success(), "{status}");
    stop
}

/// The names of what `unfinished` finds in `root`.
fn leftovers(root: &Path) -> Vec<String> {
    unfinished(root)
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// The whole scenario for one phase; `left` checks what the killed save left (the
/// names `unfinished` lists, and the root).
fn killed_at(name: &str, fault: &str, phase: &str, left: impl Fn(&[String], &Path)) {
    let dir = scratch(name);
    let want = uninterrupted(&dir);
    let root = dir.join("ckpt");
    let stop = run_until_stopped(&dir, &root, fault);
    assert!(
        stop.contains(&format!("stopped at {phase} (step 4")),
        "{stop}"
    );
    assert_eq!(latest(&root), "step-000002");
    let found = leftovers(&root);
    left(&found, &root);

    let out = ok(run(
        &dir,
        &[
            "--steps",
            "2",
            "--resume",
            root.to_str().unwrap(),
            "--checkpoint",
            root.to_str().unwrap(),
        ],
        None,
    ));
    let resumed = format!(
        "resumed from {} at step 2",
        root.join("step-000002").display()
    );
    assert!(out.contains(&resumed), "{out}");
    for f in &found {
        assert!(
            out.contains(&format!("ignored {}", root.join(f).display())),
            "{f}: {out}"
        );
    }
    assert!(out.contains("checkpoint: step 4 saved"), "{out}");
    assert_eq!(latest(&root), "step-000004");
    assert_eq!(file_sums(&root.join("step-000004")), want);
    assert!(leftovers(&root).is_empty(), "{:?}", leftovers(&root));
}

/// One partial directory of step 4, holding `files` (sorted) and no other.
fn one_partial(found: &[String], root: &Path, files: &[&str]) {
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with(".step-000004-") && found[0].ends_with(".partial"),
        "{found:?}"
    );
    let mut held: Vec<String> = std::fs::read_dir(root.join(&found[0]))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    held.sort();
    assert_eq!(held, files);
}

#[test]
fn a_save_killed_writing_a_shard_resumes_from_the_previous_checkpoint() {
    killed_at(
        "shard",
        "phase=shard,rank=1,step=4",
        "shard",
        |found, root| {
            one_partial(
                found,
                root,
                &[
                    "rank-00000.report.json",
                    "rank-00000.safetensors",
                    "rank-00001.safetensors",
                ],
            );
        },
    );
}

#[test]
fn a_save_killed_writing_a_report_resumes_from_the_previous_checkpoint() {
    killed_at(
        "report",
        "phase=report,rank=1,step=4",
        "report",
        |found, root| {
            one_partial(
                found,
                root,
                &[
                    ".rank-00001.report.json.tmp",
                    "rank-00000.report.json",
                    "rank-00000.safetensors",
                    "rank-00001.safetensors",
                ],
            );
        },
    );
}

/// Every rank's file and report.
const ALL_REPORTED: [&str; 8] = [
    "rank-00000.report.json",
    "rank-00000.safetensors",
    "rank-00001.report.json",
    "rank-00001.safetensors",
    "rank-00002.report.json",
    "rank-00002.safetensors",
    "rank-00003.report.json",
    "rank-00003.safetensors",
];

#[test]
fn a_save_killed_writing_the_manifest_resumes_from_the_previous_checkpoint() {
    killed_at(
        "manifest",
        "phase=manifest,step=4",
        "manifest",
        |found, root| {
            let mut files = vec![".manifest.json.tmp"];
            files.extend(ALL_REPORTED);
            one_partial(found, root, &files);
        },
    );
}

#[test]
fn a_save_killed_before_renaming_its_directory_resumes_from_the_previous_checkpoint() {
    // The partial directory is complete (its manifest is there), and still never read.
    killed_at("rename", "phase=rename,step=4", "rename", |found, root| {
        one_partial(
            found,
            root,
            &[
                MANIFEST,
                "rank-00000.safetensors",
                "rank-00001.safetensors",
                "rank-00002.safetensors",
                "rank-00003.safetensors",
            ],
        );
    });
}

#[test]
fn a_save_killed_switching_latest_resumes_from_the_previous_checkpoint() {
    // Step 4's directory is in place but `latest` was not switched: the resumed run
    // loads step 2 and its own save of step 4 replaces the directory.
    killed_at("latest", "phase=latest,step=4", "latest", |found, root| {
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with(".latest-"), "{found:?}");
        assert_eq!(found[1], "step-000004");
        assert!(root.join("step-000004").join(MANIFEST).is_file());
    });
}

#[test]
fn a_full_disk_fails_the_save_naming_the_file_and_keeps_the_previous_checkpoint() {
    // Injected: the named write fails with ENOSPC half-way.
    let dir = scratch("enospc");
    let want = uninterrupted(&dir);
    for (fault, file) in [
        (
            "phase=shard,rank=1,step=4,mode=enospc",
            "rank-00001.safetensors",
        ),
        ("phase=manifest,step=4,mode=enospc", ".manifest.json.tmp"),
        ("phase=latest,step=4,mode=enospc", ".latest-"),
    ] {
        let root = dir.join("ckpt");
        let _ = std::fs::remove_dir_all(&root);
        let args = [
            "--steps",
            "4",
            "--save-every",
            "2",
            "--checkpoint",
            root.to_str().unwrap(),
        ];
        let o = run(&dir, &args, Some(fault));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{fault}: {err}");
        assert!(
            err.contains(file)
                && err.contains("No space left on device")
                && !err.contains("panicked"),
            "{fault}: {err}"
        );
        assert_eq!(latest(&root), "step-000002", "{fault}");
        let out = ok(run(
            &dir,
            &[
                "--steps",
                "2",
                "--resume",
                root.to_str().unwrap(),
                "--checkpoint",
                root.to_str().unwrap(),
            ],
            None,
        ));
        assert!(out.contains("at step 2"), "{fault}: {out}");
        assert_eq!(file_sums(&root.join("step-000004")), want, "{fault}");
        assert!(
            leftovers(&root).is_empty(),
            "{fault}: {:?}",
            leftovers(&root)
        );
    }
}

/// A tmpfs of `size` mounted on `dir` until dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts one, or says why it cannot (not Linux, not root, no `mount`, refused).
    fn mount(dir: &Path, size: &str) -> Result<Tmpfs, String> {
        if !cfg!(target_os = "linux") {
            return Err("tmpfs mounts are a Linux test".into());
        }
        let o = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("`mount` cannot run: {e}"))?;
        if !o.status.success() {
            return Err(format!(
                "`mount -t tmpfs` failed (not root, or no CAP_SYS_ADMIN): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        Ok(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Fills the file system `file` is on: writes until the disk is full.
fn fill(file: &Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(file).unwrap();
    let chunk = vec![7u8; 4096];
    while f.write_all(&chunk).and_then(|()| f.sync_all()).is_ok() {}
}

#[test]
fn a_real_full_disk_fails_the_save_naming_the_file_and_keeps_the_previous_checkpoint() {
    let dir = scratch("tmpfs");
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let _tmpfs = match Tmpfs::mount(&mnt, "2m") {
        Ok(t) => t,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let root = mnt.join("ckpt");
    let r = root.to_str().unwrap();
    ok(run(&dir, &["--steps", "2", "--checkpoint", r], None));
    fill(&mnt.join("filler"));
    let o = run(
        &dir,
        &["--steps", "2", "--resume", r, "--checkpoint", r],
        None,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains(r) && err.contains("No space left on device") && !err.contains("panicked"),
        "{err}"
    );
    assert_eq!(latest(&root), "step-000002");
    std::fs::remove_file(mnt.join("filler")).unwrap();
    let out = ok(run(&dir, &["--steps", "1", "--resume", r], None));
    assert!(out.contains("at step 2"), "{out}");
}
