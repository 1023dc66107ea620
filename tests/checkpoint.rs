//! Checkpoints (`docs/checkpoints.md`): a resumed run is bit-exact, a checkpoint loads
//! onto other meshes, and a damaged or foreign one is refused whole, naming the file,
//! with the session still usable.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use overlap::checkpoint::{Manifest, SaveJob, LATEST, MANIFEST};
use overlap::executor::ExecConfig;
use overlap::graph::Buffer;
use overlap::ops::cpu::CpuBackend;
use overlap::ops::math;
use overlap::{drive, synthetic, Error, Gate, Mesh, PlanSpec, Route, Session};

use common::mixed_spec;

const SEED: u64 = 11;

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("checkpoint")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn session_of(spec: PlanSpec, init_seed: u64) -> Session<CpuBackend> {
    let backend = Arc::new(CpuBackend::new(spec.mesh));
    let mut s = Session::new(spec, backend, ExecConfig::default()).unwrap();
    s.init_params(|i, p| synthetic::init(init_seed, i, p.spec.numel() as usize))
        .unwrap();
    s
}

fn session(shard: u32, replicate: u32) -> Session<CpuBackend> {
    session_of(mixed_spec(shard, replicate), SEED)
}

/// Runs `n` more steps with the seeded synthetic gradients, numbered on from the
/// session's step counter (what `overlap run` does).
async fn steps(s: &mut Session<CpuBackend>, n: u64) {
    let gates = [Gate::NoSync, Gate::On];
    for _ in 0..n {
        let step = s.steps_done();
        drive::synthetic_step(s, SEED, step, &gates).await.unwrap();
    }
}

/// One rank's piece of a parameter and its optimizer state, as bits.
type Held = (u32, u32, Option<Vec<u32>>, Option<Vec<u32>>);

/// Every rank's parameter pieces and optimizer states.
fn state(s: &Session<CpuBackend>) -> Vec<Held> {
    let bits = |v: Option<Vec<f32>>| v.map(|v| v.iter().map(|x| x.to_bits()).collect());
    let mut out = Vec::new();
    for rank in s.local_ranks() {
        for p in 0..s.params().len() as u32 {
            let values = s.param_values(rank, p).unwrap();
            let opt = s.read_buffer(rank, Buffer::OptState { param: p }).unwrap();
            out.push((rank, p, bits(values), bits(opt)));
        }
    }
    out
}

