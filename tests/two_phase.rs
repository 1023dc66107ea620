//! The two-phase step (`Session::reduce`, then `Session::step`): between the two a
//! trainer reads every reduced gradient before the optimizers run, and the step that
//! follows equals a plain step bit for bit.

mod common;

use std::sync::Arc;

use overlap::executor::{ClipConfig, ExecConfig};
use overlap::graph::Transport;
use overlap::ops::cpu::CpuBackend;
use overlap::{Error, Gate, PlanSpec, Session};

const MESHES: [(u32, u32); 5] = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2)];
const GATES: [Gate; 3] = [Gate::NoSync, Gate::ReplicateOff, Gate::On];

fn session(spec: PlanSpec, clip: ClipConfig) -> Session<CpuBackend> {
    let backend = Arc::new(CpuBackend::new(spec.mesh));
    let exec = ExecConfig::default().with_clip(clip);
    Session::new(spec, backend, exec).unwrap()
}

fn grad(rank: u32, param: u32, i: usize, m: usize, step: u32) -> f32 {
    ((rank * 7 + param * 13 + i as u32 * 5 + m as u32 * 3 + step * 11) % 17) as f32 * 0.23 - 1.7
}

async fn micro_batches(s: &mut Session<CpuBackend>, step: u32) {
    for (m, &gate) in GATES.iter().enumerate() {
        s.begin_micro_batch(gate).await.unwrap();
        for layer in s.layers() {
            s.grad_ready(layer, |rank, param, out| {
                for (i, x) in out.iter_mut().enumerate() {
                    *x = grad(rank, param, i, m, step);
                }
            })
            .await
            .unwrap();
        }
    }
}

/// Every local rank's reduced gradient of every parameter.
fn reduced(s: &Session<CpuBackend>) -> Vec<Option<Vec<f32>>> {
    let params = s.params().len() as u32;
    s.local_ranks()
        .into_iter()
        .flat_map(|rank| (0..params).map(move |p| (rank, p)))
        .map(|(rank, p)| s.reduced_grad(rank, p).unwrap())
        .collect()
}

