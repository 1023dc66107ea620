//! `overlap env`, `bench-interference` and `cuda-smoke`: the GPU job's checks.

use std::process::ExitCode;

use overlap::Error;

use crate::interference;
#[cfg(feature = "cuda")]
use crate::smoke;
#[cfg(not(feature = "cuda"))]
use crate::verify::use_cuda;
#[cfg(not(feature = "cuda"))]
use overlap::config::BackendChoice;

/// `overlap env`: the detected rank environment, and optionally a rendezvous.
pub(crate) fn env(rendezvous: bool) -> Result<ExitCode, Error> {
    let env =
        overlap_dist::env::RankEnv::from_env()?.unwrap_or_else(overlap_dist::env::RankEnv::single);
    println!(
        "{}",
        serde_json::to_string(&env).map_err(|e| Error::Usage(e.to_string()))?
    );
    if rendezvous {
        let timeout = overlap_dist::rendezvous::start_timeout(std::time::Duration::from_secs(60));
        let mut rdv = overlap_dist::rendezvous::Rendezvous::connect(&env, timeout)?;
        let me = format!("rank {} pid {}", env.rank, std::process::id());
        if let Some(all) = rdv.gather(me.as_bytes(), timeout)? {
            let names: Vec<String> = all
                .iter()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .collect();
            println!(
                "rendezvous: {} ranks arrived: {}",
                all.len(),
                names.join(", ")
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(feature = "cuda")]
pub(crate) async fn bench_interference(
    args: &interference::InterferenceArgs,
) -> Result<ExitCode, Error> {
    let r = interference::run_cuda(args).await?;
    println!(
        "{}",
        serde_json::to_string(&r).map_err(|e| Error::Usage(e.to_string()))?
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(feature = "cuda"))]
pub(crate) async fn bench_interference(
    _: &interference::InterferenceArgs,
) -> Result<ExitCode, Error> {
    Err(Error::Usage(
        "bench-interference runs on a GPU: build with `--features cuda`".into(),
    ))
}

#[cfg(feature = "cuda")]
pub(crate) async fn cuda_smoke(mib: &str, iters: u32) -> Result<ExitCode, Error> {
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

#[cfg(not(feature = "cuda"))]
pub(crate) async fn cuda_smoke(_: &str, _: u32) -> Result<ExitCode, Error> {
    use_cuda(BackendChoice::Cuda).map(|_| ExitCode::from(2))
}
