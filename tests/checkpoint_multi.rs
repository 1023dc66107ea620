//! Checkpoints of multi-process jobs (`docs/checkpoints.md`, "Saving"), in one test
//! process: each "process" of the job is a session over `CpuBackend::one_rank` (one rank
//! of the mesh, its collectives going to the other sessions over loopback TCP, bit for
//! bit the whole mesh's results), stepped on a thread of its own. Their saves run on
//! their own background threads and meet on disk exactly as processes do: every one
//! writes its rank's files and reports, the one holding rank 0 commits.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use overlap::checkpoint::{Manifest, SaveJob, Saved, LATEST, MANIFEST};
use overlap::executor::ExecConfig;
use overlap::graph::Buffer;
use overlap::ops::cpu::{CpuBackend, CpuLinks};
use overlap::ops::Backend;
use overlap::{drive, synthetic, Error, Gate, PeerFailure, PlanSpec, Session};

mod common;

use common::mixed_spec;

const SEED: u64 = 23;
const GATES: [Gate; 2] = [Gate::NoSync, Gate::On];

/// Every rank's links to the others over loopback connections.
fn loopback(world: u32) -> Vec<CpuLinks> {
    let mut ends: Vec<Vec<(u32, TcpStream)>> = (0..world).map(|_| Vec::new()).collect();
    for a in 0..world {
        for b in a + 1..world {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            ends[a as usize].push((b, c));
            ends[b as usize].push((a, l.accept().unwrap().0));
        }
    }
    ends.into_iter()
        .enumerate()
        .map(|(r, peers)| CpuLinks::new(r as u32, world, peers).unwrap())
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("checkpoint_multi")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn whole(spec: PlanSpec) -> Session<CpuBackend> {
    let backend = Arc::new(CpuBackend::new(spec.mesh));
    let mut s = Session::new(spec, backend, ExecConfig::default()).unwrap();
    s.init_params(|i, p| synthetic::init(SEED, i, p.spec.numel() as usize))
        .unwrap();
    s
}

/// The processes of a job over `spec.mesh`, one rank each, sharing the save job `job`;
/// their parameters at other values than [`whole`]'s (a load must set them all) unless
/// `same_init`.
fn job_of(spec: &PlanSpec, job: SaveJob, same_init: bool) -> Vec<Session<CpuBackend>> {
    let seed = if same_init { SEED } else { SEED + 9 };
    loopback(spec.mesh.world())
        .iter()
        .enumerate()
        .map(|(r, links)| {
            let backend = CpuBackend::one_rank(spec.mesh, r as u32, links).unwrap();
            let mut s =
                Session::new(spec.clone(), Arc::new(backend), ExecConfig::default()).unwrap();
            s.init_params(|i, p| synthetic::init(seed, i, p.spec.numel() as usize))
                .unwrap();
            s.set_save_job(job);
            s
        })
        .collect()
}

/// `n` more steps on every process of a job, each on a thread of its own.
fn steps_together(job: &mut [Session<CpuBackend>], n: u64) {
    std::thread::scope(|scope| {
        for s in job.iter_mut() {
            scope.spawn(move || block_on(steps(s, n)));
        }
    });
}

fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

async fn steps(s: &mut Session<CpuBackend>, n: u64) {
    for _ in 0..n {
        let step = s.steps_done();
        drive::synthetic_step(s, SEED, step, &GATES).await.unwrap();
    }
}

/// Every local rank's parameter pieces and optimizer states, as bits, by rank.
fn state<B: Backend>(s: &Session<B>) -> Vec<(u32, Vec<Option<Vec<u32>>>)> {
    let bits = |v: Option<Vec<f32>>| v.map(|v| v.iter().map(|x| x.to_bits()).collect());
    s.local_ranks()
        .into_iter()
        .map(|rank| {
            let mut held = Vec::new();
            for p in 0..s.params().len() as u32 {
                held.push(bits(s.param_values(rank, p).unwrap()));
                let opt = Buffer::OptState { param: p };
                held.push(bits(s.read_buffer(rank, opt).unwrap()));
            }
            (rank, held)
        })
        .collect()
}

fn manifest(ckpt: &Path) -> Manifest {
    serde_json::from_slice(&std::fs::read(ckpt.join(MANIFEST)).unwrap()).unwrap()
}

fn latest(root: &Path) -> String {
    std::fs::read_to_string(root.join(LATEST))
        .unwrap()
        .trim()
        .to_string()
}

/// The entries of a checkpoint root, sorted.
fn entries(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Each process's save of the same state, started with rank 0's first (so it waits for
/// the others' reports), then every process waited for.
fn save_all(job: &[Session<CpuBackend>], root: &Path) -> Vec<Saved> {
    for s in job {
        let ticket = s.save_in_background(root).unwrap();
        let dir = overlap::checkpoint::step_dir_name(ticket.step);
        assert_eq!(ticket.path, root.join(dir));
    }
    job.iter()
        .map(|s| s.wait_for_saves().unwrap().expect("a save was in flight"))
        .collect()
}

/// The same manifest and the same files, byte for byte.
fn assert_same_checkpoint(a: &Path, b: &Path) {
    assert_eq!(manifest(a), manifest(b));
    assert_eq!(entries(a), entries(b));
    for f in manifest(a).files {
        let bytes = |dir: &Path| std::fs::read(dir.join(&f.file)).unwrap();
        assert!(bytes(a) == bytes(b), "{} differs", f.file);
    }
}

#[test]
fn four_processes_train_and_save_what_one_process_saves_and_it_resumes_anywhere() {
    let (one, many) = (scratch("one"), scratch("many"));
    let spec = mixed_spec(2, 2);
    let mut straight = whole(spec.clone());
    block_on(steps(&mut straight, 2));
    straight.save(&one).unwrap();

    // Four processes of one rank each train the same two steps and save: the files and
    // manifest one process saved, byte for byte, committed by rank 0's process alone,
    // and nothing left beside it.
    let mut job = job_of(&spec, SaveJob::fresh(), true);
    steps_together(&mut job, 2);
    let committed: Vec<bool> = save_all(&job, &many).iter().map(|s| s.committed).collect();
    assert_eq!(committed, [true, false, false, false]);
    drop(job);
    assert_eq!(latest(&many), "step-000002");
    assert_eq!(entries(&many), [LATEST, "step-000002"]);
    assert_same_checkpoint(&one.join("step-000002"), &many.join("step-000002"));

    // It resumes in one process bit-exactly, and on another mesh as one process's does.
    let mut resumed = whole(spec.clone());
    resumed.load(&many).unwrap();
    block_on(steps(&mut resumed, 2));
    block_on(steps(&mut straight, 2));
    assert_eq!(state(&resumed), state(&straight));
    let (mut x, mut y) = (whole(mixed_spec(4, 1)), whole(mixed_spec(4, 1)));
    x.load(&many).unwrap();
    y.load(&one).unwrap();
    assert_eq!(state(&x), state(&y));

    // The reverse: one process's checkpoint resumes in four processes, each with its
    // rank's state, which train on and save the step-4 checkpoint of the run that was
    // never interrupted.
    let mut job = job_of(&spec, SaveJob::fresh(), false);
    for s in &mut job {
        assert_eq!(s.load(one.join("step-000002")).unwrap().step, 2);
    }
    steps_together(&mut job, 2);
    let by_rank = state(&straight);
    for (r, s) in job.iter().enumerate() {
        assert_eq!(state(s), vec![by_rank[r].clone()], "rank {r}");
    }
    save_all(&job, &many);
    straight.save(&one).unwrap();
    assert_same_checkpoint(&one.join("step-000004"), &many.join("step-000004"));
}

#[test]
fn a_multi_process_save_never_reads_what_a_crashed_job_left_and_removes_it() {
    let root = scratch("crashed_job");
    let mut straight = whole(mixed_spec(2, 2));
    block_on(steps(&mut straight, 1));
    straight.save(&root).unwrap();
    block_on(steps(&mut straight, 1));
    let src = scratch("crashed_job_src");
    straight.save(&src).unwrap();

    // An earlier job died saving step 2: its partial directory holds every rank's
    // report, naming files that are not this job's (here: garbage of the right size).
    let stale = root.join(".step-000002-00000000000000aa.partial");
    std::fs::create_dir(&stale).unwrap();
    for f in manifest(&src.join("step-000002")).files {
        std::fs::write(stale.join(&f.file), vec![0u8; f.bytes as usize]).unwrap();
        let report = serde_json::json!({ "job": "00000000000000aa", "step": 2, "file": f });
        let name = format!("rank-{:05}.report.json", f.rank);
        std::fs::write(stale.join(name), report.to_string()).unwrap();
    }
    let mut job = job_of(&mixed_spec(2, 2), SaveJob::fresh(), false);
    for s in &mut job {
        s.load(&src).unwrap();
    }
    save_all(&job, &root);
    assert_eq!(latest(&root), "step-000002");
    assert_eq!(entries(&root), [LATEST, "step-000001", "step-000002"]);
    let mut r = whole(mixed_spec(2, 2));
    r.load(&root).unwrap();
    assert_eq!(state(&r), state(&straight));
}

#[test]
fn rank_0_waits_for_every_report_until_the_timeout_or_a_failed_rank() {
    let root = scratch("missing_ranks");
    let spec = mixed_spec(2, 2);
    let mut first = whole(spec.clone());
    block_on(steps(&mut first, 1));
    first.save(&root).unwrap();

    // Ranks 1 to 3 never report: rank 0's save fails after the timeout, naming them,
    // and `latest` stays on the last complete checkpoint.
    let timeout = Duration::from_millis(300);
    let mut job = job_of(&spec, SaveJob::fresh().with_report_timeout(timeout), false);
    job[0].load(&root).unwrap();
    let text = job[0].save(&root).unwrap_err().to_string();
    assert!(
        text.contains("report timeout")
            && text.contains("[1, 2, 3]")
            && text.contains("not committed"),
        "{text}"
    );
    assert_eq!(latest(&root), "step-000001");

    // Another rank of the job fails: the wait ends at once, naming it.
    let mut job = job_of(&spec, SaveJob::fresh(), false);
    job[0].load(&root).unwrap();
    let abort = job[0].peer_abort();
    let t0 = Instant::now();
    job[0].save_in_background(&root).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    abort.trigger(PeerFailure {
        rank: 3,
        reason: "killed".into(),
    });
    let text = job[0].wait_for_saves().unwrap_err().to_string();
    assert!(
        text.contains("rank 3 of the job failed") && text.contains("killed"),
        "{text}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert_eq!(latest(&root), "step-000001");
    // What those saves left is never read, and the next complete save removes it.
    let loaded = whole(spec).load(&root).unwrap();
    assert_eq!(loaded.step, 1);
    assert_eq!(loaded.unfinished.len(), 2, "{:?}", loaded.unfinished);
    first.save(&root).unwrap();
    assert_eq!(entries(&root), [LATEST, "step-000001"]);
}

#[test]
fn a_session_of_some_ranks_saves_only_with_a_save_job() {
    let root = scratch("no_job");
    let spec = mixed_spec(2, 2);
    let links = loopback(4);
    let backend = CpuBackend::one_rank(spec.mesh, 2, &links[2]).unwrap();
    let mut s = Session::new(spec, Arc::new(backend), ExecConfig::default()).unwrap();
    let e = s.check_can_save().unwrap_err().to_string();
    assert!(e.contains("ranks [2]") && e.contains("set_save_job"), "{e}");
    match s.save(&root).unwrap_err() {
        Error::Checkpoint { reason, .. } => assert!(reason.contains("set_save_job"), "{reason}"),
        other => panic!("expected Error::Checkpoint, got {other}"),
    }
    assert!(entries(&root).is_empty());
    // With one, its file and report go into the job's partial directory, and it is
    // done: committing is rank 0's process's.
    s.set_save_job(SaveJob::new(0xbeef));
    let ticket = s.save_in_background(&root).unwrap();
    assert_eq!(ticket.step, 0);
    let done = s.wait_for_saves().unwrap().unwrap();
    assert!(!done.committed);
    let partial = root.join(".step-000000-000000000000beef.partial");
    assert_eq!(
        entries(&partial),
        ["rank-00002.report.json", "rank-00002.safetensors"]
    );
}
