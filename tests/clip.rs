//! Global-norm clipping and non-finite gradients on the CPU backend: the norm against
//! an independent reference on every mesh shape (padded shards, owned routes), clipped
//! updates against `ops::math`, and NaN steps skipped or refused.

mod common;

use std::sync::Arc;

use overlap::executor::{ClipConfig, ExecConfig, ExecError, OnNonFinite};
use overlap::graph::{Buffer, Schedule, Transport};
use overlap::ops::cpu::CpuBackend;
use overlap::ops::{math, AdamwParams, MuonParams};
use overlap::{Error, Gate, Mesh, Route, Session};

const MESHES: [(u32, u32); 6] = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (2, 3)];

fn grad(rank: u32, param: u32, i: usize, m: usize, step: u32) -> f32 {
    ((rank * 7 + param * 13 + i as u32 * 5 + m as u32 * 3 + step * 11) % 17) as f32 * 0.23 - 1.7
}

fn session(shard: u32, replicate: u32, clip: ClipConfig) -> Session<CpuBackend> {
    session_on(shard, replicate, clip, Transport::Nccl)
}

fn session_on(
    shard: u32,
    replicate: u32,
    clip: ClipConfig,
    transport: Transport,
) -> Session<CpuBackend> {
    let spec = common::mixed_spec(shard, replicate)
        .with_grad_norm(true)
        .with_schedule(Schedule::default().with_transport(transport));
    let backend = Arc::new(CpuBackend::new(Mesh::new(shard, replicate).unwrap()));
    let exec = ExecConfig::default().with_clip(clip);
    Session::new(spec, backend, exec).unwrap()
}

/// One step of `gates`; `poison` sets one (rank, param, element) of the last micro-batch
/// to NaN.
async fn step(
    s: &mut Session<CpuBackend>,
    gates: &[Gate],
    step: u32,
    poison: Option<(u32, u32, usize)>,
) -> Result<overlap::StepReport, Error> {
    for (m, &gate) in gates.iter().enumerate() {
        s.begin_micro_batch(gate).await?;
        for layer in s.layers() {
            s.grad_ready(layer, |rank, param, out| {
                for (i, x) in out.iter_mut().enumerate() {
                    *x = grad(rank, param, i, m, step);
                    if m + 1 == gates.len() && poison == Some((rank, param, i)) {
                        *x = f32::NAN;
                    }
                }
            })
            .await?;
        }
    }
    s.step().await
}

/// The no_sync reference: each parameter's full reduced gradient (`avg` over the world,
/// summed over micro-batches), in f64, from the gradients themselves.
fn reference(s: &Session<CpuBackend>, micro_batches: usize, step: u32) -> Vec<Vec<f64>> {
    let world = s.spec().mesh.world();
    s.params()
        .iter()
        .enumerate()
        .map(|(p, placed)| {
            (0..placed.spec.numel() as usize)
                .map(|i| {
                    let mut sum = 0.0;
                    for m in 0..micro_batches {
                        for r in 0..world {
                            sum += f64::from(grad(r, p as u32, i, m, step));
                        }
                    }
                    sum / f64::from(world)
                })
                .collect()
        })
        .collect()
}

fn norm(g: &[Vec<f64>]) -> f64 {
    g.iter().flatten().map(|x| x * x).sum::<f64>().sqrt()
}

