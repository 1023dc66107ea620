//! The forward's parameter gathers on the CPU backend (`PlanSpec::forward`): every
//! `forward_ready` and `backward_ready` hands every local rank exactly the current full
//! parameters, bit for bit, for every route (`fsdp` and `sharded_adamw` all-gathered,
//! with and without padding; `muon` and `adamw` broadcast from the owner's shard
//! column), on every mesh of the test suite, for every prefetch depth and reshard
//! policy, step after step as the optimizers and publishes change them; the gathers
//! leave the gradient path as it was (bit-exact with the same session without them);
//! the order of calls is enforced; and each step reports the plan's memory peaks.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use overlap::graph::ForwardSpec;
use overlap::{synthetic, CpuBackend, ExecConfig, Gate, PlanSpec, Schedule, Session, Transport};

use Gate::{NoSync, On, ReplicateOff as Off};

const MESHES: [(u32, u32); 8] = [
    (1, 1),
    (2, 1),
    (1, 2),
    (2, 2),
    (3, 2),
    (4, 1),
    (1, 4),
    (2, 3),
];

const SEED: u64 = 11;

fn spec(shard: u32, replicate: u32, forward: Option<ForwardSpec>) -> PlanSpec {
    common::mixed_spec(shard, replicate).with_forward(forward)
}

fn session(spec: PlanSpec) -> Session<CpuBackend> {
    let backend = Arc::new(CpuBackend::new(spec.mesh));
    let mut s = Session::new(spec, backend, ExecConfig::default()).unwrap();
    s.init_params(|i, p| synthetic::init(SEED, i, p.spec.numel() as usize))
        .unwrap();
    s
}

/// Every parameter's full tensor from the pieces the ranks hold (replicas must agree).
fn current_params(s: &Session<CpuBackend>) -> Vec<Vec<u32>> {
    let mesh = s.spec().mesh;
    s.params()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut full: Vec<Option<u32>> = vec![None; p.spec.numel() as usize];
            for rank in s.local_ranks() {
                let Some(piece) = s.param_values(rank, i as u32).unwrap() else {
                    continue;
                };
                let range = p.spec.shard_range(mesh.shard, mesh.coord(rank).shard);
                for (k, v) in (range.start as usize..range.end as usize).zip(piece) {
                    let old = full[k].replace(v.to_bits());
                    assert!(old.map_or(true, |o| o == v.to_bits()), "replicas disagree");
                }
            }
            full.into_iter()
                .map(|x| x.expect("every element held"))
                .collect()
        })
        .collect()
}

/// Runs `steps` steps of `gates`; with the forward, checks every gathered parameter
/// against the current ones. Returns the number of checks and the final state.
async fn run(
    s: &mut Session<CpuBackend>,
    gates: &[Gate],
    steps: u64,
) -> (usize, Vec<Option<Vec<f32>>>, Vec<overlap::StepReport>) {
    let world = s.spec().mesh.world();
    let mut checks = 0;
    let mut reports = Vec::new();
    for step in 1..=steps {
        let want = current_params(s);
        for (m, &gate) in gates.iter().enumerate() {
            s.begin_micro_batch(gate).await.unwrap();
            let mut seen: BTreeMap<(u8, u32, u32), usize> = BTreeMap::new();
            let mut check = |pass: u8, rank: u32, param: u32, full: &[f32]| {
                let bits: Vec<u32> = full.iter().map(|x| x.to_bits()).collect();
                assert_eq!(
                    bits, want[param as usize],
                    "step {step} m{m} pass {pass}: rank {rank} gathered parameter {param} wrong"
                );
                *seen.entry((pass, rank, param)).or_default() += 1;
                checks += 1;
            };
            if s.has_forward() {
                for layer in s.forward_layers() {
                    s.forward_ready(layer, |r, p, full| check(0, r, p, full))
                        .await
                        .unwrap();
                }
            }
            for layer in s.layers() {
                if s.has_forward() {
                    s.backward_ready(layer, |r, p, full| check(1, r, p, full))
                        .await
                        .unwrap();
                }
                s.grad_ready(layer, |rank, param, out| {
                    synthetic::grad(SEED, step, m as u32, rank, param, out)
                })
                .await
                .unwrap();
            }
            if s.has_forward() {
                // Every rank got every parameter once per pass.
                let params = s.params().len() as u32;
                assert_eq!(seen.len(), 2 * (world * params) as usize);
                assert!(seen.values().all(|&k| k == 1));
            }
        }
        reports.push(s.step().await.unwrap());
    }
    (checks, common::read_all(s), reports)
}

fn policies() -> Vec<ForwardSpec> {
    let mut out = Vec::new();
    for prefetch in [0, 1, 2] {
        for reshard_after_forward in [true, false] {
            out.push(
                ForwardSpec::default()
                    .with_prefetch(prefetch)
                    .with_reshard_after_forward(reshard_after_forward),
            );
        }
    }
    out
}