/// The no_sync reference of parameter `p`'s element `i`: every rank's sum over the
/// micro-batches, averaged over the ranks.
fn reference(world: u32, p: u32, i: usize, step: u32) -> f64 {
    let sum: f64 = (0..world)
        .flat_map(|r| (0..GATES.len()).map(move |m| f64::from(grad(r, p, i, m, step))))
        .sum();
    sum / f64::from(world)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reduced_gradients_are_readable_before_the_update_and_the_step_is_unchanged() {
    for (shard, replicate) in MESHES {
        for transport in [Transport::Nccl, Transport::Copy] {
            let spec = common::mixed_spec(shard, replicate)
                .with_schedule(overlap::Schedule::default().with_transport(transport));
            let what = format!("{shard}x{replicate} {transport:?}");
            let (mut plain, mut phased) = (
                session(spec.clone(), ClipConfig::default()),
                session(spec.clone(), ClipConfig::default()),
            );
            for step in 0..3 {
                micro_batches(&mut plain, step).await;
                plain.step().await.unwrap();
                micro_batches(&mut phased, step).await;
                let before: Vec<_> = common::read_all(&phased).into_iter().step_by(2).collect();
                phased.reduce().await.unwrap();
                // The parameters are not updated yet.
                let params: Vec<_> = common::read_all(&phased).into_iter().step_by(2).collect();
                common::assert_same_bits(&before, &params, &what);
                // Each rank's piece of the reduced gradient is the reference's.
                let world = shard * replicate;
                for rank in phased.local_ranks() {
                    for (p, placed) in phased.params().iter().enumerate() {
                        let Some(g) = phased.reduced_grad(rank, p as u32).unwrap() else {
                            continue;
                        };
                        let mesh = phased.spec().mesh;
                        let range = placed.spec.shard_range(mesh.shard, rank % mesh.shard);
                        for (k, x) in g.iter().enumerate() {
                            let i = range.start as usize + k;
                            if i >= range.end as usize {
                                assert_eq!(*x, 0.0, "{what}: padding of {}", placed.spec.name);
                                continue;
                            }
                            let want = reference(world, p as u32, i, step);
                            assert!(
                                (f64::from(*x) - want).abs() <= 1e-5 * want.abs().max(1.0),
                                "{what}: {} rank {rank} element {i}: {x} vs {want}",
                                placed.spec.name
                            );
                        }
                    }
                }
                let r = phased.step().await.unwrap();
                assert_eq!(r.step, u64::from(step) + 1);
                common::assert_same_bits(
                    &common::read_all(&plain),
                    &common::read_all(&phased),
                    &what,
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_clipping_the_gradients_read_are_unclipped_and_their_norm_is_the_reports() {
    for (shard, replicate) in MESHES {
        let spec = common::mixed_spec(shard, replicate).with_grad_norm(true);
        let clip = ClipConfig::default().with_max_norm(Some(0.5));
        let mut s = session(spec, clip);
        micro_batches(&mut s, 0).await;
        s.reduce().await.unwrap();
        // Each element once: an owned parameter on its owner, a sharded one's pieces on
        // the shard group of replicate index 0 (every replica holds the same).
        let mut sq = 0.0f64;
        for (p, placed) in s.params().iter().enumerate() {
            let mesh = s.spec().mesh;
            for rank in 0..mesh.world() {
                let (sh, rep) = (rank % mesh.shard, rank / mesh.shard);
                let counted = match placed.owner {
                    Some(o) => o.shard == sh && o.replicate == rep,
                    None => rep == 0,
                };
                if !counted {
                    continue;
                }
                let Some(g) = s.reduced_grad(rank, p as u32).unwrap() else {
                    continue;
                };
                let range = placed.spec.shard_range(mesh.shard, sh);
                let n = (range.end - range.start) as usize;
                sq += g[..n]
                    .iter()
                    .map(|&x| f64::from(x) * f64::from(x))
                    .sum::<f64>();
            }
        }
        let r = s.step().await.unwrap();
        let norm = r.grad_norm.unwrap();
        assert!(norm > 0.5, "the clip engages");
        assert!(
            (norm - sq.sqrt()).abs() <= 1e-5 * norm,
            "{shard}x{replicate}: report {norm} vs {}",
            sq.sqrt()
        );
        // After the step, the reduced gradient is the clipped one.
        let after: f64 = reduced(&s)
            .into_iter()
            .flatten()
            .flatten()
            .map(|x| f64::from(x).abs())
            .fold(0.0, f64::max);
        assert!(after <= 0.5 + 1e-6, "{shard}x{replicate}: {after}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn between_the_phases_only_reads_and_zero_grad_are_allowed() {
    let spec = common::mixed_spec(2, 2);
    let mut s = session(spec.clone(), ClipConfig::default());
    let usage = |e: Error, phrase: &str| match e {
        Error::Usage(m) => assert!(m.contains(phrase), "{m}"),
        e => panic!("{e}"),
    };
    // Nothing to reduce.
    usage(s.reduce().await.unwrap_err(), "without any micro-batch");
    micro_batches(&mut s, 0).await;
    s.reduce().await.unwrap();
    usage(
        s.begin_micro_batch(Gate::On).await.unwrap_err(),
        "after reduce()",
    );
    usage(s.reduce().await.unwrap_err(), "after reduce()");
    let dir = std::env::temp_dir().join(format!("overlap-two-phase-{}", std::process::id()));
    assert!(s.save(&dir).is_err(), "no checkpoint of a reduced step");
    let _ = std::fs::remove_dir_all(&dir);
    // zero_grad drops the reduced step: the next one is the first step again, and equals
    // a fresh session's first step.
    s.zero_grad().await.unwrap();
    assert_eq!(s.steps_done(), 0);
    micro_batches(&mut s, 0).await;
    s.step().await.unwrap();
    let mut fresh = session(spec, ClipConfig::default());
    micro_batches(&mut fresh, 0).await;
    fresh.step().await.unwrap();
    common::assert_same_bits(
        &common::read_all(&fresh),
        &common::read_all(&s),
        "zero_grad",
    );
}
