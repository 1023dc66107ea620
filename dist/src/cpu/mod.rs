//! The CPU backend as a job of one process per rank, the role gloo plays for PyTorch:
//! each process drives one rank of the mesh ([`CpuBackend::one_rank`]) and its
//! collectives, copy-transport exchanges and gathers meet the other processes over TCP
//! links ([`CpuLinks`]).
//!
//! Set-up ([`open`]), after the launcher's variables ([`rank_env`]): the processes meet
//! at rank 0's [`Rendezvous`] and agree on what they run (equal fingerprints); every rank
//! but 0 listens on a fresh port (on `OVERLAP_BIND_ADDR` when set, else on the address
//! its connection to rank 0 leaves from) and rank 0 gathers and broadcasts the table of
//! those addresses; then every pair connects once, the lower rank to the higher, and
//! proves the job's secret both ways with the rendezvous's HMAC challenge-response
//! (labels of their own, naming the serving rank: `links`). A stranger or a process
//! with another secret is dropped and logged. Finally every rank reports whether its
//! links opened and rank 0 broadcasts the first failure, so no rank starts alone.
//!
//! The numbers are those of the in-process backend ([`overlap::Session::cpu`]) bit for
//! bit: every process completes each round from every member's whole arrival
//! (`overlap_ops::cpu`'s `remote` module), favouring simplicity over bandwidth.
//!
//! Invariant: a [`CpuWorld`] exists only when the job's size is the mesh's, every rank
//! agreed on what it runs and holds an authenticated connection to every other rank.

mod links;
mod verify;

use std::sync::Arc;
use std::time::Duration;

use overlap::config::Config;
use overlap::session::{exec_config, Session};
use overlap::Error;
use overlap_graph::Mesh;
use overlap_ops::cpu::{CpuBackend, CpuLinks};

use crate::env::RankEnv;
use crate::fingerprint::Fingerprint;
use crate::rendezvous::Rendezvous;
use crate::DistError;

pub use verify::verify;

/// How long ranks wait for each other at start, unless `OVERLAP_RENDEZVOUS_TIMEOUT_S`
/// says otherwise.
pub const START_TIMEOUT: Duration = Duration::from_secs(180);
/// How long rank 0 waits for another rank's figures at the end of a verification.
pub const GATHER_TIMEOUT: Duration = Duration::from_secs(3600);

/// This process's rank of a CPU job, its line to rank 0 and its links to every rank.
pub struct CpuWorld {
    /// Who this process is.
    pub env: RankEnv,
    /// The connections to rank 0 (kept open for the job's watch and for gathering
    /// results).
    pub rendezvous: Rendezvous,
    /// The connections to every other rank, for more backends over them
    /// ([`CpuBackend::one_rank`]; each process must make them in the same order).
    pub links: CpuLinks,
    /// The backend driving this process's rank.
    pub backend: Arc<CpuBackend>,
}

/// This process's rank environment for a CPU job on `mesh`: `None` to run every rank
/// in this process (no launcher's variables, or a job of one process); the launcher's
/// when it started as many processes as the mesh has ranks; an error naming both sizes
/// otherwise.
pub fn rank_env(mesh: Mesh) -> Result<Option<RankEnv>, Error> {
    let Some(env) = RankEnv::from_env()? else {
        return Ok(None);
    };
    if env.world_size < 2 {
        return Ok(None);
    }
    if env.world_size != mesh.world() {
        return Err(DistError::Inconsistent(format!(
            "the job has {} ranks (WORLD_SIZE) but mesh {mesh} needs shard × replicate = {}: \
             on the CPU backend each process of a job runs one rank, so start {} processes \
             (`overlap launch --nproc-per-node {}`), or one process alone to run every rank in it",
            env.world_size,
            mesh.world(),
            mesh.world(),
            mesh.world()
        ))
        .into());
    }
    Ok(Some(env))
}

/// Joins the job for a config's mesh: [`open`].
pub fn world(config: &Config, env: RankEnv, what: Fingerprint) -> Result<CpuWorld, Error> {
    open(env, config.plan.mesh, what)
}

/// [`world`], with `ready` run on every rank once the ranks agree and before any link
/// or buffer exists (a memory check, say): when it fails on any rank, every rank stops
/// with that rank's error instead of waiting for it.
pub fn world_checked(
    config: &Config,
    env: RankEnv,
    what: Fingerprint,
    ready: impl FnOnce() -> Result<(), Error>,
) -> Result<CpuWorld, Error> {
    open_checked(env, config.plan.mesh, what, ready)
}

