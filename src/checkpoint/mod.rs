//! Checkpoints: a session's parameters, optimizer state and step counter on disk, and
//! back (`docs/checkpoints.md`).
//!
//! A checkpoint is a directory `step-NNNNNN/` under a checkpoint root, holding one
//! [safetensors](https://docs.rs/safetensors) file per rank (`rank-00000.safetensors`,
//! ...) and a JSON [`Manifest`]: the mesh, the parameters, which element range of which
//! full tensor every file holds, the step counter, the run's RNG position and each
//! file's sha256. The root's `latest` file names the newest complete checkpoint.
//!
//! Saving (`protocol`) stages a host copy of the local ranks' pieces between steps
//! (`stage`), then writes on a background thread (`background`): every process writes
//! its own ranks' files and a report of each into the save's hidden partial directory;
//! the process holding rank 0 waits for every rank's report, writes the manifest,
//! renames the directory into place and only then switches `latest` (written to a
//! temporary file and renamed). A crash at any point leaves `latest` naming a complete
//! checkpoint; what the crash left is never read, and the next successful save removes
//! it. `fault` is the test hook that stops or fails a save at each of those phases.
//!
//! Loading (`read`) verifies everything before it touches the session: every file's size
//! and checksum, every tensor's dtype and shape, that the parameters are the model's, and
//! that the pieces cover every element. It then rebuilds the full tensors and hands each
//! local rank its piece under the session's own mesh, so a checkpoint loads onto another
//! `shard × replicate` mesh as well (the owners of owned routes may move: their state
//! goes to the new owner).

mod background;
mod fault;
mod manifest;
mod protocol;
mod read;
mod stage;

use std::path::{Path, PathBuf};
use std::time::Instant;

use overlap_executor::Executor;
use overlap_graph::{Coord, Mesh, Planner};
use overlap_ops::Backend;
use sha2::{Digest, Sha256};

pub(crate) use background::Saves;
pub use background::{SaveJob, SaveTicket, Saved};
pub use fault::{SaveFault, FAULT_VAR, STOP_MARKER};
pub use manifest::{
    read_manifest, Manifest, ManifestParam, RankFile, RngState, StateKind, TensorEntry,
    FORMAT_VERSION, MANIFEST,
};
pub(crate) use read::{install, read};
pub use read::{resolve, unfinished};

use crate::Error;

/// The file in a checkpoint root naming the newest complete checkpoint directory.
pub const LATEST: &str = "latest";
/// The generator of `overlap run`'s synthetic gradients, as the manifest names it.
pub const SYNTHETIC_RNG: &str = "overlap.synthetic.splitmix64";

/// What [`crate::Session::load`] restored.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// The checkpoint directory it read (the one `latest` names, when given a root).
    pub path: PathBuf,
    /// The step counter restored: the next step is `step + 1`.
    pub step: u64,
    /// The seed the run that saved it used, if it recorded one.
    pub seed: Option<u64>,
    /// The mesh it was saved on (another than the session's: it was resharded).
    pub saved_mesh: Mesh,
    /// When loaded through a root: what unfinished saves left there, which was not read
    /// ([`unfinished`]); the next successful save removes the hidden ones.
    pub unfinished: Vec<PathBuf>,
}

fn err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// The directory name of the checkpoint of step `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

fn rank_file_name(rank: u32) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// The hidden directory a job's save of step `step` writes into before it is complete.
fn partial_dir_name(step: u64, job: u64) -> String {
    format!(".step-{step:06}-{job:016x}.partial")
}

/// What an unfinished save may leave in a checkpoint root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leftover {
    /// A partial directory ([`partial_dir_name`]).
    Partial { step: u64, job: u64 },
    /// A temporary file or directory: `latest`'s (`.latest-*`), a step directory moved
    /// aside to be replaced (`.old-step-*`), or an older build's temporary directory
    /// (`.tmp-step-*`).
    Temporary,
}

