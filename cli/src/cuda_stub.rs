//! The command line's GPU entry points (`cuda/mod.rs`): the same functions, for a build
//! without the `cuda` feature; each says how to get a CUDA build. `main.rs` compiles
//! this file as the module `cuda` when the feature is off, so the callers name no
//! feature.
//!
//! Invariant: every function here has the signature of its twin in `cuda/mod.rs` and
//! returns the error a GPU command gives in a build without the backend (after the
//! checks that need no GPU, where the command has them), or, for [`detected`], `false`.

use std::process::ExitCode;

use overlap::config::{BackendChoice, Config};
use overlap::faults::Faults;
use overlap::{observe, Error, Mesh};
use overlap_sim::calibrate::Measurements;

use crate::args::{CheckpointArgs, ObserveArgs};
use crate::bench::{BenchArgs, BenchReport, CollectiveRow};
use crate::bench_optim::{BenchOptimizerArgs, OptimReport};
use crate::interference::{InterferenceArgs, InterferenceReport};
use crate::verify::use_cuda;

/// Whether this build has the CUDA backend.
pub(crate) const IN_BUILD: bool = false;

/// Whether `--backend auto` means CUDA: never, in this build.
pub(crate) fn detected() -> bool {
    false
}

/// The error of a GPU command in a build without the CUDA backend, saying how to get it.
fn no_cuda(what: &str) -> Error {
    Error::Backend(format!(
        "`overlap {what}` runs on GPUs and this build has no CUDA backend: rebuild with `cargo build --release --features cuda` and run it under `overlap launch --nproc-per-node 2 -- {what} ...`"
    ))
}

/// Without the `cuda` feature: the error of `--backend cuda`.
pub(crate) async fn verify(
    _: &Config,
    _: (u64, u64),
    _: &Faults,
    _: bool,
) -> Result<ExitCode, Error> {
    use_cuda(BackendChoice::Cuda).map(|_| ExitCode::from(2))
}

/// Without the `cuda` feature: the error of `--backend cuda`.
pub(crate) async fn run(
    _: &Config,
    _: (u32, Faults),
    _: &ObserveArgs,
    _: &CheckpointArgs,
    _: observe::Recording,
) -> Result<ExitCode, Error> {
    use_cuda(BackendChoice::Cuda).map(|_| ExitCode::from(2))
}

/// Without the `cuda` feature: the error of `--backend cuda`.
pub(crate) async fn smoke(_: &str, _: u32) -> Result<ExitCode, Error> {
    use_cuda(BackendChoice::Cuda).map(|_| ExitCode::from(2))
}

/// Without the `cuda` feature: the error saying how to get it.
pub(crate) async fn bench(_: &BenchArgs) -> Result<Option<BenchReport>, Error> {
    Err(no_cuda("bench"))
}

/// Without the `cuda` feature: the error saying how to get it.
pub(crate) async fn collectives(
    _: Mesh,
    _: &[u32],
    _: u32,
    _: u32,
) -> Result<Option<Vec<CollectiveRow>>, Error> {
    Err(no_cuda("bench-collectives"))
}

/// Without the `cuda` feature: the error saying how to get it.
pub(crate) async fn interference(_: &InterferenceArgs) -> Result<InterferenceReport, Error> {
    Err(Error::Usage(
        "bench-interference runs on a GPU: build with `--features cuda`".into(),
    ))
}

/// Without the `cuda` feature: the error saying how to get it.
pub(crate) async fn calibrate(
    _: &[u32],
    _: u32,
    _: u32,
    _: String,
) -> Result<Option<Measurements>, Error> {
    Err(no_cuda("calibrate"))
}

/// Without the `cuda` feature: `--shapes` checked, then the error saying how to get it.
pub(crate) fn bench_optimizer(args: &BenchOptimizerArgs) -> Result<OptimReport, Error> {
    let _ = crate::bench_optim::shape_set(&args.shapes)?;
    Err(no_cuda("bench-optimizer"))
}