/// Meets the other ranks, compares `what` (this rank's fingerprint) with theirs, opens
/// the links to every rank and this rank's backend over them. Every step waits at most
/// `OVERLAP_RENDEZVOUS_TIMEOUT_S` (default [`START_TIMEOUT`]).
pub fn open(env: RankEnv, mesh: Mesh, what: Fingerprint) -> Result<CpuWorld, Error> {
    open_checked(env, mesh, what, || Ok(()))
}

/// [`open`], with `ready` run on every rank before the links ([`world_checked`]).
pub fn open_checked(
    env: RankEnv,
    mesh: Mesh,
    mut what: Fingerprint,
    ready: impl FnOnce() -> Result<(), Error>,
) -> Result<CpuWorld, Error> {
    what.push("cpu.ranks_per_process", "1");
    let (mut rendezvous, timeout) = Rendezvous::meet(&env, mesh, &what, START_TIMEOUT)?;
    all_ok(&mut rendezvous, ready(), timeout)?;
    let secret = crate::rendezvous::JobSecret::for_job(&env)?;
    let linked = links::connect(&mut rendezvous, &secret, timeout);
    let links = all_ok(&mut rendezvous, linked, timeout)?;
    let backend =
        CpuBackend::one_rank(mesh, env.rank, &links).map_err(|e| Error::Backend(e.to_string()))?;
    Ok(CpuWorld {
        env,
        rendezvous,
        links,
        backend: Arc::new(backend),
    })
}

/// A session of `config` on this rank's backend, parameters initialised from the
/// config's seed as [`Session::cpu`] does (this rank keeps its pieces).
pub fn session(config: &Config, world: &CpuWorld) -> Result<Session<CpuBackend>, Error> {
    session_on(config, world.backend.clone())
}

/// [`session`] over a given backend (another one over the same links).
pub(crate) fn session_on(
    config: &Config,
    backend: Arc<CpuBackend>,
) -> Result<Session<CpuBackend>, Error> {
    let mut s = Session::new(config.plan.clone(), backend, exec_config(config)?)?;
    let seed = config.run.seed;
    s.init_params(|i, p| overlap::synthetic::init(seed, i, p.spec.numel() as usize))?;
    Ok(s)
}

/// Every rank says whether `mine` succeeded; rank 0 hands out the first failure. This
/// rank's own error comes first, then another rank's ([`DistError::Peer`]).
fn all_ok<T>(
    rendezvous: &mut Rendezvous,
    mine: Result<T, impl Into<Error> + std::fmt::Display>,
    timeout: Duration,
) -> Result<T, Error> {
    let status = match &mine {
        Ok(_) => vec![0u8],
        Err(e) => [vec![1u8], e.to_string().into_bytes()].concat(),
    };
    let verdict = match rendezvous.gather(&status, timeout)? {
        Some(all) => first_failure(&all),
        None => Vec::new(),
    };
    let verdict = rendezvous.broadcast(&verdict, timeout)?;
    let value = mine.map_err(Into::into)?;
    check_verdict(&verdict)?;
    Ok(value)
}

/// Rank 0's verdict from every rank's status: `0`, or `1`, the first failed rank
/// and its error.
fn first_failure(statuses: &[Vec<u8>]) -> Vec<u8> {
    let failed = statuses
        .iter()
        .enumerate()
        .find(|(_, s)| s.first() != Some(&0));
    match failed {
        None => vec![0u8],
        Some((rank, s)) => [
            vec![1u8],
            (rank as u32).to_le_bytes().to_vec(),
            s.get(1..).unwrap_or_default().to_vec(),
        ]
        .concat(),
    }
}

fn check_verdict(verdict: &[u8]) -> Result<(), Error> {
    match verdict.split_first() {
        Some((0, _)) => Ok(()),
        Some((1, rest)) if rest.len() >= 4 => Err(DistError::Peer {
            rank: u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]),
            reason: String::from_utf8_lossy(&rest[4..]).into_owned(),
        }
        .into()),
        _ => Err(DistError::Rendezvous(format!(
            "rank 0 sent a verdict of {} bytes on the CPU links",
            verdict.len()
        ))
        .into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_verdicts_name_the_first_failed_rank() {
        assert_eq!(first_failure(&[vec![0], vec![0]]), vec![0]);
        assert!(check_verdict(&[0]).is_ok());
        let v = first_failure(&[vec![0], vec![1, b'n', b'o'], vec![1, b'x']]);
        match check_verdict(&v) {
            Err(Error::Dist(DistError::Peer { rank, reason })) => {
                assert_eq!((rank, reason.as_str()), (1, "no"));
            }
            other => panic!("{other:?}"),
        }
        assert!(check_verdict(&[7]).is_err());
    }
}
