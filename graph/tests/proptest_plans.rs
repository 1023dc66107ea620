//! Property: every plan the planner builds is valid and survives its JSON.
//!
//! Inputs are random over everything the planner accepts: meshes of 1 to 16 ranks in
//! every `S x R` factorisation; 1 to 12 parameters of 1 to 3 dimensions whose sizes
//! (1 to 40) often do not divide by `S`, on any route (muon only for matrices) and layer;
//! bucket caps small enough to split every layer into several buckets, or large enough
//! for one; gate sequences of 1 to 5 micro-batches ending gate-on; any stream binding.

use overlap_graph::{
    validate, Bindings, DType, ForwardSpec, Gate, Mesh, Mode, ParamSpec, Plan, PlanSpec, Planner,
    ReduceOp, ReduceSpec, Route, Schedule, Stream, Transport,
};
use proptest::prelude::*;
use proptest::sample::select;

/// `(shard, replicate)` with `shard * replicate` in `1..=16`, every factorisation.
fn mesh() -> impl Strategy<Value = Mesh> {
    (1u32..=16).prop_flat_map(|world| {
        let divisors: Vec<u32> = (1..=world).filter(|d| world % d == 0).collect();
        select(divisors).prop_map(move |shard| Mesh::new(shard, world / shard).unwrap())
    })
}

/// A shape of 1 to 3 dimensions and a route it allows.
fn shape_and_route() -> impl Strategy<Value = (Vec<u64>, Route)> {
    prop::collection::vec(1u64..=40, 1..=3).prop_flat_map(|shape| {
        let routes: Vec<Route> = Route::ALL
            .into_iter()
            .filter(|&r| r != Route::Muon || shape.len() >= 2)
            .collect();
        (Just(shape), select(routes))
    })
}

fn params() -> impl Strategy<Value = Vec<ParamSpec>> {
    prop::collection::vec((shape_and_route(), 0u32..=4), 1..=12).prop_map(|ps| {
        ps.into_iter()
            .enumerate()
            .map(|(i, ((shape, route), layer))| {
                ParamSpec::new(format!("p{i}"), shape, route, layer)
            })
            .collect()
    })
}

/// Small caps force several buckets per (layer, route, owner); a large one packs each
/// group into one bucket.
fn bucket_cap() -> impl Strategy<Value = u64> {
    prop_oneof![3 => 1u64..=128, 1 => Just(1u64 << 20)]
}

/// 1 to 5 micro-batches; the last one is gate-on.
fn gates() -> impl Strategy<Value = Vec<Gate>> {
    prop::collection::vec(
        select(vec![Gate::NoSync, Gate::ReplicateOff, Gate::On]),
        0..=4,
    )
    .prop_map(|mut g| {
        g.push(Gate::On);
        g
    })
}

fn stream() -> impl Strategy<Value = Stream> {
    select(Stream::ALL.to_vec())
}

/// Any stream for any node kind: the lowering, not a convention, keeps the order.
fn bindings() -> impl Strategy<Value = Bindings> {
    prop_oneof![
        1 => Just(Bindings::default()),
        3 => [stream(), stream(), stream(), stream(), stream(), stream(), stream(), stream(), stream(), stream(), stream()].prop_map(|s| Bindings::default()
            .with_accumulate(s[0])
            .with_pack(s[1])
            .with_stage1(s[2])
            .with_fold(s[3])
            .with_stage2(s[4])
            .with_unpack(s[5])
            .with_optimizer(s[6])
            .with_publish(s[7])
            .with_combine(s[8])
            .with_exchange(s[9])
            .with_unshard(s[10])),
    ]
}

fn reduce() -> impl Strategy<Value = ReduceSpec> {
    (
        select(vec![ReduceOp::Avg, ReduceOp::Sum]),
        select(vec![DType::F32, DType::Bf16]),
    )
        .prop_map(|(op, dtype)| ReduceSpec::default().with_op(op).with_dtype(dtype))
}

/// Either transport; the copy transport with its combines 0 to 3 layers behind.
fn schedule() -> impl Strategy<Value = Schedule> {
    (
        select(vec![Transport::Nccl, Transport::Copy]),
        0u32..4,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(transport, combine_lag, early_tail_gathers, combine_after_exchanges)| {
                Schedule::default()
                    .with_transport(transport)
                    .with_combine_lag(combine_lag)
                    .with_early_tail_gathers(early_tail_gathers)
                    .with_combine_after_exchanges(combine_after_exchanges)
            },
        )
}

/// No forward, or the forward's gathers with any prefetch depth and reshard policy.
fn forward() -> impl Strategy<Value = Option<ForwardSpec>> {
    prop_oneof![
        1 => Just(None),
        1 => (0u32..4, any::<bool>()).prop_map(|(prefetch, reshard_after_forward)| Some(
            ForwardSpec::default()
                .with_prefetch(prefetch)
                .with_reshard_after_forward(reshard_after_forward)
        )),
    ]
}

fn plan_spec() -> impl Strategy<Value = PlanSpec> {
    (
        mesh(),
        params(),
        reduce(),
        bucket_cap(),
        bindings(),
        schedule(),
        forward(),
    )
        .prop_map(
            |(mesh, params, reduce, bucket_cap_bytes, bindings, schedule, forward)| {
                PlanSpec::new(mesh, params)
                    .with_reduce(reduce)
                    .with_bucket_cap_bytes(bucket_cap_bytes)
                    .with_bindings(bindings)
                    .with_schedule(schedule)
                    .with_forward(forward)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_built_plan_validates_and_round_trips_through_json(spec in plan_spec(), gates in gates()) {
        let planner = Planner::new(spec).unwrap();
        let plan = planner.plan(&gates).unwrap();
        let violations = validate(&plan, Mode::Step);
        prop_assert!(violations.is_empty(), "gates {}: {:#?}", Gate::pattern_label(&gates), violations);
        let back = Plan::from_json(&plan.to_json()).unwrap();
        prop_assert_eq!(back, plan);
    }

    #[test]
    fn every_prefix_plan_validates_as_a_prefix(spec in plan_spec(), gates in gates()) {
        let planner = Planner::new(spec).unwrap();
        for k in 1..=gates.len() {
            let prefix = planner.plan_prefix(&gates[..k]).unwrap();
            let violations = validate(&prefix, Mode::Prefix);
            prop_assert!(violations.is_empty(), "gates {}: {:#?}", Gate::pattern_label(&gates[..k]), violations);
        }
    }
}
