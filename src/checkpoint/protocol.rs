//! The save protocol on disk (`docs/checkpoints.md`, "Saving"), run on a save's
//! background thread from a staged copy.
//!
//! Every process writes its local ranks' files into the save's partial directory
//! `ROOT/.step-NNNNNN-JOB.partial/` (every process of the job computes the same name from
//! the step and the job's id), each file synced, then for each rank a report
//! (`rank-XXXXX.report.json`: the file's name, size, sha256 and tensors) written to a
//! temporary name and renamed, so that a report seen is whole. The process holding
//! global rank 0 then waits for every rank's report (polling; it gives up after the
//! job's report timeout, or at once when the job reports a failed rank), checks each
//! against its file's size on disk, writes the manifest (temporary name, sync, rename,
//! sync of the directory), renames the directory to `ROOT/step-NNNNNN/`, syncs the root,
//! switches `latest` (temporary file, sync, rename, sync of the root) and removes what
//! earlier unfinished saves left. The other processes are done after their reports.
//!
//! Invariant: `latest` only ever names a directory whose manifest was written after
//! every file it lists was synced; nothing of a partial directory is read by a load.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use overlap_executor::PeerAbort;
use serde::{Deserialize, Serialize};

use super::fault::{self, At, Phase, SaveFault};
use super::manifest::{Manifest, RankFile, RngState, FORMAT_VERSION, MANIFEST};
use super::stage::{Staged, StagedRank};
use super::{
    err, leftover, partial_dir_name, rank_file_name, sha256, step_dir_name, Leftover, Saved,
    LATEST, SYNTHETIC_RNG,
};
use crate::Error;

/// Everything a save's background thread needs: no reference into the session.
pub(crate) struct SaveWork {
    /// The checkpoint root.
    pub(crate) root: PathBuf,
    /// The job's id (the same on every process of a multi-process job).
    pub(crate) job: u64,
    /// How long the committing process waits for the other ranks' reports.
    pub(crate) report_timeout: Duration,
    /// The job's failure signal: the wait for reports ends when it fires.
    pub(crate) abort: PeerAbort,
    /// A test fault (`OVERLAP_CHECKPOINT_FAULT`).
    pub(crate) fault: Option<SaveFault>,
    /// The staged copy.
    pub(crate) staged: Staged,
}

/// A rank's report of its file, for the committing process.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Report {
    /// The job's id, 16 hex digits.
    job: String,
    /// The step saved.
    step: u64,
    /// The file, as the manifest will list it.
    file: RankFile,
}

/// A rank's report file name.
fn report_name(rank: u32) -> String {
    format!("rank-{rank:05}.report.json")
}

fn job_hex(job: u64) -> String {
    format!("{job:016x}")
}

/// Runs the protocol: this process's files and reports, and the commit if it holds rank
/// 0. A failed save of a process that drives every rank removes its partial directory
/// (no other process writes there); otherwise the next successful save does.
pub(crate) fn run(work: SaveWork) -> Result<Saved, Error> {
    let t0 = Instant::now();
    let step = work.staged.step;
    let partial = work.root.join(partial_dir_name(step, work.job));
    let result = write_and_commit(&work, &partial);
    if result.is_err() && work.staged.all_local() {
        // Best effort: nothing names it and nothing reads it.
        let _ = fs::remove_dir_all(&partial);
    }
    Ok(Saved {
        step,
        path: work.root.join(step_dir_name(step)),
        committed: result?,
        written: t0.elapsed(),
    })
}

/// Whether this process committed the checkpoint.
fn write_and_commit(work: &SaveWork, partial: &Path) -> Result<bool, Error> {
    fs::create_dir_all(partial).map_err(|e| err(partial, format!("cannot be created: {e}")))?;
    let mut mine = Vec::new();
    for r in &work.staged.ranks {
        let file = write_shard(work, partial, r)?;
        write_report(work, partial, &file)?;
        mine.push(file);
    }
    if !work.staged.commits() {
        return Ok(false);
    }
    let files = collect_reports(work, partial, mine)?;
    commit(work, partial, files)?;
    Ok(true)
}

/// Writes `bytes` to a new file at `path` and syncs it (the test fault may cut it).
fn write_synced(path: &Path, bytes: &[u8], fault: Option<&SaveFault>, at: At) -> Result<(), Error> {
    let mut f = File::create(path).map_err(|e| err(path, format!("cannot be created: {e}")))?;
    fault::write(fault, at, path, &mut f, bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| err(path, format!("writing: {e}")))
}

