//! Everything of the command line that runs on GPUs: the CUDA backend's side of
//! `overlap verify` and `overlap run`, `cuda-smoke`, `bench`, `bench-collectives`,
//! `bench-interference`, `bench-optimizer` and `calibrate`.
//!
//! The rest of the CLI reaches the GPU only through the entry points here
//! ([`IN_BUILD`], [`detected`], [`verify`], [`run`], [`smoke`], [`bench`],
//! [`collectives`], [`interference`], [`calibrate`], [`bench_optimizer`]) and names no
//! feature of its own: `main.rs` declares this module once, with a `path` attribute
//! that, in a build without the `cuda` feature, compiles `cuda_stub.rs` in its place:
//! the same functions, each saying how to get a CUDA build. The workloads the
//! benchmarks run (`crate::bench`, `crate::interference`, `crate::calibrate::measure`)
//! are generic over the backend and stay outside; what is here opens the GPU job and
//! hands it to them.
//!
//! Invariant: nothing outside this module names a CUDA type, and every entry point has
//! a twin of the same signature in `cuda_stub.rs`.

mod bench;
mod bench_optim;
mod calibrate;
mod smoke;
mod smoke_optim;

use std::process::ExitCode;

use overlap::config::Config;
use overlap::faults::Faults;
use overlap::{observe, Error, Session};

use crate::args::{CheckpointArgs, ObserveArgs};
use crate::bench_optim::{BenchOptimizerArgs, OptimReport};
use crate::interference::{InterferenceArgs, InterferenceReport};
use crate::job::{end_job, watch_host, watch_job};

pub(crate) use bench::{bench, collectives};
pub(crate) use calibrate::calibrate;

/// Whether this build has the CUDA backend.
pub(crate) const IN_BUILD: bool = true;

/// Whether `--backend auto` means CUDA: started as a rank of a job (a launcher's
/// variables are set) whose CUDA libraries load.
pub(crate) fn detected() -> bool {
    matches!(overlap_dist::env::RankEnv::from_env(), Ok(Some(_)))
        && overlap::ops::cuda::check_libraries().is_ok()
}

/// `overlap verify` on this process's GPU, as one rank of the job: this rank's results
/// against the reference, every rank's figures gathered at rank 0, which prints the
/// report.
pub(crate) async fn verify(
    cfg: &Config,
    (steps, seed): (u64, u64),
    faults: &Faults,
    json: bool,
) -> Result<ExitCode, Error> {
    let env = overlap_dist::cuda::rank_env(cfg.plan.mesh)?;
    let mut cfg = cfg.clone();
    cfg.settle_transport(env.one_node());
    let cfg = &cfg;
    let what =
        overlap_dist::fingerprint::Fingerprint::of_config(cfg, "verify", "cuda", steps, seed)?;
    let mut world = overlap_dist::cuda::world(cfg, env, false, what)?;
    let report = overlap_dist::cuda::verify(cfg, steps, seed, &mut world, faults, |s| {
        if !json {
            eprintln!("verify: step {s}/{steps} done");
        }
    })
    .await;
    end_job(Some(&world.rendezvous), &report);
    let report = report?;
    match report {
        Some(report) => crate::verify::print_verify(cfg, &report, json),
        None => Ok(ExitCode::SUCCESS),
    }
}

/// `overlap run` on this process's GPU, as one rank of the job: the session on the CUDA
/// backend, the job's checkpoint id shared and its failures watched, then the steps of
/// [`crate::run::run_steps`].
pub(crate) async fn run(
    cfg: &Config,
    (steps, faults): (u32, Faults),
    observe: &ObserveArgs,
    ckpt: &CheckpointArgs,
    recording: observe::Recording,
) -> Result<ExitCode, Error> {
    let env = overlap_dist::cuda::rank_env(cfg.plan.mesh)?;
    let mut cfg = cfg.clone();
    cfg.settle_transport(env.one_node());
    let cfg = &cfg;
    let what = overlap_dist::fingerprint::Fingerprint::of_config(
        cfg,
        "run",
        "cuda",
        u64::from(steps),
        cfg.run.seed,
    )?;
    let mut world = overlap_dist::cuda::world(cfg, env, true, what)?;
    let mut session = Session::cuda(cfg, world.backend.clone())?;
    session.inject_faults(faults);
    crate::run::share_save_job(Some(&mut world.rendezvous), &mut session)?;
    watch_job(Some(&mut world.rendezvous), session.peer_abort())?;
    watch_host(session.step_deadline())?;
    // Peers learn of a failure through the watch: a failed rank's collectives no
    // longer join, so no peer finishes a step on data it never produced.
    world.backend.set_poisoned_collectives_join(false);
    let result = crate::run::run_steps(session, cfg, steps, observe, ckpt, recording, "cuda").await;
    end_job(Some(&world.rendezvous), &result);
    result
}

/// `overlap cuda-smoke`: this rank's [`smoke::smoke`] report as one JSON line, on a
/// `1 × world` mesh of the job (or of this process alone); exit code 1 when a check
/// failed.
pub(crate) async fn smoke(mib: &str, iters: u32) -> Result<ExitCode, Error> {
    let sizes = mib
        .split(',')
        .map(|m| {
            m.trim()
                .parse::<u64>()
                .map(|m| m << 20)
                .map_err(|_| Error::Usage(format!("--mib: `{m}` is not a whole number of MiB")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let env =
        overlap_dist::env::RankEnv::from_env()?.unwrap_or_else(overlap_dist::env::RankEnv::single);
    let mesh = overlap::Mesh {
        shard: 1,
        replicate: env.world_size,
    };
    let comms = overlap::ops::cuda::mesh_comms(mesh, &overlap::graph::Bindings::default(), false);
    let mut what = overlap_dist::fingerprint::Fingerprint::build();
    what.push("command", "cuda-smoke");
    what.push("cuda_smoke.args", format!("MiB {mib}, iters {iters}"));
    let mut world = overlap_dist::cuda::open(env, mesh, comms, false, Default::default(), what)?;
    let report = smoke::smoke(&mut world, &sizes, iters).await?;
    println!(
        "{}",
        serde_json::to_string(&report).map_err(|e| Error::Usage(e.to_string()))?
    );
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `overlap bench-interference`: the probe of [`crate::interference::run`] on this
/// process's GPU (`LOCAL_RANK`, else device 0), one rank.
pub(crate) async fn interference(args: &InterferenceArgs) -> Result<InterferenceReport, Error> {
    use overlap_ops::cuda::{CudaBackend, CudaOptions};
    let device = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mesh = overlap_graph::Mesh::new(1, 1).map_err(|e| Error::Usage(e.to_string()))?;
    let backend = CudaBackend::new(CudaOptions::new(mesh, 0, device).with_timings(true))
        .map_err(|e| Error::Backend(e.to_string()))?;
    backend.set_combine_ctas(args.combine_ctas);
    crate::interference::run(
        &backend,
        args,
        |on| backend.set_combine_streaming(on),
        |stream, tag, dst, src| {
            backend
                .copy_engine_copy(stream, tag, dst, src)
                .map_err(|e| Error::Backend(e.to_string()))
        },
    )
    .await
}

/// `overlap bench-optimizer`: the optimizer tail timed on device 0
/// ([`bench_optim::run`]).
pub(crate) fn bench_optimizer(args: &BenchOptimizerArgs) -> Result<OptimReport, Error> {
    bench_optim::run(args)
}
