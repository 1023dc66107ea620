//! Shared by the integration tests that run whole steps and compare them bit for bit
//! (`aliasing.rs`, `in_place_keys.rs`). Each test crate uses part of it.
#![allow(dead_code)]

use overlap::graph::Buffer;
use overlap::ops::Backend;
use overlap::session::StepReport;
use overlap::{Gate, Mesh, ParamSpec, PlanSpec, Route, Session};

/// Six parameters over four layers and every route: identity layouts (chunks need no
/// padding on a shard group of 1 or 2), ones that need padding, and two that share a
/// bucket (the cap fits two of a layer and route).
pub fn mixed_spec(shard: u32, replicate: u32) -> PlanSpec {
    let p = |name: &str, shape: Vec<u64>, route, layer| ParamSpec::new(name, shape, route, layer);
    PlanSpec::new(
        Mesh::new(shard, replicate).expect("a valid mesh"),
        vec![
            p("w", vec![4, 6], Route::Muon, 3),
            p("norm", vec![16], Route::Fsdp, 2),
            p("bias", vec![7], Route::Adamw, 2),
            p("odd", vec![9], Route::Fsdp, 1),
            p("emb", vec![10, 3], Route::ShardedAdamw, 0),
            p("emb2", vec![5], Route::ShardedAdamw, 0),
        ],
    )
    .with_bucket_cap_bytes(160)
}

/// Runs `steps` steps of `gates` with seeded gradients, calling `after` with each
/// step's report.
pub async fn run_steps<B: Backend>(
    s: &mut Session<B>,
    gates: &[Gate],
    steps: u32,
    mut after: impl FnMut(&Session<B>, StepReport),
) {
    for step in 0..steps {
        for (m, &gate) in gates.iter().enumerate() {
            s.begin_micro_batch(gate).await.expect("begin_micro_batch");
            for layer in s.layers() {
                s.grad_ready(layer, |rank, param, out| {
                    for (i, x) in out.iter_mut().enumerate() {
                        *x = ((rank * 7 + param * 13 + i as u32 + m as u32 * 3 + step) % 11) as f32
                            * 0.37
                            - 1.1;
                    }
                })
                .await
                .expect("grad_ready");
            }
        }
        let r = s.step().await.expect("step");
        after(s, r);
    }
}

/// Every parameter and reduced gradient of every local rank.
pub fn read_all<B: Backend>(s: &Session<B>) -> Vec<Option<Vec<f32>>> {
    let params = s.params().len() as u32;
    let mut out = Vec::new();
    for rank in s.local_ranks() {
        for param in 0..params {
            for b in [Buffer::Param { param }, Buffer::Reduced { param }] {
                out.push(s.read_buffer(rank, b).expect("read"));
            }
        }
    }
    out
}

/// Every buffer equal bit for bit, and finite.
pub fn assert_same_bits(a: &[Option<Vec<f32>>], b: &[Option<Vec<f32>>], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    let bits = |v: &Option<Vec<f32>>| {
        v.as_ref()
            .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
    };
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(bits(x), bits(y), "{what}: buffer {i} differs");
        if let Some(v) = y {
            assert!(v.iter().all(|x| x.is_finite()), "{what}: buffer {i}");
        }
    }
}
