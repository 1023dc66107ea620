//! Checkpoints of multi-process jobs (`docs/checkpoints.md`, "Saving"), without
//! processes: each "process" is a session over a backend that drives only some ranks of
//! the mesh (what a process of a multi-process job is), all in one test process. Their
//! saves run on their own background threads and meet on disk exactly as processes do:
//! every one writes its ranks' files and reports, the one holding rank 0 commits.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use overlap::checkpoint::{Manifest, SaveJob, LATEST, MANIFEST};
use overlap::executor::ExecConfig;
use overlap::graph::{Buffer, Stream};
use overlap::ops::cpu::{CpuBackend, CpuBuffer, CpuEvent};
use overlap::ops::{Backend, BoxFuture, EventStatus, Kernel, OpsError, Tag, Timing};
use overlap::{drive, synthetic, Error, Gate, PeerFailure, PlanSpec, Session};

use common::mixed_spec;

const SEED: u64 = 23;

/// The CPU backend seen from one process of a job: it drives only `ranks`. Such a
/// session cannot run a step (its peers are not there), but it loads, holds and saves
/// its ranks' state as a process of a job does.
struct Part {
    inner: CpuBackend,
    ranks: Vec<u32>,
}

impl Backend for Part {
    type Buffer = CpuBuffer;
    type Event = CpuEvent;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn local_ranks(&self) -> Vec<u32> {
        self.ranks.clone()
    }
    fn alloc(&self, rank: u32, len: usize) -> Result<CpuBuffer, OpsError> {
        self.inner.alloc(rank, len)
    }
    fn len(&self, buf: &CpuBuffer) -> usize {
        self.inner.len(buf)
    }
    fn upload(&self, buf: &CpuBuffer, data: &[f32]) -> Result<(), OpsError> {
        self.inner.upload(buf, data)
    }
    fn download(&self, buf: &CpuBuffer) -> Result<Vec<f32>, OpsError> {
        self.inner.download(buf)
    }
    fn event(&self, rank: u32) -> CpuEvent {
        self.inner.event(rank)
    }
    fn launch(&self, rank: u32, stream: Stream, tag: Tag, kernel: Kernel<CpuBuffer>) {
        self.inner.launch(rank, stream, tag, kernel);
    }
    fn record(&self, rank: u32, stream: Stream, event: &CpuEvent) {
        self.inner.record(rank, stream, event);
    }
    fn wait(&self, rank: u32, stream: Stream, event: &CpuEvent) {
        self.inner.wait(rank, stream, event);
    }
    fn status(&self, event: &CpuEvent) -> EventStatus {
        self.inner.status(event)
    }
    fn host_wait(&self, event: &CpuEvent) -> BoxFuture<Result<(), OpsError>> {
        self.inner.host_wait(event)
    }
    fn errors(&self) -> Vec<(u32, Stream, Tag, OpsError)> {
        self.inner.errors()
    }
    fn reset(&self) {
        self.inner.reset();
    }
    fn take_timings(&self) -> Vec<Timing> {
        self.inner.take_timings()
    }
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

/// One process of a job on mesh `spec.mesh` driving `ranks`, its parameters at other
/// values than the whole session's (a load must set them all).
fn process(spec: PlanSpec, ranks: &[u32]) -> Session<Part> {
    let backend = Arc::new(Part {
        inner: CpuBackend::new(spec.mesh),
        ranks: ranks.to_vec(),
    });
    let mut s = Session::new(spec, backend, ExecConfig::default()).unwrap();
    s.init_params(|i, p| synthetic::init(SEED + 9, i, p.spec.numel() as usize))
        .unwrap();
    s
}

/// The processes of a job over the 2x2 mesh, one rank each, sharing one save job.
fn job_of_four(job: SaveJob) -> Vec<Session<Part>> {
    (0..4)
        .map(|r| {
            let mut s = process(mixed_spec(2, 2), &[r]);
            s.set_save_job(job);
            s
        })
        .collect()
}

async fn steps(s: &mut Session<CpuBackend>, n: u64) {
    for _ in 0..n {
        let step = s.steps_done();
        drive::synthetic_step(s, SEED, step, &[Gate::NoSync, Gate::On])
            .await
            .unwrap();
    }
}

/// Every local rank's parameter pieces and optimizer states, as bits, by rank.
fn state<B: Backend>(s: &Session<B>) -> Vec<(u32, Vec<Option<Vec<u32>>>)> {
    let bits = |v: Option<Vec<f32>>| v.map(|v| v.iter().map(|x| x.to_bits()).collect());
    s.local_ranks()
        .into_iter()
        .map(|rank| {
            let mut held = Vec::new();
            for p in 0..s.planner().params().len() as u32 {
                held.push(bits(s.param_values(rank, p).unwrap()));
                let opt = Buffer::OptState { param: p };
                held.push(bits(s.executor().read(rank, opt).unwrap()));
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
fn save_all(job: &[Session<Part>], root: &Path) -> Vec<overlap::checkpoint::Saved> {
    for s in job {
        let ticket = s.save_in_background(root).unwrap();
        assert_eq!(
            ticket.path,
            root.join(overlap::checkpoint::step_dir_name(ticket.step))
        );
    }
    job.iter()
        .map(|s| s.wait_for_saves().unwrap().expect("a save was in flight"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_save_the_checkpoint_one_process_saves_and_it_resumes_anywhere() {
    let (one, many) = (scratch("one"), scratch("many"));
    let mut straight = whole(mixed_spec(2, 2));
    steps(&mut straight, 2).await;
    straight.save(&one).unwrap();

    // One process's checkpoint resumes in four: each gets its rank's state.
    let mut job = job_of_four(SaveJob::fresh());
    for s in &mut job {
        assert_eq!(s.load(&one).unwrap().step, 2);
    }
    let whole_state = state(&straight);
    for (r, s) in job.iter().enumerate() {
        assert_eq!(state(s), vec![whole_state[r].clone()], "rank {r}");
    }

    // Four processes save it: the same files and manifest, byte for byte, committed by
    // rank 0's process alone, and nothing left beside it.
    let saved = save_all(&job, &many);
    let committed: Vec<bool> = saved.iter().map(|s| s.committed).collect();
    assert_eq!(committed, [true, false, false, false]);
    assert_eq!(latest(&many), "step-000002");
    assert_eq!(entries(&many), [LATEST, "step-000002"]);
    let (a, b) = (one.join("step-000002"), many.join("step-000002"));
    assert_eq!(manifest(&a), manifest(&b));
    assert_eq!(entries(&a), entries(&b));
    for f in manifest(&a).files {
        let same =
            std::fs::read(a.join(&f.file)).unwrap() == std::fs::read(b.join(&f.file)).unwrap();
        assert!(same, "{} differs", f.file);
    }

    // It resumes in one process bit-exactly, and on another mesh as one process's does.
    let mut resumed = whole(mixed_spec(2, 2));
    resumed.load(&many).unwrap();
    steps(&mut resumed, 2).await;
    steps(&mut straight, 2).await;
    assert_eq!(state(&resumed), state(&straight));
    let (mut x, mut y) = (whole(mixed_spec(4, 1)), whole(mixed_spec(4, 1)));
    x.load(&many).unwrap();
    y.load(&one).unwrap();
    assert_eq!(state(&x), state(&y));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_process_save_never_reads_what_a_crashed_job_left_and_removes_it() {
    let root = scratch("crashed_job");
    let mut straight = whole(mixed_spec(2, 2));
    steps(&mut straight, 1).await;
    straight.save(&root).unwrap();
    steps(&mut straight, 1).await;
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
    let mut job = job_of_four(SaveJob::fresh());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_0_waits_for_every_report_until_the_timeout_or_a_failed_rank() {
    let root = scratch("missing_ranks");
    let mut first = whole(mixed_spec(2, 2));
    steps(&mut first, 1).await;
    first.save(&root).unwrap();

    // Ranks 2 and 3 never report: the save fails after the timeout, naming them, and
    // `latest` stays on the last complete checkpoint.
    let job = SaveJob::fresh().with_report_timeout(Duration::from_millis(300));
    let mut half = process(mixed_spec(2, 2), &[0, 1]);
    half.set_save_job(job);
    half.load(&root).unwrap();
    let e = half.save(&root).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("report timeout")
            && text.contains("[2, 3]")
            && text.contains("not committed"),
        "{text}"
    );
    assert_eq!(latest(&root), "step-000001");

    // Another rank of the job fails: the wait ends at once, naming it.
    let mut half = process(mixed_spec(2, 2), &[0, 1]);
    half.set_save_job(SaveJob::fresh());
    half.load(&root).unwrap();
    let abort = half.peer_abort();
    let t0 = Instant::now();
    half.save_in_background(&root).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    abort.trigger(PeerFailure {
        rank: 3,
        reason: "killed".into(),
    });
    let text = half.wait_for_saves().unwrap_err().to_string();
    assert!(
        text.contains("rank 3 of the job failed") && text.contains("killed"),
        "{text}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert_eq!(latest(&root), "step-000001");
    // What those saves left is never read, and the next complete save removes it.
    let loaded = whole(mixed_spec(2, 2)).load(&root).unwrap();
    assert_eq!(loaded.step, 1);
    assert_eq!(loaded.unfinished.len(), 2, "{:?}", loaded.unfinished);
    first.save(&root).unwrap();
    assert_eq!(entries(&root), [LATEST, "step-000001"]);
}

#[test]
fn a_session_of_some_ranks_saves_only_with_a_save_job() {
    let root = scratch("no_job");
    let s = process(mixed_spec(2, 2), &[2, 3]);
    let e = s.check_can_save().unwrap_err().to_string();
    assert!(
        e.contains("ranks [2, 3]") && e.contains("set_save_job"),
        "{e}"
    );
    match s.save(&root).unwrap_err() {
        Error::Checkpoint { reason, .. } => assert!(reason.contains("set_save_job"), "{reason}"),
        other => panic!("expected Error::Checkpoint, got {other}"),
    }
    assert!(entries(&root).is_empty());
    // With one, its files and reports go into the job's partial directory, and it is
    // done: committing is rank 0's process's.
    let mut s = s;
    s.set_save_job(SaveJob::new(0xbeef));
    let saved = s.save_in_background(&root).unwrap();
    assert_eq!(saved.step, 0);
    let done = s.wait_for_saves().unwrap().unwrap();
    assert!(!done.committed);
    let partial = root.join(".step-000000-000000000000beef.partial");
    assert_eq!(
        entries(&partial),
        [
            "rank-00002.report.json",
            "rank-00002.safetensors",
            "rank-00003.report.json",
            "rank-00003.safetensors"
        ]
    );
}