/// Makes a directory's entries (new files, renames) durable.
fn sync_dir(dir: &Path) -> Result<(), Error> {
    #[cfg(unix)]
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| err(dir, format!("syncing the directory: {e}")))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

fn rename(from: &Path, to: &Path) -> Result<(), Error> {
    fs::rename(from, to).map_err(|e| err(to, format!("renaming {} to it: {e}", from.display())))
}

/// One rank's safetensors file, synced; what the manifest will say of it.
fn write_shard(work: &SaveWork, dir: &Path, r: &StagedRank) -> Result<RankFile, Error> {
    let file = rank_file_name(r.rank);
    let path = dir.join(&file);
    let bytes = r.serialize(&path)?;
    let at = At {
        phase: Phase::Shard,
        rank: Some(r.rank),
        step: work.staged.step,
    };
    write_synced(&path, &bytes, work.fault.as_ref(), at)?;
    Ok(RankFile {
        rank: r.rank,
        file,
        bytes: bytes.len() as u64,
        sha256: sha256(&bytes),
        tensors: r.entries.clone(),
    })
}

/// A rank's report: written under a temporary name, synced and renamed, so that the
/// committing process never reads half of one.
fn write_report(work: &SaveWork, dir: &Path, file: &RankFile) -> Result<(), Error> {
    let report = Report {
        job: job_hex(work.job),
        step: work.staged.step,
        file: file.clone(),
    };
    let name = report_name(file.rank);
    let path = dir.join(&name);
    let json =
        serde_json::to_vec_pretty(&report).map_err(|e| err(&path, format!("serialising: {e}")))?;
    let tmp = dir.join(format!(".{name}.tmp"));
    let at = At {
        phase: Phase::Report,
        rank: Some(file.rank),
        step: work.staged.step,
    };
    write_synced(&tmp, &json, work.fault.as_ref(), at)?;
    rename(&tmp, &path)
}

