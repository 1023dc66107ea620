//! `overlap verify` (the gated path against the no_sync reference), which backend a
//! command runs on, and the CPU backend's meeting of a multi-process job.

use std::process::ExitCode;

use overlap::config::{BackendChoice, Config};
use overlap::rendezvous::Rendezvous;
use overlap::{Error, PeerAbort};

/// Prints a verification report (text, or one JSON line) and picks the exit code.
pub(crate) fn print_verify(
    cfg: &Config,
    report: &overlap::verify::VerifyReport,
    json: bool,
) -> Result<ExitCode, Error> {
    if json {
        println!(
            "{}",
            serde_json::to_string(report).map_err(|e| Error::Usage(e.to_string()))?
        );
    } else {
        println!(
            "verify {}: mesh {} ({} ranks), gates {}, {} steps",
            cfg.source, cfg.plan.mesh, report.ranks, report.gates, report.steps
        );
        for (route, e) in &report.per_route {
            println!("  {route:<14} worst relative error {e:.3e}");
        }
        println!(
            "  gradients      worst {:.3e} at {} (tolerance {:.0e})",
            report.worst_rel_err, report.worst_at, report.grad_tolerance
        );
        let against = if report.update_rel_err.is_empty() {
            "gated vs no_sync"
        } else {
            "GPU vs CPU backend"
        };
        println!(
            "  parameters     worst {:.3e} {against} (tolerance {:.0e})",
            report.param_rel_err, report.param_tolerance
        );
        for (opt, e) in &report.update_rel_err {
            println!("  {opt:<14} update relative error {e:.3e} (GPU vs CPU backend)");
        }
        println!("  partials left  {}", report.partials_left);
        if let Some(n) = report.forward_mismatches {
            println!("  forward        {n} gathered elements differ from the parameters");
        }
        println!("{}", if report.ok { "OK" } else { "FAILED" });
    }
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Whether a backend choice means the CUDA backend: `cuda`, or `auto` in a build with
/// it, started as a rank of a job (a launcher's variables are set) whose CUDA libraries
/// load.
pub(crate) fn use_cuda(choice: BackendChoice) -> Result<bool, Error> {
    match choice {
        BackendChoice::Cpu => Ok(false),
        BackendChoice::Cuda if cfg!(feature = "cuda") => Ok(true),
        BackendChoice::Cuda => Err(Error::Backend(
            "backend \"cuda\" is not in this build: rebuild with `cargo build --release --features cuda`".into(),
        )),
        BackendChoice::Auto => Ok(auto_cuda()),
    }
}

#[cfg(feature = "cuda")]
pub(crate) fn auto_cuda() -> bool {
    matches!(overlap::dist::RankEnv::from_env(), Ok(Some(_)))
        && overlap::ops::cuda::check_libraries().is_ok()
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn auto_cuda() -> bool {
    false
}

#[cfg(feature = "cuda")]
pub(crate) async fn verify_cuda(
    cfg: &Config,
    steps: u64,
    seed: u64,
    json: bool,
) -> Result<ExitCode, Error> {
    let env = overlap::cuda::rank_env(cfg.plan.mesh)?;
    let mut cfg = cfg.clone();
    cfg.settle_transport(env.one_node());
    let cfg = &cfg;
    let what = overlap::fingerprint::Fingerprint::of_config(cfg, "verify", "cuda", steps, seed)?;
    let mut world = overlap::cuda::world(cfg, env, false, what)?;
    let report = overlap::cuda::verify(cfg, steps, seed, &mut world, |s| {
        if !json {
            eprintln!("verify: step {s}/{steps} done");
        }
    })
    .await;
    end_job(Some(&world.rendezvous), &report);
    let report = report?;
    match report {
        Some(report) => print_verify(cfg, &report, json),
        None => Ok(ExitCode::SUCCESS),
    }
}

#[cfg(not(feature = "cuda"))]
pub(crate) async fn verify_cuda(_: &Config, _: u64, _: u64, _: bool) -> Result<ExitCode, Error> {
    use_cuda(BackendChoice::Cuda).map(|_| ExitCode::from(2))
}

/// On the CPU backend every process runs the whole mesh; started as ranks of a job
/// (`overlap launch`, torchrun, ...), the processes still meet at the rendezvous and
/// check that they run the same thing, so that a job that would disagree on GPUs
/// disagrees here too.
pub(crate) fn meet_cpu(
    cfg: &Config,
    command: &str,
    steps: u64,
    seed: u64,
) -> Result<Option<Rendezvous>, Error> {
    let Some(env) = overlap::dist::RankEnv::from_env()? else {
        return Ok(None);
    };
    if env.world_size < 2 {
        return Ok(None);
    }
    let what = overlap::fingerprint::Fingerprint::of_config(cfg, command, "cpu", steps, seed)?;
    let timeout = overlap::rendezvous::start_timeout(std::time::Duration::from_secs(180));
    let mut rdv = Rendezvous::connect(&env, timeout)?;
    rdv.agree(&what, timeout)?;
    if env.rank == 0 {
        eprintln!(
            "rendezvous: {} ranks agree on what they run (fingerprint {})",
            env.world_size,
            &what.digest()[..16]
        );
    }
    Ok(Some(rdv))
}

/// How long a rank told of another rank's failure may take to stop by itself before it
/// exits anyway (a wait the executor does not own, such as a device call).
pub(crate) const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// Watches a multi-process job for the other ranks' failures (`rdv`, when there is
/// one): the session's waits end at once when one fails, and if this process has not
/// stopped [`STOP_GRACE`] later it exits with status 2 naming the failed rank.
pub(crate) fn watch_job(rdv: Option<&mut Rendezvous>, abort: PeerAbort) -> Result<(), Error> {
    let Some(rdv) = rdv else {
        return Ok(());
    };
    rdv.watch(abort.clone())?;
    let spawned = std::thread::Builder::new()
        .name("peer-failure-exit".into())
        .spawn(move || loop {
            if let Some(f) = abort.failure() {
                std::thread::sleep(STOP_GRACE);
                eprintln!(
                    "error: rank {} of the job failed: {} (this rank did not stop within {} s; exiting)",
                    f.rank,
                    f.reason,
                    STOP_GRACE.as_secs()
                );
                crate::exit_now(2);
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        });
    spawned
        .map(drop)
        .map_err(|e| Error::Usage(format!("cannot start watching the job: {e}")))
}

/// How long past its step's deadline a process whose host is stuck in a device call
/// (the executor could not report the timeout itself) lives on.
pub(crate) const STUCK_GRACE: std::time::Duration = std::time::Duration::from_secs(15);

/// A watchdog for the host itself (both backends): if a step is still in progress [`STUCK_GRACE`] after
/// its deadline (the executor reports a timeout within seconds of it unless the issuing
/// thread is blocked inside the driver, for instance by a launch queue full behind a
/// kernel that never ends), the process exits with status 2 saying so.
pub(crate) fn watch_host(deadline: overlap::StepDeadline) -> Result<(), Error> {
    let spawned = std::thread::Builder::new()
        .name("step-watchdog".into())
        .spawn(move || loop {
            if let Some(d) = deadline.get() {
                if std::time::Instant::now() > d + STUCK_GRACE {
                    eprintln!(
                        "error: the step did not end within {} s of its deadline ([run] step_timeout) and the host is blocked inside a device call; exiting",
                        STUCK_GRACE.as_secs()
                    );
                    crate::exit_now(2);
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(250));
        });
    spawned
        .map(drop)
        .map_err(|e| Error::Usage(format!("cannot start the step watchdog: {e}")))
}

/// Ends a watched job's command: a goodbye when it went well, the error for the other
/// ranks when it did not (unless the error is another rank's failure, which they know).
pub(crate) fn end_job<T>(rdv: Option<&Rendezvous>, result: &Result<T, Error>) {
    let Some(rdv) = rdv else {
        return;
    };
    match result {
        Ok(_) => rdv.bye(),
        Err(Error::Exec(overlap::executor::ExecError::PeerFailed { .. })) => {}
        Err(e) => rdv.abort(&e.to_string()),
    }
}
