//! `overlap verify` (the gated path against the no_sync reference), which backend a
//! command runs on, and the verification of a multi-process job on the CPU backend.

use std::process::ExitCode;

use overlap::config::{BackendChoice, Config};
use overlap::faults::Faults;
use overlap::Error;

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
        if let Some(e) = report.forward_rel_err {
            println!(
                "  forward        gathered parameters worst {e:.3e} against the reference's (tolerance {:.0e})",
                report.param_tolerance
            );
        }
        println!("{}", if report.ok { "OK" } else { "FAILED" });
    }
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `overlap verify` on the CPU backend as one rank of a multi-process job (started by
/// `overlap launch`, torchrun, Slurm or Open MPI): this rank's results against the
/// reference for its rank, every rank's figures gathered at rank 0, which prints the
/// report (`overlap_dist::cpu::verify`). `None` for a process alone (it verifies every
/// rank itself).
pub(crate) async fn verify_cpu_job(
    cfg: &Config,
    (steps, seed): (u64, u64),
    faults: &Faults,
    json: bool,
) -> Result<Option<ExitCode>, Error> {
    // Two sessions: the gated one and the reference.
    let Some(mut world) = crate::job::cpu_world(cfg, "verify", (steps, seed), 2)? else {
        return Ok(None);
    };
    let report = overlap_dist::cpu::verify(cfg, steps, seed, &mut world, faults, |s| {
        if !json {
            eprintln!("verify: step {s}/{steps} done");
        }
    })
    .await;
    crate::job::end_job(Some(&world.rendezvous), &report);
    match report? {
        Some(report) => print_verify(cfg, &report, json).map(Some),
        None => Ok(Some(ExitCode::SUCCESS)),
    }
}

/// Whether a backend choice means the CUDA backend: `cuda`, or `auto` in a build with
/// it, started as a rank of a job (a launcher's variables are set) whose CUDA libraries
/// load.
pub(crate) fn use_cuda(choice: BackendChoice) -> Result<bool, Error> {
    match choice {
        BackendChoice::Cpu => Ok(false),
        BackendChoice::Cuda if crate::cuda::IN_BUILD => Ok(true),
        BackendChoice::Cuda => Err(Error::Backend(
            "backend \"cuda\" is not in this build: rebuild with `cargo build --release --features cuda`".into(),
        )),
        BackendChoice::Auto => Ok(crate::cuda::detected()),
    }
}
