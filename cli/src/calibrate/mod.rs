//! `overlap calibrate`: measures on the job's GPUs what the simulator's cost model needs
//! and writes a hardware profile that `overlap simulate --hardware` reads
//! (docs/simulate.md, "Calibrating a profile").
//!
//! Three parts: the arguments and the command here; the measurements in [`measure`]
//! (generic over the backend; on GPUs with the `cuda` feature, one process per GPU under
//! `overlap launch`); the pure derivation of the profile, its TOML text and the summary
//! in [`model`], which the CPU tests cover.
//!
//! Invariant: everything that can be refused without a GPU is refused before one is
//! opened (flags, the base profile, a job of one GPU without a base, a job across
//! nodes), and the file written parses back through `overlap_sim::hardware` to the very
//! figures printed.

pub(crate) mod measure;
use overlap_sim::calibrate as model;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use overlap::Error;

/// `overlap calibrate`'s arguments.
#[derive(clap::Args)]
pub(crate) struct CalibrateArgs {
    /// Write the profile to this file (TOML, for `overlap simulate --hardware`).
    #[arg(long, value_name = "FILE")]
    pub(crate) out: PathBuf,
    /// Keep the figures this job cannot measure from this profile (e.g.
    /// hardware/h200-nvlink.toml): on one GPU everything across GPUs, always
    /// `copy_engine.concurrency` and a `[network]` table. Required on one GPU.
    #[arg(long, value_name = "PROFILE")]
    pub(crate) base: Option<PathBuf>,
    /// Sizes of the collective, exchange and copy sweeps in MiB, comma-separated: at
    /// least two different ones, each 1 to 1024.
    #[arg(long, default_value = "1,4,16,64,256")]
    pub(crate) mib: String,
    /// Timed calls (steps, rounds) per measurement.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) iters: u32,
    /// Untimed ones before them.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub(crate) warmup: u32,
    /// The profile's name (default: the GPU's and their number, e.g. `nvidia-h200-x2`).
    #[arg(long)]
    pub(crate) name: Option<String>,
}

/// The largest size of a sweep, MiB.
pub(crate) const MAX_MIB: u32 = 1024;

impl CalibrateArgs {
    /// Checks the flags that clap does not: `--mib` (returned, sorted, without
    /// repeats), `--name` and `--out` (a file in a directory that exists).
    pub(crate) fn check(&self) -> Result<Vec<u32>, Error> {
        let mut sizes = parse_mib(&self.mib)?;
        sizes.sort_unstable();
        sizes.dedup();
        if sizes.len() < 2 {
            return Err(Error::Usage(format!(
                "--mib {}: at least two different sizes (the fits need them)",
                self.mib
            )));
        }
        if let Some(n) = &self.name {
            model::check_name(n)?;
        }
        check_out(&self.out)?;
        Ok(sizes)
    }
}

/// `--mib`'s sizes, each a whole number of MiB from 1 to [`MAX_MIB`].
pub(crate) fn parse_mib(s: &str) -> Result<Vec<u32>, Error> {
    s.split(',')
        .map(|m| match m.trim().parse::<u32>() {
            Ok(v) if (1..=MAX_MIB).contains(&v) => Ok(v),
            _ => Err(Error::Usage(format!(
                "--mib: `{}` is not a whole number of MiB from 1 to {MAX_MIB}",
                m.trim().escape_debug()
            ))),
        })
        .collect()
}

/// `--out` names a file (not a directory) in a directory that exists.
fn check_out(out: &Path) -> Result<(), Error> {
    if out.is_dir() {
        return Err(Error::Usage(format!(
            "--out {}: is a directory; name the profile file",
            out.display()
        )));
    }
    let dir = out.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(d) = dir.filter(|d| !d.is_dir()) {
        return Err(Error::Usage(format!(
            "--out {}: the directory {} does not exist",
            out.display(),
            d.display()
        )));
    }
    Ok(())
}

/// `overlap calibrate` (module docs): rank 0 writes `--out` and prints the summary; the
/// other ranks measure and exit.
pub(crate) async fn run(args: &CalibrateArgs) -> Result<ExitCode, Error> {
    let sizes = args.check()?;
    let base = match &args.base {
        Some(path) => Some((
            overlap_sim::hardware::from_file(path)
                .map_err(|e| Error::Usage(format!("--base: {e}")))?,
            path.display().to_string(),
        )),
        None => None,
    };
    let env =
        overlap_dist::env::RankEnv::from_env()?.unwrap_or_else(overlap_dist::env::RankEnv::single);
    model::check_job(env.world_size, env.local_world_size, base.is_some())?;
    let command = std::iter::once("overlap".to_string())
        .chain(std::env::args().skip(1))
        .collect::<Vec<_>>()
        .join(" ");
    let Some(m) = crate::cuda::calibrate(&sizes, args.warmup, args.iters, command).await? else {
        return Ok(ExitCode::SUCCESS);
    };
    let calibrated = model::derive(
        &m,
        base.as_ref().map(|(p, f)| (p, f.as_str())),
        args.name.as_deref(),
    )?;
    let text = model::to_toml(&calibrated);
    let out = args.out.display().to_string();
    // What is written must read back as the figures printed.
    let back = overlap_sim::hardware::from_toml(&text, &out).map_err(|e| {
        Error::Backend(format!(
            "calibrate: the written profile does not parse: {e}"
        ))
    })?;
    if back != calibrated.profile {
        return Err(Error::Backend(
            "calibrate: the written profile does not parse back to the same figures".into(),
        ));
    }
    std::fs::write(&args.out, &text)
        .map_err(|e| Error::Usage(format!("--out {out}: cannot write: {e}")))?;
    println!(
        "overlap calibrate: profile `{}` written to {out} ({} × {}, driver {}, NCCL {}, {})",
        calibrated.profile.name, m.env.gpu, m.env.world, m.env.driver, m.env.nccl, m.env.date
    );
    print!("{}", model::summary(&calibrated));
    Ok(ExitCode::SUCCESS)
}
