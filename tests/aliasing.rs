//! Buffer aliasing in the executor (`ExecConfig::aliasing`): a step gives bit-identical
//! parameters and reduced gradients with and without it, on every mesh shape and gate
//! sequence tried here, aliasing does happen where the layout allows it, and pooled
//! buffers stay bounded.

use std::sync::Arc;

use overlap::executor::ExecConfig;
use overlap::graph::{Bindings, Buffer, ReduceSpec};
use overlap::ops::cpu::CpuBackend;
use overlap::{Gate, Mesh, ParamSpec, PlanSpec, Route, Session};

fn spec(shard: u32, replicate: u32) -> PlanSpec {
    let p = |name: &str, shape: Vec<u64>, route, layer| ParamSpec {
        name: name.into(),
        shape,
        route,
        layer,
    };
    PlanSpec {
        mesh: Mesh::new(shard, replicate).unwrap(),
        params: vec![
            // Identity layouts (chunks need no padding on a shard group of 1 or 2)...
            p("w", vec![4, 6], Route::Muon, 3),
            p("norm", vec![16], Route::Fsdp, 2),
            p("bias", vec![7], Route::Adamw, 2),
            // ...and ones that need padding or share a bucket.
            p("odd", vec![9], Route::Fsdp, 1),
            p("emb", vec![10, 3], Route::ShardedAdamw, 0),
            p("emb2", vec![5], Route::ShardedAdamw, 0),
        ],
        reduce: ReduceSpec::default(),
        // One bucket per parameter except where two of a layer and route fit.
        bucket_cap_bytes: 160,
        bindings: Bindings::default(),
        schedule: Default::default(),
    }
}

/// Runs `steps` steps of `gates` and returns every parameter and reduced gradient of
/// every rank, the aliased nodes of the last step and the most pooled buffers.
async fn run(
    shard: u32,
    replicate: u32,
    gates: &[Gate],
    aliasing: bool,
) -> (Vec<Option<Vec<f32>>>, usize, usize) {
    let mesh = Mesh::new(shard, replicate).unwrap();
    let backend = Arc::new(CpuBackend::new(mesh));
    let exec = ExecConfig {
        aliasing,
        stage1_window: 2,
        ..ExecConfig::default()
    };
    let mut s = Session::new(spec(shard, replicate), backend, exec).unwrap();
    let mut aliased = 0;
    let mut pooled = 0;
    for step in 0..3u32 {
        for (m, &gate) in gates.iter().enumerate() {
            s.begin_micro_batch(gate).await.unwrap();
            for layer in s.layers() {
                s.grad_ready(layer, |rank, param, out| {
                    for (i, x) in out.iter_mut().enumerate() {
                        *x = ((rank * 7 + param * 13 + i as u32 + m as u32 * 3 + step) % 11) as f32
                            * 0.37
                            - 1.1;
                    }
                })
                .await
                .unwrap();
            }
        }
        let r = s.step().await.unwrap();
        aliased = r.stats.aliased_nodes;
        pooled = pooled.max(
            s.executor()
                .pooled_buffers()
                .iter()
                .map(|&(_, n)| n)
                .max()
                .unwrap_or(0),
        );
    }
    let mut out = Vec::new();
    for rank in 0..mesh.world() {
        for param in 0..6 {
            for b in [Buffer::Param { param }, Buffer::Reduced { param }] {
                out.push(s.executor().read(rank, b).unwrap());
            }
        }
    }
    (out, aliased, pooled)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aliasing_is_bit_identical_and_keeps_the_pool_bounded() {
    let sequences: [&[Gate]; 4] = [
        &[Gate::On],
        &[Gate::On, Gate::On],
        &[Gate::NoSync, Gate::On],
        &[Gate::ReplicateOff, Gate::On],
    ];
    for (shard, replicate) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        for gates in sequences {
            let (off, none, pooled_off) = run(shard, replicate, gates, false).await;
            let (on, aliased, pooled_on) = run(shard, replicate, gates, true).await;
            let what = format!("mesh {shard}x{replicate}, gates {gates:?}");
            assert_eq!(none, 0, "{what}");
            assert!(aliased > 0, "{what}: nothing was aliased");
            assert_eq!(off.len(), on.len());
            for (i, (a, b)) in off.iter().zip(&on).enumerate() {
                let bits = |v: &Option<Vec<f32>>| {
                    v.as_ref()
                        .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                };
                assert_eq!(bits(a), bits(b), "{what}: buffer {i} differs");
                if let Some(v) = b {
                    assert!(v.iter().all(|x| x.is_finite()), "{what}: buffer {i}");
                }
            }
            assert!(
                pooled_on <= pooled_off,
                "{what}: {pooled_on} pooled buffers with aliasing, {pooled_off} without"
            );
        }
    }
}
