//! Property: on random meshes (up to 16 ranks), parameter sets and gate sequences, every
//! plan validates and the gated path equals the no_sync reference.

use overlap::graph::{validate, Gate, Mode, Planner};
use overlap::verify::verify;
use overlap::{Config, Route};
use proptest::prelude::*;

fn meshes() -> impl Strategy<Value = (u32, u32)> {
    (1u32..=16).prop_flat_map(|world| {
        let divisors: Vec<u32> = (1..=world).filter(|d| world % d == 0).collect();
        proptest::sample::select(divisors).prop_map(move |s| (s, world / s))
    })
}

fn params() -> impl Strategy<Value = Vec<(Vec<u64>, Route, u32)>> {
    let route = prop_oneof![
        Just(Route::Fsdp),
        Just(Route::ShardedAdamw),
        Just(Route::Muon),
        Just(Route::Adamw)
    ];
    proptest::collection::vec(
        (proptest::collection::vec(1u64..12, 1..3), route, 0u32..4),
        1..7,
    )
    .prop_map(|ps| {
        ps.into_iter()
            .map(|(mut shape, route, layer)| {
                if route == Route::Muon && shape.len() < 2 {
                    shape.push(3);
                }
                (shape, route, layer)
            })
            .collect()
    })
}

fn gates() -> impl Strategy<Value = Vec<Gate>> {
    let g = prop_oneof![Just(Gate::NoSync), Just(Gate::ReplicateOff), Just(Gate::On)];
    proptest::collection::vec(g, 0..3).prop_map(|mut v| {
        v.push(Gate::On);
        v
    })
}

fn config(
    (s, r): (u32, u32),
    params: &[(Vec<u64>, Route, u32)],
    gates: &[Gate],
    cap: u64,
    (transport, lag): (&str, u32),
) -> Config {
    let mut t = format!("[mesh]\nshard = {s}\nreplicate = {r}\n[buckets]\ncap_bytes = {cap}\n[overlap]\ntransport = \"{transport}\"\ncombine_lag = {lag}\n[accumulation]\ngates = [");
    t += &gates
        .iter()
        .map(|g| format!("\"{}\"", g.label()))
        .collect::<Vec<_>>()
        .join(", ");
    t += "]\n";
    for (i, (shape, route, layer)) in params.iter().enumerate() {
        t += &format!(
            "[[param]]\nname = \"p{i}\"\nshape = {shape:?}\nroute = \"{}\"\nlayer = {layer}\n",
            route.name()
        );
    }
    Config::from_toml(&t, "property.toml").unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn random_meshes_params_and_gates_validate_and_verify(mesh in meshes(), params in params(), gates in gates(), cap in prop_oneof![Just(32u64), Just(1u64 << 20)], transport in (prop_oneof![Just("nccl"), Just("copy")], 0u32..3)) {
        let cfg = config(mesh, &params, &gates, cap, transport);
        let plan = Planner::new(cfg.plan.clone()).unwrap().plan(&gates).unwrap();
        let v = validate(&plan, Mode::Step);
        prop_assert!(v.is_empty(), "{:?}", v);
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let report = rt.block_on(verify(&cfg, 2, 11, |_| {})).unwrap();
        prop_assert!(report.ok, "mesh {:?} gates {} : {:?}", mesh, Gate::pattern_label(&gates), report);
        prop_assert_eq!(report.partials_left, 0);
    }
}