#[tokio::test(flavor = "current_thread")]
async fn gathers_hand_every_rank_the_current_parameters_and_change_no_gradient() {
    let gates = [NoSync, Off, On];
    for (shard, replicate) in MESHES {
        let mut plain = session(spec(shard, replicate, None));
        let (_, reference, _) = run(&mut plain, &gates, 3).await;
        for fw in policies() {
            let mut s = session(spec(shard, replicate, Some(fw)));
            let (checks, state, _) = run(&mut s, &gates, 3).await;
            let world = (shard * replicate) as usize;
            assert_eq!(
                checks,
                3 * gates.len() * 2 * world * 6,
                "{shard}x{replicate} {fw:?}"
            );
            common::assert_same_bits(&state, &reference, &format!("{shard}x{replicate} {fw:?}"));
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn gathers_are_exact_on_the_copy_transport_and_with_other_bindings() {
    for (shard, replicate) in [(2, 2), (3, 2)] {
        let mut plain = session(spec(shard, replicate, None));
        let (_, reference, _) = run(&mut plain, &[Off, On], 2).await;
        let copy = spec(shard, replicate, Some(ForwardSpec::default()))
            .with_schedule(Schedule::default().with_transport(Transport::Copy));
        let mut s = session(copy);
        let (_, state, _) = run(&mut s, &[Off, On], 2).await;
        common::assert_same_bits(&state, &reference, "copy transport");
        // The gathers on the reduce stream, beside Stage 1.
        let mut bound = spec(shard, replicate, Some(ForwardSpec::default()));
        bound.bindings.unshard = overlap::Stream::Reduce;
        let mut s = session(bound);
        let (_, state, _) = run(&mut s, &[Off, On], 2).await;
        common::assert_same_bits(&state, &reference, "gathers on the reduce stream");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn steps_report_the_plans_memory_peaks_per_local_rank() {
    for forward in [None, Some(ForwardSpec::default())] {
        let mut s = session(spec(2, 2, forward));
        let (_, _, reports) = run(&mut s, &[Off, On], 1).await;
        let r = &reports[0];
        let plan = s.step_plan(&[Off, On]).unwrap();
        let want: Vec<_> = s.local_ranks().iter().map(|&g| plan.memory(g)).collect();
        assert_eq!(r.memory, want);
        assert_eq!(r.memory.len(), 4);
        // The pictures and traces name the lane the gathers run on.
        let publish = overlap::observe::lane_name(&plan, 0, overlap::Stream::Publish);
        let want = if forward.is_some() {
            "publish + unshard"
        } else {
            "publish"
        };
        assert_eq!(publish, want);
        assert_eq!(
            overlap::observe::lane_name(&plan, 0, overlap::Stream::Compute),
            "compute"
        );
        assert_eq!(r.replica_bytes, plan.replica_bytes());
        for m in &r.memory {
            assert!(m.shard_bytes > 0 && m.grad_peak_bytes > 0);
            assert_eq!(m.full_peak_bytes > 0, forward.is_some(), "{m:?}");
            assert!(m.param_peak_bytes < r.replica_bytes + m.shard_bytes);
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn the_order_of_calls_is_enforced() {
    let mut s = session(spec(2, 2, Some(ForwardSpec::default())));
    let usage = |r: Result<(), overlap::Error>| match r {
        Err(overlap::Error::Usage(m)) => m,
        other => panic!("expected a usage error, got {other:?}"),
    };
    let m = usage(s.forward_ready(0, |_, _, _| {}).await);
    assert!(m.contains("before begin_micro_batch"), "{m}");
    s.begin_micro_batch(On).await.unwrap();
    // Backward first, or a layer out of order.
    let m = usage(s.grad_ready(3, |_, _, o| o.fill(0.0)).await);
    assert!(m.contains("before backward_ready(layer 3)"), "{m}");
    let m = usage(s.forward_ready(1, |_, _, _| {}).await);
    assert!(m.contains("forward_ready(layer 0) is next"), "{m}");
    let m = usage(s.backward_ready(3, |_, _, _| {}).await);
    assert!(m.contains("forward_ready(layer 0) is next"), "{m}");
    for layer in s.forward_layers() {
        s.forward_ready(layer, |_, _, _| {}).await.unwrap();
    }
    let m = usage(s.forward_ready(0, |_, _, _| {}).await);
    assert!(m.contains("backward_ready(layer 3) is next"), "{m}");
    s.backward_ready(3, |_, _, _| {}).await.unwrap();
    let m = usage(s.backward_ready(3, |_, _, _| {}).await);
    assert!(m.contains("grad_ready(layer 3) is next"), "{m}");
    // A step needs every layer's gradients.
    assert!(s.step().await.is_err());
    s.zero_grad().await.unwrap();
    // And the session still runs a whole step after that.
    let (checks, _, _) = run(&mut s, &[On], 1).await;
    assert_eq!(checks, 2 * 4 * 6);
    // A session without the forward has no forward calls.
    let mut plain = session(spec(2, 1, None));
    plain.begin_micro_batch(On).await.unwrap();
    let m = usage(plain.forward_ready(0, |_, _, _| {}).await);
    assert!(m.contains("PlanSpec::with_forward"), "{m}");
    let m = usage(plain.backward_ready(3, |_, _, _| {}).await);
    assert!(m.contains("gathers no parameters"), "{m}");
}

#[tokio::test(flavor = "current_thread")]
async fn verify_checks_every_gathered_element() {
    let config = overlap::Config::from_toml(
        r#"
        [mesh]
        shard = 2
        replicate = 2
        [model]
        layers = 2
        hidden = 8
        vocab = 13
        [accumulation]
        gates = ["no_sync", "off", "on"]
        [forward]
        prefetch = 0
        "#,
        "forward.toml",
    )
    .unwrap();
    let r = overlap::verify::verify(&config, 2, 5, |_| {})
        .await
        .unwrap();
    assert_eq!(r.forward_mismatches, Some(0));
    let e = r
        .forward_rel_err
        .expect("a forward plan reports forward_rel_err");
    assert!(e <= r.param_tolerance, "{e:e}");
    assert!(r.ok, "{r:?}");
    // Gathered parameters off by more than the tolerance are reported as such.
    let want = [1.0f32, -2.0, 4.0];
    assert_eq!(overlap::verify::full_rel_err(&want, &want), 0.0);
    let off = [1.0f32, -2.0, 4.0 + 4e-4];
    assert!(overlap::verify::full_rel_err(&off, &want) > r.param_tolerance);
    assert_eq!(overlap::verify::full_rel_err(&want[..2], &want), f64::MAX);
}