/// What `name`, an entry of a checkpoint root, is, if an unfinished save left it.
fn leftover(name: &str) -> Option<Leftover> {
    if let Some(rest) = name
        .strip_prefix(".step-")
        .and_then(|r| r.strip_suffix(".partial"))
    {
        let (step, job) = rest.split_once('-')?;
        return Some(Leftover::Partial {
            step: step.parse().ok()?,
            job: u64::from_str_radix(job, 16).ok()?,
        });
    }
    let temporary = [".latest-", ".old-step-", ".tmp-step-"];
    temporary
        .iter()
        .any(|p| name.starts_with(p))
        .then_some(Leftover::Temporary)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// A file name with no directory part.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\'])
        && Path::new(name).components().count() == 1
}

/// Whether the rank at `c` writes a parameter's piece: replicate 0 of each shard column
/// for sharded routes (the other replicas hold the same values), the owner for owned
/// routes (which alone holds the optimizer state).
fn writes(owner: Option<Coord>, c: Coord) -> bool {
    match owner {
        None => c.replicate == 0,
        Some(o) => o == c,
    }
}

/// Whether the rank at `c` holds a parameter's values under `owner`.
fn holds_param(owner: Option<Coord>, c: Coord) -> bool {
    owner.map_or(true, |o| o.shard == c.shard)
}

/// Whether the rank at `c` runs a parameter's optimizer (and keeps its state).
fn runs_optimizer(owner: Option<Coord>, c: Coord) -> bool {
    owner.map_or(true, |o| o == c)
}

/// Why a session cannot save: it drives only some ranks of its mesh and was given no
/// [`SaveJob`] to save with the job's other processes.
pub(crate) fn check_can_save<B: Backend>(
    planner: &Planner,
    exec: &Executor<B>,
    saves: &Saves,
) -> Result<SaveJob, String> {
    let world = planner.spec().mesh.world();
    let local = exec.local_ranks();
    saves
        .job(local.len() as u64 == u64::from(world))
        .ok_or_else(|| {
            format!(
                "this session drives ranks {local:?} of the mesh's {world}, so it saves together \
             with the job's other processes: give every process the same job id first \
             (Session::set_save_job with a SaveJob rank 0 drew and sent to the others; \
             `overlap run` does it)"
            )
        })
}

/// Starts a save of `exec`'s state under `root` (see the module docs): waits for the
/// save in flight, stages the local ranks' pieces and hands them to a background thread.
pub(crate) fn save_in_background<B: Backend>(
    planner: &Planner,
    exec: &Executor<B>,
    saves: &Saves,
    root: &Path,
    seed: Option<u64>,
) -> Result<SaveTicket, Error> {
    let fault = saves.fault();
    if exec.in_step() {
        return Err(Error::Usage(
            "save during a step; call it before the first micro-batch or after step()".into(),
        ));
    }
    let job = check_can_save(planner, exec, saves).map_err(|r| err(root, r))?;
    let t0 = Instant::now();
    let previous = saves.wait()?;
    let waited = t0.elapsed();
    std::fs::create_dir_all(root).map_err(|e| err(root, format!("cannot be created: {e}")))?;
    let t1 = Instant::now();
    let staged = stage::stage(planner, exec, seed)?;
    let ticket = SaveTicket {
        step: staged.step,
        path: root.join(step_dir_name(staged.step)),
        staged: t1.elapsed(),
        waited,
        previous,
    };
    saves.start(protocol::SaveWork {
        root: root.to_path_buf(),
        job: job.id,
        report_timeout: job.report_timeout,
        abort: exec.peer_abort(),
        fault,
        staged,
    })?;
    Ok(ticket)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftovers_are_told_by_name() {
        let job = 0x0123_4567_89ab_cdef;
        assert_eq!(
            leftover(&partial_dir_name(42, job)),
            Some(Leftover::Partial { step: 42, job })
        );
        for name in [".latest-00ff", ".old-step-000002-1", ".tmp-step-000002-1-1"] {
            assert_eq!(leftover(name), Some(Leftover::Temporary), "{name}");
        }
        for name in ["latest", "step-000002", ".step-x.partial", "notes.txt"] {
            assert_eq!(leftover(name), None, "{name}");
        }
    }
}