/// The full tensors of a session's parameters and optimizer state, from the ranks that
/// hold them: `(values, AdamW m and v or Muon momentum as one or two full tensors)`.
fn full_state(s: &Session<CpuBackend>) -> Vec<(Vec<f32>, Vec<Vec<f32>>)> {
    let mesh = s.spec().mesh;
    s.params()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let numel = p.spec.numel() as usize;
            let muon = p.spec.route == Route::Muon;
            let mut values = vec![f32::NAN; numel];
            let mut opt = vec![vec![f32::NAN; numel]; if muon { 1 } else { 2 }];
            for rank in s.local_ranks() {
                let c = mesh.coord(rank);
                if p.owner.is_some_and(|o| o != c) {
                    continue;
                }
                let r = p.spec.shard_range(mesh.shard, c.shard);
                let r = r.start as usize..r.end as usize;
                let v = s.param_values(rank, i as u32).unwrap().unwrap();
                values[r.clone()].copy_from_slice(&v);
                let st = s
                    .read_buffer(rank, Buffer::OptState { param: i as u32 })
                    .unwrap()
                    .unwrap();
                for (k, part) in st.chunks(r.len().max(1)).enumerate().take(opt.len()) {
                    opt[k][r.clone()].copy_from_slice(part);
                }
            }
            assert!(values.iter().all(|x| !x.is_nan()), "{}", p.spec.name);
            (values, opt)
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn refused(e: Error) -> (String, String) {
    match e {
        Error::Checkpoint { path, reason } => (path, reason),
        other => panic!("expected Error::Checkpoint, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_on_the_same_mesh_is_bit_exact() {
    let dir = scratch("same_mesh");
    let mut straight = session(2, 2);
    steps(&mut straight, 4).await;

    let mut first = session(2, 2);
    steps(&mut first, 2).await;
    let saved = first.save(&dir).unwrap();
    assert_eq!(saved, dir.join("step-000002"));
    assert_eq!(
        std::fs::read_to_string(dir.join(LATEST)).unwrap().trim(),
        "step-000002"
    );
    drop(first);

    // Different initial values: everything must come from the checkpoint.
    let mut resumed = session_of(mixed_spec(2, 2), SEED + 1);
    let loaded = resumed.load(&dir).unwrap();
    assert_eq!(loaded.step, 2);
    assert_eq!(loaded.path, saved);
    assert_eq!(resumed.steps_done(), 2);
    steps(&mut resumed, 2).await;
    assert_eq!(resumed.steps_done(), 4);
    assert_eq!(state(&resumed), state(&straight));
}

/// A local rank's piece of a parameter and of its optimizer state: `(rank, parameter id,
/// values, state)`.
type Piece = (u32, usize, Vec<f32>, Vec<f32>);

/// Checks that each local rank of `s` holds, after a load, its piece of the full tensors
/// `saved` under `s`'s mesh (values where it holds the parameter, state where it runs the
/// optimizer, nothing elsewhere); returns the pieces with state.
fn assert_pieces_of(s: &Session<CpuBackend>, saved: &[(Vec<f32>, Vec<Vec<f32>>)]) -> Vec<Piece> {
    let mesh = s.spec().mesh;
    let mut pieces = Vec::new();
    for rank in s.local_ranks() {
        let c = mesh.coord(rank);
        for (i, p) in s.params().iter().enumerate() {
            let id = i as u32;
            let r = p.spec.shard_range(mesh.shard, c.shard);
            let r = r.start as usize..r.end as usize;
            let (full, opt) = &saved[i];
            let held = s.param_values(rank, id).unwrap();
            if p.owner.is_some_and(|o| o.shard != c.shard) {
                assert_eq!(held, None);
                continue;
            }
            let held = held.unwrap();
            let name = &p.spec.name;
            assert_eq!(bits(&held), bits(&full[r.clone()]), "{name} on rank {rank}");
            let state = s.read_buffer(rank, Buffer::OptState { param: id }).unwrap();
            if p.owner.is_some_and(|o| o != c) {
                assert_eq!(state, None, "{name} on rank {rank}");
                continue;
            }
            let want: Vec<f32> = opt.iter().flat_map(|t| t[r.clone()].to_vec()).collect();
            assert_eq!(
                bits(&state.unwrap()),
                bits(&want),
                "{name} state on rank {rank}"
            );
            pieces.push((rank, i, held, want));
        }
    }
    pieces
}

/// Checks that step 3 moved each piece as the reference math does from the restored
/// values and state, with the reduced gradient the step used.
fn assert_reference_step(s: &Session<CpuBackend>, before: Vec<Piece>) {
    let hp = ExecConfig::default();
    let mesh = s.spec().mesh;
    for (rank, i, mut p0, mut st) in before {
        let spec = &s.params()[i].spec;
        let grad = s.reduced_grad(rank, i as u32).unwrap().unwrap();
        if spec.route == Route::Muon {
            let (rows, cols) = spec.matrix_dims();
            math::muon(
                &mut p0,
                &grad,
                &mut st,
                rows as usize,
                cols as usize,
                &hp.muon,
            );
        } else {
            let n = p0.len();
            let (m, v) = st.split_at_mut(n);
            // Step 3: the restored counter drives the bias correction.
            math::adamw(&mut p0, &grad, m, v, &hp.adamw, 3);
        }
        let after = s.param_values(rank, i as u32).unwrap().unwrap();
        let name = &spec.name;
        assert_eq!(bits(&after), bits(&p0), "{name} on rank {rank} of {mesh}");
        let state = s
            .read_buffer(rank, Buffer::OptState { param: i as u32 })
            .unwrap()
            .unwrap();
        assert_eq!(
            bits(&state),
            bits(&st),
            "{name} state on rank {rank} of {mesh}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_loads_onto_other_meshes_and_steps_as_the_reference_math() {
    let dir = scratch("reshard");
    let mut src = session(2, 2);
    steps(&mut src, 2).await;
    src.save(&dir).unwrap();
    let saved = full_state(&src);
    for (shard, replicate) in [(4, 1), (1, 2)] {
        let mut s = session_of(mixed_spec(shard, replicate), SEED + 7);
        let loaded = s.load(&dir).unwrap();
        assert_eq!(loaded.saved_mesh, Mesh::new(2, 2).unwrap());
        // Each rank's piece under the new mesh, before and after one more step.
        let before = assert_pieces_of(&s, &saved);
        steps(&mut s, 1).await;
        assert_eq!(s.steps_done(), 3);
        assert_reference_step(&s, before);
    }
}

/// A session that refused a load: unchanged, and a step on it equals a step on an
/// untouched twin.
async fn assert_unchanged_and_usable(mut s: Session<CpuBackend>) {
    let mut twin = session(2, 2);
    assert_eq!(s.steps_done(), 0);
    assert_eq!(state(&s), state(&twin));
    steps(&mut s, 1).await;
    steps(&mut twin, 1).await;
    assert_eq!(state(&s), state(&twin));
}

async fn saved_after_one_step(name: &str) -> PathBuf {
    let dir = scratch(name);
    let mut s = session(2, 2);
    steps(&mut s, 1).await;
    s.save(&dir).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_is_refused_naming_the_file_and_nothing_is_loaded() {
    let ckpt = saved_after_one_step("flipped").await;
    // Rank 1's file: a loader installing file by file would already have loaded rank 0.
    let file = ckpt.join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();

    let mut s = session(2, 2);
    let (path, reason) = refused(s.load(ckpt.parent().unwrap()).unwrap_err());
    assert!(path.ends_with("rank-00001.safetensors"), "{path}");
    assert!(
        reason.contains("sha256") && reason.contains("corrupted"),
        "{reason}"
    );
    assert_unchanged_and_usable(s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_file_is_refused_even_with_a_matching_manifest() {
    let ckpt = saved_after_one_step("truncated").await;
    let file = ckpt.join("rank-00000.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let cut = &bytes[..bytes.len() - 10];
    std::fs::write(&file, cut).unwrap();

    let mut s = session(2, 2);
    let (path, reason) = refused(s.load(&ckpt).unwrap_err());
    assert!(path.ends_with("rank-00000.safetensors"), "{path}");
    assert!(reason.contains("truncated"), "{reason}");

    // The manifest rewritten to match the cut file: the tensors themselves are short.
    let mpath = ckpt.join(MANIFEST);
    let mut m: Manifest = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m.files[0].bytes = cut.len() as u64;
    m.files[0].sha256 = sha256_hex(cut);
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    let (path, reason) = refused(s.load(&ckpt).unwrap_err());
    assert!(path.ends_with("rank-00000.safetensors"), "{path}");
    assert!(reason.contains("safetensors"), "{reason}");

    // A missing file.
    std::fs::remove_file(&file).unwrap();
    let (path, reason) = refused(s.load(&ckpt).unwrap_err());
    assert!(path.ends_with("rank-00000.safetensors"), "{path}");
    assert!(reason.contains("cannot be read"), "{reason}");
    assert_unchanged_and_usable(s).await;
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_another_model_is_refused_naming_the_parameter() {
    let ckpt = saved_after_one_step("other_model").await;
    let other = |f: &dyn Fn(&mut PlanSpec)| {
        let mut spec = mixed_spec(2, 2);
        f(&mut spec);
        session_of(spec, SEED)
    };
    type Change<'a> = &'a dyn Fn(&mut PlanSpec);
    let cases: [(Change, &str); 4] = [
        (
            &|s| s.params[3].shape = vec![10],
            "`odd` has shape [9] in the checkpoint, [10]",
        ),
        (
            &|s| s.params[1].route = Route::ShardedAdamw,
            "`norm` has route fsdp in the checkpoint, sharded_adamw",
        ),
        (
            &|s| s.params[5].name = "emb3".into(),
            "`emb3` of this model is not in the checkpoint",
        ),
        (
            &|s| {
                s.params.pop();
            },
            "parameter `emb2` is not in this model",
        ),
    ];
    for (change, phrase) in cases {
        let mut s = other(change);
        let (path, reason) = refused(s.load(&ckpt).unwrap_err());
        assert!(path.ends_with(MANIFEST), "{path}");
        assert!(reason.contains(phrase), "{reason}");
        assert_eq!(s.steps_done(), 0);
    }
    // A manifest whose mesh does not match its files is refused, and so is one whose
    // mesh is beyond the planner's limit (before anything of its size is allocated).
    let mpath = ckpt.join(MANIFEST);
    let original = std::fs::read(&mpath).unwrap();
    for (mesh, phrase) in [
        (
            serde_json::json!({ "shard": 8, "replicate": 2 }),
            "lists 4 rank files",
        ),
        (
            serde_json::json!({ "shard": 65535, "replicate": 65535 }),
            "more than the planner's limit",
        ),
    ] {
        let mut m: serde_json::Value = serde_json::from_slice(&original).unwrap();
        m["mesh"] = mesh;
        std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
        let mut s = session(2, 2);
        let (path, reason) = refused(s.load(&ckpt).unwrap_err());
        assert!(path.ends_with(MANIFEST), "{path}");
        assert!(reason.contains(phrase), "{reason}");
    }
    // A newer format is named as such.
    let mpath = ckpt.join(MANIFEST);
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m["format_version"] = 99.into();
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    let mut s = session(2, 2);
    let (_, reason) = refused(s.load(&ckpt).unwrap_err());
    assert!(
        reason.contains("format version 99") && reason.contains("newer"),
        "{reason}"
    );
    assert_unchanged_and_usable(s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_save_leaves_latest_on_the_last_complete_checkpoint() {
    let dir = scratch("interrupted");
    let mut s = session(2, 2);
    steps(&mut s, 1).await;
    s.save(&dir).unwrap();
    let want = state(&s);
    // A save of step 2 that died after its first file (a partial directory without a
    // manifest), one that died writing `latest`, and an older build's temporary
    // directory.
    steps(&mut s, 1).await;
    let partial = dir.join(".step-000002-00000000000000aa.partial");
    std::fs::create_dir(&partial).unwrap();
    std::fs::write(partial.join("rank-00000.safetensors"), b"partial").unwrap();
    let latest_tmp = dir.join(".latest-00000000000000aa");
    std::fs::write(&latest_tmp, b"step-0").unwrap();
    let legacy = dir.join(".tmp-step-000002-1-1");
    std::fs::create_dir(&legacy).unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.join(LATEST)).unwrap().trim(),
        "step-000001"
    );
    let mut r = session(2, 2);
    let loaded = r.load(&dir).unwrap();
    assert_eq!(loaded.step, 1);
    assert_eq!(state(&r), want);
    assert_eq!(
        loaded.unfinished,
        [latest_tmp.clone(), partial.clone(), legacy.clone()]
    );
    // A partial directory is no checkpoint.
    let (path, reason) = refused(r.load(&partial).unwrap_err());
    assert!(path.ends_with(".partial"), "{path}");
    assert!(reason.contains("not a checkpoint"), "{reason}");
    // The next save completes, moves `latest` and removes what the others left.
    s.save(&dir).unwrap();
    let loaded = r.load(&dir).unwrap();
    assert_eq!((loaded.step, loaded.unfinished), (2, vec![]));
    assert_eq!(state(&r), state(&s));
    assert!(!partial.exists() && !latest_tmp.exists() && !legacy.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_save_holds_its_steps_state_while_the_next_steps_run() {
    let dir = scratch("background");
    let mut s = session(2, 2);
    steps(&mut s, 2).await;
    let at_2 = state(&s);
    let first = s.save_in_background(&dir).unwrap();
    assert_eq!((first.step, &first.path), (2, &dir.join("step-000002")));
    assert!(first.previous.is_none());
    steps(&mut s, 2).await;
    // A second save waits for the first and hands over what it saved.
    let second = s.save_in_background(&dir).unwrap();
    assert_eq!(second.step, 4);
    let done = second.previous.expect("the first save, waited for");
    assert_eq!((done.step, done.committed), (2, true));
    let done = s.wait_for_saves().unwrap().expect("the second save");
    assert_eq!((done.step, &done.path), (4, &dir.join("step-000004")));
    assert!(s.wait_for_saves().unwrap().is_none());
    assert!(s.poll_save().unwrap().is_none());
    // Step 2's checkpoint holds step 2's state, though two steps ran while it was
    // written.
    let mut r = session(2, 2);
    r.load(dir.join("step-000002")).unwrap();
    assert_eq!(state(&r), at_2);
    r.load(&dir).unwrap();
    assert_eq!(state(&r), state(&s));
    // A session dropped with a save in flight finishes it first.
    steps(&mut s, 1).await;
    s.save_in_background(&dir).unwrap();
    drop(s);
    assert_eq!(
        std::fs::read_to_string(dir.join(LATEST)).unwrap().trim(),
        "step-000005"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_background_save_is_reported_by_the_next_call_and_nothing_is_lost() {
    let dir = scratch("background_failure");
    let mut s = session(2, 2);
    steps(&mut s, 1).await;
    s.save(&dir).unwrap();
    // A file where the save's partial directory goes: the background thread fails.
    s.set_save_job(SaveJob::new(0xfeed));
    steps(&mut s, 1).await;
    let in_the_way = dir.join(".step-000002-000000000000feed.partial");
    std::fs::write(&in_the_way, b"in the way").unwrap();
    s.save_in_background(&dir).unwrap();
    steps(&mut s, 1).await;
    let (path, reason) = refused(s.save_in_background(&dir).unwrap_err());
    assert!(path.ends_with(".partial"), "{path}");
    assert!(reason.contains("cannot be created"), "{reason}");
    // Reported once; nothing new was started; `latest` is where it was.
    assert!(s.wait_for_saves().unwrap().is_none());
    assert_eq!(
        std::fs::read_to_string(dir.join(LATEST)).unwrap().trim(),
        "step-000001"
    );
    assert_eq!(s.save(&dir).unwrap(), dir.join("step-000003"));
    assert!(!in_the_way.exists(), "the next successful save removes it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_saved_before_the_first_step_clears_optimizer_state() {
    let dir = scratch("step0");
    let s0 = session(2, 2);
    s0.save(&dir).unwrap();
    let mut s = session(2, 2);
    steps(&mut s, 2).await;
    s.load(dir.join("step-000000")).unwrap();
    assert_eq!(state(&s), state(&s0));
    assert_unchanged_and_usable(s).await;
}