/// The piece of parameter `p` rank `rank` holds, and where it starts, if it holds one.
fn piece(s: &Session<CpuBackend>, rank: u32, p: u32) -> Option<std::ops::Range<usize>> {
    let mesh = s.spec().mesh;
    let placed = &s.params()[p as usize];
    match placed.owner {
        Some(o) if mesh.rank(o) != rank => None,
        Some(_) => Some(0..placed.spec.numel() as usize),
        None => {
            let r = placed.spec.shard_range(mesh.shard, mesh.coord(rank).shard);
            Some(r.start as usize..r.end as usize)
        }
    }
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * (1.0 + a.abs().max(b.abs()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_global_norm_equals_the_reference_on_every_mesh() {
    let gate_sets: [&[Gate]; 2] = [&[Gate::On], &[Gate::NoSync, Gate::ReplicateOff, Gate::On]];
    for (shard, replicate, gates, transport) in MESHES.into_iter().flat_map(|(s, r)| {
        gate_sets
            .into_iter()
            .flat_map(move |g| [Transport::Nccl, Transport::Copy].map(move |t| (s, r, g, t)))
    }) {
        {
            // Norm only: the reduced gradients stay as they are, so they can be
            // compared with the reference too.
            let mut s = session_on(shard, replicate, ClipConfig::default(), transport);
            let r = step(&mut s, gates, 1, None).await.unwrap();
            let g = reference(&s, gates.len(), 1);
            let want = norm(&g);
            let got = r.grad_norm.expect("a clipping plan reports its norm");
            assert!(
                close(got, want, 1e-5),
                "{shard}x{replicate} {gates:?} {transport:?}: norm {got} != {want}"
            );
            assert_eq!(r.skipped, None);
            for rank in s.local_ranks() {
                for p in 0..g.len() as u32 {
                    let Some(range) = piece(&s, rank, p) else {
                        continue;
                    };
                    let red = s
                        .read_buffer(rank, Buffer::Reduced { param: p })
                        .unwrap()
                        .unwrap();
                    assert_eq!(red.len(), range.len(), "{shard}x{replicate} p{p}");
                    for (x, want) in red.iter().zip(&g[p as usize][range]) {
                        assert!(close(f64::from(*x), *want, 1e-5));
                    }
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clipped_steps_equal_the_reference_optimizers_on_the_clipped_gradient() {
    let max_norm = 0.75f32;
    for (shard, replicate) in MESHES {
        let clip = ClipConfig::default()
            .with_max_norm(Some(max_norm))
            .with_on_nonfinite(OnNonFinite::Skip);
        let mut s = session(shard, replicate, clip);
        let gates = [Gate::ReplicateOff, Gate::On];
        let r = step(&mut s, &gates, 1, None).await.unwrap();
        let g = reference(&s, gates.len(), 1);
        let n = norm(&g);
        assert!(close(r.grad_norm.unwrap(), n, 1e-5));
        let factor = (f64::from(max_norm) / (n + 1e-6)).min(1.0);
        assert!(factor < 0.5, "the test must clip: factor {factor}");
        for rank in s.local_ranks() {
            for (p, placed) in s.params().iter().enumerate() {
                let Some(range) = piece(&s, rank, p as u32) else {
                    continue;
                };
                let clipped: Vec<f32> = g[p].iter().map(|x| (x * factor) as f32).collect();
                // The reference optimizer on the whole parameter (from zero), then this
                // rank's piece of it.
                let numel = placed.spec.numel() as usize;
                let mut want = vec![0.0f32; numel];
                if placed.spec.route == Route::Muon {
                    let (rows, cols) = placed.spec.matrix_dims();
                    let mut mom = vec![0.0; numel];
                    let hp = MuonParams::default();
                    math::muon(
                        &mut want,
                        &clipped,
                        &mut mom,
                        rows as usize,
                        cols as usize,
                        &hp,
                    );
                } else {
                    let (mut m, mut v) = (vec![0.0; numel], vec![0.0; numel]);
                    let hp = AdamwParams::default();
                    math::adamw(&mut want, &clipped, &mut m, &mut v, &hp, 1);
                }
                let red = s
                    .read_buffer(rank, Buffer::Reduced { param: p as u32 })
                    .unwrap()
                    .unwrap();
                let got = s
                    .read_buffer(rank, Buffer::Param { param: p as u32 })
                    .unwrap()
                    .unwrap();
                for (k, i) in range.enumerate() {
                    assert!(
                        close(f64::from(red[k]), f64::from(clipped[i]), 1e-5),
                        "{shard}x{replicate} {}: clipped grad {} != {}",
                        placed.spec.name,
                        red[k],
                        clipped[i]
                    );
                    assert!(
                        close(f64::from(got[k]), f64::from(want[i]), 1e-4),
                        "{shard}x{replicate} {}: param {} != {}",
                        placed.spec.name,
                        got[k],
                        want[i]
                    );
                }
            }
        }
    }
}

/// Every parameter and optimizer state of every local rank, as bits.
fn state(s: &Session<CpuBackend>) -> Vec<Option<Vec<u32>>> {
    let mut out = Vec::new();
    for rank in s.local_ranks() {
        for param in 0..s.params().len() as u32 {
            for b in [Buffer::Param { param }, Buffer::OptState { param }] {
                let v = s.read_buffer(rank, b).unwrap();
                out.push(v.map(|v| v.iter().map(|x| x.to_bits()).collect()));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nan_step_is_skipped_and_the_next_proceeds() {
    for (shard, replicate) in [(2, 2), (2, 3), (1, 1)] {
        let clip = ClipConfig::default()
            .with_max_norm(Some(1.0))
            .with_on_nonfinite(OnNonFinite::Skip);
        let mut s = session(shard, replicate, clip);
        let gates = [Gate::On];
        let r1 = step(&mut s, &gates, 1, None).await.unwrap();
        assert_eq!((r1.step, r1.skipped), (1, None));
        let before = state(&s);
        let last = shard * replicate - 1;
        let r2 = step(&mut s, &gates, 2, Some((last, 1, 0))).await.unwrap();
        assert_eq!(r2.skipped, Some("nonfinite"));
        assert_eq!(r2.step, 2);
        assert!(r2.grad_norm.unwrap().is_nan());
        assert_eq!(s.steps_done(), 1, "the step counter did not advance");
        assert_eq!(
            state(&s),
            before,
            "{shard}x{replicate}: a skipped step changed state"
        );
        let r3 = step(&mut s, &gates, 3, None).await.unwrap();
        assert_eq!((r3.step, r3.skipped), (2, None));
        assert!(r3.grad_norm.unwrap().is_finite());
        assert_ne!(state(&s), before);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nan_step_is_refused_with_on_nonfinite_error() {
    let clip = ClipConfig::default()
        .with_max_norm(None)
        .with_on_nonfinite(OnNonFinite::Error);
    let mut s = session(2, 2, clip);
    let gates = [Gate::ReplicateOff, Gate::On];
    step(&mut s, &gates, 1, None).await.unwrap();
    let before = state(&s);
    let err = step(&mut s, &gates, 2, Some((2, 0, 3))).await.unwrap_err();
    assert!(
        matches!(err, Error::Exec(ExecError::NonFinite { step: 2, .. })),
        "{err}"
    );
    assert!(err.to_string().contains("on_nonfinite"), "{err}");
    assert_eq!(state(&s), before);
    assert_eq!(s.steps_done(), 1);
    let r = step(&mut s, &gates, 3, None).await.unwrap();
    assert_eq!((r.step, r.skipped), (2, None));
}

#[test]
fn a_max_norm_for_a_spec_without_the_norm_nodes_is_refused() {
    // Without `with_grad_norm(true)` the plan has no norm or clip nodes: the threshold
    // would be ignored.
    let spec = common::mixed_spec(2, 2);
    assert!(!spec.grad_norm);
    let backend = Arc::new(CpuBackend::new(spec.mesh));
    let exec = ExecConfig::default().with_clip(
        ClipConfig::default()
            .with_max_norm(Some(1.0))
            .with_on_nonfinite(OnNonFinite::Skip),
    );
    match Session::new(spec, backend, exec) {
        Err(e @ Error::Usage(_)) => assert!(e.to_string().contains("with_grad_norm"), "{e}"),
        Err(e) => panic!("expected a usage error, got {e}"),
        Ok(_) => panic!("a max_norm that can never clip must be refused"),
    }
    // Without a threshold the same spec is fine.
    let spec = common::mixed_spec(2, 2);
    let backend = Arc::new(CpuBackend::new(spec.mesh));
    assert!(Session::new(spec, backend, ExecConfig::default()).is_ok());
}

/// `OVERLAP_FAULT`'s `mode=nan` (here [`ExecConfig::fault`]): a NaN written into one
/// reduced gradient just before the rank's norm makes the step non-finite on every
/// rank, on every mesh and transport, whichever rank it names; the step is skipped and
/// the next proceeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_nan_skips_the_step_on_every_mesh() {
    use overlap::executor::{Fault, FaultMode};
    for (shard, replicate) in MESHES {
        for transport in [Transport::Nccl, Transport::Copy] {
            // The last rank of the first replicate index: it counts its shards.
            let rank = shard - 1;
            let spec = common::mixed_spec(shard, replicate)
                .with_grad_norm(true)
                .with_schedule(Schedule::default().with_transport(transport));
            let backend = Arc::new(CpuBackend::new(Mesh::new(shard, replicate).unwrap()));
            let exec = ExecConfig::default()
                .with_clip(
                    ClipConfig::default()
                        .with_max_norm(Some(0.5))
                        .with_on_nonfinite(OnNonFinite::Skip),
                )
                .with_fault(Some(
                    Fault::new(rank, "grad_norm", 2, FaultMode::Nan).unwrap(),
                ));
            let mut s = Session::new(spec, backend, exec).unwrap();
            let gates = [Gate::ReplicateOff, Gate::On];
            let r1 = step(&mut s, &gates, 1, None).await.unwrap();
            assert_eq!(r1.skipped, None);
            let before = state(&s);
            let r2 = step(&mut s, &gates, 2, None).await.unwrap();
            let what = format!("{shard}x{replicate} {transport:?}");
            assert_eq!(r2.skipped, Some("nonfinite"), "{what}");
            assert!(r2.grad_norm.unwrap().is_nan(), "{what}");
            assert_eq!(state(&s), before, "{what}: a skipped step changed state");
            let r3 = step(&mut s, &gates, 3, None).await.unwrap();
            assert_eq!((r3.step, r3.skipped), (2, None), "{what}");
            assert!(r3.grad_norm.unwrap().is_finite(), "{what}");
        }
    }
}
