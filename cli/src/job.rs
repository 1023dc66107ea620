//! What `overlap run` and `verify` do as one process of a multi-process job: join the
//! CPU backend's job (one rank per process, linked to the others), watch the other
//! ranks for failures, watch the host itself, and end with a goodbye or the error.

use std::time::{Duration, Instant};

use overlap::config::Config;
use overlap::resources::RanksHere;
use overlap::{Error, PeerAbort, StepDeadline};
use overlap_dist::cpu::CpuWorld;
use overlap_dist::rendezvous::Rendezvous;

/// Started as ranks of a job (`overlap launch`, torchrun, Slurm, Open MPI: two or more
/// processes), each process runs one rank of the mesh on the CPU backend: it meets the
/// others at the rendezvous, checks that they run the same thing, that its rank's
/// `sessions` sessions fit its memory (every rank stops with the error of one that does
/// not), and links to every rank (`overlap_dist::cpu`). `None` for a process alone,
/// which runs every rank.
pub(crate) fn cpu_world(
    cfg: &Config,
    command: &str,
    (steps, seed): (u64, u64),
    sessions: u32,
) -> Result<Option<CpuWorld>, Error> {
    let Some(env) = overlap_dist::cpu::rank_env(cfg.plan.mesh)? else {
        return Ok(None);
    };
    let what = overlap_dist::fingerprint::Fingerprint::of_config(cfg, command, "cpu", steps, seed)?;
    let digest = what.digest();
    // This rank's memory, and its machine's processes' together.
    let mesh = cfg.plan.mesh;
    let here = RanksHere::one(mesh, env.rank, env.local_rank, env.local_world_size);
    let world = overlap_dist::cpu::world_checked(cfg, env, what, || {
        overlap::resources::check_cpu_ranks(cfg, sessions, &here).map(drop)
    })?;
    if world.env.rank == 0 {
        eprintln!(
            "rendezvous: {} ranks agree on what they run (fingerprint {}); one rank per process, linked",
            world.env.world_size,
            &digest[..16]
        );
    }
    Ok(Some(world))
}

/// How long a rank told of another rank's failure may take to stop by itself before it
/// exits anyway (a wait the executor does not own, such as a device call).
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(30);

/// How long past its step's deadline a process whose host is stuck in a device call
/// (the executor could not report the timeout itself) lives on.
pub(crate) const STUCK_GRACE: Duration = Duration::from_secs(15);

/// Starts a thread named `name` that asks `stuck` every `every` whether the process
/// must end; when it answers with a message, the message is printed and the process
/// exits with status 2 at once ([`crate::exit_now`]).
fn exit_when(
    name: &str,
    every: Duration,
    mut stuck: impl FnMut() -> Option<String> + Send + 'static,
) -> Result<(), Error> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || loop {
            if let Some(why) = stuck() {
                eprintln!("error: {why}");
                crate::exit_now(2);
            }
            std::thread::sleep(every);
        })
        .map(drop)
        .map_err(|e| Error::Usage(format!("cannot start {name}: {e}")))
}

/// Watches a multi-process job for the other ranks' failures (`rdv`, when there is
/// one): the session's waits end at once when one fails, and if this process has not
/// stopped [`STOP_GRACE`] later it exits with status 2 naming the failed rank.
pub(crate) fn watch_job(rdv: Option<&mut Rendezvous>, abort: PeerAbort) -> Result<(), Error> {
    let Some(rdv) = rdv else {
        return Ok(());
    };
    rdv.watch(abort.clone())?;
    let mut told: Option<Instant> = None;
    exit_when("peer-failure-exit", Duration::from_millis(100), move || {
        let f = abort.failure()?;
        let since = *told.get_or_insert_with(Instant::now);
        (since.elapsed() >= STOP_GRACE).then(|| {
            format!(
                "rank {} of the job failed: {} (this rank did not stop within {} s; exiting)",
                f.rank,
                f.reason,
                STOP_GRACE.as_secs()
            )
        })
    })
}

/// A watchdog for the host itself (both backends): if a step is still in progress
/// [`STUCK_GRACE`] after its deadline (the executor reports a timeout within seconds of
/// it unless the issuing thread is blocked inside the driver, for instance by a launch
/// queue full behind a kernel that never ends), the process exits with status 2 saying
/// so.
pub(crate) fn watch_host(deadline: StepDeadline) -> Result<(), Error> {
    exit_when("step-watchdog", Duration::from_millis(250), move || {
        let d = deadline.get()?;
        (Instant::now() > d + STUCK_GRACE).then(|| {
            format!(
                "the step did not end within {} s of its deadline ([run] step_timeout) and the host is blocked inside a device call; exiting",
                STUCK_GRACE.as_secs()
            )
        })
    })
}

/// Ends a watched job's command: a goodbye when it went well, the error for the other
/// ranks when it did not (another rank's failure is passed on by rank 0 only).
pub(crate) fn end_job<T>(rdv: Option<&Rendezvous>, result: &Result<T, Error>) {
    let Some(rdv) = rdv else {
        return;
    };
    match result {
        Ok(_) => rdv.bye(),
        // Another rank's failure: rank 0 passes it on (this rank may have learned of it
        // through a data link the others do not share), the others have nothing to add.
        Err(Error::Exec(overlap::executor::ExecError::PeerFailed { rank, reason })) => {
            rdv.pass_on(*rank, reason)
        }
        Err(e) => rdv.abort(&e.to_string()),
    }
}