/// Every rank's file, in rank order: this process's own (`mine`) and the others' from
/// their reports, waited for.
fn collect_reports(
    work: &SaveWork,
    dir: &Path,
    mine: Vec<RankFile>,
) -> Result<Vec<RankFile>, Error> {
    let world = work.staged.mesh.world();
    let mut got: BTreeMap<u32, RankFile> = mine.into_iter().map(|f| (f.rank, f)).collect();
    let start = Instant::now();
    let mut pause = Duration::from_millis(2);
    loop {
        for rank in 0..world {
            if got.contains_key(&rank) {
                continue;
            }
            if let Some(f) = read_report(work, dir, rank)? {
                got.insert(rank, f);
            }
        }
        if got.len() as u64 == u64::from(world) {
            return Ok(got.into_values().collect());
        }
        check_waiting(work, dir, &got, start.elapsed())?;
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// Refuses to wait on when another rank of the job failed or the timeout passed.
fn check_waiting(
    work: &SaveWork,
    dir: &Path,
    got: &BTreeMap<u32, RankFile>,
    waited: Duration,
) -> Result<(), Error> {
    let not_committed = format!(
        "step {} was not committed; `{LATEST}` still names the previous checkpoint",
        work.staged.step
    );
    if let Some(f) = work.abort.failure() {
        return Err(err(
            dir,
            format!(
                "rank {} of the job failed while this save waited for the ranks' reports \
                 ({}); {not_committed}",
                f.rank, f.reason
            ),
        ));
    }
    if waited < work.report_timeout {
        return Ok(());
    }
    let missing: Vec<u32> = (0..work.staged.mesh.world())
        .filter(|r| !got.contains_key(r))
        .take(16)
        .collect();
    Err(err(
        dir,
        format!(
            "waited {:?} (the save job's report timeout) for the reports of ranks {missing:?}{}: \
             is every process of the job saving into this directory, on a file system they \
             all see? {not_committed}",
            work.report_timeout,
            if missing.len() == 16 { " and more" } else { "" }
        ),
    ))
}

/// Rank `rank`'s report, once it is there, checked against this save and its file's
/// size on disk.
fn read_report(work: &SaveWork, dir: &Path, rank: u32) -> Result<Option<RankFile>, Error> {
    let path = dir.join(report_name(rank));
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(err(&path, format!("cannot be read: {e}"))),
    };
    let r: Report = serde_json::from_slice(&bytes)
        .map_err(|e| err(&path, format!("is not a valid report: {e}")))?;
    let (job, step) = (job_hex(work.job), work.staged.step);
    if r.job != job || r.step != step || r.file.rank != rank || r.file.file != rank_file_name(rank)
    {
        return Err(err(
            &path,
            format!(
                "reports rank {}'s `{}` of job {} step {}; this save is rank {rank}'s of job \
                 {job} step {step}",
                r.file.rank, r.file.file, r.job, r.step
            ),
        ));
    }
    let shard = dir.join(&r.file.file);
    let len = fs::metadata(&shard)
        .map_err(|e| err(&shard, format!("reported but cannot be read: {e}")))?
        .len();
    if len != r.file.bytes {
        return Err(err(
            &shard,
            format!("is {len} bytes; its report says {}", r.file.bytes),
        ));
    }
    Ok(Some(r.file))
}

/// Writes the manifest, renames the directory into place and switches `latest`; then
/// removes what unfinished saves left.
fn commit(work: &SaveWork, partial: &Path, files: Vec<RankFile>) -> Result<(), Error> {
    let step = work.staged.step;
    write_manifest(work, partial, files)?;
    for rank in 0..work.staged.mesh.world() {
        // Best effort: the manifest says all a report said.
        let _ = fs::remove_file(partial.join(report_name(rank)));
    }
    let at = At {
        phase: Phase::Rename,
        rank: None,
        step,
    };
    fault::point(work.fault.as_ref(), at, partial)
        .map_err(|e| err(partial, format!("renaming: {e}")))?;
    let name = step_dir_name(step);
    install_dir(&work.root, partial, &name, work.job)?;
    switch_latest(work, &name)?;
    clean_up(&work.root, work.job, step);
    Ok(())
}

/// The manifest, under a temporary name, synced, renamed, and the directory synced.
fn write_manifest(work: &SaveWork, dir: &Path, files: Vec<RankFile>) -> Result<(), Error> {
    let s = &work.staged;
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        overlap_version: env!("CARGO_PKG_VERSION").into(),
        mesh: s.mesh,
        step: s.step,
        rng: RngState {
            generator: SYNTHETIC_RNG.into(),
            seed: s.seed,
            position: s.step,
        },
        params: s.params.clone(),
        files,
    };
    let path = dir.join(MANIFEST);
    let json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| err(&path, format!("serialising: {e}")))?;
    let tmp = dir.join(format!(".{MANIFEST}.tmp"));
    let at = At {
        phase: Phase::Manifest,
        rank: None,
        step: s.step,
    };
    write_synced(&tmp, &json, work.fault.as_ref(), at)?;
    rename(&tmp, &path)?;
    sync_dir(dir)
}

/// Renames the partial directory to `root/name` and syncs the root. A directory of the
/// same step already there (a run resumed from an older checkpoint saves that step
/// again) is moved aside first and removed after.
fn install_dir(root: &Path, partial: &Path, name: &str, job: u64) -> Result<(), Error> {
    let dest = root.join(name);
    if !dest.exists() {
        rename(partial, &dest)?;
        return sync_dir(root);
    }
    let old = root.join(format!(".old-{name}-{}", job_hex(job)));
    rename(&dest, &old)?;
    rename(partial, &dest)?;
    sync_dir(root)?;
    let _ = fs::remove_dir_all(&old);
    Ok(())
}

/// Points `latest` at `name`: a temporary file, synced, renamed over it, the root synced.
fn switch_latest(work: &SaveWork, name: &str) -> Result<(), Error> {
    let root = &work.root;
    let tmp = root.join(format!(".{LATEST}-{}", job_hex(work.job)));
    let at = At {
        phase: Phase::Latest,
        rank: None,
        step: work.staged.step,
    };
    write_synced(
        &tmp,
        format!("{name}\n").as_bytes(),
        work.fault.as_ref(),
        at,
    )?;
    rename(&tmp, &root.join(LATEST))?;
    sync_dir(root)
}

/// Removes what unfinished saves left in the root (after a commit of `step` by `job`):
/// every partial directory but this job's of later steps (its processes may be writing
/// the next save already), and every temporary directory or file. Best effort.
fn clean_up(root: &Path, job: u64, step: u64) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(kind) = name.to_str().and_then(leftover) else {
            continue;
        };
        if matches!(kind, Leftover::Partial { step: s, job: j } if j == job && s > step) {
            continue;
        }
        let path = entry.path();
        let removed = if path.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        if let Err(e) = removed {
            tracing::warn!("checkpoint: cannot remove {}: {e}", path.display());
        }
    }
}
