//! `overlap env` and `bench-interference`: the GPU job's checks (`cuda-smoke` is
//! [`crate::cuda::smoke`]).

use std::process::ExitCode;

use overlap::Error;

use crate::interference;

/// `overlap env`: the detected rank environment, and optionally a rendezvous.
pub(crate) fn env(rendezvous: bool) -> Result<ExitCode, Error> {
    let env =
        overlap_dist::env::RankEnv::from_env()?.unwrap_or_else(overlap_dist::env::RankEnv::single);
    println!(
        "{}",
        serde_json::to_string(&env).map_err(|e| Error::Usage(e.to_string()))?
    );
    if rendezvous {
        let timeout = overlap_dist::rendezvous::start_timeout(std::time::Duration::from_secs(60))?;
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

/// `overlap bench-interference`: the probe's report on this process's GPU, as one JSON
/// line.
pub(crate) async fn bench_interference(
    args: &interference::InterferenceArgs,
) -> Result<ExitCode, Error> {
    let r = crate::cuda::interference(args).await?;
    println!(
        "{}",
        serde_json::to_string(&r).map_err(|e| Error::Usage(e.to_string()))?
    );
    Ok(ExitCode::SUCCESS)
}
