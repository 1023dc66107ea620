//! `overlap calibrate`'s measurements on this process's GPU: the job
//! [`crate::calibrate::measure::measure`] runs on, opened under `overlap launch` (or
//! alone, on one GPU).
//!
//! Invariant: every rank opens the same job and runs the same sweep; only rank 0
//! returns the measurements.

use overlap::Error;
use overlap_graph::Stream;
use overlap_ops::Tag;
use overlap_sim::calibrate::{Environment, Measurements};

use super::bench::{bench_fingerprint, open_cuda};
use crate::bench::BenchArgs;
use crate::calibrate::measure::{measure, Hooks, Sweep};

/// `overlap calibrate` on this process's GPU, under `overlap launch` (or alone, on one
/// GPU): opens the job (mesh `world × 1`, the copy ring for the exchanges with receives
/// copied out, kernel timings on), runs [`measure`] at the GPU sizes of [`Sweep::gpu`] and
/// returns rank 0's measurements (the other ranks `None`). Rank 0 says each measurement
/// on stderr.
pub(crate) async fn calibrate(
    mib: &[u32],
    warmup: u32,
    iters: u32,
    command: String,
) -> Result<Option<Measurements>, Error> {
    use overlap_graph::{Bindings, Transport};
    let env =
        overlap_dist::env::RankEnv::from_env()?.unwrap_or_else(overlap_dist::env::RankEnv::single);
    let sweep = Sweep::gpu(env.world_size, mib, warmup, iters)?;
    let mesh = sweep.bench.mesh;
    // A ring on the copy stream for the exchanges; no receive stays in place (the
    // exchanges are timed without combines), so each copies its receive out.
    let copy_spec = BenchArgs {
        transport: Transport::Copy,
        ..sweep.bench
    }
    .spec(Bindings::default());
    let links = overlap_dist::cuda::Links {
        copy: (sweep.world >= 2).then(|| {
            overlap_dist::cuda::copy_setup(
                &[&copy_spec],
                sweep.slot_bytes as usize,
                overlap_ops::cuda::DEFAULT_COPY_RING_DEPTH,
                false,
            )
        }),
        ..Default::default()
    };
    let world = open_cuda(
        mesh,
        Bindings::default(),
        links,
        bench_fingerprint(
            "calibrate",
            format!("MiB {mib:?}, warmup {warmup}, iters {iters}"),
        ),
    )?;
    let backend = world.backend.clone();
    let info = backend.info().clone();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let environment = Environment {
        gpu: info.name.clone(),
        driver: info.driver.clone(),
        nccl: info.nccl.clone(),
        date: overlap_sim::calibrate::date_utc(now),
        command,
        world: sweep.world,
        warmup,
        iters,
    };
    let rank = world.env.rank;
    if rank == 0 {
        eprintln!(
            "calibrate: {} × {}, driver {}, NCCL {}",
            info.name, sweep.world, info.driver, info.nccl
        );
    }
    let engine_copy = |_: u32, s: Stream, t: Tag, dst: &_, src: &_| {
        backend
            .copy_engine_copy(s, t, dst, src)
            .map_err(|e| Error::Backend(e.to_string()))
    };
    let streaming = |on: bool| backend.set_combine_streaming(on);
    let hooks = Hooks {
        engine_copy: &engine_copy,
        streaming: &streaming,
    };
    let say = |line: String| {
        if rank == 0 {
            eprintln!("calibrate: {line}");
        }
    };
    let m = measure(backend.clone(), &sweep, environment, &hooks, &say).await?;
    Ok((rank == 0).then_some(m))
}
